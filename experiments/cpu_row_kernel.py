"""How long does the CPU's fused row kernel take for each divergence and temperature?

Times `jsdgpu.cpu.rows.fused_kernel` alone (its statistics, KL sums, results and gradient row) on
one chunk of logits, the teacher the student plus noise, for each divergence at temperatures 1
and 2, with the gradient; the best of five calls after one, ms. It times the jsdgpu that
PYTHONPATH gives (this script puts no path of its own first), so two codes compare in turns:

    mkdir -p /tmp/old && git archive ddc1a8d jsdgpu | tar -x -C /tmp/old
    for r in 1 2; do PYTHONPATH=/tmp/old python experiments/cpu_row_kernel.py; PYTHONPATH=. python experiments/cpu_row_kernel.py; done

Answer (this project's CI kind of machine, 2 cores of an AMD EPYC, 2026-12-04; docs/design.md,
"The CPU backend"), 512 rows of V = 32000, ms, two rounds in turns, the code with one KL loop for
every divergence (ddc1a8d) / one loop a divergence: at temperature 1, forward KL 21.23 and 21.52
/ 16.83 and 16.76, the JSD 21.32 and 21.45 / 21.17 and 21.05, reverse KL 21.57 and 21.48 / 17.27
and 17.75; at temperature 2, 26.76 and 27.35 / 21.76 and 21.78, 26.71 and 27.18 / 25.74 and
26.30, 27.20 and 26.92 / 21.82 and 22.46.
"""

import argparse
import time

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--noise", type=float, default=1.0, help="the teacher's logits: the student's plus this times N(0, 1)")
    a = p.parse_args(argv)

    from jsdgpu.cpu.rows import fused_kernel
    from jsdgpu.options import Divergence

    rng = np.random.default_rng(0)
    s = rng.standard_normal((a.tokens, a.vocab), dtype=np.float32) * 4
    t = s + rng.standard_normal((a.tokens, a.vocab), dtype=np.float32) * np.float32(a.noise)
    target = rng.integers(0, a.vocab, a.tokens).astype(np.int32)
    ce, jsd, label_terms = (np.empty(a.tokens, np.float32) for _ in range(3))
    G = np.empty_like(s)  # (apart from s: each call reads the same logits)
    print("| divergence | temperature | ms |\n| --- | --- | --- |")
    for mode in Divergence:
        for temperature in (1.0, 2.0):
            def call():
                fused_kernel(s, t, target, 1.0 / temperature, int(mode), 0.5, 0.5, 0.5 / temperature, ce, jsd, G,
                             label_terms, True, 1.0, 0.0)
            call()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            print(f"| {mode.name.lower()} | {temperature:g} | {min(times) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
