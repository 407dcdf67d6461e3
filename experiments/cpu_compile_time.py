"""How long does a process with a cold Numba cache wait for the CPU row kernels' compilation?

Each CPU row kernel compiles on its first call of a process whose Numba cache does not hold it
(a user's first try, a CI run, any change to the kernels' sources) and is loaded from the cache
after that. This compiles each of the four kernels of the jsdgpu that PYTHONPATH gives (this
script puts no path of its own first) into an empty cache directory of its own, on a few rows
(the fused kernel, then the three phases of vocab parallelism, each with the gradient), and
prints the seconds each kernel's compilation took, by Numba's own compile events. Run it on two
codes in turns:

    mkdir -p /tmp/old && git archive f76f9f8 jsdgpu | tar -x -C /tmp/old
    for r in 1 2; do
      PYTHONPATH=/tmp/old python experiments/cpu_compile_time.py
      PYTHONPATH=. python experiments/cpu_compile_time.py
    done

Answer (this project's CI kind of machine, 2 cores of an AMD EPYC, 2026-12-05; docs/design.md,
"The CPU backend"), s of each kernel's compilation, two rounds, f76f9f8 (each kernel's row
inlined into its parallel loop) / each row a function of its own: the fused kernel 80.2 and 76.3
/ 25.2 and 28.4; the phases' statistics 2.7 and 2.8 / 2.9 and 3.0, KL sums 15.5 and 16.6 / 11.4
and 11.3, results 22.1 and 22.4 / 13.5 and 13.7.
"""

import argparse
import os
import tempfile
import time


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="jsdgpu_numba_")  # (before numba is imported)
    import numba
    import numpy as np
    from numba.core import event

    import jsdgpu
    from jsdgpu.cpu import rows
    from jsdgpu.cpu.divergences import precise_terms
    from jsdgpu.options import Divergence

    print(f"jsdgpu from {jsdgpu.__file__}")
    rng = np.random.default_rng(0)
    n, v = 6, 40
    s = rng.standard_normal((n, v), dtype=np.float32)
    t = rng.standard_normal((n, v), dtype=np.float32)
    target = rng.integers(0, v, n).astype(np.int64)
    ce, jsd, label_terms = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
    G = np.empty((n, v), np.float32)
    mode, beta = int(Divergence.JSD), 0.5
    soft_b, poly = precise_terms(Divergence.JSD, beta)
    stats, kl = np.empty((8, n)), np.empty((2, n))
    calls = {
        "fused_kernel": lambda: rows.fused_kernel(s, t, target, 1.0, mode, beta, 1 - beta, soft_b, poly, 1.0, 1.0, ce,
                                                  jsd, G, label_terms, True, 1.0, 0.0, numba.get_num_threads()),
        "stats_kernel": lambda: rows.stats_kernel(s, t, target, 1.0, stats),
        "kl_kernel": lambda: rows.kl_kernel(s, t, 1.0, mode, beta, stats, kl),
        "finish_kernel": lambda: rows.finish_kernel(s, t, target, 1.0, mode, beta, 1.0, 1.0, stats, kl, ce, jsd, G,
                                                    label_terms, True),
    }
    print("| kernel | compilation, s | its first call, s |")
    print("| --- | --- | --- |")
    for name, call in calls.items():
        with event.install_recorder("numba:compile") as recorder:
            start = time.perf_counter()
            call()
            wall = time.perf_counter() - start
        began, compiled = {}, 0.0
        for stamp, e in recorder.buffer:  # the kernel's own compile event (its callees' nest in it)
            key = id(e.data["dispatcher"]), str(e.data["args"])
            if e.is_start:
                began[key] = stamp
            elif e.data["dispatcher"].py_func.__name__ == name:
                compiled = stamp - began[key]
        print(f"| {name} | {compiled:.1f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
