"""How fast is each of the step's matrix products by cuBLASLt, by its workspace, and against
cuBLAS's default algorithm (cublasGemmEx, CuPy's handle, its own workspace)?

Answer (one H200, 2026-12-02; docs/design.md, "Products" and "The host before the first
product"): a workspace makes grad_input at T = 1024 faster (0.822 against 0.714 ms: its output is
too few tiles for the GPU, and the algorithms that split the sum need one), but with room for one
the heuristic's eight candidates left out the fastest logits algorithm (0.726 against 0.854), so
both kinds are candidates now; the logits of 1024 rows cut at 256 rows took less than cut at 128
(0.827 / 1.674 against 0.867 / 1.879 ms, student / teacher). Single products move by 5-10% from run
to run on these machines.

    python experiments/products.py                          # the benchmark's shape, T = 1024 and 8192
    python experiments/products.py --workspace-mib 0 4 32

The products of a step at the benchmark's shape (bf16, V = 128256, Hs = 2048, Ht = 4096, float32
logits and grad_input): at T = 1024 (one chunk, G held: grad_weight one product into bf16), and a
chunk of 2048 rows at T = 8192 (grad_weight a float32 sum over chunks: its product adds to it).
Each by jsdgpu.cuda.products.gemm with each most workspace (its tuning picks among the candidates
that take none and those that fit), and by cuBLAS's default; the logits also as a default call
queues them at T = 1024 (its first rows, then the rest). Medians of 20 CUDA-event-timed runs after 3.
"""

import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def timed(fn):
    """Median ms of fn() over 20 runs after 3 (the benchmark's timing)."""
    import harness
    return harness.time_ms(lambda i: fn(), 1, 3, 20)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspace-mib", type=float, nargs="+", default=[0, 32],
                   help="the most workspace an algorithm may take (the candidates: those that take none, "
                        "and those that fit)")
    a = p.parse_args()
    import cupy  # needs the GPU: after --help
    import harness

    from jsdgpu.cuda import products
    from jsdgpu.cuda.steps import leading_dim
    from jsdgpu.cuda.products import N, T
    V, HS, HT, bf16 = harness.V, harness.HS, harness.HT, harness.BF16
    ld = leading_dim(V)
    rng = cupy.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(bf16)
    (ws, wt), = harness.make_weights(1)
    alpha = cupy.full((), 1e-3, np.float32)  # 1/N on the device, as the step's backward products take it
    rows = []
    for tokens, c in ((1024, 1024), (8192, 2048)):
        xs, xt = normal(c, HS), normal(c, HT)
        G = normal(c, ld, scale=1e-3)
        logits_s, logits_t = cupy.empty((c, ld), np.float32), cupy.empty((c, ld), np.float32)
        grad_input = cupy.empty((c, HS), np.float32)
        grad_weight = cupy.empty((V, HS), bf16 if tokens == 1024 else np.float32)
        beta = 0.0 if tokens == 1024 else 1.0
        # (name, gemm's arguments but the last, workspace_bytes): products.py's forms
        shapes = [("student logits", (T, N, V, c, HS, 1.0, ws, HS, xs, HS, 0.0, logits_s, ld)),
                  ("teacher logits", (T, N, V, c, HT, 1.0, wt, HT, xt, HT, 0.0, logits_t, ld)),
                  ("grad_input", (N, N, HS, c, V, alpha, ws, HS, G, ld, 0.0, grad_input, HS)),
                  ("grad_weight" + (" (adds)" if beta else ""),
                   (N, T, HS, V, c, alpha, xs, HS, G, ld, beta, grad_weight, HS))]
        for name, args in shapes:
            row = {"T": tokens, "rows": c, "product": name}
            for mib in a.workspace_mib:
                if beta:  # tune its class first, as the step's first chunk (beta 0) does
                    products.gemm(*args[:10], 0.0, *args[11:], workspace_bytes=int(mib * 2**20))
                row[f"Lt {mib:g} MiB"] = timed(lambda: products.gemm(*args, workspace_bytes=int(mib * 2**20)))
            row["cuBLAS default"] = timed(lambda: products._gemm_default(*args))
            rows.append(row)
        if tokens == 1024:  # the logits as a default call queues them: its head, then the rest
            for head in (128, 256):
                for name, w, x, out, h in (("student", ws, xs, logits_s, HS), ("teacher", wt, xt, logits_t, HT)):
                    def split(mib):
                        for part in (slice(0, head), slice(head, c)):
                            products.gemm(T, N, V, part.stop - part.start, h, 1.0, w, h, x[part], h, 0.0,
                                          out[part], ld, workspace_bytes=int(mib * 2**20))
                    rows.append({"T": tokens, "rows": c, "product": f"{name} logits, {head} + {c - head} rows",
                                 **{f"Lt {mib:g} MiB": timed(lambda: split(mib)) for mib in a.workspace_mib}})
    columns = [k for k in rows[0] if k not in ("T", "rows", "product")]
    print("| T | rows | product | " + " | ".join(columns) + " |")
    print("| --- | --- | --- |" + " --- |" * len(columns))
    for r in rows:
        print(f"| {r['T']} | {r['rows']} | {r['product']} | "
              + " | ".join(f"{r[k]:.3f}" if k in r else "" for k in columns) + " |")


if __name__ == "__main__":
    main()
