"""Is a step bound by the host? Each step started from an idle GPU (as bench.py's are): its
CUDA-event time, the host's time in forward (which waits for the selection) and in backward, and
the host's wait for the GPU after backward returned (drain: the GPU work still queued then).
Where the drain is near 0, the GPU waited for the host; where it is most of the step, the host
was done early and the step's time is the GPU's.

Answer (one H200, 2026-12-02, this script as it stands): not bound by the host at any T. At
T = 1024 the online loss took 4.60 ms, its host 1.76 ms in forward and 0.24 in backward, and the
GPU ran 2.44 ms more after backward returned; the top-k loss (k = 64) 2.50 ms, host 1.26 + 0.22,
drain 1.04; the four products alone (bench.py's floor) 3.97 ms, host 0.22. At T = 8192 the
online loss 36.5 ms with a drain of 32.0, the top-k 22.8 with 19.5. So at T = 1024 what the
step takes beyond its products is GPU work (the row kernels, the small kernels) or GPU idle
before the host has queued a step's first work, not the host's pace in the rest of the step.

    python experiments/host_bound.py
"""

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def measure(forward, backward, n=15, warmup=4):
    """Medians of (event ms, host ms in forward, host ms in backward, host ms waiting after)."""
    import cupy
    rows = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for i in range(warmup + n):
        cupy.cuda.Device().synchronize()
        start.record()
        t0 = time.perf_counter()
        ctx = forward()
        t1 = time.perf_counter()
        if backward:
            backward(ctx)
        t2 = time.perf_counter()
        stop.record()
        stop.synchronize()
        t3 = time.perf_counter()
        if i >= warmup:
            rows.append((cupy.cuda.get_elapsed_time(start, stop), (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                         (t3 - t2) * 1e3))
    return [statistics.median(c) for c in zip(*rows)]


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import harness  # needs the GPU: after --help
    import jsdgpu
    weights = harness.make_weights(2)
    rng = np.random.default_rng(0)
    for T in (1024, 2048, 8192):
        sets = harness.make_sets(T, weights, rng, 1.0)
        xs, ws, xt, wt, target = sets[0]
        ev, f, b, d = measure(lambda: jsdgpu.forward(xs, ws, xt, wt, target)[1], jsdgpu.backward)
        print(f"online T={T}: event {ev:.3f} ms, host fwd {f:.3f} + bwd {b:.3f}, drain {d:.3f}")
        floor = harness.impl_gemm_floor(sets, "fwd_bwd")
        ev, f, b, d = measure(lambda: floor(0), None)
        print(f"floor  T={T}: event {ev:.3f} ms, host {f:.3f}, drain {d:.3f}")
        if T != 2048:
            ids, lq = jsdgpu.teacher_topk(xt, wt, 64)
            ev, f, b, d = measure(lambda: jsdgpu.forward_topk(xs, ws, ids, lq, target)[1], jsdgpu.backward)
            print(f"topk   T={T}: event {ev:.3f} ms, host fwd {f:.3f} + bwd {b:.3f}, drain {d:.3f}")


if __name__ == "__main__":
    main()
