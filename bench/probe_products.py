"""Each of the four matrix products timed alone, as gemm_floor runs it (CuPy's `@`, bf16 out)
and as jsdgpu runs it (float32 logits and grad_input, bf16 grad_weight), on a random G and on
the G the row kernel writes, and the fastest of cuBLASLt's candidate algorithms for jsdgpu's
form (jsdgpu tunes its logits products among them: jsdgpu/_cublaslt.py). Where the step's time
beyond the row kernel goes.

    python bench/probe_products.py [--tokens 1024 2048]
"""

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cupy  # noqa: E402

import bench  # noqa: E402
from jsdgpu import _cublaslt  # noqa: E402
from jsdgpu._cupy_backend import _CUDA_TYPE, _N, _T, _gemm, _logits, _weight_gemm, launch_rows  # noqa: E402
from jsdgpu._driver import LossOptions  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    a = p.parse_args()
    V, HS = bench.V, bench.HS
    print("| T | product | floor (CuPy @, bf16 out) | jsdgpu | jsdgpu, other out dtype | "
          "fastest cuBLASLt candidate, jsdgpu's form |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T in a.tokens:
        xs, ws, xt, wt, target, _, work = bench.one_chunk(T, np.random.default_rng(0))
        G = work["G"]
        ce, jsd, terms = (cupy.empty(T, np.float32) for _ in range(3))
        launch_rows(work, T, target, LossOptions(0.5, 0.5, 0.5, 1.0, -100), ce, jsd, G, terms)
        G_random = (cupy.random.standard_normal((T, V), dtype=np.float32) * 1e-3).astype(bench.BF16)
        ls16 = cupy.empty((T, V), bench.BF16)
        gi32, gi16 = cupy.empty((T, HS), np.float32), cupy.empty((T, HS), bench.BF16)
        gw16, gw32 = cupy.empty((V, HS), bench.BF16), cupy.empty((V, HS), np.float32)

        def t(fn):
            return bench.time_ms(lambda i: fn(), 1, 3, 20)

        def fastest_lt(trans_a, trans_b, m, n, k, a, lda, b, ldb, out, ldd, alpha=1.0):
            product = _cublaslt._Product(cupy.cuda.Device().id, trans_a, trans_b, m, n, k, lda, ldb, ldd,
                                         _CUDA_TYPE[a.dtype], _CUDA_TYPE[b.dtype], _CUDA_TYPE[out.dtype], False)
            return min(t(lambda: product.run(algo, a, b, out, alpha, 0.0)) for algo in product.candidates())

        def grad_input(g, out):  # [T, Hs] = G @ Ws; column-major: Ws [Hs, V] @ G^T [V, T]
            _gemm(_N, _N, HS, T, V, 1.0 / T, ws, HS, g, g.shape[1], 0.0, out, HS)

        ls, lt = work["logits_s"], work["logits_t"]
        rows = [
            ("student logits", t(lambda: xs @ ws.T), t(lambda: _logits(xs, ws, ls)), t(lambda: _logits(xs, ws, ls16)),
             fastest_lt(_T, _N, V, T, HS, ws, HS, xs, HS, ls, ls.shape[1])),
            ("teacher logits", t(lambda: xt @ wt.T), t(lambda: _logits(xt, wt, lt)), None,
             fastest_lt(_T, _N, V, T, bench.HT, wt, bench.HT, xt, bench.HT, lt, lt.shape[1])),
            ("grad_input, random G", t(lambda: G_random @ ws), t(lambda: grad_input(G_random, gi32)),
             t(lambda: grad_input(G_random, gi16)), None),
            ("grad_input, row kernel's G", t(lambda: G @ ws), t(lambda: grad_input(G, gi32)),
             t(lambda: grad_input(G, gi16)), fastest_lt(_N, _N, HS, T, V, ws, HS, G, G.shape[1], gi32, HS, 1.0 / T)),
            ("grad_weight, random G", t(lambda: G_random.T @ xs),
             t(lambda: _weight_gemm(G_random, V, xs, 1.0 / T, 0.0, gw16)),
             t(lambda: _weight_gemm(G_random, V, xs, 1.0 / T, 0.0, gw32)), None),
            ("grad_weight, row kernel's G", t(lambda: G.T @ xs),
             t(lambda: _weight_gemm(G, V, xs, 1.0 / T, 0.0, gw16)),
             t(lambda: _weight_gemm(G, V, xs, 1.0 / T, 0.0, gw32)),
             fastest_lt(_N, _T, HS, V, T, xs, HS, G, G.shape[1], gw16, HS, 1.0 / T)),
        ]
        show = lambda ms: "" if ms is None else f"{ms:.3f}"  # noqa: E731
        for name, floor, ours, other, lt_best in rows:
            print(f"| {T} | {name} | {floor:.3f} | {ours:.3f} | {show(other)} | {show(lt_best)} |")


if __name__ == "__main__":
    main()
