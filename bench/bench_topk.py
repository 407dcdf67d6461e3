"""The offline-distillation benchmark: the top-k loss (forward + backward) against its own three
products' floor, the online step's four, and a plain PyTorch implementation of the same math
(full student logits, gather, autograd); teacher_topk against the teacher's logits product alone.
bf16, V = 128256, student hidden 2048, teacher hidden 4096 (harness.py's workload), the top-k
from the benchmark's own teacher by teacher_topk.

    python bench/bench_topk.py --tokens 1024 2048 4096 8192 --k 64 256 --out bench/results/h200_topk

Writes <out>.json (one record per measurement) and prints a table.
"""

import argparse
import json
import sys

import numpy as np

BETA, TEMPERATURE = 0.5, 1.0


def torch_topk_loss(xs, ws, ids, lq, target, ignore_index=-100):
    """The bucket-mode top-k loss (docs/contract.md) with the full student logits in plain
    PyTorch, default options: what a user writes without a fused loss."""
    import torch
    s = (xs @ ws.T).float()
    valid = target != ignore_index
    n = valid.sum().clamp(min=1)
    ce = torch.nn.functional.cross_entropy(s, target, ignore_index=ignore_index, reduction="sum") / n
    logp = torch.log_softmax(s / TEMPERATURE, -1)
    lp = logp.gather(1, ids)
    lp_rest = torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-6))
    lq_rest = torch.log1p(-lq.exp().sum(-1).clamp(max=1 - 1e-6))
    LP, LQ = torch.cat([lp, lp_rest[:, None]], 1), torch.cat([lq, lq_rest[:, None]], 1)
    logm = torch.logsumexp(torch.stack([LP + np.log(1 - BETA), LQ + np.log(BETA)]), 0)
    jsd = BETA * (LQ.exp() * (LQ - logm)).sum(-1) + (1 - BETA) * (LP.exp() * (LP - logm)).sum(-1)
    return 0.5 * ce + 0.5 * (jsd * valid).sum() / n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--k", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sets", type=int, default=2)
    p.add_argument("--warm-seconds", type=float, default=1.0,
                   help="each measurement's warm-up runs at least this long (the GPU at its power cap)")
    p.add_argument("--no-torch", action="store_true", help="leave out the plain PyTorch implementation")
    p.add_argument("--out", default=None, help="write <out>.json")
    a = p.parse_args(argv)
    import cupy  # here, not above: --help runs without a GPU

    import jsdgpu
    from harness import V, copy_bandwidth, device_name, make_sets, make_weights, peak_mib, time_ms
    print(f"device {device_name()}: copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s", flush=True)
    weights = make_weights(a.sets)
    rng = np.random.default_rng(0)
    records = []

    def record(**r):
        records.append(r)
        print(json.dumps(r), flush=True)

    timing = dict(n_sets=a.sets, warmup=a.warmup, repeats=a.repeats, warm_s=a.warm_seconds)
    for T in a.tokens:
        sets = make_sets(T, weights, rng)
        floor4 = _floor(sets, with_teacher=True)
        floor3 = _floor(sets, with_teacher=False)
        record(impl="floor_4_products", T=T, k=None, ms=round(time_ms(floor4, **timing), 4))
        record(impl="floor_3_products", T=T, k=None, ms=round(time_ms(floor3, **timing), 4))
        teacher = lambda i: sets[i][2] @ sets[i][3].T  # noqa: E731  the teacher's logits product alone
        record(impl="teacher_logits_product", T=T, k=None, ms=round(time_ms(teacher, **timing), 4))
        for k in a.k:
            topk = [jsdgpu.teacher_topk(xt, wt, k) for _, _, xt, wt, _ in sets]
            record(impl="teacher_topk", T=T, k=k,
                   ms=round(time_ms(lambda i: jsdgpu.teacher_topk(sets[i][2], sets[i][3], k), **timing), 4))

            def step(i):
                xs, ws, _, _, target = sets[i]
                loss, ctx = jsdgpu.forward_topk(xs, ws, *topk[i], target, beta=BETA, temperature=TEMPERATURE)
                jsdgpu.backward(ctx)
            record(impl="jsdgpu_topk", T=T, k=k, ms=round(time_ms(step, **timing), 4),
                   peak_mib=round(peak_mib(step), 1))
            if not a.no_torch:
                record(impl="torch_topk", T=T, k=k, **_torch_measure(sets, topk, timing))
        cupy.get_default_memory_pool().free_all_blocks()
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(dict(device=device_name(), V=V, records=records), f, indent=1)
    _table(records)


def _floor(sets, with_teacher):
    """The products at full size, bf16 in and out, through CuPy (cuBLAS): the student's logits
    (and the teacher's), grad_input and grad_weight."""
    import cupy
    from harness import BF16, V
    T = sets[0][0].shape[0]
    G = (cupy.random.standard_normal((T, V), dtype=np.float32) * 1e-3).astype(BF16)

    def fn(i):
        xs, ws, xt, wt, _ = sets[i]
        xs @ ws.T
        if with_teacher:
            xt @ wt.T
        G @ ws
        G.T @ xs
    return fn


def _torch_measure(sets, topk, timing):
    import torch
    from harness import peak_mib, time_ms
    tsets = []
    for (xs, ws, _, _, target), (ids, lq) in zip(sets, topk):
        t = [torch.from_dlpack(a) for a in (xs, ws)]
        tsets.append((t[0].detach().requires_grad_(True), t[1].detach().requires_grad_(True),
                      torch.from_dlpack(ids).long(), torch.from_dlpack(lq), torch.from_dlpack(target)))

    def fn(i):
        xs, ws, ids, lq, target = tsets[i]
        torch_topk_loss(xs, ws, ids, lq, target).backward()
        xs.grad = ws.grad = None
    try:
        ms = time_ms(fn, **timing)
        return dict(ms=round(ms, 4), peak_mib=round(peak_mib(fn, torch_too=True), 1))
    except torch.OutOfMemoryError as e:
        print(f"torch_topk: {e}", file=sys.stderr)
        return dict(ms=None, peak_mib=None)


def _table(records):
    by = {(r["impl"], r["T"], r["k"]): r for r in records}
    print("\nT      k    topk ms  x floor3  / floor4  torch ms  torch/topk  peak MiB (topk / torch)  "
          "teacher_topk ms  / its product")
    for (impl, T, k), r in sorted(by.items(), key=lambda x: (x[0][1], x[0][2] or 0)):
        if impl != "jsdgpu_topk":
            continue
        f3, f4 = by[("floor_3_products", T, None)]["ms"], by[("floor_4_products", T, None)]["ms"]
        tt, tp = by[("teacher_topk", T, k)]["ms"], by[("teacher_logits_product", T, None)]["ms"]
        torch_r = by.get(("torch_topk", T, k), {})
        tms = torch_r.get("ms")
        print(f"{T:<6} {k:<4} {r['ms']:8.3f}  {r['ms'] / f3:8.3f}  {r['ms'] / f4:8.3f}  "
              f"{tms if tms is None else round(tms, 3)!s:>8}  "
              f"{'-' if tms is None else round(tms / r['ms'], 2)!s:>10}  "
              f"{r['peak_mib']:9.0f} / {torch_r.get('peak_mib')!s:>8}  {tt:15.3f}  {tt / tp:8.3f}")


if __name__ == "__main__":
    main()
