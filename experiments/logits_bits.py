"""Do cuBLASLt's candidate algorithms for a logits product give a row the same bits, whatever
the algorithm and the rows it is computed with?

For each head shape, the union of the heuristic's candidates over several row counts (the
classes a call's products fall in: a head of 256 rows, a rest of 44, chunks of 300-2048), each
run at each row count it can, and the first 44 rows' logits compared bit for bit with those of
the heuristic's first candidate at 44 rows. Printed per candidate: its configuration (cuBLASLt's
algo id, tile, split-k, reduction scheme, stages, inner and cluster shape), which bit group its
rows fall in at each row count, and its time at 1024 and 2048 rows.

    python experiments/logits_bits.py [--shapes 128256x2048 128256x4096 523x16]

Answer (one H200, 2026-12-03; docs/design.md, "Products"): each algorithm gives a row the same
bits at every row count. At 128256x2048 and 128256x4096 all 29 candidates give one bit pattern;
at 523x16, two (the 17 that split k over CTAs, and the others); at 1000x100, three.
"""

import argparse
import ctypes
import json
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ROWS = (44, 256, 300, 512, 1024, 2048)
# cublasLtMatmulAlgoConfigAttributes_t: name -> (number, bytes)
CONFIG = {"id": (0, 4), "tile": (1, 4), "splitk": (2, 4), "reduction": (3, 4), "swizzle": (4, 4),
          "custom": (5, 4), "stages": (6, 4), "inner": (7, 2), "cluster": (8, 2)}


def config(lib, algo):
    """cuBLASLt's configuration of algo, by CONFIG's names (None where it has none)."""
    get = lib.cublasLtMatmulAlgoConfigGetAttribute
    get.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    out = {}
    for name, (attr, size) in CONFIG.items():
        value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        status = get(ctypes.byref(algo), attr, ctypes.byref(value), size, ctypes.byref(written))
        out[name] = None if status else value.value
    return out


def timed(run, reps=20):
    import cupy
    run()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        run()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["128256x2048", "128256x4096", "523x16", "1000x100"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import cupy  # the GPU is needed from here on

    from jsdgpu.cuda import products
    from jsdgpu.cuda.steps import leading_dim
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    report = []
    for shape in args.shapes:
        v, h = map(int, shape.split("x"))
        ld = leading_dim(v)
        w = cupy.asarray((rng.standard_normal((v, h)) / np.sqrt(h)).astype(bf16))
        x = cupy.asarray(rng.standard_normal((max(ROWS), h)).astype(bf16))
        types = (products._CUDA_TYPE[bf16], products._CUDA_TYPE[bf16], products._CUDA_TYPE[np.dtype(np.float32)])
        device = cupy.cuda.Device().id
        made = {n: products._Product(device, products.T, products.N, v, n, h, h, h, ld, *types, False,
                                     products.WORKSPACE_BYTES) for n in ROWS}
        algos = {}
        for n in ROWS:
            for algo in made[n].candidates():
                algos.setdefault(bytes(algo), algo)
        room = cupy.empty(products.WORKSPACE_BYTES, np.uint8)
        groups, rows_out = {}, []
        first = made[44].candidates()[0]
        for key, algo in [(bytes(first), first)] + [(k, a) for k, a in algos.items() if k != bytes(first)]:
            row = {"shape": shape, "config": config(made[44].lib, algo), "groups": {}, "ms": {}}
            for n in ROWS:
                if made[n].workspace_of(algo) is None:
                    continue
                out = cupy.full((n, ld), np.nan, np.float32)

                def run(n=n, out=out):
                    made[n].run(algo, w, x[:n], out, 1.0, 0.0, room)
                run()
                bits = out[:44, :v].get().tobytes()
                row["groups"][n] = groups.setdefault(bits, len(groups))
                if n in (1024, 2048):
                    row["ms"][n] = round(timed(run), 4)
            rows_out.append(row)
            print(shape, row["config"], "groups by rows", row["groups"], "ms", row["ms"], flush=True)
        report.extend(rows_out)
        print(f"{shape}: {len(algos)} candidates, {len(groups)} distinct bit patterns of the first 44 rows")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
