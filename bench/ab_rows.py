"""A/B of fused row kernels: `jsd_rows_bf16` of each rows.cu source given, launched as the library
launches it on 2048 rows of the benchmark's logits (median of 20 launches; the sources take turns,
two rounds, the best round kept), in five option sets, and its outputs (CE, JSD, G) against the
first source's. How the kernel variants of bench/NOTES.md were compared, e.g.

    git show 4f451f8:jsdgpu/rows.cu > /tmp/rows_4f451f8.cu
    python bench/ab_rows.py /tmp/rows_4f451f8.cu jsdgpu/rows.cu
"""

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cupy  # noqa: E402

import bench  # noqa: E402
from jsdgpu._driver import LossOptions  # noqa: E402

ROWS = 2048
# name: (options, with G)
CONFIGS = {"jsd": (LossOptions(0.5, 0.5, 0.5, 1.0, -100), True),
           "jsd, loss only": (LossOptions(0.5, 0.5, 0.5, 1.0, -100), False),
           "forward KL": (LossOptions(0.5, 0.5, 0.0, 1.0, -100), True),
           "reverse KL": (LossOptions(0.5, 0.5, 1.0, 1.0, -100), True),
           "temperature 2": (LossOptions(0.3, 0.7, 0.3, 2.0, -100), True)}


def load_kernel(path):
    """jsd_rows_bf16 of the source at path, as _cupy_backend.fused_kernel gives it."""
    from jsdgpu import _cupy_backend
    module = cupy.RawModule(code=pathlib.Path(path).read_text(), options=("-std=c++17",))
    real = _cupy_backend._module
    _cupy_backend._module = lambda device_id, options=None: module
    _cupy_backend.fused_kernel.cache_clear()
    try:
        return _cupy_backend.fused_kernel(cupy.cuda.Device().id, "jsd_rows_bf16", _cupy_backend._CLUSTER,
                                          _cupy_backend._THREADS, _cupy_backend._GROUPS)
    finally:
        _cupy_backend._module = real
        _cupy_backend.fused_kernel.cache_clear()


def max_rel_diff(a, b):
    return float(cupy.max(cupy.abs(a - b)) / cupy.max(cupy.abs(b)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", type=pathlib.Path, help="rows.cu files; the first is the reference")
    a = p.parse_args()
    from jsdgpu import _cupy_backend  # loads cuBLAS: after --help
    *_, target, _, work = bench.one_chunk(ROWS, np.random.default_rng(0))
    kernels = [load_kernel(path) for path in a.sources]
    names = [path.name for path in a.sources]
    print("| options | " + " | ".join(f"{n} µs per row" for n in names)
          + " | max relative difference from the first: CE, JSD, G |")
    print("| --- " * (len(names) + 2) + "|")
    for config, (opts, with_grad) in CONFIGS.items():
        outputs, times = [], [[] for _ in kernels]
        for round_ in range(2):
            for i, kernel in enumerate(kernels):
                w = dict(work, kernel=kernel)
                ce, jsd, terms = (cupy.full(ROWS, np.nan, np.float32) for _ in range(3))
                G = work["G"] if with_grad else None
                if G is not None:
                    G.fill(np.nan)  # poisoned: every entry must be written

                def run(_, w=w, ce=ce, jsd=jsd, terms=terms, G=G):
                    _cupy_backend.launch_rows(w, ROWS, target, opts, ce, jsd, G, terms)

                run(0)
                if round_ == 0:
                    outputs.append((ce.copy(), jsd.copy(), None if G is None else G.astype(np.float32)))
                times[i].append(bench.time_ms(run, 1, 3, 20))
        ref = outputs[0]
        diffs = []
        for out in outputs[1:]:
            d = [max_rel_diff(out[0], ref[0]), max_rel_diff(out[1], ref[1])]
            if with_grad:
                d.append(max_rel_diff(out[2], ref[2]))
            nan = sum(int(cupy.isnan(x).sum()) for x in out if x is not None)
            diffs.append(", ".join(f"{x:.1e}" for x in d) + (f" ({nan} NaN)" if nan else ""))
        print(f"| {config} | " + " | ".join(f"{1e3 * min(t) / ROWS:.3f}" for t in times)
              + " | " + "; ".join(diffs) + " |")


if __name__ == "__main__":
    main()
