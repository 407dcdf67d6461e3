"""What does reduction="none" cost a compiled PyTorch step, against "mean"?

torch.compile(fullgraph=True) of FusedLinearJSDLoss at the benchmark's shape (bf16, V = 128256,
hidden 2048 / 4096), forward + backward (backward of "none" with a random upstream gradient), the
two reductions in turns step by step (bench/bench_run.py's timed_turns: each step from an idle GPU,
after a second of turns), eagerly too. With the carried gradients (jsdgpu/torch_rows.py) the
compiled "none" runs the call once; before, its backward ran the call again (1.63 times the step,
docs/design.md, "Token weights and the sum").

    python experiments/compiled_none.py [--tokens 1024 4096 8192] [--ignored 0.25] [--repeats 10]

Prints, for each T, the median ms of each step and "none" ÷ "mean", compiled and eager.

Answer (one H200, 2026-12-04, --tokens 1024 8192): compiled "none" ÷ "mean" 0.980 and 1.015
(4.21 / 4.29 and 29.45 / 29.02 ms), eagerly 1.005 and 1.025; the code before the carried
gradients (the call computed again in backward) 1.444 and 1.595 compiled, 1.001 and 1.030 eagerly.
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--ignored", type=float, default=0.25, help="the share of ignored rows")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    import numpy as np
    import torch  # needs the GPU: after --help
    from bench_run import timed_turns
    from harness import make_sets, make_weights

    import jsdgpu.torch as jtorch
    weights = make_weights(1)
    rng = np.random.default_rng(0)
    print("| T | mean, compiled | none, compiled | ÷ | mean, eager | none, eager | ÷ |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for T in a.tokens:
        (step_set,) = make_sets(T, weights, rng, 1.0 - a.ignored)
        xs, ws, xt, wt, target = (torch.from_dlpack(x) for x in step_set)
        xs, ws = xs.detach().requires_grad_(True), ws.detach().requires_grad_(True)
        upstream = torch.randn(T, device="cuda")

        def step(reduction, compiled):
            module = jtorch.FusedLinearJSDLoss(reduction=reduction)
            fn = torch.compile(module, fullgraph=True) if compiled else module

            def run():
                out = fn(xs, ws, xt, wt, target)
                (out * upstream).sum().backward() if reduction == "none" else out.backward()
                xs.grad = ws.grad = None
            return run
        fns = [step(r, c) for c in (True, False) for r in ("mean", "none")]
        ms = timed_turns(fns, a.repeats, 1.0)
        print(f"| {T} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[1] / ms[0]:.3f} | {ms[2]:.2f} | {ms[3]:.2f} | "
              f"{ms[3] / ms[2]:.3f} |", flush=True)
        del fns
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
