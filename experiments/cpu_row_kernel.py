"""How long does the CPU's fused row kernel take for each divergence and temperature?

Times `jsdgpu.cpu.rows.fused_kernel` alone, as the backend calls it (`CpuOnlineRows.fused_rows`):
its statistics, KL sums, results and gradient row on one chunk of logits, the teacher the
student plus noise, for each divergence at temperatures 1 and 2, with the gradient; the best of
five calls after one, ms. It times the jsdgpu that
PYTHONPATH gives (this script puts no path of its own first), so two codes compare in turns:

    mkdir -p /tmp/old && git archive 9116466 jsdgpu | tar -x -C /tmp/old
    for r in 1 2; do
      NUMBA_CACHE_DIR=/tmp/nc_old PYTHONPATH=/tmp/old python experiments/cpu_row_kernel.py
      NUMBA_CACHE_DIR=/tmp/nc_new PYTHONPATH=. python experiments/cpu_row_kernel.py
    done

Answer (this project's CI kind of machine, 2 cores of an AMD EPYC, 2026-12-05; docs/design.md,
"The CPU backend"), 512 rows of V = 32000, ms, two rounds in turns, each code with a Numba cache
of its own (NUMBA_CACHE_DIR: Numba's cache does not see a change in a module the kernel calls
into), the float64 kernel (9116466) / the float32 one: at temperature 1, forward KL 15.78 and
16.48 / 7.72 and 7.69, the JSD 20.54 and 20.39 / 10.04 and 9.99, reverse KL 16.28 and 16.89 /
10.90 and 10.93; at temperature 2, 21.79 and 21.44 / 8.19 and 7.84, 25.66 and 25.26 / 11.75 and
11.24, 21.00 and 21.72 / 11.48 and 11.15.
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

    from jsdgpu.cpu.online_work import CpuOnlineRows, CpuWork
    from jsdgpu.options import LossOptions

    rng = np.random.default_rng(0)
    s = rng.standard_normal((a.tokens, a.vocab), dtype=np.float32) * 4
    t = s + rng.standard_normal((a.tokens, a.vocab), dtype=np.float32) * np.float32(a.noise)
    target = rng.integers(0, a.vocab, a.tokens).astype(np.int32)
    ce, jsd, label_terms = (np.empty(a.tokens, np.float32) for _ in range(3))
    G = np.empty_like(s)  # (apart from s: each call reads the same logits)
    work = CpuWork(None, None, None, None, s, t, fused=True)
    print("| divergence | temperature | ms |\n| --- | --- | --- |")
    for beta in (0.0, 0.5, 1.0):
        for temperature in (1.0, 2.0):
            opts = LossOptions(beta=beta, temperature=temperature)

            def call():  # (the backend's call of the kernel: the same in the codes compared)
                CpuOnlineRows.fused_rows(work, target, opts, ce, jsd, G, label_terms)
            call()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            print(f"| {opts.divergence.name.lower()} | {temperature:g} | {min(times) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
