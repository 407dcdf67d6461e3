"""Where does a run's step lose to its floor? bench_run.py's run, step by step.

The run of bench/bench_run.py (history calls first, then ten steps in turn: the JSD falling, 0-40%
of the rows ignored), at each T: every step's CUDA-event time against the four products at its
valid rows, then one turn of the ten steps profiled (CUPTI, through PyTorch's profiler) with each
step's GPU time by kind: products, row kernels, other kernels, idle from its first GPU work to
its last, and how many products it ran. Needs a GPU and PyTorch.

    python experiments/run_steps.py [--tokens 1024 4096] [--kernels]
    python experiments/run_steps.py --tokens 8192 --impls jsdgpu jsdgpu_softcap  # a feature's steps beside

Answer (one H200): docs/design.md, "A run's inputs".
"""

import argparse
import collections
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "experiments")]


def split_steps(events, markers):
    """events cut at the marker kernels' starts: one list per step (markers: the start time of
    each step's first event, from a zero-length marker kernel queued before it)."""
    steps = [[] for _ in markers]
    for e in events:
        i = sum(1 for m in markers if e["ts"] >= m) - 1
        if i >= 0:
            steps[i].append(e)
    return steps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--kernels", action="store_true", help="also each step's kernels by total time")
    p.add_argument("--impls", nargs="+", default=["jsdgpu"],
                   help="bench_run.py's implementations to profile (jsdgpu, jsdgpu_softcap, ...)")
    a = p.parse_args()
    import cupy  # needs the GPU: after --help
    import torch

    import bench_run
    import harness
    from profile_step import kind, print_kernels, profile_one

    marker = cupy.RawKernel('extern "C" __global__ void step_marker() {}', "step_marker")
    ws, wn = bench_run.heads(cupy, 4.0, 1)
    for step in bench_run.history_steps(cupy, ws, wn):
        harness.time_ms(bench_run.implementation("jsdgpu", step), 1, 2, 3)
    table = []
    for T in a.tokens:
        steps = bench_run.run_steps(cupy, T, ws, wn)
        floor = bench_run.timed_turns([bench_run.implementation("gemm_floor", s) for s in steps], a.repeats, 1.0)
        for impl in a.impls:
            fns = [bench_run.implementation(impl, s) for s in steps]
            ours = bench_run.timed_turns(fns, a.repeats, 1.0)

            def turn(_, fns=fns):  # the ten steps, each after a marker kernel
                for fn in fns:
                    marker((1,), (1,), ())
                    fn()
            events = profile_one(turn)
            markers = [e["ts"] for e in events if e["name"] == "step_marker"]
            for i, step_events in enumerate(split_steps(events, markers)):
                step_events = [e for e in step_events if e["name"] != "step_marker"]
                busy = collections.Counter()
                for e in step_events:
                    busy[kind(e)] += e["dur"] / 1e3
                span = (max(e["ts"] + e["dur"] for e in step_events) - step_events[0]["ts"]) / 1e3
                n_products = sum(1 for e in step_events if kind(e) == "products")
                valid = int((steps[i][4] != -100).sum())
                table.append((impl, T, i, valid, ours[i], floor[i], busy, span, n_products))
                if a.kernels:
                    print_kernels(f"{impl}, T = {T}, step {i}, {valid} valid rows:", step_events)
            del fns
        del steps
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    print("| implementation | T | step | valid rows | step ms | floor ms | × floor | profiled: products | row kernels | other "
          "| idle | span | products run |")
    print("| --- " * 13 + "|")
    for impl, T, i, valid, ms, fl, busy, span, n in table:
        idle = span - sum(busy.values())
        print(f"| {impl} | {T} | {i} | {valid} | {ms:.3f} | {fl:.3f} | {ms / fl:.3f} | {busy.get('products', 0):.3f} | "
              f"{busy.get('rows', 0):.3f} | {busy.get('other', 0):.3f} | {idle:.3f} | {span:.3f} | {n} |")


if __name__ == "__main__":
    main()
