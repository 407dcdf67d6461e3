"""Does the row work's time depend on how close the student is to the teacher?

The fused kernel forms every row's soft part in its one pass, small or large (row_math.cuh,
column_terms): the fast sums and the precise one side by side. This times it alone, and the three
phase kernels (vocab parallelism, teacher vocabularies past 131072), on 2048 rows of the
benchmark's vocabulary whose teacher logits are the student's plus noise of a given std: from
independent rows (mean row JSD about 0.7 nats) down to 1e-4 nats, for the JSD, the two KLs and a
temperature, with gradients. Logits of std 4, float32, written straight into the chunk's buffers
(no products). Needs a GPU. --vocab: both vocabularies (past 131072 the fused kernel's wide
shape; past 262144 the phase kernels alone); --configs: some of the options' rows.

    python experiments/row_kernel_divergence.py [--rows 2048] [--repeats 30]
    python experiments/row_kernel_divergence.py --vocab 151936 262144 --configs jsd "forward KL"

Answer (one H200, the row kernel's table in docs/design.md, "Small divergences", and at wider
vocabularies "Wide vocabularies"): printed last.
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

NOISE = (None, 2.0, 0.6, 0.25, 0.08, 0.028)  # None: an independent teacher
CONFIGS = {"jsd": dict(beta=0.5), "forward KL": dict(beta=0.0), "reverse KL": dict(beta=1.0),
           "jsd, beta 0.9, T 2": dict(beta=0.9, temperature=2.0)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--vocab", type=int, nargs="+")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    a = p.parse_args()
    import cupy  # needs the GPU: after --help

    import harness
    rng = cupy.random.default_rng(0)
    print("| V | options | teacher | mean row soft part, nats | fused µs per 1024 rows | × the independent row's "
          "| phases µs per 1024 rows | phases ÷ fused | largest relative difference of the rows' soft parts |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for V in a.vocab or [harness.V]:
        table(rng, a.rows, V, a.configs, a.repeats)


def table(rng, T, V, configs, repeats):
    """The table's rows of vocabulary V (at most 262144: the fused kernel's widest)."""
    import cupy
    import numpy as np

    import harness
    import jsdgpu
    from jsdgpu.cuda.backend import CudaBackend as B
    weight = cupy.empty((V, 8), harness.BF16)  # prepare reads the heads' shape and dtype alone
    work = B.prepare(weight, weight, None, None, T, fused=True)
    G = B.gradient_rows(work, T, own_g=True)
    target = cupy.asarray(np.random.default_rng(0).integers(0, V, T), np.int32)
    ce, jsd, terms = (cupy.empty(T, np.float32) for _ in range(3))
    student = rng.standard_normal((T, V), dtype=np.float32) * 4.0
    work.logits_s[:, :V] = student
    for name in configs:
        opts = jsdgpu.LossOptions(**CONFIGS[name])
        base = None
        for noise in NOISE:
            fresh = rng.standard_normal((T, V), dtype=np.float32)
            work.logits_t[:, :V] = fresh * 4.0 if noise is None else student + noise * fresh
            fused = harness.time_ms(lambda i: B.fused_rows(work, target, opts, ce, jsd, G, terms), 1, 5,
                                    repeats, warm_s=0.3)
            soft, fused_soft = float(jsd.mean()), jsd.copy()

            def phases(i):
                stats = B.row_stats(work, target, opts)
                B.row_finish(work, target, stats, B.row_kl(work, target, stats, opts), opts, ce, jsd, G, terms)
            phase = harness.time_ms(phases, 1, 3, max(5, repeats // 3))
            differ = float(cupy.abs(jsd - fused_soft).max() / cupy.abs(jsd).max())
            per = 1024 / T * 1000
            base = base or fused
            print(f"| {V} | {name} | {'independent' if noise is None else f'student + {noise} N(0, 1)'} | {soft:.2e} "
                  f"| {fused * per:.0f} | {fused / base:.3f} | {phase * per:.0f} | {phase / fused:.2f} | {differ:.1e} |", flush=True)


if __name__ == "__main__":
    main()
