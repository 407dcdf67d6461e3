"""Is the top-k loss's own logits product (jsdgpu/cuda/src/topk_logits.cu, its epilogue the row
kernel's streaming work; topk_finish after it) faster than cuBLAS's product and the row kernel?

Answer (one H200, at the power cap; docs/design.md, "Top-k: the logits product of our own"):
per chunk, yes: the own product and topk_finish took 0.996 / 1.949 / 8.071 ms for 1024 / 2048 /
8192 rows against cuBLASLt's product and the row kernel's 1.119 / 2.198 / 8.254 (the product
alone 0.926 / 1.760 / 7.519, cuBLASLt's float32 product alone 0.850 / 1.765 / 6.291). The first
version of this script timed a kernel of its own (commit 625e3d5): 0.936 / 1.800 / 7.536 ms
with the epilogue's work. With the slots' logits packed and topk_finish at 64 threads (commit
ee0d42a, --rows 1024 2048 --k K --repeats 10 --warm-seconds 0.5): 0.933 / 1.831 ms (k = 64) and
0.964 / 1.846 (k = 256) against 1.081 / 2.064 and 1.075 / 2.115; topk_finish alone 0.039 / 0.068
and 0.063 / 0.112. With the consumers' ping-pong (commit b1001fd, --rows 2048 --k 64 --repeats 10
--warm-seconds 0.5, twice, and commit 6b17f80's script once between): the product alone 1.922 and
1.912 ms against 2.015, cuBLASLt's 1.667 and 1.585. With topk_finish's loads ahead and
topk_slot_bits' whole rows (commit 4b10d17 against ed45ea7, --rows 2048 --k K --repeats 10
--warm-seconds 0.3, one after the other): topk_finish alone 0.090 / 0.067 ms (k = 256 / 64)
against 0.126 / 0.070.

    python experiments/own_gemm.py                  # chunks of 1024, 2048 and 8192 rows, k = 64
    python experiments/own_gemm.py --rows 1024 --k 256 --warm-seconds 0

Per chunk size: cuBLASLt's logits product alone; it and the row kernel (the library's path on
other GPUs, dtypes and temperatures); the own product and topk_finish (bf16, temperature 1, on
sm_90), with the largest difference of the rows' losses and of G (as its row scales times what is
stored) between the two; then the own product alone (topk_slot_bits and topk_logits), and
topk_finish alone.
Medians of CUDA-event-timed runs, each measurement after --warm-seconds of its own workload
(bench/harness.py).
"""

import argparse
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 2048, 8192])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warm-seconds", type=float, default=1.0)
    args = p.parse_args()

    os.environ["JSDGPU_TOPK_PRODUCT"] = "own"  # the own product at every T, before the library is imported
    import cupy  # here, not above: --help runs without a GPU
    import harness
    import ml_dtypes

    from jsdgpu.cuda import products
    from jsdgpu.cuda.backend import CudaBackend as B
    from jsdgpu.options import split_options

    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    v, opts = args.vocab, split_options(dict(beta=0.5))[0]
    print("rows | variant | ms | check")
    for m in args.rows:
        x = cupy.asarray(rng.standard_normal((m, args.hidden)).astype(bf16))
        w = cupy.asarray((rng.standard_normal((v, args.hidden)) * 4 / args.hidden**0.5).astype(bf16))
        ids = cupy.asarray(np.stack([rng.choice(v, args.k, replace=False) for _ in range(m)]), np.int32)
        lq = cupy.full((m, args.k), np.log(0.9 / args.k), np.float32)
        target = cupy.asarray(rng.integers(0, v, m), np.int32)
        assert B.topk_own_product(opts, x, w, args.k, True)
        paths = {}
        for own in (False, True):
            work = B.topk_prepare(w, None, m, own=own, k=args.k)
            out = [cupy.zeros(m, np.float32) for _ in range(4)] + [B.topk_gradient_rows(work, m)]

            def step(work=work, own=own, out=out, product=True):
                ce, soft, label_terms, scale, G = out
                if own and product:
                    B.topk_own_logits(work, x, ids, lq, G)
                elif not own:
                    B.head_logits(work, x)
                B.topk_rows(work, ids, lq, target, opts, "bucket", ce, soft, G, label_terms, scale, x)
            paths[own] = step, out, work
        for own in (False, True):
            paths[own][0]()
        cupy.cuda.Device().synchronize()
        (ce0, _, _, s0, G0), (ce1, _, _, s1, G1) = paths[False][1], paths[True][1]

        def as_float(G, scale):
            return (G[:, :v].view(np.uint16).astype(np.uint32) << 16).view(np.float32) * scale[:, None]
        g0, g1 = as_float(G0, s0), as_float(G1, s1)
        check = (f"rows' CE {float(cupy.abs(ce1 - ce0).max() / cupy.abs(ce0).max()):.1e}, "
                 f"G {float(cupy.abs(g1 - g0).max() / cupy.abs(g0).max()):.1e} (largest differences, relative)")
        logits = cupy.empty((m, G0.shape[1]), np.float32)
        t = harness.time_ms(lambda i: products.logits(x, w, logits), 1, 3, args.repeats, args.warm_seconds)
        print(f"{m} | cuBLASLt's logits product | {t:.3f} | -")
        for own, name in ((False, "cuBLASLt's product + topk_rows"), (True, "topk_logits + topk_finish")):
            t = harness.time_ms(lambda i: paths[own][0](), 1, 3, args.repeats, args.warm_seconds)
            print(f"{m} | {name} | {t:.3f} | {check if own else '-'}", flush=True)
        # last: it leaves the flags set (timing only)
        t = harness.time_ms(lambda i: B.topk_own_logits(paths[True][2], x, ids, lq, paths[True][1][4]), 1, 3,
                            args.repeats, args.warm_seconds)
        print(f"{m} | topk_slot_bits + topk_logits alone | {t:.3f} | -", flush=True)
        # again and again on the same product's output (the flags it cleared: timing only; while it
        # cleared the bitmap, on a cleared one: the same loads and math on other slots' places)
        t = harness.time_ms(lambda i: paths[True][0](product=False), 1, 3, args.repeats, args.warm_seconds)
        print(f"{m} | topk_finish alone | {t:.3f} | -", flush=True)


if __name__ == "__main__":
    main()
