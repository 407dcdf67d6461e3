"""What do a run's first steps pay for tuning the products (jsdgpu/cuda/products.py)?

In a fresh process, bench/bench_run.py's run at each T (its ten steps in turn: the JSD falling,
0-40% of the rows ignored), round after round, each step timed from an idle GPU (CUDA events).
Each product class is tuned by its first product (its candidates timed on it), so a run's first
steps are slower until the classes its row counts meet are all tuned. Prints, per round, the ten
steps' ms and the classes tuned in it; then the same steps' total once tuned (the last round)
and what the first rounds paid over it.

    python experiments/first_steps.py [--tokens 1024 8192] [--rounds 6]

Tuning's choices are kept on disk (jsdgpu/cuda/tuning_cache.py): run it with
JSDGPU_GEMM_CACHE=<a new file> twice, and with JSDGPU_GEMM_CACHE=0, to see what the second
process saves.

Answer (one H200, 2026-12-04): docs/design.md, "Products" (about 60 ms a class, in the first two
rounds; a round's time tuned from the third; with the choices of an earlier process on disk,
142 ms over the tuned steps at T = 1024 against 1840, and nothing at T = 8192 after it).
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    import cupy  # needs the GPU: after --help
    from bench_run import heads, implementation, run_steps

    from jsdgpu.cuda import products
    ws, wn = heads(cupy, 4.0, 1)
    print("| T | round | ms, the ten steps | classes tuned in the round |")
    print("| --- | --- | --- | --- |")
    for T in a.tokens:
        fns = [implementation("jsdgpu", step) for step in run_steps(cupy, T, ws, wn)]
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        totals = []
        for r in range(a.rounds):
            tuned, total = len(products._tuned), 0.0
            for fn in fns:
                cupy.cuda.Device().synchronize()
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                total += cupy.cuda.get_elapsed_time(start, stop)
            totals.append(total)
            print(f"| {T} | {r} | {total:.1f} | {len(products._tuned) - tuned} |", flush=True)
        print(f"| {T} | paid over the last round | {sum(t - totals[-1] for t in totals[:-1]):.1f} | "
              f"{len(products._tuned)} classes in all |", flush=True)
        del fns
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
