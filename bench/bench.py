"""jsdgpu benchmark: the loss against the GEMM floor, Liger-Kernel and plain PyTorch.

    python bench/bench.py                 # T = 1024, 2048, 4096, 8192; writes bench/results/
    python bench/bench.py --tokens 1024 --impls jsdgpu gemm_floor --out /tmp/r
    python bench/bench.py --render bench/results/h200.json   # its table and plot again (no GPU)

The workload, timing and implementations are harness.py's; the tables and plot report.py's.
"""

import argparse
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402

IMPLS = ["jsdgpu", "gemm_floor", "liger", "torch"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    p.add_argument("--sets", type=int, default=2, help="input sets rotated between runs")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--warm-seconds", type=float, default=1.0,
                   help="each measurement's warm-up runs at least this long (the GPU at its power cap)")
    p.add_argument("--name", help="result file name (default: the device's name)")
    p.add_argument("--budgets-gib", type=float, nargs="*", default=[0.25, 0.5, 1.0, 5.0],
                   help="memory_budget values (GiB) timed at the largest T beside the default")
    p.add_argument("--render", type=pathlib.Path, metavar="JSON",
                   help="time nothing: write the table and plot of a results file again, beside it")
    a = p.parse_args(argv)
    if a.render:
        report.render(a.render)
        return

    import cupy  # the GPU is needed from here on

    from harness import (V, HS, HT, available, copy_bandwidth, device_name, impl_gemm_floor,
                         impl_jsdgpu, impl_jsdgpu_jax, impl_jsdgpu_torch, impl_liger, impl_torch, make_sets,
                         make_weights, peak_mib, stage_breakdown, time_ms)

    rng = np.random.default_rng(0)
    name = a.name or device_name()
    impls = [i for i in a.impls if available(i)]
    front_ends = [i for i in ("jsdgpu_torch", "jsdgpu_torch_compiled", "jsdgpu_jax") if available(i)]
    skipped = sorted(set(a.impls) - set(impls))
    bw = copy_bandwidth()
    print(f"device {name}: copy bandwidth {bw / 1e12:.2f} TB/s; implementations {impls}"
          + (f" (not importable: {skipped})" if skipped else ""))

    plan = []  # (T, impl, mode, valid fraction, memory budget or None for the default)
    for T in a.tokens:
        for impl in impls:
            plan.append((T, impl, "fwd_bwd", 1.0, None))
            if impl in ("jsdgpu", "gemm_floor"):
                plan.append((T, impl, "fwd", 1.0, None))
            if impl == "jsdgpu":
                plan.append((T, impl, "fwd_bwd", 0.5, None))
                # the capturable mode (no host synchronization, every row computed), dense and half ignored
                plan += [(T, "jsdgpu_capturable", "fwd_bwd", valid, None) for valid in (1.0, 0.5)]
                # the front ends: PyTorch eager and compiled, JAX jitted
                plan += [(T, impl, "fwd_bwd", 1.0, None) for impl in front_ends]
    plan += [(max(a.tokens), "jsdgpu", "fwd_bwd", 1.0, int(g * 2**30)) for g in a.budgets_gib]
    try:
        from tqdm import tqdm
        progress = tqdm(plan, file=sys.stderr, desc="bench")
    except ImportError:
        progress = plan

    weights = make_weights(a.sets)
    records, cache = [], {}
    result = dict(device=name, copy_bytes_per_s=bw, V=V, Hs=HS, Ht=HT, dtype="bfloat16",
                  date=time.strftime("%Y-%m-%d"),
                  command="python bench/bench.py " + " ".join(argv or sys.argv[1:]),
                  records=records)
    a.out.mkdir(parents=True, exist_ok=True)
    for T, impl, mode, valid, budget in progress:
        key = (T, valid)
        if key not in cache:
            cache.clear()
            cupy.get_default_memory_pool().free_all_blocks()
            cache[key] = make_sets(T, weights, rng, valid)
        sets = cache[key]
        fn = {"jsdgpu": lambda: impl_jsdgpu(sets, mode, memory_budget=budget),
              "jsdgpu_capturable": lambda: impl_jsdgpu(sets, mode, capturable=True),
              "jsdgpu_torch": lambda: impl_jsdgpu_torch(sets, mode),
              "jsdgpu_torch_compiled": lambda: impl_jsdgpu_torch(sets, mode, compiled=True),
              "jsdgpu_jax": lambda: impl_jsdgpu_jax(sets, mode),
              "gemm_floor": lambda: impl_gemm_floor(sets, mode),
              "liger": lambda: impl_liger(sets, mode), "torch": lambda: impl_torch(sets, mode)}[impl]()
        torch_based = impl in ("liger", "torch", "jsdgpu_torch", "jsdgpu_torch_compiled")
        try:
            ms = time_ms(fn, a.sets, a.warmup, a.repeats, a.warm_seconds)
            mib = peak_mib(fn, torch_too=torch_based)
        except Exception as e:  # e.g. out of memory for the full-logits PyTorch at large T
            print(f"\n{impl} T={T} {mode}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        finally:
            if torch_based:
                import torch
                torch.cuda.empty_cache()
        records.append(dict(impl=impl, T=T, mode=mode, valid_fraction=valid, ms=round(ms, 4),
                            peak_mib=round(mib, 1), **({} if budget is None else
                                                       dict(memory_budget=budget))))
        (a.out / f"{name}.json").write_text(json.dumps(result, indent=1))  # kept if cut short

    cache.clear()
    cupy.get_default_memory_pool().free_all_blocks()
    stages, row_kernel = stage_breakdown(1024, rng, bw)

    result.update(stages_T1024=stages, row_kernel=row_kernel)
    (a.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    report.render(a.out / f"{name}.json")


if __name__ == "__main__":
    main()
