"""What does reduction "none" cost a jitted JAX step against "mean"?

A jax.jit(jax.value_and_grad) step of jsdgpu.jax.fused_linear_jsd_loss at the benchmark's shape
(bench/harness.py: V = 128256, hidden 2048 / 4096, bf16, logits of std about 4): "mean", and
"none" with the rows' losses times a random upstream gradient, summed; the two in turns, each
timed after a second of its own steps (harness.time_ms: median of CUDA-event times of a step
waited for), per T and share of valid rows. Prints ms a step and none / mean.

Answer (one H200, 2026-12-04; docs/design.md, "Token weights and the sum"): with the gradients
carried from forward to backward, "none" took 1.011 / 1.029 times "mean" at T = 1024 (every row
valid / 70%) and 1.002 / 0.992 at 8192; computing the call again in backward (the code before),
1.503 / 1.603 and 1.619 / 1.602. The top-k loss (k = 64, 70% valid, two rounds): 1.015 at
T = 1024 and 1.027 at 8192.

    python experiments/jax_none.py --tokens 1024 8192 --valid 1 0.7
    python experiments/jax_none.py --topk 64 --tokens 1024 8192 --valid 0.7   # the top-k loss

--package DIR: the jsdgpu package in DIR (a copy of another version: git archive REV jsdgpu | tar
-x -C DIR) instead of this one's, to compare the two (docs/design.md, "Token weights and the sum").
"""

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--valid", type=float, nargs="+", default=[1.0, 0.7], help="shares of valid rows")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--package", type=pathlib.Path, help="a directory holding another jsdgpu package")
    p.add_argument("--topk", type=int, metavar="K",
                   help="the top-k loss instead, against the teacher's top K (jsdgpu.teacher_topk of its logits)")
    a = p.parse_args()
    if a.package:
        sys.path.insert(0, str(a.package.resolve()))
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the loss's memory is CuPy's
    import jax
    import jax.numpy as jnp
    import numpy as np

    import harness
    import jsdgpu
    from jsdgpu.jax import fused_linear_jsd_loss, fused_linear_topk_jsd_loss

    print("jsdgpu from", pathlib.Path(jsdgpu.__file__).parent)
    weights = harness.make_weights(2)
    rng = np.random.default_rng(0)
    rows = []
    for T in a.tokens:
        for valid in a.valid:
            sets = harness.make_sets(T, weights, rng, valid)
            if a.topk:  # (xs, ws, ids, logprobs, target)
                sets = [(xs, ws, *jsdgpu.teacher_topk(xt, wt, a.topk), target) for xs, ws, xt, wt, target in sets]
            sets = [tuple(jnp.from_dlpack(x) for x in s) for s in sets]
            upstream = jnp.asarray(rng.standard_normal(T).astype(np.float32))

            def loss(*arrays, reduction):
                out = (fused_linear_topk_jsd_loss if a.topk else fused_linear_jsd_loss)(*arrays, reduction=reduction)
                return (out * upstream).sum() if reduction == "none" else out
            steps = {r: jax.jit(jax.value_and_grad(lambda *s, r=r: loss(*s, reduction=r), argnums=(0, 1)))
                     for r in ("mean", "none")}
            fns = {r: (lambda i, f=f: jax.block_until_ready(f(*sets[i]))) for r, f in steps.items()}
            times = {r: [] for r in fns}
            for _ in range(a.rounds):
                for r, fn in fns.items():
                    times[r].append(harness.time_ms(fn, len(sets), 2, a.repeats, warm_s=1.0))
            mean, none = (float(np.median(times[r])) for r in ("mean", "none"))
            rows.append((T, valid, mean, none))
            print(f"T {T} valid {valid}: mean {times['mean']} none {times['none']}", flush=True)
    print("| T | valid rows | mean ms | none ms | none / mean |\n| --- | --- | --- | --- | --- |")
    for T, valid, mean, none in rows:
        print(f"| {T} | {valid:.0%} | {mean:.2f} | {none:.2f} | {none / mean:.3f} |")


if __name__ == "__main__":
    main()
