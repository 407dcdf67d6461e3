"""Does a jitted JAX step with the loss copy anything to the host or wait on the host inside it?

Answer (H200, 2026-12-01; docs/design.md, "The front ends"): neither. At T = 1024 the profiled
step made one device-to-device copy and no device-to-host copy; the one host synchronization
recorded (cudaDeviceSynchronize) is the profiler's own, from its exit after the step (the Python
frames around each call are printed).

    python experiments/jax_step.py                 # T = 1024, the benchmark's shape, bf16

One jax.jit(jax.value_and_grad(loss)) call after warm-up, under PyTorch's profiler (CUPTI records
the CUDA work and runtime calls of the whole process, XLA's too): the device-to-host copies, the
host synchronization calls (cudaStreamSynchronize, cudaEventSynchronize, cuStreamSynchronize,
...) from the call until the result is ready, with the Python frames around each, and the
kernels by kind.
"""

import argparse
import collections
import json
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    a = p.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import numpy as np

    import harness  # needs the GPU: after --help
    import jax
    import jax.numpy as jnp
    from torch.profiler import ProfilerActivity, profile

    from jsdgpu.jax import fused_linear_jsd_loss
    xs, ws, xt, wt, target = (jnp.from_dlpack(x) for x in harness.make_sets(
        a.tokens, harness.make_weights(1), np.random.default_rng(0))[0])
    step = jax.jit(jax.value_and_grad(fused_linear_jsd_loss, argnums=(0, 1)))
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


if __name__ == "__main__":
    main()
