"""Where does a CPU step at a large vocabulary and few rows a chunk spend its time, and would the
logits product run faster asked for transposed?

Times one forward + backward step (`jsdgpu.forward`, `jsdgpu.backward` on NumPy arrays; T = 512,
V = 128256, hidden 256 by default: the default budget's chunks of 32 rows there), its products
through the backend's own matmul (`products.through`, each call timed), then the logits product
`[M, H] @ [H, V]` at each of --rows as the backend calls it (`products.split_matmul`) against the
same product into a transposed buffer (`W @ X^T`, also split) and a parallel Numba transpose of
that buffer into the chunk's rows; best of five, ms.

    python experiments/cpu_logits_layout.py
    python experiments/cpu_logits_layout.py --rows 32 64 128 512

Answer (two cores of the Zen 4 EPYC, 2026-12-05; docs/record.md, "the CPU's logits product of
few rows, transposed"): steps of 1.58-1.94 s, 1.38-1.73 s of them in the products, 0.90 s in the
32 logits products; that product at 32 rows 26.1 ms as called, transposed 18.4 and its
transpose 3.2 (at 64 rows 34.4 against 28.6 + 6.2, at 128 rows 53.1 against 49.1 + 11.7).
"""

import argparse
import collections
import pathlib
import sys
import time

import numba
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jsdgpu  # noqa: E402
from jsdgpu.cpu import products  # noqa: E402


@numba.njit(parallel=True)
def transpose(src, dst):
    """dst [M, V] = src [V, M].T, in blocks of 512 of V."""
    v, m = src.shape
    for block in numba.prange((v + 511) // 512):
        lo, hi = block * 512, min(v, block * 512 + 512)
        for i in range(m):
            for j in range(lo, hi):
                dst[i, j] = src[j, i]


def best_ms(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rows", type=int, nargs="*", default=[32, 64, 128])
    a = p.parse_args()
    rng = np.random.default_rng(0)
    T, V, H = a.tokens, a.vocab, a.hidden
    xs, xt = (rng.standard_normal((T, H), np.float32) for _ in range(2))
    ws, wt = (rng.standard_normal((V, H), np.float32) * np.float32(0.25) for _ in range(2))
    target = rng.integers(0, V, T)

    calls = collections.defaultdict(lambda: [0, 0.0])
    own = products._CallProducts().matmul

    def timed(x, y, out):
        start = time.perf_counter()
        own(x, y, out)
        entry = calls[(x.shape, y.shape)]
        entry[0] += 1
        entry[1] += time.perf_counter() - start
        return out
    for step in range(4):  # the first: compilation, or Numba's cache
        calls.clear()
        start = time.perf_counter()
        with products.through(timed):
            _, ctx = jsdgpu.forward(xs, ws, xt, wt, target)
            jsdgpu.backward(ctx)
        total = time.perf_counter() - start
        if step:
            print(f"step {total:.3f} s, its products {sum(t for _, t in calls.values()):.3f} s")
    for shapes, (count, seconds) in calls.items():
        print(f"  {shapes[0]} @ {shapes[1]}: {count} calls, {seconds:.3f} s")

    for m in a.rows:
        x = rng.standard_normal((m, H), np.float32)
        rows, columns = np.empty((m, V), np.float32), np.empty((V, m), np.float32)
        direct = best_ms(lambda: products.split_matmul(x, ws.T, rows))
        flipped = best_ms(lambda: products.split_matmul(ws, x.T, columns))
        back = best_ms(lambda: transpose(columns, rows))
        assert np.allclose(rows, x @ ws.T, rtol=1e-4, atol=1e-3)
        print(f"{m} rows: {direct:.1f} ms as called; transposed {flipped:.1f} + its transpose {back:.1f}")


if __name__ == "__main__":
    main()
