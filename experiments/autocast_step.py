"""What does autocast over float32 weights add to the module's step (eager, or --compiled),
beyond its casts?

Answer (one H200, 2026-12-05, two runs; docs/design.md, "The front ends"): under autocast the
step took 0.95 and 0.87 ms longer than on bf16 weights at T = 1024, less than the casts alone
(1.13 and 1.12 ms: the step's own work partly hides them), and 1.62 and 1.88 ms longer at T =
8192, 0.45 and 0.70 ms (1.5% and 2.4% of the step) beyond the casts (1.17 and 1.18): the float32
gradients' wider writes (grad_input, and the master weight's gradient, written in float32).
Compiled (--compiled --tokens 4096 8192 --rounds 3 --reps 10, two H100s, 2026-12-06, two runs
on each alternating with --package of the code before, whose operator copied the float32 sum
into its output): the autocast step took 17.08, 17.91, 16.89 and 17.41 ms at T = 4096 against
18.74, 18.84, 17.65 and 17.61 with the copy, and 31.64, 31.74, 31.94 and 32.09 at 8192 against
32.81, 32.14, 31.99 and 32.23 (less in each of the eight pairs); it added 1.22-2.13 ms to the
bf16 step at T = 4096 and 0.68-1.26 at 8192 (casts 1.6).

Three steps on the same inputs, in turns (--rounds rounds of --reps steps each, the median of
each round's median), after a second of all three (the GPU at its power cap), V = 128256, Hs =
2048, Ht = 4096, the teacher = the student + noise (its hidden state [x_s | noise],
its head [W_s | 0.7 W_n]), 0-40% of the rows ignored, other rows each step:

- bf16: FusedLinearJSDLoss forward + backward on bf16 inputs and weights;
- autocast: the same on float32 inputs and a float32 master weight, under
  torch.autocast("cuda", torch.bfloat16) (the loss casts them itself: jsdgpu.torch's docstring);
- casts: the four casts to bf16 alone (both inputs and both weights), what autocast must add.

    python experiments/autocast_step.py --tokens 1024 8192
    python experiments/autocast_step.py --tokens 4096 8192 --compiled   # the module compiled

--package DIR: the jsdgpu package in DIR (git archive REV jsdgpu | tar -x -C DIR) instead of this
tree's, to compare two versions run after run.
"""

import argparse
import pathlib
import statistics
import sys
import time

V, HS, HT = 128256, 2048, 4096
IGNORED = (0.0, 0.4, 0.1, 0.3, 0.2, 0.35)


def step_inputs(torch, tokens, generator):
    """One (x_s, x_t, labels) per share of IGNORED, float32."""
    out = []
    for share in IGNORED:
        xs = torch.randn(tokens, HS, device="cuda", generator=generator)
        xt = torch.cat([xs, torch.randn(tokens, HT - HS, device="cuda", generator=generator)], 1)
        labels = torch.randint(0, V, (tokens,), device="cuda", generator=generator)
        labels[torch.rand(tokens, device="cuda", generator=generator) < share] = -100
        out.append((xs, xt, labels))
    return out


def steps(torch, loss_fn, tokens, generator):
    """name -> step(i) on input set i"""
    ws = torch.randn(V, HS, device="cuda", generator=generator) * (4 / HS ** 0.5)
    wn = torch.randn(V, HT - HS, device="cuda", generator=generator) * (0.7 * 4 / (HT - HS) ** 0.5)
    wt = torch.cat([ws, wn], 1)
    master = ws.clone().requires_grad_(True)
    ws16, wt16 = ws.bfloat16().requires_grad_(True), wt.bfloat16()
    sets = step_inputs(torch, tokens, generator)
    sets16 = [(xs.bfloat16(), xt.bfloat16(), labels) for xs, xt, labels in sets]

    def bf16(i):
        xs, xt, labels = sets16[i % len(sets16)]
        loss_fn(xs.detach().requires_grad_(True), ws16, xt, wt16, labels).backward()
        ws16.grad = None

    def autocast(i):
        xs, xt, labels = sets[i % len(sets)]
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(xs.detach().requires_grad_(True), master, xt, wt, labels)
        loss.backward()
        master.grad = None

    def casts(i):
        xs, xt, _ = sets[i % len(sets)]
        return xs.bfloat16(), master.bfloat16(), xt.bfloat16(), wt.bfloat16()

    return {"bf16": bf16, "autocast": autocast, "casts": casts}


def timed_turns(torch, fns, rounds, reps):
    until, i = time.perf_counter() + 1.0, 0
    while time.perf_counter() < until:
        for fn in fns.values():
            fn(i)
        torch.cuda.synchronize()
        i += 1
    rounds_ms = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times = []
            for j in range(reps):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(j)
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop))
            rounds_ms[name].append(statistics.median(times))
    return rounds_ms


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--compiled", action="store_true", help="the module under torch.compile(fullgraph=True)")
    p.add_argument("--package", type=pathlib.Path, help="a directory holding another jsdgpu package")
    a = p.parse_args()
    if a.package:
        sys.path.insert(0, str(a.package.resolve()))
    import torch

    import jsdgpu.torch as jtorch
    print("jsdgpu from", jtorch.__file__)
    loss_fn = jtorch.FusedLinearJSDLoss()
    if a.compiled:
        loss_fn = torch.compile(loss_fn, fullgraph=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for tokens in a.tokens:
        rounds_ms = timed_turns(torch, steps(torch, loss_fn, tokens, generator), a.rounds, a.reps)
        ms = {name: statistics.median(v) for name, v in rounds_ms.items()}
        added = ms["autocast"] - ms["bf16"]
        print(f"T = {tokens}: bf16 {ms['bf16']:.3f} ms, autocast {ms['autocast']:.3f}, casts alone "
              f"{ms['casts']:.3f}; autocast adds {added:.3f} ms, {added - ms['casts']:+.3f} beyond the casts "
              f"({(added - ms['casts']) / ms['bf16']:+.1%} of the bf16 step)")
        print("  each round's median:", {name: [round(t, 3) for t in v] for name, v in rounds_ms.items()})


if __name__ == "__main__":
    main()
