"""Does the top-k row kernel gain by reading a row once, G stored as a row scale times values
taken against the row's first batch (topk_rows.cu, row_scale), over its two streaming passes?

Answer (one H200, 2026-12-02; docs/design.md, "Top-k"): yes, by a third. On one chunk of 2731
rows at V = 128256, bf16 G: k = 64 0.620 ms against 0.928 with two passes, k = 256 0.676 against
0.989, temperature 2 with no hard part 0.602 against 0.930, renormalized 0.564 against 0.887.
The losses come out with the same bits; G, its scale applied, differs from the two passes' by
bf16 rounding (at most 4.2e-3 of the chunk's largest |G|, 5.5e-3 of a row's norm).

    python experiments/topk_row_kernel.py

Each kernel runs as the library launches it (jsdgpu.cuda.topk_kernels.topk_rows) on random logits
(std 2) and a random teacher's top-k (90% of its mass in the slots); medians of five rounds of
three launches, the two ways in turns.
"""

import argparse
import pathlib
import statistics
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

V, ROWS = 128256, 2731
CASES = ((64, 1.0, 0.5, "bucket"), (256, 1.0, 0.5, "bucket"), (64, 2.0, 0.0, "bucket"),
         (64, 1.0, 0.5, "renormalize"))  # k, temperature, weight_hard_loss, missing_mass


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import cupy  # here, not above: --help runs without a GPU

    from jsdgpu.cuda import topk_kernels
    from jsdgpu.options import split_options

    rng = cupy.random.default_rng(0)
    logits = rng.standard_normal((ROWS, V), dtype=np.float32) * 2
    target = cupy.asarray(np.random.default_rng(1).integers(0, V, ROWS), dtype=np.int32)

    def slots(k):
        ids = (cupy.arange(k, dtype=np.int32)[None, :] * (V // k) + cupy.arange(ROWS, dtype=np.int32)[:, None] * 7919) % V
        z = rng.standard_normal((ROWS, k), dtype=np.float32) * 3
        lq = cupy.log(0.9 * cupy.exp(z) / cupy.exp(z).sum(1, keepdims=True)).astype(np.float32)
        return ids.astype(np.int32), lq

    def bf16_as_float32(G):
        return (G.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    for k, temperature, weight_hard, missing_mass in CASES:
        ids, lq = slots(k)
        opts = split_options(dict(beta=0.5, temperature=temperature, weight_hard_loss=weight_hard))[0]
        outs = {once: (cupy.zeros(ROWS, np.float32), cupy.zeros(ROWS, np.float32), cupy.zeros((ROWS, V), ml_dtypes.bfloat16),
                       cupy.zeros(ROWS, np.float32), cupy.zeros(ROWS, np.float32) if once else None)
                for once in (False, True)}

        def run(once):
            ce, soft, G, label_terms, scale = outs[once]
            topk_kernels.topk_rows(logits, None, target, V, ids, lq, opts, missing_mass == "bucket", ce, soft, G,
                              label_terms, scale)

        times = {False: [], True: []}
        for _ in range(5):
            for once in (False, True):
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                for _ in range(3):
                    run(once)
                stop.record()
                stop.synchronize()
                times[once].append(cupy.cuda.get_elapsed_time(start, stop) / 3)
        ce2, soft2, G2, _, _ = outs[False]
        ce1, soft1, G1, _, scale = outs[True]
        twice, once = bf16_as_float32(G2), bf16_as_float32(G1) * scale[:, None]
        largest = float(abs(once - twice).max() / abs(twice).max())
        row = float((cupy.linalg.norm(once - twice, axis=1) / cupy.linalg.norm(twice, axis=1)).max())
        same = bool((ce1 == ce2).all() and (soft1 == soft2).all())
        print(f"k = {k}, temperature {temperature}, weight_hard_loss {weight_hard}, {missing_mass}: "
              f"once {statistics.median(times[True]):.3f} ms, twice {statistics.median(times[False]):.3f} ms; "
              f"G apart {largest:.1e} of the largest, {row:.1e} of a row's norm; losses the same bits: {same}; "
              f"rows read twice after all: {int((scale == 1).sum())}")


if __name__ == "__main__":
    main()
