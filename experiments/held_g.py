"""What does grad_weight's float32 sum over chunks cost a step, against G held for all rows at
the same chunks?

At T = 4096 and 8192 the default budget (2.5 GiB) gives chunks of 2048 rows, each of which adds
its G.T @ Xs to a float32 [V, Hs] sum (1 GB at the benchmark's shape: read and written again by
every chunk's product), converted to bf16 at the end; where G is held for all rows, backward
forms grad_weight in one product straight into bf16. This times both at the same chunks of 2048
rows (G held by a budget large enough for it), in turns, and the grad_weight products alone.

    python experiments/held_g.py [--tokens 4096 8192] [--rounds 16]

Answer (one H200, 2026-12-04, --rounds 12; docs/record.md): held minus sums -0.35 ± 0.38 ms at
T = 4096 (19.34 ms with the sums) and -0.42 ± 0.70 at 8192 (38.56): within the noise, for 1 and 2
GB more memory. The products alone at T = 8192: one into bf16 6.22 ms, four of 2048 rows adding
to float32 7.15, two of 4096 6.80 (and the sum's conversion to bf16 beside them). The library
now holds G at T = 4096 in the float32 sum's room (no more memory than summing), where
experiments/ab_versions.py measured -0.655 ± 0.154 ms, 24 rounds (docs/design.md, "Chunks and G").
"""

import argparse
import pathlib
import statistics
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rounds", type=int, default=16)
    a = p.parse_args()
    import cupy  # needs the GPU: after --help
    import harness
    import ml_dtypes

    import jsdgpu
    from jsdgpu.cuda import products
    from jsdgpu.cuda.products import N, T as TR
    from jsdgpu.cuda.steps import leading_dim
    bf16 = ml_dtypes.bfloat16
    V, HS, HT, CHUNK = 128256, 2048, 4096, 2048
    rng = cupy.random.default_rng(0)
    ws = (rng.standard_normal((V, HS), dtype=np.float32) * (4 / HS**0.5)).astype(bf16)
    wt = (rng.standard_normal((V, HT), dtype=np.float32) * (4 / HT**0.5)).astype(bf16)

    def timed(fn):
        """Median ms of fn() over 7 runs after 2 (harness.time_ms)."""
        return harness.time_ms(lambda i: fn(), 1, 2, 7)

    lines = []
    for T in a.tokens:
        xs = rng.standard_normal((T, HS), dtype=np.float32).astype(bf16)
        xt = rng.standard_normal((T, HT), dtype=np.float32).astype(bf16)
        target = cupy.asarray(np.random.default_rng(1).integers(0, V, T))
        variants = {"sums": dict(chunk_size=CHUNK), "held": dict(chunk_size=CHUNK, memory_budget=16 << 30)}

        def step(opts):
            loss, ctx = jsdgpu.forward(xs, ws, xt, wt, target, **opts)
            return jsdgpu.backward(ctx)
        grads = {}
        for name, opts in variants.items():
            cupy.get_default_memory_pool().free_all_blocks()
            grads[name] = [cupy.asnumpy(g).astype(np.float32) for g in step(opts)[:2]]
        diff = float(np.abs(grads["sums"][1] - grads["held"][1]).max() / np.abs(grads["held"][1]).max())
        times = {name: [] for name in variants}
        for r in range(a.rounds):
            for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
                times[name].append(timed(lambda: step(variants[name])))
        d = [x - y for x, y in zip(times["held"], times["sums"])]
        err = 2 * statistics.stdev(d) / len(d) ** 0.5
        lines.append(f"T={T} chunks of {CHUNK}: sums {statistics.median(times['sums']):.3f} ms, held "
                     f"{statistics.median(times['held']):.3f} ms, held - sums {statistics.mean(d):+.3f} ± {err:.3f} "
                     f"ms ({a.rounds} rounds); grad_weight max diff / max {diff:.2e}")

        # the grad_weight products alone: one of T rows into bf16, or T / CHUNK adding to float32
        ld = leading_dim(V)
        G = (rng.standard_normal((T, ld), dtype=np.float32) * 1e-3).astype(bf16)
        alpha = cupy.full((), 1.0 / T, np.float32)
        out16, out32 = cupy.empty((V, HS), bf16), cupy.empty((V, HS), np.float32)

        def one():
            products.gemm(N, TR, HS, V, T, alpha, xs, HS, G, ld, 0.0, out16, HS)

        def chunked(rows):
            def run():
                for c in range(0, T, rows):
                    products.gemm(N, TR, HS, V, rows, alpha, xs[c:], HS, G[c:], ld, 0.0 if c == 0 else 1.0,
                                  out32, HS)
            return run
        one(), chunked(CHUNK)(), chunked(2 * CHUNK)()
        lines.append(f"T={T} grad_weight: one product into bf16 {timed(one):.3f} ms; chunks of {CHUNK} adding "
                     f"to float32 {timed(chunked(CHUNK)):.3f}; of {2 * CHUNK} {timed(chunked(2 * CHUNK)):.3f}; "
                     f"float32 to bf16 {timed(lambda: out32.astype(bf16)):.3f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
