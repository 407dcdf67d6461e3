"""Which fused-kernel shape should take a teacher vocabulary wider than 131072 columns?

Past 131072 a row's columns need more than the registers of 8 SMs: a fifth group a thread in
shared memory (up to 163840 columns), or CTAs of 1024 threads, one per SM, 16384 columns each.
This times the library's shapes that hold each vocabulary (sources.FUSED_SHAPES) and, on request,
clusters of other sizes of CTAs of 1024 threads, against the three phase kernels, their outputs
compared with the phases': the JSD with G, teacher = student + 0.6 N(0, 1) at logit std 4, float32
logits written straight into the chunk's buffers. Needs a GPU.

    python experiments/wide_shapes.py [--vocab 151936 201088 262144] [--clusters 10 12 13]

Answer (one H200, 2026-12-04; docs/design.md, "Wide vocabularies"): the shape with a fifth group
in shared memory runs 15 clusters at once, 692 µs per 1024 rows at V = 151936 and 711 at 163840,
against 1091 and 1099 with clusters of 16 CTAs of 1024 threads and 1319 and 1438 for the phases.
The GPU runs 7 clusters of CTAs of 1024 threads at once (one per GPC) whatever their size, so the
largest is the fastest: at 151936 1078 with 16 CTAs against 1117-1248 with 10-13 (--clusters);
at 201088 1219 (16) against 1765 for the phases, at 262144 1343 against 2278. The outputs are
the phases' to float32's rounding (G, bf16: to its last bit). The wide shape with a fifth group
in shared memory (--vocab 262144 262208 327680, 2026-12-04): 1479 µs at Gemma 3's 262208 against
2288 for the phases, 1653 against 2859 at 327680; at 262144, 1402 against the wide shape's 1305
(the fifth group, past the row's end, still worked on).
"""

import argparse
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[151936, 201088, 262144])
    p.add_argument("--clusters", type=int, nargs="*", default=[],
                   help="clusters of these many CTAs of 1024 threads (one per SM), beside the library's shapes")
    p.add_argument("--rows", type=int, default=2048)
    a = p.parse_args()
    import cupy  # needs the GPU: after --help
    import numpy as np

    import harness
    import jsdgpu
    from jsdgpu.cuda import kernels, sources
    from jsdgpu.cuda.backend import CudaBackend as B

    T, device = a.rows, cupy.cuda.Device().id
    rng = cupy.random.default_rng(0)
    opts = jsdgpu.LossOptions(beta=0.5)
    print("| V | kernel | clusters in flight | µs per 1024 rows | ÷ phases | largest relative difference "
          "from the phases': CE, JSD, G |")
    print("| --- | --- | --- | --- | --- | --- |")
    for V in a.vocab:
        weight = cupy.empty((V, 8), harness.BF16)  # prepare reads the heads' shape and dtype alone
        work = B.prepare(weight, weight, None, None, T, fused=False)
        G = B.gradient_rows(work, T, own_g=True)
        target = cupy.asarray(np.random.default_rng(0).integers(0, V, T), np.int32)
        student = rng.standard_normal((T, V), dtype=np.float32) * 4.0
        work.logits_s[:, :V] = student
        work.logits_t[:, :V] = student + 0.6 * rng.standard_normal((T, V), dtype=np.float32)
        ce, jsd, terms = (cupy.empty(T, np.float32) for _ in range(3))

        def phases(i):
            stats = B.row_stats(work, target, opts)
            B.row_finish(work, target, stats, B.row_kl(work, target, stats, opts), opts, ce, jsd, G, terms)
        phase_ms = harness.time_ms(phases, 1, 3, 10, warm_s=0.3)
        want = [x.astype(np.float32) for x in (ce, jsd, G[:, :V])]
        per = 1024 / T * 1000
        print(f"| {V} | phases | | {phase_ms * per:.0f} | 1.00 | |", flush=True)
        shapes = list(sources.FUSED_SHAPES) + [sources.FusedShape(cluster=c, threads=1024, min_ctas=1)
                                               for c in a.clusters]
        for shape in shapes:
            if shape.max_vocab < V:
                continue
            fused = dataclasses.replace(work, fused=kernels.fused_kernel(device, weight.dtype, shape))
            G.fill(np.nan)
            ms = harness.time_ms(lambda i: B.fused_rows(fused, target, opts, ce, jsd, G, terms), 1, 5, 20,
                                 warm_s=0.3)
            got = [x.astype(np.float32) for x in (ce, jsd, G[:, :V])]
            diff = ", ".join(f"{float(cupy.abs(g - w).max() / cupy.abs(w).max()):.1e}" for g, w in zip(got, want))
            kind = f"{shape.cluster} CTAs of {shape.threads}, {shape.groups} + {shape.extra} groups"
            print(f"| {V} | {kind} | {fused.fused.max_clusters} | {ms * per:.0f} | {ms / phase_ms:.2f} "
                  f"| {diff} |", flush=True)


if __name__ == "__main__":
    main()
