"""Is one version of the library faster than another, step for step?

Answer (one H200, 2026-12-01): the code after the capturable mode took 4.85-4.89 ms at T = 1024
where the layout's code (commit 682ba3f) took 4.18-4.34, and 2.72-2.79 against 2.41-2.51 with half
the rows ignored. On 2026-12-02, c658ff5 against
the code that queues the first products ahead of the rest: T = 1024 4.87 / 4.41 and 4.78 / 4.83
ms, half ignored 2.79 / 2.58 and 2.79 / 2.59. With --jax (docs/design.md, "The front ends";
five runs): back to back the jitted step took 1-6% less than the CuPy call at T = 1024 and
-0.7% to +0.6% at T = 8192; each call waited for, +1% to +7% and -1.6% to +3.3%. With --topk 64
(docs/design.md, "Top-k"; five pairs), the top-k loop with the first products queued ahead of
its checks and selection against 8afdcab: T = 1024 -10% to +2%, half ignored -16% to -1%, T =
8192 -2% to 0%. The head sized by the last call, the selection beside it on a side stream
(docs/design.md, "The host before the first product"; four pairs) against a24723d: T = 1024
-2.5%, half ignored -2.4%, T = 2048 half ignored -1.0%, T = 8192 no change; --topk 64 no change.
G held for all rows in more chunks (docs/design.md, "Chunks and G"): see there. A call like the
last queuing its first product ahead of its checks (docs/design.md, "The host before the first
product"; --tokens 1024, three pairs in one run): 4.33 / 4.43 / 4.18 ms against 4.01 / 4.20 /
4.60 before, no change that the noise lets through. The top-k row kernel reading a row once
(docs/design.md, "Top-k"; --topk 64 --tokens 1024 2048 4096 8192, two pairs): 2.70 / 2.73 ms
against 2.97 / 3.05 at T = 1024, 21.97 / 22.19 against 23.72 / 22.69 at T = 8192. The top-k's
first row kernel queued before the host's wait (docs/design.md, "Top-k"; same tokens, five
pairs): -3.1% at T = 1024 and 2048, -1.7% at 4096, -1.2% at 8192, faster in 18 of 20 pairs.
The top-k loss's own logits product against cuBLAS's (docs/design.md, "Top-k: the logits product
of our own"; a copy of the package with OWN_TOPK_PRODUCT = True as DIR or on PYTHONPATH, 24
rounds): queued as the call's first GPU work, own minus cuBLAS's +0.158 ms at T = 1024, +0.130 at
2048, +0.047 at 4096, -0.634 at 8192; with the first chunk's G @ Ws queued before the wait,
-0.169 at 2048 and -0.193 at 4096. The own product's host path shortened (G made first, tensor
maps kept, arguments by address: docs/design.md, "Top-k: the logits product of our own"), against
itself without it at T = 1024: -0.089 ± 0.037 ms; against cuBLAS's path: +0.004 ± 0.041 at 512,
-0.022 ± 0.041 and (--topk 256) -0.059 ± 0.044 at 1024; queued before the call's checks too, in
a call like the last: +0.008 ± 0.049 (not kept, docs/record.md). label_order a warp per row
(docs/design.md, "Top-k"): --topk 256 --tokens 8192, -0.273 ± 0.108 ms. The own product's slots'
logits packed and its chunks of 2048 rows (commit ee0d42a against 436bfe3, --tokens 2048 8192):
--topk 256 +0.049 ± 0.066 and -0.538 ± 0.108 ms, --topk 64 +0.030 ± 0.098 and -0.627 ± 0.134.
The own product's ping-pong and topk_finish's terms not kept (commit b1001fd against 6b17f80,
--tokens 1024 2048 8192): --topk 64 -0.064 ± 0.041, -0.090 ± 0.039 and -0.336 ± 0.081 ms,
--topk 256 -0.013 ± 0.035, +0.013 ± 0.056 and +0.060 ± 0.098 (docs/design.md, "Top-k: the logits
product of our own"). topk_finish's loads ahead and topk_slot_bits' whole rows (commit 4b10d17
against ed45ea7): --topk 256 --tokens 2048 8192 +0.054 ± 0.109 and -0.060 ± 0.123 ms, --topk 64
--tokens 8192 -0.116 ± 0.170.
Soft caps of 30 on both models, the step with them against itself without them (--softcap 30
--tokens 1024 2048 4096 8192, no --against; docs/design.md, "Scaled and soft-capped logits"; two
runs, 2026-12-04): 1.032-1.034, 1.047-1.051, 1.026-1.027 and 1.037-1.040 times the step.
With --against (docs/design.md, "The host before the first product"; 682ba3f's jsdgpu beside
this code, three runs): T = 1024 -0.127 ± 0.053, -0.013 ± 0.063 and -0.093 ± 0.047 ms back to
back at the GPU's power cap, and -0.291 ± 0.057 each step after half a second of idle (--cool
0.5), where the clock is free.

    mkdir -p /tmp/old && git archive 682ba3f jsdgpu | tar -x -C /tmp/old
    for v in /tmp/old . /tmp/old .; do PYTHONPATH=$v python experiments/ab_versions.py $v; done
    python experiments/ab_versions.py new --against /tmp/old              # in one process, in turns
    python experiments/ab_versions.py new --against /tmp/old --cool 0.5   # each step from an idle GPU

jsdgpu (the one PYTHONPATH gives: this script puts no path of its own first) forward + backward
at the benchmark shape, medians of 15 CUDA-event-timed steps after 3, for T = 1024 (all rows
valid and half ignored), 2048 and 8192 (half ignored). Run the versions in turns, as above.
With --jax: the CuPy call and jax.jit(jax.value_and_grad(loss)) of jsdgpu.jax at T = 1024 and
8192, all rows valid, each timed two ways: each call waited for (its wall time, the benchmark's
measure), and ten calls back to back with one wait at the end (per call, the median of five
rounds), as a training loop queues its steps. --vocab sets both vocabularies (past 131072 the
teacher's rows take the fused kernel's wider shapes, past 327680 the three phase kernels), --beta
the divergence, --softcap C caps of C on both models' logits (their std is 4); without
--against, the step with them and without them in turns (ABBA, as below: the same products, so
that only the caps' cost differs). --topk K: the top-k loss (jsdgpu.forward_topk) against the
teacher's top K (jsdgpu.teacher_topk) instead, at T = 1024 (all rows valid and half ignored) and
8192. --tokens: those T instead, every row valid.
--against DIR: DIR/jsdgpu is loaded beside the first one (as jsdgpu_other) and the two are timed
in turns in this process (ABBA over 24 rounds, so that the GPU's clock, which falls as it meets
its power cap, falls on both alike): the medians of each one's round medians, and the mean
difference with two standard errors. --cool S: each round's time is one step after S seconds of
idle instead.
"""

import argparse
import functools
import statistics
import time

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("label", help="what to print before the times (the version's path)")
    p.add_argument("--jax", action="store_true", help="the CuPy call against the jitted JAX step")
    p.add_argument("--vocab", type=int, default=128256,
                   help="both vocabularies (past 327680 the teacher's takes the phase kernels)")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--softcap", type=float, metavar="C", help="soft caps of C on both models' logits")
    p.add_argument("--topk", type=int, metavar="K", help="the top-k loss against the teacher's top K")
    p.add_argument("--tokens", type=int, nargs="+", help="these T instead, every row valid")
    p.add_argument("--against", metavar="DIR",
                   help="DIR/jsdgpu loaded beside this one, the two timed in turns in this process")
    p.add_argument("--cool", type=float, metavar="SECONDS",
                   help="with --against: each timed step one step after the GPU idled this long")
    a = p.parse_args()
    if a.jax:
        import os
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import cupy  # needs the GPU: after --help
    import ml_dtypes

    import jsdgpu
    other = load_other(a.against) if a.against else None
    bf16 = ml_dtypes.bfloat16
    V, HS, HT = a.vocab, 2048, 4096
    rng = cupy.random.default_rng(0)
    ws = (rng.standard_normal((V, HS), dtype=np.float32) * (4 / HS**0.5)).astype(bf16)
    wt = (rng.standard_normal((V, HT), dtype=np.float32) * (4 / HT**0.5)).astype(bf16)
    out = []
    caps = dict(student_logit_softcap=a.softcap, teacher_logit_softcap=a.softcap) if a.softcap else {}

    def timed(step, warmup=3, repeats=15):
        for _ in range(warmup):
            step()
        start, stop, times = cupy.cuda.Event(), cupy.cuda.Event(), []
        for _ in range(repeats):
            start.record()
            step()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        return statistics.median(times)

    def after_idle(step):
        time.sleep(a.cool)
        return timed(step, warmup=0, repeats=1)

    def back_to_back(step, wait):
        rounds = []
        for _ in range(5):
            cupy.cuda.Device().synchronize()
            start = time.perf_counter()
            results = [step() for _ in range(10)]
            wait(results)
            rounds.append((time.perf_counter() - start) * 1e3 / 10)
            del results
        return statistics.median(rounds)
    cases = (((1024, 1.0), (8192, 1.0)) if a.jax else ((1024, 1.0), (1024, 0.5), (8192, 1.0)) if a.topk
             else ((1024, 1.0), (1024, 0.5), (2048, 0.5), (8192, 0.5)))
    if a.tokens:
        cases = [(T, 1.0) for T in a.tokens]
    for T, valid in cases:
        xs = rng.standard_normal((T, HS), dtype=np.float32).astype(bf16)
        xt = rng.standard_normal((T, HT), dtype=np.float32).astype(bf16)
        target = np.random.default_rng(1).integers(0, V, T)
        target[np.random.default_rng(2).permutation(T)[:int(T * (1 - valid))]] = -100
        target = cupy.asarray(target)

        stored = jsdgpu.teacher_topk(xt, wt, a.topk) if a.topk else None

        def step(lib=jsdgpu, caps=caps):
            loss_ctx = (lib.forward_topk(xs, ws, *stored, target, beta=a.beta) if a.topk
                        else lib.forward(xs, ws, xt, wt, target, beta=a.beta, **caps))
            lib.backward(loss_ctx[1])
        if caps and not other:  # what the caps cost: the same products, the row kernel's work apart
            step(), step(caps={})
            out.append(f"T={T} valid={valid}: {in_turns(timed, step, lambda: step(caps={}))}")
            continue
        if other:
            step(), step(other)  # compiled, the products' algorithms chosen
            out.append(f"T={T} valid={valid}: {in_turns(after_idle if a.cool else timed, step, lambda: step(other))}")
            continue
        out.append(f"T={T} valid={valid}: {timed(step):.3f} ms")
        if a.jax:
            out.append(f"back to back {back_to_back(step, lambda r: cupy.cuda.Device().synchronize()):.3f} ms")
            import jax
            import jax.numpy as jnp

            from jsdgpu.jax import fused_linear_jsd_loss
            args = [jnp.from_dlpack(x) for x in (xs, ws, xt, wt, target)]
            jitted = jax.jit(jax.value_and_grad(functools.partial(fused_linear_jsd_loss, beta=a.beta), argnums=(0, 1)))
            out.append(f"jax: {timed(lambda: jax.block_until_ready(jitted(*args))):.3f} ms, back to back "
                       f"{back_to_back(lambda: jitted(*args), jax.block_until_ready):.3f} ms")
    print(a.label, "; ".join(out))


def load_other(root, name="jsdgpu_other"):
    """The package at root/jsdgpu, imported as `name` (its imports are relative)."""
    import importlib.util
    import pathlib
    import sys
    package = pathlib.Path(root) / "jsdgpu"
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def in_turns(timed, this, other, rounds=24):
    """Both steps timed in turns (ABBA, so that a drift of the GPU's clocks falls on both alike):
    the medians of each one's per-round medians, and the mean of this minus other per round with
    two standard errors."""
    ours, theirs = [], []
    for r in range(rounds):
        for step, times in ((this, ours), (other, theirs))[::1 if r % 2 == 0 else -1]:
            times.append(timed(step))
    diffs = [x - y for x, y in zip(ours, theirs)]
    error = 2 * statistics.stdev(diffs) / len(diffs) ** 0.5
    return (f"this {statistics.median(ours):.3f} ms, other {statistics.median(theirs):.3f} ms, "
            f"this - other {statistics.mean(diffs):+.3f} ± {error:.3f} ms ({rounds} rounds)")


if __name__ == "__main__":
    main()
