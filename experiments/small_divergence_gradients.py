"""How far from float64 is the soft part's gradient alone where the divergence is small?

The soft part's gradient (weight_hard_loss 0: beside the hard part's, a small soft gradient hides
in that one's rounding) on the CPU, 6 rows of V = 1031, logits of std 2, the teacher the student
plus noise on its head, at several betas, temperatures and noises: the largest relative error of
grad_input and grad_weight against the float64 reference over three draws. --package: the
directory of another version of the library (a checkout of the code before a change).

    python experiments/small_divergence_gradients.py
    python experiments/small_divergence_gradients.py --package /tmp/before   # git worktree add /tmp/before REV

Answer (the Zen 4 EPYC, 2026-12-05; docs/design.md, "Small divergences"): the code before the
gradient's polynomial (b84755b~1) 0.069-1100 at beta 1e-6, up to 1.2 at beta 1e-3, and at noise
1e-3 and temperature 20 (log-ratios of about 1e-4) 2.1e-3 in forward KL and 2.2e-3 in the JSD at
beta 0.5; after it every beta as reverse KL, whose log-ratio was the logits' difference before
too: 8.7e-4 and 2.0e-4 at noise 1e-3 (temperatures 1 and 20; what the float32 logits' own
rounding leaves there, the tests' floors), 1.8e-5 and 4.8e-6 at noise 0.05, at most 1.1e-6 at
noise 1.

With --noises 0.5 1 2 4 --soft (log-ratios of about 0.1-1 nats and past, each cell "grad / soft",
the soft part's error against the same reference; Zen 4, 2026-12-07): the CPU's near columns on
|d| < 1/2 with seven terms (docs/design.md, "The CPU backend") against the code before, on |d| < 1
with nine (commit fcf222d): the gradients' largest 3.8e-6 in both, every other cell 5.5e-7 to
1.8e-6 in both and within 1e-7 of each other; the soft parts' 1.1e-8 to 8.4e-7 in both.
"""

import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

BETAS = (0.0, 1e-6, 1e-3, 0.1, 0.5, 0.9, 1 - 1e-3, 1 - 1e-6, 1.0)
NOISES = (1e-3, 0.05, 1.0)
TEMPERATURES = (1.0, 20.0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", type=pathlib.Path, default=ROOT, help="the library's directory (default: this one)")
    p.add_argument("--noises", type=float, nargs="+", default=NOISES)
    p.add_argument("--soft", action="store_true", help="each cell also the soft part's relative error (grad / soft)")
    a = p.parse_args()
    sys.path.insert(0, str(a.package))
    import jsdgpu
    from jsdgpu.reference import reference

    def rel(got, want):
        return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    print("| beta | " + " | ".join(f"noise {n:g}, T {t:g}" for n in a.noises for t in TEMPERATURES) + " |")
    print("| --- |" + " --- |" * (len(a.noises) * len(TEMPERATURES)))
    for beta in BETAS:
        cells = []
        for noise in a.noises:
            for temperature in TEMPERATURES:
                worst = worst_soft = 0.0
                for seed in range(3):
                    rng = np.random.default_rng(seed)
                    xs = rng.standard_normal((6, 16)).astype(np.float32)
                    ws = (rng.standard_normal((1031, 16)) * 2 / 4).astype(np.float32)
                    wt = (ws + noise / 4 * rng.standard_normal(ws.shape)).astype(np.float32)
                    target = rng.integers(0, 1031, 6)
                    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.0, weight_soft_loss=1.0)
                    _, ctx = jsdgpu.forward(xs, ws, xs, wt, target, **opts)
                    grad_input, grad_weight, _ = jsdgpu.backward(ctx)
                    want = reference(xs, ws, xs, wt, target, **opts)
                    worst = max(worst, rel(grad_input, want[3]), rel(grad_weight, want[4]))
                    worst_soft = max(worst_soft, abs(float(ctx.soft_loss) - want[2]) / want[2])
                cells.append(f"{worst:.1e}" + (f" / {worst_soft:.1e}" if a.soft else ""))
        print(f"| {beta:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
