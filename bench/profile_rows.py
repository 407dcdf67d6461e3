"""Where the fused row kernel's time goes: its time against the number of rows (the fixed cost
and the cost per row), how many clusters fit the GPU at once, the kernel built with -ftz=true,
the host time a whole step spends before its first GEMM (the GPU idles then: the step starts by
reading the targets), and (run under Nsight Compute) one launch of each row kernel.

    python bench/profile_rows.py                       # the timings and the occupancy
    ncu --set full -k regex:'jsd_rows_bf16_c16|vp_' -c 4 python bench/profile_rows.py --once
"""

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cupy  # noqa: E402

import bench  # noqa: E402
import jsdgpu  # noqa: E402
from jsdgpu import _cupy_backend  # noqa: E402
from jsdgpu._cupy_backend import CupyBackend, _THREADS, _kernel, _logits, _slice, launch_rows  # noqa: E402
from jsdgpu._driver import LossOptions  # noqa: E402


def max_active_clusters(func, cluster, smem):
    """cuOccupancyMaxActiveClusters for the kernel at its launch configuration, or None."""
    try:
        from cuda.bindings import driver as cu
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster * 1024, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = _THREADS[cluster], 1, 1
        config.sharedMemBytes = smem
        err, n = cu.cuOccupancyMaxActiveClusters(cu.CUfunction(func.kernel.ptr), config)
        return int(n) if err == cu.CUresult.CUDA_SUCCESS else str(err)
    except Exception as e:  # noqa: BLE001 - reported, not needed
        return f"{type(e).__name__}: {e}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--once", action="store_true", help="one launch of each kernel (for ncu)")
    p.add_argument("--host", action="store_true", help="only the host time before the first GEMM")
    a = p.parse_args()
    T = 2048
    xs, ws, xt, wt, target = bench.make_sets(T, bench.make_weights(1), np.random.default_rng(0))[0]
    be = CupyBackend()
    work = be.prepare(ws, wt, None, None, T, True, fused=True)
    _logits(xs, ws, work["logits_s"])
    _logits(xt, wt, work["logits_t"])
    opts = LossOptions(0.5, 0.5, 0.5, 1.0, -100)
    ce, jsd, terms = (cupy.empty(T, np.float32) for _ in range(3))
    tgt = target.astype(np.int32)
    G = work["G"]
    fused = {}
    for cluster, options in ((8, ()), (16, ()), (16, ("-ftz=true",))):
        func = _kernel(cupy.cuda.Device().id, "bf16", cluster, ("-std=c++17",) + options)[0]
        fused[(cluster,) + options] = dict(work, func=func, cluster=cluster, slice=_slice(bench.V, cluster))
    if a.host:
        return host_before_first_gemm(xs[:1024], ws, xt[:1024], wt, target[:1024])
    if a.once:
        launch_rows(fused[(16,)], 1024, tgt, opts, ce, jsd, G, terms)
        stats = be.row_stats(work, tgt[:1024], opts)
        kl = be.row_kl(work, tgt[:1024], stats, opts)
        be.row_finish(work, tgt[:1024], stats, kl, opts, ce, jsd, terms)
        cupy.cuda.Device().synchronize()
        return
    print("| kernel | max active clusters | rows | ms | µs per row |")
    print("| --- | --- | --- | --- | --- |")
    for key, w in fused.items():
        active = max_active_clusters(w["func"], w["cluster"], 8 * w["slice"])
        for rows in (132, 264, 512, 1024, 2048):
            ms = bench.time_ms(lambda i: launch_rows(w, rows, tgt, opts, ce, jsd, G[:rows], terms), 1, 3, 20)
            print(f"| cluster {' '.join(map(str, key))} | {active} | {rows} | {ms:.3f} | {1e3 * ms / rows:.2f} |")
    host_before_first_gemm(xs[:1024], ws, xt[:1024], wt, target[:1024])


def host_before_first_gemm(xs, ws, xt, wt, target, repeats=20):
    """Median host milliseconds from the start of a step (GPU idle) to its first GEMM's launch,
    and of the whole step's GPU time."""
    first = []
    real_logits = _cupy_backend._logits

    def logits(*args):
        if len(first) < len(starts):  # the step's first GEMM
            first.append(time.perf_counter())
        return real_logits(*args)

    _cupy_backend._logits = logits
    starts = []
    try:
        for _ in range(repeats):
            cupy.cuda.Device().synchronize()
            starts.append(time.perf_counter())
            jsdgpu.backward(jsdgpu.forward(xs, ws, xt, wt, target)[1])
    finally:
        _cupy_backend._logits = real_logits
    cupy.cuda.Device().synchronize()
    gpu = bench.time_ms(lambda i: jsdgpu.backward(jsdgpu.forward(xs, ws, xt, wt, target)[1]), 1, 3, repeats)
    host = statistics.median(1e3 * (f - s) for f, s in zip(first, starts))
    print(f"T = {xs.shape[0]}: host time before the first GEMM {host:.3f} ms; step {gpu:.3f} ms")


if __name__ == "__main__":
    main()
