"""How much of a step's time is the host's, and how much does the idle before a step matter?

Answer (one H200, 2026-12-02; docs/design.md, "The benchmark" and "The host before the first
product"): the default step took 4.47-4.60 ms at T = 1024 against 4.39-4.50 for the capturable
step's graph replayed (two runs), and the top-k step 2.82-2.84 against 2.66-2.71 (three runs);
at T = 8192 the two are within 0.2 ms. Idle before a step shortens it, since the GPU runs the
loop at its power cap: at T = 1024 the replay took 4.54 ms back to back, 4.29 after 0.5 ms of
idle, 3.93 after 2 ms and 3.87 after a second; the top-k step at T = 8192 21.75 back to back and
18.56 after a second.

A step replayed from a CUDA graph runs its kernels with no host between them, so the capturable
step's eager time minus its graph's replay time is what the host's queuing costs that step (its
launches falling behind the GPU, and any wait), measured without a profiler (whose callbacks slow
the host: experiments/profile_step.py's idle times are upper bounds). The default mode (rows
gathered, one host wait) is timed beside them: it runs the same products where every row is
valid.

    python experiments/graph_replay.py                      # the online loss, T = 1024, 2048, 8192
    python experiments/graph_replay.py --topk 64            # the top-k loss against the teacher's top 64

bf16, V = 128256, Hs = 2048, Ht = 4096 (the benchmark's shape), every row valid, beta 0.5.
Medians of 20 CUDA-event-timed steps after 3, each waited for (the benchmark's measure), the
three ways in turns over five rounds; each way's median of its round medians. Then the graph's
replays each after the GPU idled a while (--idle-ms; medians of 40 replays, of 5 after 100 ms or
more): the GPU runs the loop at its power cap, with its SM clock lowered, and idle time lets the
clock rise for the next step.
"""

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 8192])
    p.add_argument("--topk", type=int, metavar="K", help="the top-k loss against the teacher's top K")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--idle-ms", type=float, nargs="+", default=[1000.0],
                   help="the graph's replays each after this long with the GPU idle (ascending)")
    a = p.parse_args()
    import cupy  # needs the GPU: after --help
    import harness
    import ml_dtypes

    import jsdgpu
    bf16 = ml_dtypes.bfloat16
    V, HS, HT = 128256, 2048, 4096
    rng = cupy.random.default_rng(0)
    ws = (rng.standard_normal((V, HS), dtype=np.float32) * (4 / HS**0.5)).astype(bf16)
    wt = (rng.standard_normal((V, HT), dtype=np.float32) * (4 / HT**0.5)).astype(bf16)
    stream = cupy.cuda.Stream(non_blocking=True)  # a capture needs a stream of its own
    pool = cupy.cuda.MemoryPool()  # and memory that outlives it
    rows = []
    cupy.cuda.Device().synchronize()  # the weights, made on the legacy stream, which ours does not wait for
    with stream, cupy.cuda.using_allocator(pool.malloc):
        for T in a.tokens:
            xs = rng.standard_normal((T, HS), dtype=np.float32).astype(bf16)
            xt = rng.standard_normal((T, HT), dtype=np.float32).astype(bf16)
            target = cupy.asarray(np.random.default_rng(1).integers(0, V, T))
            stored = jsdgpu.teacher_topk(xt, wt, a.topk) if a.topk else None

            def step(capturable):
                loss, ctx = (jsdgpu.forward_topk(xs, ws, *stored, target, capturable=capturable)
                             if a.topk else jsdgpu.forward(xs, ws, xt, wt, target, capturable=capturable))
                return loss, jsdgpu.backward(ctx)
            for _ in range(2):  # kernels compiled, the products' algorithms chosen
                step(True)
            stream.synchronize()
            stream.begin_capture()
            try:
                step(None)  # capturable by itself: the stream is capturing
            finally:
                graph = stream.end_capture()
            ways = {"default": lambda i: step(False), "capturable": lambda i: step(True),
                    "graph": lambda i: graph.launch(stream)}
            times = {name: [] for name in ways}
            for _ in range(a.rounds):
                for name, fn in ways.items():
                    times[name].append(harness.time_ms(fn, 1, 3, 20))
            ms = {name: statistics.median(t) for name, t in times.items()}
            after_idle = [statistics.median(replays_after(lambda: graph.launch(stream), idle / 1e3, harness))
                          for idle in a.idle_ms]
            rows.append(f"| {T} | {ms['default']:.3f} | {ms['capturable']:.3f} | {ms['graph']:.3f} | "
                        + " | ".join(f"{t:.3f}" for t in after_idle) + f" | {ms['capturable'] - ms['graph']:.3f} |")
    print(f"{'top-k (k = %d)' % a.topk if a.topk else 'online'} loss, fwd + bwd, ms\n")
    print("| T | default | capturable | its graph replayed | "
          + " | ".join(f"replayed after {idle:g} ms idle" for idle in a.idle_ms) + " | host's share |\n"
          + "| --- " * (5 + len(a.idle_ms)) + "|")
    print("\n".join(rows))


def replays_after(replay, idle_s, harness):
    """Event times (ms) of replays each after idle_s of the GPU idle (the host spinning, so that
    short idles are kept to): 5 after a second or more, 40 after less."""
    times = []
    for _ in range(5 if idle_s >= 0.1 else 40):
        until = time.perf_counter() + idle_s
        while time.perf_counter() < until:
            pass
        times.append(harness.time_ms(lambda i: replay(), 1, 0, 1))
    return times


if __name__ == "__main__":
    main()
