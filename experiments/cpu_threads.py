"""Do the CPU row kernels pay for their parallel region at small calls?

A CPU step's products run on NumPy's BLAS threads (OpenBLAS), which keep spinning for a while
after each product, and its row kernels on Numba's threads (OpenMP), which spin too after each
parallel region. On a machine of two cores a parallel kernel that follows a product, and a
product that follows a parallel kernel, wait for a thread that another holds. This times whole
steps (jsdgpu.forward and backward on NumPy arrays, float32, hidden 64) of the jsdgpu that
PYTHONPATH gives (this script puts no path of its own first), medians of 7 after 3, twice: run
it on the code before cpu/threads.py (every kernel parallel) and on this code (one thread below
PARALLEL_FROM values).

    mkdir -p /tmp/old && git archive 0a31e93 jsdgpu | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python experiments/cpu_threads.py; PYTHONPATH=. python experiments/cpu_threads.py

Answer (this project's CI kind of machine, 2 cores, 2026-12-04; docs/design.md, "The CPU
backend"), ms a step, the two runs of each, before / after: T = 13, V = 1031 6.82 and 6.83 /
0.31 and 0.26; 64 x 1000 7.71 and 7.58 / 0.73 and 0.72; 256 x 4000 10.44 and 10.48 / 11.52 and
11.49; 512 x 8000 39.49 and 41.08 / 36.42 and 36.46; 512 x 16000 83.23 and 83.09 / 75.71 and 77.71;
and past the threshold, the same code: 512 x 32000 164.28 and 152.28 / 156.17 and 157.45,
1024 x 32000 301.44 and 290.79 / 288.32 and 287.68.
"""

import argparse
import statistics
import time

import numpy as np

SHAPES = ["13x1031", "64x1000", "256x4000", "512x8000", "512x16000", "512x32000", "1024x32000"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="T x V")
    p.add_argument("--hidden", type=int, default=64)
    a = p.parse_args()

    import jsdgpu
    rng = np.random.default_rng(0)
    print(f"jsdgpu from {jsdgpu.__file__}")
    for shape in a.shapes:
        T, V = map(int, shape.split("x"))
        f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
        case = dict(student_input=f(T, a.hidden), student_weight=f(V, a.hidden) * 0.1,
                    teacher_input=f(T, a.hidden), teacher_weight=f(V, a.hidden) * 0.1,
                    target=rng.integers(0, V, T))

        def step():
            loss, ctx = jsdgpu.forward(**case)
            jsdgpu.backward(ctx)
        ms = []
        for _ in range(2):
            for _ in range(3):
                step()
            times = []
            for _ in range(7):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            ms.append(1e3 * statistics.median(times))
        print(f"T = {T}, V = {V} ({T * V} logits): {' / '.join(f'{x:.2f}' for x in ms)} ms", flush=True)


if __name__ == "__main__":
    main()
