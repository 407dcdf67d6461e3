"""Vocab-parallel jsdgpu: the benchmark workload on one GPU, and on P GPUs that each hold 1/P of
the vocabulary of both LM heads, talking over NCCL (CuPy's bindings), one process per GPU.

    python bench/bench_vocab_parallel.py --gpus 2     # writes bench/results/<device>x2.{json,md}

Same workload and timing as bench.py (harness.py: V = 128256, Ht = 4096, Hs = 2048, bf16; medians of
CUDA-event times, inputs rotated). A P-GPU time is the largest of the ranks' medians.
"""

import argparse
import json
import multiprocessing
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def worker(rank, n_gpus, nccl_id, a, results):
    sys.path.insert(0, str(ROOT / "bench"))
    import cupy
    cupy.cuda.Device(rank).use()
    import harness
    comm = None
    if n_gpus > 1:
        from cupy.cuda import nccl
        comm = nccl.NcclCommunicator(n_gpus, nccl_id, rank)
    lo, hi = rank * harness.V // n_gpus, (rank + 1) * harness.V // n_gpus
    # every rank draws the same full weights (same seed) and keeps its rows
    weights = [(ws[lo:hi].copy(), wt[lo:hi].copy()) for ws, wt in harness.make_weights(a.sets)]
    cupy.get_default_memory_pool().free_all_blocks()
    rng = np.random.default_rng(0)  # the same inputs and targets on every rank
    for T in a.tokens:
        sets = harness.make_sets(T, weights, rng)
        for mode in ("fwd_bwd", "fwd"):
            fn = harness.impl_jsdgpu(sets, mode, vocab_parallel=comm)
            ms = harness.time_ms(fn, a.sets, a.warmup, a.repeats)
            results.put((rank, T, mode, ms, harness.peak_mib(fn)))
        del sets
        cupy.get_default_memory_pool().free_all_blocks()


def run(n_gpus, a):
    """{(T, mode): (ms, peak MiB)}, the largest over the ranks."""
    ctx = multiprocessing.get_context("spawn")
    nccl_id = None
    if n_gpus > 1:
        from cupy.cuda import nccl
        nccl_id = nccl.get_unique_id()
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, n_gpus, nccl_id, a, results)) for r in range(n_gpus)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(n_gpus * len(a.tokens) * 2):
        rank, T, mode, ms, mib = results.get(timeout=900)
        old = out.get((T, mode), (0.0, 0.0))
        out[(T, mode)] = (max(old[0], ms), max(old[1], mib))
        print(f"{n_gpus} GPU(s), rank {rank}: T={T} {mode} {ms:.2f} ms", file=sys.stderr)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a worker failed with exit code {p.exitcode}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--sets", type=int, default=2, help="input sets rotated between runs")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    a = p.parse_args(argv)

    import cupy
    if cupy.cuda.runtime.getDeviceCount() < a.gpus:
        raise SystemExit(f"needs {a.gpus} GPUs, this machine has {cupy.cuda.runtime.getDeviceCount()}")
    sys.path.insert(0, str(ROOT / "bench"))
    import harness
    name = f"{harness.device_name()}x{a.gpus}"
    records = []
    timings = {n: run(n, a) for n in (1, a.gpus)}
    for n, times in timings.items():
        for (T, mode), (ms, mib) in sorted(times.items()):
            records.append(dict(impl="jsdgpu", gpus=n, T=T, mode=mode, ms=round(ms, 4),
                                peak_mib=round(mib, 1)))
    result = dict(device=name, V=harness.V, Hs=harness.HS, Ht=harness.HT, dtype="bfloat16",
                  date=time.strftime("%Y-%m-%d"),
                  command="python bench/bench_vocab_parallel.py " + " ".join(argv or sys.argv[1:]),
                  records=records)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    one = timings[1]
    lines = [f"Device {name}, {result['date']}; V={harness.V}, Hs={harness.HS}, Ht={harness.HT}, bf16, "
             f"each GPU holding 1/{a.gpus} of the vocabulary. `{result['command']}`", "",
             f"| T | mode | 1 GPU ms | {a.gpus} GPUs ms | speed-up | peak MiB per GPU (1 / {a.gpus}) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for (T, mode), (ms, mib) in sorted(timings[a.gpus].items()):
        lines.append(f"| {T} | {mode} | {one[(T, mode)][0]:.2f} | {ms:.2f} | "
                     f"{one[(T, mode)][0] / ms:.2f} | {one[(T, mode)][1]:.0f} / {mib:.0f} |")
    table = "\n".join(lines) + "\n"
    (a.out / f"{name}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
