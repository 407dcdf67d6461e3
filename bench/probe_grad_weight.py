"""grad_weight = G.T @ Xs two ways, at the benchmark shape: summed over chunks of 2048 rows in
float32 (beta = 1) and converted to bf16 after, against one product over all rows straight
into bf16. The measurement behind holding G for all rows (jsdgpu/_driver.py).

    python bench/probe_grad_weight.py
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cupy  # noqa: E402

import bench  # noqa: E402
from jsdgpu._cupy_backend import CupyBackend, _weight_gemm  # noqa: E402


def main():
    rng = cupy.random.default_rng(0)
    print("| T | f32 sums over chunks + conversion | one bf16 product |")
    print("| --- | --- | --- |")
    for T in (1024, 2048, 8192):
        xs = rng.standard_normal((T, bench.HS), dtype=np.float32).astype(bench.BF16)
        G = (rng.standard_normal((T, bench.V), dtype=np.float32) * 1e-3).astype(bench.BF16)
        sums = cupy.empty((bench.V, bench.HS), np.float32)
        out = cupy.empty((bench.V, bench.HS), bench.BF16)
        chunk = min(T, 2048)

        def summed(i):
            for c in range(0, T, chunk):
                _weight_gemm(G[c:c + chunk], bench.V, xs[c:c + chunk], 1e-3, float(c > 0), sums)
            CupyBackend.scale_cast(sums, None, bench.BF16)

        ms_sums = bench.time_ms(summed, 1, 2, 10)
        ms_one = bench.time_ms(lambda i: _weight_gemm(G, bench.V, xs, 1e-3, 0.0, out), 1, 2, 10)
        print(f"| {T} | {ms_sums:.3f} ms | {ms_one:.3f} ms |")


if __name__ == "__main__":
    main()
