"""Where the fused row kernel's time goes: its time against the number of rows (the fixed cost
and the cost per row) and how many clusters fit the GPU at once, for the kernel the library
uses and for other shapes of it (rows.cu, ROW_KERNEL_VARIANTS); the host time a whole step
spends before its first GEMM (the GPU idles then: the step starts by selecting the valid rows,
which waits for the GPU); and
(run under Nsight Compute) one launch of each row kernel.

    python bench/profile_rows.py                       # the timings and the occupancy
    ncu --set full -k regex:'jsd_rows_bf16|vp_' -c 4 python bench/profile_rows.py --once
"""

import argparse
import pathlib
import re
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cupy  # noqa: E402

import bench  # noqa: E402
import jsdgpu  # noqa: E402
from jsdgpu import _cupy_backend  # noqa: E402
from jsdgpu._cupy_backend import _slice, fused_kernel, launch_rows  # noqa: E402
from jsdgpu._driver import LossOptions  # noqa: E402

# the shapes of rows.cu's ROW_KERNEL_VARIANTS: clusters of c CTAs of t threads, g float4 groups
# a thread, register allocation for m CTAs per SM
VARIANTS = ("jsd_rows_bf16_c16_t512_g4_m1", "jsd_rows_bf16_c8_t1024_g4_m1", "jsd_rows_bf16_c16_t256_g8_m2")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--once", action="store_true", help="one launch of each kernel (for ncu)")
    p.add_argument("--host", action="store_true", help="only the host time before the first GEMM")
    a = p.parse_args()
    T = 2048
    if a.host:
        return host_times(bench.make_weights(1)[0])
    xs, ws, xt, wt, tgt, be, work = bench.one_chunk(T, np.random.default_rng(0))
    opts = LossOptions(0.5, 0.5, 0.5, 1.0, -100)
    ce, jsd, terms = (cupy.empty(T, np.float32) for _ in range(3))
    G = work["G"]
    kernels = {"jsd_rows_bf16": work}
    device = cupy.cuda.Device().id
    for name in VARIANTS:
        cluster, threads, groups = map(int, re.search(r"_c(\d+)_t(\d+)_g(\d+)_", name).groups())
        kernel = fused_kernel(device, name, cluster, threads, groups, ("-std=c++17", "-DROW_KERNEL_VARIANTS"))
        kernels[name] = dict(work, kernel=kernel, cluster=cluster, threads=threads, slice=_slice(bench.V, cluster))
    if a.once:
        launch_rows(work, 1024, tgt, opts, ce, jsd, G, terms)
        stats = be.row_stats(work, tgt[:1024], opts)
        kl = be.row_kl(work, tgt[:1024], stats, opts)
        be.row_finish(work, tgt[:1024], stats, kl, opts, ce, jsd, G[:1024], terms)
        cupy.cuda.Device().synchronize()
        return
    print("| kernel | max active clusters | rows | ms | µs per row |")
    print("| --- | --- | --- | --- | --- |")
    for name, w in kernels.items():
        active = w["kernel"][2]
        for rows in (132, 264, 512, 1024, 2048):
            ms = bench.time_ms(lambda i: launch_rows(w, rows, tgt, opts, ce, jsd, G[:rows], terms), 1, 3, 20)
            print(f"| {name} | {active} | {rows} | {ms:.3f} | {1e3 * ms / rows:.2f} |")
    host_times((ws, wt))


def host_times(weights):
    """host_before_first_gemm at T = 1024, with every row valid and with half of them."""
    for valid in (1.0, 0.5):
        host_before_first_gemm(*bench.make_sets(1024, [weights], np.random.default_rng(1), valid)[0])


def host_before_first_gemm(xs, ws, xt, wt, target, repeats=20):
    """Median host milliseconds from the start of a step (GPU idle) to its first GEMM's launch,
    split where the valid rows have been selected (the step's one wait for the GPU: from there
    it idles even inside a training loop), and of the whole step's GPU time."""
    first, selected = [], []
    real_logits, real_select = _cupy_backend._logits, _cupy_backend.CupyBackend.select_rows

    def logits(*args):
        if len(first) < len(starts):  # the step's first GEMM
            first.append(time.perf_counter())
        return real_logits(*args)

    def select_rows(*args):
        result = real_select(*args)
        selected.append(time.perf_counter())
        return result

    _cupy_backend._logits, _cupy_backend.CupyBackend.select_rows = logits, staticmethod(select_rows)
    starts = []
    try:
        for _ in range(repeats):
            cupy.cuda.Device().synchronize()
            starts.append(time.perf_counter())
            jsdgpu.backward(jsdgpu.forward(xs, ws, xt, wt, target)[1])
    finally:
        _cupy_backend._logits, _cupy_backend.CupyBackend.select_rows = real_logits, staticmethod(real_select)
    cupy.cuda.Device().synchronize()
    gpu = bench.time_ms(lambda i: jsdgpu.backward(jsdgpu.forward(xs, ws, xt, wt, target)[1]), 1, 3, repeats)
    host = statistics.median(1e3 * (f - s) for f, s in zip(first, starts))
    after = statistics.median(1e3 * (f - c) for f, c in zip(first, selected))
    valid = float(cupy.count_nonzero(target != -100)) / len(target)
    print(f"T = {xs.shape[0]}, {valid:.0%} of the rows valid: host time before the first GEMM "
          f"{host:.3f} ms, of which {after:.3f} ms after the valid rows were selected; step {gpu:.3f} ms")


if __name__ == "__main__":
    main()
