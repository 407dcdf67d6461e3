"""Where does one step's GPU time go?

Answer (H200, 2026-11-30): at T = 8192 the products take what the four-product floor does
(29.3 of a 38.0 ms profiled step), the fused row kernel 3.5 ms (at the SM clock the products
leave it), the other kernels 0.65 ms and the GPU idles 0.09 ms from the first product on; at
T = 1024 the products take 3.43 of 4.14 ms and the row kernel 0.36. (The present code's steps,
profiled by experiments/run_steps.py: docs/design.md, "Where a step's time goes".)

    python experiments/profile_step.py                              # T = 1024 and 8192, fwd + bwd
    python experiments/profile_step.py --tokens 8192 --valid 1 0.5 --modes fwd_bwd fwd --kernels
    python experiments/profile_step.py --topk 64 --kernels    # the top-k loss (jsdgpu.forward_topk)
    python experiments/profile_step.py --tokens 1024 --gaps 8  # where the GPU idles, between which kernels
    python experiments/profile_step.py --topk 64 --tokens 8192 --steps 6  # per step, 6 back to back

Per step: the products (cuBLAS), the row kernels (fused_rows or phase_*), the other kernels and
copies, the GPU's idle time from the first product to the step's last kernel, and the time from
the step's first kernel to the first product. From PyTorch's profiler (CUPTI records every kernel
of the process, CuPy's too), beside the step's CUDA-event time. The profiler's callbacks slow the
host's CUDA calls, so the idle times it shows are upper bounds, the host's setup before the first
product most of all (experiments/host_time.py measures that without the profiler); and a profile
covers a few steps, nearer the GPU's full clock than the event-timed loop, which runs at its power
cap (docs/design.md, "The benchmark"), so its kernels sum to less than the step's event time.
Needs PyTorch.
"""

import argparse
import collections
import json
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def kind(event):
    name = event["name"]
    if event.get("cat") != "kernel":
        return "other"
    if any(k in name for k in ("fused_rows", "phase_stats", "phase_kl", "phase_finish",
                               "topk_rows", "topk_finish")):  # mangled or not
        return "rows"
    # (topk_logits: the top-k loss's own logits product, with the row work's streaming part)
    if any(k in name for k in ("gemm", "nvjet", "xmma", "cutlass", "splitKreduce", "topk_logits")):
        return "products"
    return "other"


def profile_one(fn, steps=1):
    """The GPU events (kernels, copies, memsets) of steps calls of fn queued back to back, by
    start time."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):  # the first profile of a process also times CUPTI's start-up: not kept
        cupy.cuda.Device().synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn(1)
            cupy.cuda.Device().synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    torch.cuda.synchronize()
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])


def summarize(events, steps=1):
    """ms by kind and idle ms from the first product on, each per step (of steps back to back),
    and ms from the first step's first kernel's end to its first product (the whole step where no
    row is valid)."""
    busy = collections.Counter()
    first_product = next((e for e in events if kind(e) == "products"), events[-1])
    idle, end = 0.0, events[0]["ts"]
    for e in events:
        busy[kind(e)] += e["dur"]
        if e["ts"] > first_product["ts"]:
            idle += max(0.0, e["ts"] - end)
        end = max(end, e["ts"] + e["dur"])
    before = first_product["ts"] - (events[0]["ts"] + events[0]["dur"])
    return {k: v / 1e3 / steps for k, v in busy.items()}, idle / 1e3 / steps, max(0.0, before) / 1e3


def topk_step(sets, mode, k):
    """fn(i): bench_topk.py's step (forward_topk, and backward in fwd_bwd) on set i, against
    the top k of the set's teacher."""
    import jsdgpu
    from bench_topk import BETA, TEMPERATURE
    topk = [jsdgpu.teacher_topk(xt, wt, k) for _, _, xt, wt, _ in sets]

    def fn(i):
        xs, ws, _, _, target = sets[i]
        _, ctx = jsdgpu.forward_topk(xs, ws, *topk[i], target, beta=BETA, temperature=TEMPERATURE,
                                     compute_grad=mode == "fwd_bwd")
        if mode == "fwd_bwd":
            jsdgpu.backward(ctx)
    return fn


def print_kernels(title, events):
    """The title, then the events' kernels by total time (ms), with how many times each ran."""
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        total[e["name"][:90]] += e["dur"] / 1e3
        count[e["name"][:90]] += 1
    print(title)
    for name, t in total.most_common():
        print(f"    {t:8.3f} ms  x{count[name]:<3d} {name}")


def idle_gaps(events, shortest_us):
    """[(µs from the step's first event, gap µs, the event before, the event after)] for each time
    the GPU ran nothing for at least shortest_us."""
    gaps, end, last = [], events[0]["ts"] + events[0]["dur"], events[0]["name"]
    for e in events[1:]:
        if e["ts"] - end >= shortest_us:
            gaps.append((end - events[0]["ts"], e["ts"] - end, last, e["name"]))
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e["name"]
    return gaps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--valid", type=float, nargs="+", default=[1.0], help="fractions of valid rows")
    p.add_argument("--modes", nargs="+", default=["fwd_bwd"], choices=["fwd_bwd", "fwd"])
    p.add_argument("--kernels", action="store_true", help="also list each step's kernels by total time")
    p.add_argument("--gaps", type=float, metavar="US",
                   help="also list each step's GPU idle gaps of at least US µs, between which kernels")
    p.add_argument("--steps", type=int, default=1,
                   help="profile this many steps back to back, each kind's time per step (at the clocks a "
                        "sustained run holds: one step after an idle GPU may run at higher clocks)")
    p.add_argument("--topk", type=int, metavar="K",
                   help="the top-k loss against the benchmark teacher's top K (bench/bench_topk.py's step)")
    a = p.parse_args()
    import harness  # needs the GPU: after --help
    rng = np.random.default_rng(0)
    weights = harness.make_weights(2)
    rows = []
    for T in a.tokens:
        for valid in a.valid:
            sets = harness.make_sets(T, weights, rng, valid)
            for mode in a.modes:
                fn = harness.impl_jsdgpu(sets, mode) if a.topk is None else topk_step(sets, mode, a.topk)
                ms = harness.time_ms(fn, len(sets), 3, 10)
                events = profile_one(fn, a.steps)
                busy, idle, before = summarize(events, a.steps)
                rows.append((T, valid, mode, ms, busy, idle, before))
                if a.gaps is not None:
                    print(f"T = {T}, {valid:.0%} valid, {mode}: idle gaps of {a.gaps} µs or more")
                    for start_us, gap, prev, nxt in idle_gaps(events, a.gaps):
                        print(f"    at {start_us:8.1f} µs: {gap:6.1f} µs  after {prev[:60]}  before {nxt[:60]}")
                if a.kernels:
                    print_kernels(f"T = {T}, {valid:.0%} valid, {mode}:", events)
    print("| T | valid rows | mode | step ms (events) | products | row kernels | other | GPU idle from the first "
          "product | selection to first product |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for T, valid, mode, ms, busy, idle, before in rows:
        print(f"| {T} | {valid:.0%} | {mode} | {ms:.2f} | {busy.get('products', 0):.2f} | {busy.get('rows', 0):.2f} | "
              f"{busy.get('other', 0):.2f} | {idle:.2f} | {before:.2f} |")


if __name__ == "__main__":
    main()
