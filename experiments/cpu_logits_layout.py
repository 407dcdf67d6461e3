"""Does a CPU step at a large vocabulary and few rows a chunk gain by its logits products run
transposed (`products._transposed_product`), and from how many rows does that form lose?

Times forward + backward steps (`jsdgpu.forward`, `jsdgpu.backward` on NumPy arrays; T = 512,
V = 128256, hidden 256 by default: the default budget's chunks of 32 rows there) with the
transposed form and without it (the call's products told which: `products._CallProducts`), in
turns in one process, medians of --rounds, and whether the two give the same bits; then the
logits product `[M, H] @ [H, V]` at each of --rows as NumPy calls it (`products.split_matmul`)
against the transposed form (also split over the threads), best of five, ms.

    python experiments/cpu_logits_layout.py --rows 16 32 48 64 96 128
    python experiments/cpu_logits_layout.py --tokens 1024 --rows

Answer (two cores of the Zen 4 EPYC, 2026-12-05; docs/design.md, "The CPU backend"): steps at
T = 512 1.321 s transposed against 1.524, at T = 1024 2.075 against 2.157 (chunks of 64 rows),
the same bits; the product at 16, 32, 48, 64, 96 and 128 rows 13.8, 20.0, 25.5, 31.5, 42.8 and
58.6 ms transposed against 20.1, 25.1, 28.6, 33.4, 42.0 and 53.4.
"""

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jsdgpu  # noqa: E402
from jsdgpu.cpu import products  # noqa: E402


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
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rows", type=int, nargs="*", default=[32, 64, 128])
    a = p.parse_args()
    rng = np.random.default_rng(0)
    T, V, H = a.tokens, a.vocab, a.hidden
    xs, xt = (rng.standard_normal((T, H), np.float32) for _ in range(2))
    ws, wt = (rng.standard_normal((V, H), np.float32) * np.float32(0.25) for _ in range(2))
    target = rng.integers(0, V, T)

    seconds, results = {True: [], False: []}, {}
    for turn in range(a.rounds + 1):  # the first: compilation, or Numba's cache
        for transposed in (True, False):
            start = time.perf_counter()
            with products.through(products._CallProducts(transposed=transposed).matmul):
                loss, ctx = jsdgpu.forward(xs, ws, xt, wt, target)
                grads = jsdgpu.backward(ctx)
            if turn:
                seconds[transposed].append(time.perf_counter() - start)
            results[transposed] = [np.asarray(loss), *(g for g in grads if g is not None)]
    same = all(np.array_equal(x, y) for x, y in zip(results[True], results[False]))
    print(f"steps: {np.median(seconds[True]):.3f} s transposed, {np.median(seconds[False]):.3f} as called; "
          f"the same bits: {same}")

    for m in a.rows:
        x = rng.standard_normal((m, H), np.float32)
        rows = np.empty((m, V), np.float32)
        direct = best_ms(lambda: products.split_matmul(x, ws.T, rows))
        flipped = best_ms(lambda: products._split(products._transposed_product, x, ws.T, rows))
        assert np.allclose(rows, x @ ws.T, rtol=1e-4, atol=1e-3)
        print(f"{m} rows: {direct:.1f} ms as called, {flipped:.1f} transposed")


if __name__ == "__main__":
    main()
