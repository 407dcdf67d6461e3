"""Which shape and source of the fused row kernel is fastest, and how does its time grow with the
rows of a chunk?

Answer (H200, 2026-11-30; docs/design.md, "The fused row kernel"): the library's shape, clusters
of 16 CTAs of 512 threads with 4 float4 groups a thread and two CTAs per SM, took 0.421 µs per
row at 2048 rows against 0.457-0.635 for the other shapes (clusters of 8 CTAs of 1024 threads; 16
of 256 with 8 groups; 16 of 512 at one CTA per SM); its time per row is flat from about 1024
rows on (at fewer rows, fewer clusters than fit the GPU have rows to take). The models' logits
(H200, 2026-12-04; docs/design.md, "Scaled and soft-capped logits"), µs per row at 2048 rows,
soft_tanh against tanhf (--sources, the sources before it first): the JSD 0.567-0.573, with caps
of 30 on both models 0.733 against 0.822, on the teacher alone 0.638 against 0.680, on the
student alone 0.683 against 0.761, caps of 1 on both (no warp skips the exponential) 0.895
against 0.857; a student scale of 2 alone 0.632-0.642. The student model's derivative folded
into pass 2 (H200, 2026-12-05, two runs, the sources before it first; same section), after
against before: caps of 30 on both 0.718 and 0.720 against 0.735 and 0.739, on the student alone
0.693 and 0.672 against 0.685 and 0.703; without a model 0.564 against 0.569 (the second run).
Pass 2's columns without branches (H100, 2026-12-06; docs/design.md, "Small divergences"), before
against after at 2048 rows: the JSD 0.710 against 0.625 on the benchmark's chunk, 0.666 against
0.638 with --noise 0.25. The library's kernel as it is (H100, 2026-12-07), µs per row at 1024 /
2048 rows: the JSD 0.622 / 0.592 (0.630 / 0.604 with --noise 0.25), forward KL 0.552 / 0.525,
reverse KL 0.532 / 0.509, temperature 2 0.705 / 0.679, caps of 30 on both 0.814 / 0.785 (0.814 /
0.784 on 2026-12-08, when caps of 5 on both took 0.935 / 0.893 and caps of 1 0.924 / 0.895). On
one H200 (2026-12-07, right after ten minutes of the benchmark): the JSD 0.627 / 0.633 (0.631 /
0.603 with --noise 0.25), forward KL 0.550 / 0.525, reverse KL 0.526 / 0.495, caps of 30 on both
0.819 / 0.800.

    python experiments/fused_row_kernel.py                               # the library's kernel
    python experiments/fused_row_kernel.py --shapes 16,512,4,2 8,1024,4,1 16,256,8,2
    python experiments/fused_row_kernel.py --sources jsdgpu/cuda/src /tmp/variant_src   # A/B
    python experiments/fused_row_kernel.py --noise 0.25 --sources ...   # a converging student's rows
    python experiments/fused_row_kernel.py --configs jsd "jsd, caps 30 on both" --sources ...
    ncu --clock-control none -k regex:fused_rows -c 1 python experiments/fused_row_kernel.py --once
    ncu ... -c 2 python experiments/fused_row_kernel.py --once "jsd, caps 30 on both" --sources A B

Under ncu (one H100, 2026-12-06; docs/design.md, "The fused row kernel"), the JSD on 1024 rows
issues 425.7 M instructions, on 70% of the schedulers' cycles. With `--page source --print-source
sass --csv` (each instruction's count) the same launch counted 472 M: under that page the warps
went round the mbarrier waits' poll loops more, so take its counts outside those loops.

Each kernel runs as the library launches it, on chunks of the benchmark's logits (bench/harness.py
one_chunk; with --noise, the student's logits of std 4 and the teacher's the student's plus noise
of that std, as experiments/row_kernel_divergence.py draws them: 0.25 gives a mean row JSD of
about 0.007 nats, where nearly every column takes the polynomials), median of 20 launches, the
kernels taking turns, two rounds, the best kept; its outputs (CE, JSD, G, poisoned before each
run) compared with the first kernel's. A source is a
directory holding fused_rows.cu and the headers it includes (a copy of jsdgpu/cuda/src, edited).
"""

import argparse
import dataclasses
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

ROWS = (256, 1024, 2048)
CONFIGS = {"jsd": (dict(beta=0.5), True), "jsd, loss only": (dict(beta=0.5), False),
           "forward KL": (dict(beta=0.0), True), "reverse KL": (dict(beta=1.0), True),
           "temperature 2": (dict(beta=0.3, weight_hard_loss=0.3, weight_soft_loss=0.7, temperature=2.0), True),
           # the models' logits, made in the kernel's registers (docs/design.md, "Scaled and
           # soft-capped logits"): what each part of a soft cap costs
           "jsd, caps 30 on both": (dict(beta=0.5, student_logit_softcap=30.0, teacher_logit_softcap=30.0), True),
           "jsd, cap 30 on the teacher": (dict(beta=0.5, teacher_logit_softcap=30.0), True),
           "jsd, cap 30 on the student": (dict(beta=0.5, student_logit_softcap=30.0), True),
           "jsd, student scale 2": (dict(beta=0.5, student_logit_scale=2.0), True),
           # logits of std 1 against caps of 1: every warp has columns on both sides of
           # TANH_POLY_BELOW, so that none skips soft_tanh's exponential (the worst case)
           "jsd, caps 1 on both": (dict(beta=0.5, student_logit_softcap=1.0, teacher_logit_softcap=1.0), True),
           # caps of 5 against logits of std 1: a column in 370 past TANH_POLY_BELOW, as a row's
           # largest logits under a cap that bites there
           "jsd, caps 5 on both": (dict(beta=0.5, student_logit_softcap=5.0, teacher_logit_softcap=5.0), True)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=[], metavar="C,T,G,M",
                   help="cluster, threads, groups, CTAs per SM of other shapes to time")
    p.add_argument("--sources", nargs="+", type=pathlib.Path, default=[],
                   help="source directories to time (the first is the reference)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="CONFIG",
                   help="the options to time (default: all)")
    p.add_argument("--once", nargs="?", const="jsd", choices=list(CONFIGS), metavar="CONFIG",
                   help="one launch of each kernel on 1024 rows, of CONFIG (default: jsd; for ncu)")
    p.add_argument("--noise", type=float, help="a converging student: the teacher's logits the student's plus "
                   "noise of this std (logits of std 4); default: the benchmark's independent chunk")
    a = p.parse_args()
    import cupy  # needs the GPU: after --help

    import harness
    import jsdgpu
    from jsdgpu.cuda import kernels, sources
    from jsdgpu.cuda.backend import CudaBackend

    device = cupy.cuda.Device().id
    variants = {"library": None}
    for text in a.shapes:
        shape = sources.FusedShape(*map(int, text.split(",")))
        variants[f"c{shape.cluster} t{shape.threads} g{shape.groups} m{shape.min_ctas}"] = (shape, None)
    for root in a.sources:
        variants[str(root)] = (sources.FUSED, sources.source("fused_rows", root))
    if a.sources:
        del variants["library"]
    xs, ws, xt, wt, target, be, work, G_all = harness.one_chunk(max(ROWS), np.random.default_rng(0))
    if a.noise is not None:
        rng, V = cupy.random.default_rng(0), harness.V
        student = rng.standard_normal((max(ROWS), V), dtype=np.float32) * 4.0
        work.logits_s[:, :V] = student
        work.logits_t[:, :V] = student + a.noise * rng.standard_normal((max(ROWS), V), dtype=np.float32)
    # the same chunk's buffers with each variant's kernel (the library's CudaWork, replaced field)
    works = {name: work if v is None else dataclasses.replace(work, fused=kernels.fused_kernel(
        device, ws.dtype, *v)) for name, v in variants.items()}
    if a.once:
        options, with_grad = CONFIGS[a.once]
        ce, jsd, terms = (cupy.empty(1024, np.float32) for _ in range(3))
        for w in works.values():
            CudaBackend.fused_rows(w, target[:1024], jsdgpu.LossOptions(**options), ce, jsd,
                                   G_all[:1024] if with_grad else None, terms)
        cupy.cuda.Device().synchronize()
        return
    names = list(works)
    print("| options | rows | " + " | ".join(f"{n} µs per row" for n in names)
          + " | max relative difference from the first: CE, JSD, G |")
    print("| --- " * (len(names) + 3) + "|")
    for config in a.configs:
        options, with_grad = CONFIGS[config]
        opts = jsdgpu.LossOptions(**options)
        for rows in ROWS:
            outputs, times = [], [[] for _ in names]
            for round_ in range(2):
                for i, name in enumerate(names):
                    ce, jsd, terms = (cupy.full(rows, np.nan, np.float32) for _ in range(3))
                    G = G_all[:rows] if with_grad else None
                    if G is not None:
                        G.fill(np.nan)  # poisoned: every entry must be written

                    def run(_, w=works[name], ce=ce, jsd=jsd, terms=terms, G=G):
                        CudaBackend.fused_rows(w, target[:rows], opts, ce, jsd, G, terms)
                    run(0)
                    if round_ == 0:
                        outputs.append((ce.copy(), jsd.copy(), None if G is None else G.astype(np.float32)))
                    times[i].append(harness.time_ms(run, 1, 3, 20))
            diffs = []
            for out in outputs[1:]:
                d = [float(cupy.max(cupy.abs(x - r)) / cupy.max(cupy.abs(r)))
                     for x, r in zip(out, outputs[0]) if x is not None]
                nan = sum(int(cupy.isnan(x).sum()) for x in out if x is not None)
                diffs.append(", ".join(f"{x:.1e}" for x in d) + (f" ({nan} NaN)" if nan else ""))
            print(f"| {config} | {rows} | " + " | ".join(f"{1e3 * min(t) / rows:.3f}" for t in times)
                  + " | " + "; ".join(diffs) + " |")


if __name__ == "__main__":
    main()
