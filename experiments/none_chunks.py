"""Why does reduction="none" cost 5-7% of the step at T = 8192 (bench/results/h200_run.md)?

At the default budget, "mean" takes four chunks of 2048 rows and sums grad_weight in float32;
"none" holds G for all rows (its backward needs each row's grad_output) beside six chunks of 1408.
This times, in turns, the step (forward + backward, every row valid) at:

- mean: the default (four chunks of 2048, the float32 sum);
- none: the default (six chunks of 1408, G held);
- mean, chunks of 1408 (six, the sum): the chunks' count alone;
- mean, chunks of 1408, G held (a budget that holds it): none's plan, with mean's backward;
- none, memory_budget 3 GiB (four chunks of 2048, G held): more memory, mean's chunks.

    python experiments/none_chunks.py [--tokens 8192] [--rounds 12] [--history]

--history: first the calls bench/bench_run.py makes before its distributions (its history calls,
and its run's steps at T = 1024, 4096 and 8192, "mean" and "none"), so that the products' classes
are tuned as they are there.

Each variant's median ms over the rounds, and each minus "mean" with twice its standard error.

Answer (one H200, 2026-12-04, --rounds 10; docs/design.md, "Token weights and the sum" and
"Products"): fresh, "mean" 38.68 / 39.05 ms (two runs), none -0.48 ± 0.97 / -2.43 ± 0.80, mean
in chunks of 1408 -1.03 ± 1.56 / -2.40 ± 1.41, those with G held -0.41 ± 1.94 / -1.90 ± 1.56,
none with 3 GiB -0.07 ± 2.85 / -1.17 ± 2.07: the six chunks cost nothing. With --history: "mean"
37.86, none +2.28 ± 0.32, mean in chunks of 1408 +1.39 ± 0.28, with G held +1.38 ± 0.37, none
with 3 GiB -0.90 ± 0.40: the products of 1408 rows take their class's algorithm, tuned at 1536
rows by the history; with eight classes an octave (products._bucket's unit 1 << (bit_length -
4), a copy of the package) none +0.30 ± 0.26, mean in chunks of 1408 +0.38 ± 0.61; the package
with them (products._bucket, since) none +0.09 ± 0.37 and +0.50 ± 0.56 ("mean" 38.59).
"""

import argparse
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

VARIANTS = {"mean": {}, "none": dict(reduction="none"), "mean, chunks of 1408": dict(chunk_size=1408),
            "mean, chunks of 1408, G held": dict(chunk_size=1408, memory_budget=8 << 30),
            "none, budget 3 GiB": dict(reduction="none", memory_budget=3 << 30)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--history", action="store_true", help="bench_run.py's calls before its distributions first")
    a = p.parse_args()
    import cupy  # needs the GPU: after --help
    import harness
    import numpy as np
    from bench_run import timed_turns

    import jsdgpu
    if a.history:
        run_history(cupy, jsdgpu)
    weights = harness.make_weights(1)
    rng = np.random.default_rng(0)
    for T in a.tokens:
        (step_set,) = harness.make_sets(T, weights, rng)
        ones = cupy.ones(T, np.float32)

        def step(opts):
            def run():
                loss, ctx = jsdgpu.forward(*step_set, **opts)
                jsdgpu.backward(ctx, ones if opts.get("reduction") == "none" else 1.0)
            return run
        fns = [step(opts) for opts in VARIANTS.values()]
        rounds = [timed_turns(fns, 1, 1.0 if r == 0 else 0.0) for r in range(a.rounds)]
        base = [r[0] for r in rounds]
        print(f"T = {T}, {a.rounds} rounds, ms:")
        for k, name in enumerate(VARIANTS):
            times = [r[k] for r in rounds]
            d = [x - y for x, y in zip(times, base)]
            err = 2 * statistics.stdev(d) / len(d) ** 0.5 if k else 0.0
            print(f"  {name:32s} {statistics.median(times):7.2f}   - mean {statistics.mean(d):+.3f} ± {err:.3f}")


def run_history(cupy, jsdgpu):
    """bench_run.py's calls before its distributions: its history calls, then its run's steps."""
    from bench_run import heads, history_steps, run_steps
    ws, wn = heads(cupy, 4.0, 1)

    def steps():  # one T's steps held at a time
        yield from history_steps(cupy, ws, wn)
        for T in (1024, 4096, 8192):
            yield from run_steps(cupy, T, ws, wn)
    for step in steps():
        for reduction in ("mean", "none"):
            jsdgpu.backward(jsdgpu.forward(*step, reduction=reduction)[1])
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
