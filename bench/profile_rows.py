"""Where the fused row kernel's time goes: its time against the number of rows (the fixed cost
and the cost per row), how many clusters fit the GPU at once, and (run under Nsight Compute)
one launch of each row kernel to profile.

    python bench/profile_rows.py                       # the timings and the occupancy
    ncu --set full -k regex:'jsd_rows_bf16_c16|vp_' -c 4 python bench/profile_rows.py --once
"""

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cupy  # noqa: E402

import bench  # noqa: E402
from jsdgpu._cupy_backend import CupyBackend, _THREADS, _kernel, _logits, _slice, launch_rows  # noqa: E402
from jsdgpu._driver import LossOptions  # noqa: E402


def max_active_clusters(func, cluster, smem):
    """cuOccupancyMaxActiveClusters for the kernel at its launch configuration, or None."""
    try:
        from cuda.bindings import driver as cu
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster * 1024, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = _THREADS[cluster], 1, 1
        config.sharedMemBytes = smem
        err, n = cu.cuOccupancyMaxActiveClusters(cu.CUfunction(func.kernel.ptr), config)
        return int(n) if err == cu.CUresult.CUDA_SUCCESS else str(err)
    except Exception as e:  # noqa: BLE001 - reported, not needed
        return f"{type(e).__name__}: {e}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--once", action="store_true", help="one launch of each kernel (for ncu)")
    a = p.parse_args()
    T = 2048
    xs, ws, xt, wt, target = bench.make_sets(T, bench.make_weights(1), np.random.default_rng(0))[0]
    be = CupyBackend()
    work = be.prepare(ws, wt, None, None, T, True, fused=True)
    _logits(xs, ws, work["logits_s"])
    _logits(xt, wt, work["logits_t"])
    opts = LossOptions(0.5, 0.5, 0.5, 1.0, -100)
    ce, jsd, terms = (cupy.empty(T, np.float32) for _ in range(3))
    tgt = target.astype(np.int32)
    G = work["G"]
    fused = {}
    for cluster in (8, 16):
        fused[cluster] = dict(work, func=_kernel(cupy.cuda.Device().id, "bf16", cluster)[0],
                              cluster=cluster, slice=_slice(bench.V, cluster))
    if a.once:
        launch_rows(fused[16], 1024, tgt, opts, ce, jsd, G, terms)
        stats = be.row_stats(work, tgt[:1024], opts)
        kl = be.row_kl(work, tgt[:1024], stats, opts)
        be.row_finish(work, tgt[:1024], stats, kl, opts, ce, jsd, terms)
        cupy.cuda.Device().synchronize()
        return
    print("| cluster | max active clusters | rows | ms | µs per row |")
    print("| --- | --- | --- | --- | --- |")
    for cluster, w in fused.items():
        active = max_active_clusters(w["func"], cluster, 8 * w["slice"])
        for rows in (132, 264, 512, 1024, 2048):
            ms = bench.time_ms(lambda i: launch_rows(w, rows, tgt, opts, ce, jsd, G[:rows], terms), 1, 3, 20)
            print(f"| {cluster} | {active} | {rows} | {ms:.3f} | {1e3 * ms / rows:.2f} |")


if __name__ == "__main__":
    main()
