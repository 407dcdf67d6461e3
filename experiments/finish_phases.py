"""Where does topk_finish's time go, row by row?

Answer (one H200, 2048 rows, docs/design.md, "Top-k: the logits product of our own"): a row took
69.8 thousand SM cycles at k = 256 and 50.7 at k = 64 (the kernel 0.096 and 0.061 ms), against
99.9 and 53.6 with commit ed45ea7's kernel (--against), mostly waits for loads and block
reductions. There the partials, loaded after the label's dot product, took 14.6-15.1 thousand
cycles to merge (4.6 loaded before it), the slots' gradient loop 13.7 (k = 256; 8.7 with the slots
in shared memory), and the row's end 18.8 (the bitmap's clears, behind the slots' G stores; 1.2
with no clears). Without the slots' G stores the kernel took 0.078 and 0.056 ms.

    python experiments/finish_phases.py                      # 1024 and 2048 rows, k = 64 and 256
    python experiments/finish_phases.py --against DIR        # also another copy's topk_rows.cu (DIR: its jsdgpu)

topk_finish compiled from topk_rows.cu's text with clock64 stamps by thread 0 at the ends of its
phases (the label's logit, the partials' merge, the slots' places, their logsumexps, the
divergence, the row scale, a rescale pass, the slots' gradient, the end); variants: the
library's, without the slots' G stores (timing only: G is wrong), and --against's. Per rows and
k: the per-row median cycles of each phase, after a product (topk_slot_bits and topk_logits),
and the kernel's median time, each launch right after a product (as in a step: G's rows just
written by it), the variants in turns. Needs an sm_90 GPU.
"""

import argparse
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

PHASES = ["label", "partials", "places", "slot lse", "divergence", "scale", "rescale", "gradient", "end"]
ANCHORS = [  # (a line of topk_rows_body, the stamp goes after it) for the stamps 0 to 9
    ("  const bool one_pass = G != nullptr && row_scale != nullptr;", False),
    ("  __syncthreads();  // the bitmap, the target's logit and the ring's mbarriers are ready", True),
    ("  const double lse_s = lse_bits(st.s) * LN2,", False),
    ("  // 2. the categories' normalizations", False),
    ("  sl = block_all<THREADS>(sl);", True),
    ("  sums = block_all<THREADS>(sums);", True),
    ("  if (FUSED && second_pass) {", False),
    ("  __syncthreads();  // the streaming pass's writes come before the slots' own", True),
    ("  if constexpr (FUSED)", False),  # the end: the flags (and, before, the bitmap) cleared
    ("    if (threadIdx.x == 0 && row % 64 == 0) fp.ready[row / 64] = 0;", True),
]
MOST_ROWS = 4096


def stamped(src):
    src = src.replace("template <int MODE, int OUT, int THREADS, int STAGES, bool FUSED = false>",
                      f"__device__ long long phase_clock[{MOST_ROWS * 16}];\n"
                      "template <int MODE, int OUT, int THREADS, int STAGES, bool FUSED = false>", 1)
    at = src.index("void topk_rows_body(")
    for i, (anchor, after) in enumerate(ANCHORS):
        at = src.index(anchor, at)  # the anchors in order
        stamp = (f"\n  if constexpr (FUSED) if (threadIdx.x == 0 && row < {MOST_ROWS}) "
                 f"phase_clock[row * 16 + {i}] = clock64();\n")
        end = at + len(anchor)
        src = src[:end] + stamp + src[end:] if after else src[:at] + stamp + src[at:]
        at = end + len(stamp)
    return src


def without_slot_stores(src):
    store = "    store4<OUT>(grow(), id, &value, 1);"
    assert src.count(store) == 1
    return src.replace(store, "    if (value == 12345.0f) store4<OUT>(grow(), id, &value, 1);  // (never)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--k", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--against", metavar="DIR", help="another copy of the package (its jsdgpu directory)")
    args = p.parse_args()
    os.environ["JSDGPU_TOPK_PRODUCT"] = "own"
    import cupy  # here, not above: --help runs without a GPU
    import ml_dtypes

    from jsdgpu.cuda import sources, topk_kernels
    from jsdgpu.cuda.backend import CudaBackend as B
    from jsdgpu.options import split_options

    src = sources.source("topk_rows")
    texts = {"library": src, "no slot stores": without_slot_stores(src)}
    if args.against:
        texts["against"] = sources.source("topk_rows", root=pathlib.Path(args.against) / "cuda" / "src")
    name = sources.topk_finish()
    modules = {label: cupy.RawModule(code=stamped(text), options=sources.OPTIONS, name_expressions=[name])
               for label, text in texts.items()}
    finish = {label: module.get_function(name) for label, module in modules.items()}

    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    v, hidden, opts = 128256, 2048, split_options(dict(beta=0.5))[0]
    w = cupy.asarray((rng.standard_normal((v, hidden)) * 4 / hidden**0.5).astype(bf16))
    print("rows | k | variant | ms | per-row median SM cycles: " + " / ".join(PHASES) + " | total")
    for m in args.rows:
        assert m <= MOST_ROWS
        x = cupy.asarray(rng.standard_normal((m, hidden)).astype(bf16))
        target = cupy.asarray(rng.integers(0, v, m), np.int32)
        for k in args.k:
            ids = cupy.asarray(np.stack([rng.choice(v, k, replace=False) for _ in range(m)]), np.int32)
            lq = cupy.full((m, k), np.log(0.9 / k), np.float32)
            work = B.topk_prepare(w, None, m, own=True, k=k)
            G = B.topk_gradient_rows(work, m)
            out = [cupy.zeros(m, np.float32) for _ in range(4)]

            def product_then_finish(label):  # topk_finish the variant's, every other kernel the library's
                B.topk_own_logits(work, x, ids, lq, G)
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                # CudaBackend.topk_rows's call of the finishing kernel, with the variant's kernel
                own = work.own
                grid, block, arguments, shared = topk_kernels.topk_finish_launch(
                    target, v, ids, lq, opts, True, *out[:2], G, *out[2:], own.partials, own.ref, own.slot_logits, x,
                    work.ws, work.bias_s, own.bitmap, own.ready, own.slots_before)
                finish[label](grid, block, arguments, shared_mem=shared)
                stop.record()
                stop.synchronize()
                return cupy.cuda.get_elapsed_time(start, stop)

            phases, times = {}, {label: [] for label in modules}
            for label, module in modules.items():
                clock = cupy.ndarray((MOST_ROWS * 16,), np.int64, module.get_global("phase_clock"))
                product_then_finish(label)  # warm
                clock.fill(0)
                product_then_finish(label)
                stamps = cupy.asnumpy(clock).reshape(MOST_ROWS, 16)[:m, :len(ANCHORS)]
                phases[label] = np.median(np.diff(stamps, axis=1), axis=0), np.median(stamps[:, -1] - stamps[:, 0])
            for _ in range(args.rounds):
                for label in modules:
                    times[label] += [product_then_finish(label) for _ in range(5)]
            for label in modules:
                each, total = phases[label]
                print(f"{m} | {k} | {label} | {np.median(times[label]):.4f} | "
                      + " / ".join(f"{c:.0f}" for c in each) + f" | {total:.0f}", flush=True)


if __name__ == "__main__":
    main()
