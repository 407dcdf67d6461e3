"""What does reduction="none" cost a compiled PyTorch step, against "mean"?

torch.compile(fullgraph=True) of FusedLinearJSDLoss at the benchmark's shape (bf16, V = 128256,
hidden 2048 / 4096), forward + backward (backward of "none" with a random upstream gradient), the
two reductions in turns step by step (bench/bench_run.py's timed_turns: each step from an idle GPU,
after a second of turns), eagerly too. With the carried gradients (jsdgpu/torch_rows.py) the
compiled "none" runs the call once; before, its backward ran the call again (1.63 times the step,
docs/design.md, "Token weights and the sum").

    python experiments/compiled_none.py [--tokens 1024 4096 8192] [--ignored 0.25] [--repeats 10]
    python experiments/compiled_none.py --topk 64 --tokens 1024 8192   # the top-k loss
    python experiments/compiled_none.py --topk 64 --tokens 1024 --profile   # and where the GPU idles

--package DIR: the jsdgpu package in DIR (git archive REV jsdgpu | tar -x -C DIR) instead of this
one's, to compare the two.

Prints, for each T, the median ms of each step and "none" ÷ "mean", compiled and eager.

Answer (one H200, 2026-12-04, --tokens 1024 8192): compiled "none" ÷ "mean" 0.980 and 1.015
(4.21 / 4.29 and 29.45 / 29.02 ms), eagerly 1.005 and 1.025; the code before the carried
gradients (the call computed again in backward) 1.444 and 1.595 compiled, 1.001 and 1.030 eagerly.
The top-k loss (--topk 64, four runs): 1.177-1.208 at T = 1024 and 0.970-0.995 at 8192; before
its carry, 1.517 and 1.357 (docs/design.md, "Token weights and the sum").
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
    p.add_argument("--topk", type=int, metavar="K",
                   help="the top-k loss instead, against the teacher's top K (jsdgpu.teacher_topk of its logits)")
    p.add_argument("--package", type=pathlib.Path, help="a directory holding another jsdgpu package")
    p.add_argument("--profile", action="store_true",
                   help="then one step of each under torch's profiler: the GPU's gaps (torch_step.py's)")
    a = p.parse_args()
    import numpy as np
    import torch  # needs the GPU: after --help
    from bench_run import timed_turns  # (which puts this repository first on sys.path)
    if a.package:
        sys.path.insert(0, str(a.package.resolve()))
    from harness import make_sets, make_weights

    import jsdgpu
    import jsdgpu.torch as jtorch
    print("jsdgpu from", pathlib.Path(jsdgpu.__file__).parent)
    weights = make_weights(1)
    rng = np.random.default_rng(0)
    print("| T | mean, compiled | none, compiled | ÷ | mean, eager | none, eager | ÷ |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for T in a.tokens:
        (step_set,) = make_sets(T, weights, rng, 1.0 - a.ignored)
        xs, ws, xt, wt, target = step_set
        teacher = jsdgpu.teacher_topk(xt, wt, a.topk) if a.topk else (xt, wt)  # (ids, logprobs) or (xt, wt)
        xs, ws, target, *teacher = (torch.from_dlpack(x) for x in (xs, ws, target, *teacher))
        xs, ws = xs.detach().requires_grad_(True), ws.detach().requires_grad_(True)
        upstream = torch.randn(T, device="cuda")

        def step(reduction, compiled):
            module = (jtorch.FusedLinearTopKJSDLoss if a.topk else jtorch.FusedLinearJSDLoss)(reduction=reduction)
            fn = torch.compile(module, fullgraph=True) if compiled else module

            def run():
                out = fn(xs, ws, *teacher, target)
                (out * upstream).sum().backward() if reduction == "none" else out.backward()
                xs.grad = ws.grad = None
            return run
        fns = [step(r, c) for c in (True, False) for r in ("mean", "none")]
        ms = timed_turns(fns, a.repeats, 1.0)
        print(f"| {T} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[1] / ms[0]:.3f} | {ms[2]:.2f} | {ms[3]:.2f} | "
              f"{ms[3] / ms[2]:.3f} |", flush=True)
        if a.profile:
            from torch_step import profile
            for fn, name in zip(fns, ("compiled_mean", "compiled_none", "eager_mean", "eager_none")):
                profile(lambda i, fn=fn: fn(), None, f"{name}_{T}")
        del fns
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
