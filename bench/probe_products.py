"""Each of the four matrix products timed alone, as gemm_floor runs it (CuPy's `@`, bf16 out)
and as jsdgpu runs it (float32 logits and grad_input, bf16 grad_weight), on a random G and on
the G the row kernel writes. Where the step's time beyond the row kernel goes.

    python bench/probe_products.py [--tokens 1024 2048]
"""

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cupy  # noqa: E402

import bench  # noqa: E402
from jsdgpu._cupy_backend import _N, _gemm, _logits, _weight_gemm, launch_rows  # noqa: E402
from jsdgpu._driver import LossOptions  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    a = p.parse_args()
    V, HS = bench.V, bench.HS
    print("| T | product | floor (CuPy @, bf16 out) | jsdgpu | jsdgpu, other out dtype |")
    print("| --- | --- | --- | --- | --- |")
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

        def grad_input(g, out):  # [T, Hs] = G @ Ws; column-major: Ws [Hs, V] @ G^T [V, T]
            _gemm(_N, _N, HS, T, V, 1.0 / T, ws, HS, g, g.shape[1], 0.0, out, HS)

        rows = [
            ("student logits", t(lambda: xs @ ws.T), t(lambda: _logits(xs, ws, work["logits_s"])),
             t(lambda: _logits(xs, ws, ls16))),
            ("teacher logits", t(lambda: xt @ wt.T), t(lambda: _logits(xt, wt, work["logits_t"])), None),
            ("grad_input, random G", t(lambda: G_random @ ws), t(lambda: grad_input(G_random, gi32)),
             t(lambda: grad_input(G_random, gi16))),
            ("grad_input, row kernel's G", t(lambda: G @ ws), t(lambda: grad_input(G, gi32)),
             t(lambda: grad_input(G, gi16))),
            ("grad_weight, random G", t(lambda: G_random.T @ xs),
             t(lambda: _weight_gemm(G_random, V, xs, 1.0 / T, 0.0, gw16)),
             t(lambda: _weight_gemm(G_random, V, xs, 1.0 / T, 0.0, gw32))),
            ("grad_weight, row kernel's G", t(lambda: G.T @ xs),
             t(lambda: _weight_gemm(G, V, xs, 1.0 / T, 0.0, gw16)),
             t(lambda: _weight_gemm(G, V, xs, 1.0 / T, 0.0, gw32))),
        ]
        for name, floor, ours, other in rows:
            print(f"| {T} | {name} | {floor:.3f} | {ours:.3f} | {'' if other is None else f'{other:.3f}'} |")


if __name__ == "__main__":
    main()
