"""How long does the CPU's fused row kernel take for each divergence and temperature?

Times `jsdgpu.cpu.rows.fused_kernel` alone, as the backend calls it (`CpuOnlineRows.fused_rows`,
its gradient written over the student's logits, which are restored, untimed, before each call):
its statistics, KL sums, results and gradient row on one chunk of logits, the teacher the
student plus noise, for each divergence at temperatures 1 and 2, with the gradient; the best of
five calls after one, ms. It times the jsdgpu that PYTHONPATH gives (this script puts no path of
its own first). With --against DIR, another code (DIR/jsdgpu) is imported under another name and
each call of this one is paired with a call of it, in turns in one process; the median of the
pairs' ratios is the comparison to read on a machine whose speed moves from minute to minute (this
project's CI kind: the same code's JSD took from 14.5 to 27.6 ms a call, process to process, in
one hour on 2026-12-07):

    mkdir -p /tmp/old && git archive a2d5ccf jsdgpu | tar -x -C /tmp/old
    PYTHONPATH=. python experiments/cpu_row_kernel.py --against /tmp/old --beta 0.5 0.25 --temperature 1 --repeats 31

Answer (2026-12-07, the CI's kind, two runs; a2d5ccf's JSD with nine terms of its mixture log
against six from b = 1/3: docs/design.md, "The CPU backend"): at beta 1/2 the older code took
1.045 and 1.063 times this one's time (best calls 15.27 / 14.70 and 15.55 / 14.71 ms), at beta
1/4, where both take nine, 1.006 and 1.003.

--phases times the three phase kernels of vocab parallelism in the fused kernel's place
(statistics, KL sums, then results and a G of its own), as the backend calls them with no
communicator between them.

Answer (2026-12-07, the Xeon kind of CI's machines, 2 cores, which LLVM names rocketlake; the
row functions at 512 bits, fastmath.wide_vectors, against the package of 43ca3c2 at 256;
docs/design.md, "The CPU backend"): `--against DIR --temperature 1 2 --repeats 15`, the code
before took 1.159 / 1.243 times as long in forward KL (temperature 1 / 2), 1.235 / 1.298 in the
JSD, 1.238 / 1.303 in reverse KL; `--phases --against DIR --temperature 1 --repeats 9`, 1.472,
1.371 and 1.187.

Or two codes in processes in turns, each with a Numba cache of its own (the older codes' kernels
are keyed by rows.py alone, and would not see a change made in a module they inline):

    mkdir -p /tmp/old && git archive d2285bd jsdgpu | tar -x -C /tmp/old
    for r in 1 2; do
      NUMBA_CACHE_DIR=/tmp/nc_old PYTHONPATH=/tmp/old python experiments/cpu_row_kernel.py
      NUMBA_CACHE_DIR=/tmp/nc_new PYTHONPATH=. python experiments/cpu_row_kernel.py
    done

Answer (this project's CI kind of machine, 2 cores of an AMD EPYC, 2026-12-05; docs/design.md,
"The CPU backend"), 512 rows of V = 32000, ms, two rounds in turns, d2285bd / the kernel whose
gradient loop no longer meets its own logits' memory (and with the vectorized maxima, one
division in the JSD's columns, int32 steps in log32): at temperature 1, forward KL 13.69 and
12.86 / 6.12 and 6.18, the JSD 16.07 and 15.29 / 8.19 and 8.17, reverse KL 16.65 and 16.10 /
6.59 and 6.59; at temperature 2, 28.12 and 27.41 / 7.12 and 7.20, 31.01 and 30.52 / 10.11 and
10.07, 30.89 and 30.48 / 7.49 and 7.73.

With --placements (the same machine's kind, 2026-12-05, three runs), the backend's buffers,
which start on a cache line, against NumPy's arrays, 16 bytes past one, ms: at temperature 1,
forward KL 6.58-7.22 against 6.84-7.26, the JSD 8.60-8.96 against 9.04-9.17, reverse KL
7.10-7.46 against 7.29-7.58; at temperature 2, 7.46-7.71 against 7.64-8.03, 10.46-11.03
against 10.61-11.33, 8.16-8.45 against 8.49-8.77: 1-5% less in every run but for one case
(the JSD at temperature 2, 11.03 against 11.07).
"""

import argparse
import importlib
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--noise", type=float, default=1.0, help="the teacher's logits: the student's plus this times N(0, 1)")
    p.add_argument("--beta", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--repeats", type=int, default=6, help="calls of each code per case, the first not counted")
    p.add_argument("--phases", action="store_true",
                   help="the three phase kernels (vocab parallelism's: statistics, KL sums, results and G of its "
                        "own) in one call's place, where no communicator combines them")
    compared = p.add_mutually_exclusive_group()
    compared.add_argument("--placements", action="store_true",
                          help="each case also with the logits in NumPy's own arrays (16 bytes past a cache line), "
                               "the two in turns, where the backend's buffers start on a line "
                               "(jsdgpu.cpu.steps.row_buffer)")
    compared.add_argument("--against", type=pathlib.Path, metavar="DIR",
                          help="a directory holding another jsdgpu (git archive REV jsdgpu | tar -x -C DIR): "
                               "imported under another name, its kernel and this one called in turns in this one "
                               "process, and the median of each pair's ratio printed (a noisy machine moves both "
                               "alike)")
    a = p.parse_args(argv)

    codes = {"this": "jsdgpu"}
    if a.against:
        renamed = pathlib.Path(tempfile.mkdtemp(prefix="jsdgpu_against_"))
        shutil.copytree(a.against / "jsdgpu", renamed / "jsdgpu_against")  # (its imports are relative)
        sys.path.insert(0, str(renamed))
        codes["against"] = "jsdgpu_against"

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((a.tokens, a.vocab), dtype=np.float32) * 4
    teacher = logits + rng.standard_normal((a.tokens, a.vocab), dtype=np.float32) * np.float32(a.noise)
    target = rng.integers(0, a.vocab, a.tokens).astype(np.int32)
    ce, jsd, label_terms = (np.empty(a.tokens, np.float32) for _ in range(3))
    G = np.empty(logits.shape, np.float32)  # (--phases: G of its own)
    works = {}  # name: (the code's CpuOnlineRows, its LossOptions, its work)
    for code, package in codes.items():
        online_work = importlib.import_module(package + ".cpu.online_work")
        loss_options = importlib.import_module(package + ".options").LossOptions
        try:
            row_buffer = importlib.import_module(package + ".cpu.steps").row_buffer
        except (ImportError, AttributeError):  # a code from before the backend's own buffers (NumPy's arrays)
            def row_buffer(*shape):
                return np.empty(shape, np.float32)
        placements = {"backend's buffers": row_buffer}
        if a.placements:
            placements["NumPy's arrays"] = lambda *shape: np.empty(shape, np.float32)
        for where, empty in placements.items():
            s, t = empty(*logits.shape), empty(*logits.shape)  # G is written over s: restored before each call
            t[...] = teacher
            name = where if len(codes) == 1 else code
            works[name] = online_work.CpuOnlineRows, loss_options, online_work.CpuWork(None, None, None, None, s, t,
                                                                                       fused=True)
    ratio = " | against ÷ this, median of the pairs" if a.against else ""
    print("| divergence | beta | temperature | " + " | ".join(f"ms, {name}" for name in works) + f"{ratio} |\n"
          + "| --- " * (3 + len(works) + bool(a.against)) + "|")
    for beta in a.beta:
        for temperature in a.temperature:
            times = {name: [] for name in works}
            for _ in range(a.repeats):  # (the first: compilation, or Numba's cache)
                for name, (online_rows, loss_options, work) in works.items():
                    opts = loss_options(beta=beta, temperature=temperature)
                    work.s[...] = logits
                    start = time.perf_counter()
                    if a.phases:
                        stats = online_rows.row_stats(work, target, opts)
                        kl = online_rows.row_kl(work, target, stats, opts)
                        online_rows.row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms)
                    else:
                        online_rows.fused_rows(work, target, opts, ce, jsd, work.s, label_terms)  # (the backend's call)
                    times[name].append(time.perf_counter() - start)
            pairs = (f" | {np.median(np.array(times['against'][1:]) / np.array(times['this'][1:])):.3f}"
                     if a.against else "")
            print(f"| {opts.divergence.name.lower()} | {beta:g} | {temperature:g} | "
                  + " | ".join(f"{min(ts[1:]) * 1e3:.2f}" for ts in times.values()) + f"{pairs} |")


if __name__ == "__main__":
    main()
