"""Why does reduction="none" cost 5-7% of the step at T = 8192 (bench/results/h200_run.md)?

At the default budget, "mean" takes four chunks of 2048 rows and sums grad_weight in float32;
"none" holds G for all rows (its backward needs each row's grad_output) beside six chunks of 1408.
This times, in turns, the step (forward + backward, every row valid) at:

- mean: the default (four chunks of 2048, the float32 sum);
- none: the default (six chunks of 1408, G held);
- mean, chunks of 1408 (six, the sum): the chunks' count alone;
- mean, chunks of 1408, G held (a budget that holds it): none's plan, with mean's backward;
- none, memory_budget 3 GiB (four chunks of 2048, G held): more memory, mean's chunks.

    python experiments/none_chunks.py [--tokens 8192] [--rounds 12]

Each variant's median ms over the rounds, and each minus "mean" with twice its standard error.

Answer (one H200, 2026-12-04, --rounds 10; docs/design.md, "Token weights and the sum"): "mean"
38.68 ms; none -0.48 ± 0.97, mean in chunks of 1408 -1.03 ± 1.56, those with G held -0.41 ±
1.94, none with 3 GiB -0.07 ± 2.85: no cost of the six chunks that the noise lets through, in a
fresh process (the benchmark's 5-7% at T = 8192 comes after its run's other shapes).
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
    a = p.parse_args()
    import cupy  # needs the GPU: after --help
    import harness
    import numpy as np
    from bench_run import timed_turns

    import jsdgpu
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


if __name__ == "__main__":
    main()
