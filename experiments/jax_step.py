"""Does a jitted JAX step with the loss copy anything to the host or wait on the host inside it?

Answer (H200, 2026-12-02; docs/design.md, "The front ends"): neither. At T = 1024 the profiled
step made one device-to-device copy (the loss) and no device-to-host copy; the one host
synchronization recorded (cudaDeviceSynchronize) is the profiler's own, from its exit after the
step (the Python frames around each call are printed). The compiled step is the callback alone
(XLA folds the backward rule's multiply by the cotangent 1 away). --timeline: five steps queued
back to back keep the GPU busy with no gap over 50 µs; a step waited for alone ends 0.3-0.9 ms
after its GPU work (JAX's wait), as a jitted chain of plain XLA products does.

    python experiments/jax_step.py                 # T = 1024, the benchmark's shape, bf16
    python experiments/jax_step.py --timeline      # where the jitted step's time goes

With --timeline: see timeline() below (the calls in time under the profiler, then timed
without it, waited for and back to back, then five jitted steps back to back profiled).

One jax.jit(jax.value_and_grad(loss)) call after warm-up, under PyTorch's profiler (CUPTI records
the CUDA work and runtime calls of the whole process, XLA's too): the device-to-host copies, the
host synchronization calls (cudaStreamSynchronize, cudaEventSynchronize, cuStreamSynchronize,
...) from the call until the result is ready, with the Python frames around each, and the
kernels by kind.
"""

import argparse
import collections
import functools
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--timeline", action="store_true", help="the CuPy call against the jitted step, in time")
    a = p.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import numpy as np

    import harness  # needs the GPU: after --help
    import jax
    import jax.numpy as jnp
    from torch.profiler import ProfilerActivity, profile

    from jsdgpu.jax import fused_linear_jsd_loss
    arrays = harness.make_sets(a.tokens, harness.make_weights(1), np.random.default_rng(0))[0]
    xs, ws, xt, wt, target = (jnp.from_dlpack(x) for x in arrays)
    step = jax.jit(jax.value_and_grad(fused_linear_jsd_loss, argnums=(0, 1)))
    if a.timeline:
        return timeline(arrays, step, (xs, ws, xt, wt, target))
    # the compiled step's operations: the callback, and whatever XLA kept of the backward rule
    hlo = step.lower(xs, ws, xt, wt, target).compile().as_text()
    ops = collections.Counter(re.search(r"\b([a-z][a-z0-9-]*)\(", line.split("=", 1)[1]).group(1)
                              for line in hlo.splitlines() if line.strip().startswith(("%", "ROOT")) and "=" in line)
    print("compiled step's operations:", dict(ops))
    for _ in range(3):
        jax.block_until_ready(step(xs, ws, xt, wt, target))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        jax.block_until_ready(step(xs, ws, xt, wt, target))
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    copies = collections.Counter(e["name"] for e in events if e.get("cat") == "gpu_memcpy")
    calls = [e for e in events if "ynchronize" in e.get("name", "") and e.get("cat") != "python_function"]
    syncs = collections.Counter(e["name"] for e in calls)
    kernels = collections.Counter("product" if any(k in e["name"] for k in ("gemm", "nvjet", "xmma", "cutlass"))
                                  else e["name"][:40] for e in events if e.get("cat") == "kernel")
    print("device copies:", dict(copies) or "none")
    print("host synchronization calls:", dict(syncs) or "none")
    print("kernels:", dict(kernels.most_common(12)))
    # where each synchronization was called from: the Python frames around it on its thread
    frames = [e for e in events if e.get("cat") == "python_function"]
    for sync in calls:
        around = [f for f in frames if f["tid"] == sync["tid"] and f["ts"] <= sync["ts"] <= f["ts"] + f.get("dur", 0)]
        print(sync["name"], "called from:", " > ".join(f["name"] for f in sorted(around, key=lambda f: f["ts"])) or
              "no Python frame around it")


def timeline(arrays, step, args):
    """The CuPy call, the jitted step, and for scale two jitted calls of the same product
    (x @ w.T over the student's logits, ten times): by XLA, and by CuPy in a buffer_callback.
    1. Three of each in turns under the profiler: each call's wall time, µs from the call to its
       first GPU work, to its last GPU work's end, the GPU's busy time, the host's last launch,
       and the longest GPU gaps.
    2. Without the profiler (with a jitted x + 1 and a callback doing nothing beside them): each
       call waited for, and ten back to back with one wait (as a training loop queues its
       steps), three rounds and a fourth that keeps the third's results alive.
    3. Five jitted steps back to back under the profiler: the host's waits and allocations,
       and the GPU's gaps."""
    import cupy
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import torch
    from jax.experimental.buffer_callback import buffer_callback
    from torch.profiler import ProfilerActivity, profile

    import jsdgpu
    from jsdgpu.cuda import products
    xs, ws = args[:2]

    def xla_products(x, w):
        return sum(jnp.sum(jnp.dot(x * (i + 1), w.T, preferred_element_type=jnp.float32)) for i in range(10))

    def callback_products(ctx, out, x, w):
        with cupy.cuda.ExternalStream(ctx.stream):
            x, w = (cupy.asarray(b).view(ml_dtypes.bfloat16) for b in (x, w))
            for _ in range(10):
                products.logits(x, w, cupy.asarray(out[0]))
    by_xla = jax.jit(xla_products)
    by_callback = jax.jit(buffer_callback(callback_products, (jax.ShapeDtypeStruct((len(xs), ws.shape[0]),
                                                                                   jnp.float32),)))
    queue = {"cupy": lambda: jsdgpu.backward(jsdgpu.forward(*arrays)[1]), "jax": lambda: step(*args),
             "xla products": lambda: by_xla(xs, ws), "callback products": lambda: by_callback(xs, ws)}

    def waited(name):
        result = queue[name]()
        cupy.cuda.Device().synchronize() if name == "cupy" else jax.block_until_ready(result)
    for _ in range(3):
        for name in queue:
            waited(name)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            for name in queue:
                with torch.profiler.record_function(f"call {name} {i}"):
                    waited(name)
    trace = pathlib.Path(os.environ.get("OUT", tempfile.gettempdir())) / "jax_timeline_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("call ")),
                    key=lambda e: e["ts"])
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    host_api = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
    print("| call | wall µs | to first GPU work µs | to last GPU end µs | GPU busy µs | last launch µs "
          "| longest gaps µs (before what) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in ranges:
        end = r["ts"] + r["dur"]
        work = [g for g in gpu if r["ts"] <= g["ts"] < end]
        api_calls = [c for c in host_api if r["ts"] <= c["ts"] < end and "aunch" in c["name"]]
        if not work:
            print(f"| {r['name']} | {r['dur']:.0f} | no GPU work |")
            continue
        busy, gaps, reach = 0.0, [], work[0]["ts"]
        for g in work:
            if g["ts"] > reach:
                gaps.append((g["ts"] - reach, g["name"][:30]))
            busy += max(0.0, g["ts"] + g["dur"] - max(reach, g["ts"]))
            reach = max(reach, g["ts"] + g["dur"])
        gaps = ", ".join(f"{t:.0f} ({n})" for t, n in sorted(gaps, reverse=True)[:3])
        last_launch = api_calls[-1]["ts"] - r["ts"] if api_calls else float("nan")
        print(f"| {r['name']} | {r['dur']:.0f} | {work[0]['ts'] - r['ts']:.0f} | {reach - r['ts']:.0f} | {busy:.0f} "
              f"| {last_launch:.0f} | {gaps} |")
    # no profiler: each call waited for (median of 15), and ten back to back with one wait (three
    # rounds, each's results dropped before the next; then a round that keeps the last one's)
    queue["xla: x + 1"] = functools.partial(jax.jit(lambda x: x + 1), jnp.zeros(()))
    queue["callback doing nothing"] = functools.partial(jax.jit(buffer_callback(
        lambda ctx, out, *a: None, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[:2]))), *args)
    print("| call | ms waited for | ms per call, ten back to back (three rounds) | the same, the last round's kept |")
    print("| --- | --- | --- | --- |")
    for name, call in queue.items():
        times = []
        for _ in range(15):
            start = time.perf_counter()
            waited(name)
            times.append(1e3 * (time.perf_counter() - start))
        rounds, results = [], None
        for keep in (False, False, False, True):
            kept, results = results if keep else None, None  # noqa: F841 (held through the round)
            cupy.cuda.Device().synchronize()
            start = time.perf_counter()
            results = [call() for _ in range(10)]
            cupy.cuda.Device().synchronize() if name == "cupy" else jax.block_until_ready(results)
            rounds.append((time.perf_counter() - start) / 10 * 1e3)
        del kept, results
        print(f"| {name} | {statistics.median(times):.3f} | {' / '.join(f'{t:.3f}' for t in rounds[:3])} "
              f"| {rounds[3]:.3f} |")
    # five jitted steps back to back, profiled: the host's waits and allocations, and the GPU's gaps
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("call back to back"):
            jax.block_until_ready([queue["jax"]() for _ in range(5)])
    prof.export_chrome_trace(str(trace.with_name("jax_back_to_back_trace.json")))
    events = json.loads(trace.with_name("jax_back_to_back_trace.json").read_text())["traceEvents"]
    r = [e for e in events if e.get("name") == "call back to back"][0]
    print(f"five jitted steps back to back: {r['dur']:.0f} µs; host calls that wait or allocate "
          "(µs from the start, duration, thread):")
    for c in sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"]):
        if any(k in c["name"] for k in ("ynchronize", "Query", "Alloc", "Free", "alloc", "free", "Wait")):
            print(f"  {c['ts'] - r['ts']:.0f} +{c['dur']:.0f} {c['name']} tid {c['tid']}")
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    reach = gpu[0]["ts"]
    print(f"GPU: first work at {reach - r['ts']:.0f} µs; gaps over 50 µs:")
    for g in gpu:
        if g["ts"] - reach > 50:
            print(f"  {reach - r['ts']:.0f} .. {g['ts'] - r['ts']:.0f} before {g['name'][:40]}")
        reach = max(reach, g["ts"] + g["dur"])
    print(f"GPU: last work ends at {reach - r['ts']:.0f} µs")


if __name__ == "__main__":
    main()
