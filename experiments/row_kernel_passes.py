"""Where the CPU's fused row kernel spends its time, pass by pass, against what half the machine's
copy bandwidth would allow (issue: the row kernels at half of it).

    python experiments/row_kernel_passes.py
    python experiments/row_kernel_passes.py --tokens 256 --vocab 128256

The kernel (jsdgpu/cpu/rows.py) makes four passes over a row: its maxima, its statistics (the
student's and the teacher's exp and their sums), the KL sums (the JSD's mixture log a column),
and the results and gradient row. Each line times the kernel cut after one more pass (the same
inlined helpers, compiled here the way rows.py compiles them), in ns a logit and core, then the
whole kernel, then float64 exp and log (fastmath.py's) alone, one a logit; last, the time a logit
that would move the kernel's 12 bytes (both logits read, the gradient written) at half of a
parallel copy's bandwidth (bench/bench_cpu.py's). Medians of --repeats calls after one untimed.
"""

import argparse
import pathlib
import statistics
import sys
import time

import numba
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_cpu import row_kernel_bandwidth  # noqa: E402

from jsdgpu.cpu.fastmath import FAST, exp64, log64  # noqa: E402
from jsdgpu.cpu.rows import _row_kl, _row_max, _row_stats, fused_kernel  # noqa: E402

KERNEL = dict(parallel=True, fastmath=FAST)


@numba.njit(**KERNEL)
def _kernel_cut(s, t, target, inv_temp, mode, beta, passes, out):
    """The fused kernel's first `passes` passes on each row (1: the maxima; 2: and the statistics;
    3: and the KL sums); out, a number of the last, so that nothing is left out as unused."""
    n, vs = s.shape
    for i in numba.prange(n):
        if passes == 1:
            out[i] = _row_max(s[i]) + _row_max(t[i])
            continue
        p, h = np.empty(vs), np.empty(vs)
        stats = _row_stats(s[i], t[i], target[i], inv_temp, vs, t.shape[1], p, h)
        out[i] = stats[3] + stats[5]
        if passes == 3:
            a, b = _row_kl(s[i], t[i], inv_temp, mode, beta, stats, p, h)
            out[i] = a + b


@numba.njit(**KERNEL)
def _exp_alone(x, out):
    for i in numba.prange(x.shape[0]):
        total = 0.0
        for j in range(x.shape[1]):
            total += exp64(np.float64(x[i, j]))
        out[i] = total


@numba.njit(**KERNEL)
def _log_alone(x, out):
    for i in numba.prange(x.shape[0]):
        total = 0.0
        for j in range(x.shape[1]):
            total += log64(np.float64(x[i, j]) + 8.0)
        out[i] = total


def _median_seconds(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    T, V = a.tokens, a.vocab
    rng = np.random.default_rng(0)
    s = rng.standard_normal((T, V), dtype=np.float32) * 4
    t = s + rng.standard_normal((T, V), dtype=np.float32)
    target = rng.integers(0, V, T).astype(np.int32)
    out = np.empty(T)
    G = np.empty_like(s)
    ce, jsd, terms = (np.empty(T, np.float32) for _ in range(3))
    cores = numba.get_num_threads()
    per_logit = lambda seconds: seconds * cores / (T * V) * 1e9  # noqa: E731 - ns a logit and core
    jsd_mode, beta = 1, 0.5
    print(f"T = {T}, V = {V}, JSD (beta {beta}), {cores} threads; ns a logit and core")
    print("| temperature | maxima | + statistics | + KL sums | whole kernel (+ gradient) |")
    print("| --- | --- | --- | --- | --- |")
    for temperature in (1.0, 2.0):
        inv = 1.0 / temperature
        cut = [_median_seconds(lambda k=k: _kernel_cut(s, t, target, inv, jsd_mode, beta, k, out), a.repeats)
               for k in (1, 2, 3)]
        whole = _median_seconds(lambda: fused_kernel(s, t, target, inv, jsd_mode, beta, 0.5, 0.5 * inv, ce, jsd, G,
                                                     terms, True, 1.0, 0.0), a.repeats)
        print(f"| {temperature:g} | " + " | ".join(f"{per_logit(x):.2f}" for x in (*cut, whole)) + " |")
    exp_ns = per_logit(_median_seconds(lambda: _exp_alone(s, out), a.repeats))
    log_ns = per_logit(_median_seconds(lambda: _log_alone(s, out), a.repeats))
    _, copy_gb_s = row_kernel_bandwidth(T, V)
    half_copy_ns = 12 / (copy_gb_s / 2) * cores  # 12 bytes a logit at half the copy's GB/s
    print(f"exp64 alone {exp_ns:.2f}, log64 alone {log_ns:.2f}; half of the copy's {copy_gb_s:.1f} GB/s: "
          f"{half_copy_ns:.2f} ns a logit and core")


if __name__ == "__main__":
    main()
