"""jsdgpu's CPU backend against the loss in plain PyTorch (eager and torch.compile), on the CPU.

    python bench/bench_cpu.py                       # writes bench/results/cpu_<cores>cores.{json,md}
    python bench/bench_cpu.py --tokens 512 --vocab 32000 --impls jsdgpu
    python bench/bench_cpu.py --tokens 512 --vocab 128256 --impls jsdgpu --budget 64 --name cpu_budget64

Forward + backward (the gradients of both inputs of the student), float32, hidden 256 / 256,
student and teacher logits of std 4, every row valid, default options (--budget: jsdgpu's
memory_budget in MiB instead of the backend's default; jsdgpu_torch, the torch front end on CPU
tensors, takes the default); the median of --repeats
steps after WARM_STEPS untimed ones. Each implementation and shape runs
in a process of its own, and its peak memory is the process's peak resident memory during one
step beyond what it held before (the inputs), from Linux's VmHWM (reset through clear_refs).
The row kernel's bandwidth: jsdgpu's fused CPU row kernel alone on one chunk of logits for each
divergence, as the backend calls it (the gradient written over the student's logits), its bytes
(each logit of both read once, the float32 gradient written once) over its time, against the
machine's copy bandwidth (a parallel copy of 1 GB by the same Numba threads), each kernel call
followed by a copy: its share is the median of those pairs' ratios (row_kernel_bandwidth).
"""

import argparse
import ctypes
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# jsdgpu on NumPy arrays, jsdgpu through its torch front end on CPU tensors (its products by
# torch's BLAS: jsdgpu.cpu.products), the plain loss in PyTorch eager and compiled
IMPLS = ["jsdgpu", "jsdgpu_torch", "torch_eager", "torch_compile"]
HIDDEN = 256
# untimed steps first (their times are kept in the json, as warm_seconds): compilation (Numba's
# from its cache, torch.compile's) and first allocations, and a process's first steps with torch's
# CPU BLAS (jsdgpu_torch), which in some processes took about twice as long as the later ones
WARM_STEPS = 3


def inputs(T, V, seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((T, HIDDEN), dtype=np.float32)
    xt = rng.standard_normal((T, HIDDEN), dtype=np.float32)
    ws = rng.standard_normal((V, HIDDEN), dtype=np.float32) * np.float32(4.0 / HIDDEN**0.5)
    wt = rng.standard_normal((V, HIDDEN), dtype=np.float32) * np.float32(4.0 / HIDDEN**0.5)
    return xs, ws, xt, wt, rng.integers(0, V, T)


def step_fn(impl, T, V, budget_mib=None):
    """fn() running one forward + backward of impl on the shape's inputs."""
    xs, ws, xt, wt, target = inputs(T, V)
    if impl == "jsdgpu":
        import jsdgpu
        budget = None if budget_mib is None else budget_mib << 20

        def fn():
            loss, ctx = jsdgpu.forward(xs, ws, xt, wt, target, memory_budget=budget)
            jsdgpu.backward(ctx)
        return fn
    import torch

    from plain_loss import torch_loss
    t = [torch.from_numpy(a) for a in (xs, ws, xt, wt)]
    t[0].requires_grad_(True)
    t[1].requires_grad_(True)
    target_t = torch.from_numpy(target)
    if impl == "jsdgpu_torch":  # (its default budget: the front end takes none)
        from jsdgpu.torch import fused_linear_jsd_loss as loss_fn
    else:
        loss_fn = torch.compile(torch_loss) if impl == "torch_compile" else torch_loss

    def fn():
        loss_fn(*t, target_t).backward()
        t[0].grad = t[1].grad = None
    return fn


def _status_kib(field):
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _large_blocks_mapped():
    """From here on, every block of 128 KiB or more that glibc's malloc gives is a mapping of its
    own, returned to the system when freed. glibc otherwise raises that threshold to the largest
    block freed, so that the timed steps' blocks came from its heap and stayed resident once freed:
    the measured step then reused them, and its peak beyond the resident memory before it read 0
    MiB (jsdgpu at T = 512, in two runs of three). And the heap's free memory goes back to the
    system (malloc_trim): what the warm-up steps freed there, or Numba's compilation of the kernels
    in a process with no cache, was still resident, and the step reused it (0 MiB again, at T =
    512, V = 32000 in every process with a cold cache; 68.5 MiB with the trim, as with a warm one)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)


def measure(impl, T, V, repeats, budget_mib=None):
    """(median seconds, peak MiB beyond the inputs, the untimed steps' seconds) of one
    implementation at one shape, in this process."""
    fn = step_fn(impl, T, V, budget_mib)
    warm = [_timed(fn) for _ in range(WARM_STEPS)]
    times = [_timed(fn) for _ in range(repeats)]
    _large_blocks_mapped()
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    fn()
    return statistics.median(times), (_status_kib("VmHWM") - before) / 1024, warm


def row_kernel_bandwidth(T, V, pairs=7):
    """({divergence: GB/s of the fused row kernel on one chunk of T rows}, {divergence: its share
    of the copy's bandwidth}, the copy's GB/s). The kernel as the backend calls it: its gradient
    written over the student's logits, which are restored (untimed) before each call; the teacher
    the student plus N(0, 1). Each kernel call is followed by a copy, and the share is the median
    of the pairs' ratios, the GB/s the best of each. These machines' bandwidth moves from minute to
    minute: a copy timed apart from the kernels (once, after them) read 44.7 and 35.3 GB/s in two
    runs minutes apart, which put the same kernels at 25-42% and 45-56% of it."""
    import numba

    from jsdgpu.cpu.online_work import CpuOnlineRows, CpuWork
    from jsdgpu.cpu.steps import row_buffer
    from jsdgpu.options import LossOptions

    @numba.njit(parallel=True)
    def copy(a, b):
        for i in numba.prange(a.shape[0]):
            b[i] = a[i]
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((T, V), dtype=np.float32) * 4
    s, t = row_buffer(T, V), row_buffer(T, V)  # (the backend's buffers)
    t[...] = logits + rng.standard_normal((T, V), dtype=np.float32)
    target = rng.integers(0, V, T).astype(np.int32)
    ce, jsd, terms = (np.empty(T, np.float32) for _ in range(3))
    work = CpuWork(None, None, None, None, s, t, fused=True)
    a = np.ones(2**28, np.float32)
    b = np.empty_like(a)
    rates, shares, copies = {}, {}, []
    for beta, name in ((0.0, "forward_kl"), (0.5, "jsd"), (1.0, "reverse_kl")):
        opts = LossOptions(beta=beta)
        kernel, copied = [], []
        for _ in range(pairs + 1):  # (the first pair: compilation, or Numba's cache)
            copy(logits, s)
            kernel.append(12 * s.size / _timed(lambda: CpuOnlineRows.fused_rows(work, target, opts, ce, jsd, s, terms)))
            copied.append(2 * a.nbytes / _timed(lambda: copy(a, b)))
        kernel, copied = np.array(kernel[1:]), np.array(copied[1:])
        rates[name], shares[name] = float(kernel.max() / 1e9), float(np.median(kernel / copied))
        copies += list(copied)
    return rates, shares, float(max(copies) / 1e9)


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=int, metavar="MIB", help="jsdgpu's memory_budget (default: the backend's)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", help="result file name (default: cpu_<cores>cores)")
    p.add_argument("--one", nargs=3, metavar=("IMPL", "T", "V"), help=argparse.SUPPRESS)  # a child process
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one[0], int(a.one[1]), int(a.one[2]), a.repeats, a.budget)))
        return
    cores = os.cpu_count()
    result = dict(cores=cores, date=time.strftime("%Y-%m-%d"), hidden=HIDDEN,
                  command="python bench/bench_cpu.py " + " ".join(argv or sys.argv[1:]), rows=[])
    name = a.name or f"cpu_{cores}cores"
    a.out.mkdir(parents=True, exist_ok=True)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for V in a.vocab:
        for T in a.tokens:
            row = dict(T=T, V=V, seconds={}, peak_mib={}, warm_seconds={})
            for impl in a.impls:
                # the plain loss holds about eight [T, V] float32 arrays at once
                if impl.startswith("torch") and 8 * 4 * T * V > 0.8 * total:
                    row["seconds"][impl] = row["peak_mib"][impl] = None
                    continue
                budget = [] if a.budget is None else ["--budget", str(a.budget)]
                out = subprocess.run([sys.executable, __file__, "--one", impl, str(T), str(V),
                                      "--repeats", str(a.repeats), *budget], capture_output=True, text=True)
                if out.returncode:
                    print(out.stderr[-2000:], file=sys.stderr)
                    row["seconds"][impl] = row["peak_mib"][impl] = None
                    continue
                row["seconds"][impl], row["peak_mib"][impl], row["warm_seconds"][impl] = json.loads(
                    out.stdout.splitlines()[-1])
                print(f"T={T} V={V} {impl}: {row['seconds'][impl]:.3f} s, {row['peak_mib'][impl]:.0f} MiB",
                      flush=True)
            result["rows"].append(row)
            (a.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    if "jsdgpu" in a.impls:
        result["row_kernel_gb_s"], result["row_kernel_share"], result["copy_gb_s"] = row_kernel_bandwidth(512, 32000)
    (a.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (a.out / f"{name}.md").write_text(render(result))
    print(render(result))


def render(result):
    lines = [f"`{result['command']}` ({result['cores']} cores, {result['date']}), forward + backward, float32, "
             f"hidden {result['hidden']} / {result['hidden']}; seconds a step (median), peak memory beyond the "
             "inputs.", "",
             "| T | V | jsdgpu s | jsdgpu through torch s | torch eager s | torch.compile s | jsdgpu ÷ compiled "
             "| through torch ÷ compiled | jsdgpu MiB | eager MiB | compiled MiB | jsdgpu ÷ compiled, memory |",
             "| --- " * 12 + "|"]
    for r in result["rows"]:
        s, m = r["seconds"], r["peak_mib"]

        def cell(d, k, f):
            return f.format(d[k]) if d.get(k) is not None else "—"

        def ratio(d, impl="jsdgpu"):
            return f"{d[impl] / d['torch_compile']:.2f}" if d.get(impl) and d.get("torch_compile") else "—"
        lines.append(f"| {r['T']} | {r['V']} | {cell(s, 'jsdgpu', '{:.3f}')} | {cell(s, 'jsdgpu_torch', '{:.3f}')} | "
                     f"{cell(s, 'torch_eager', '{:.3f}')} | {cell(s, 'torch_compile', '{:.3f}')} | {ratio(s)} | "
                     f"{ratio(s, 'jsdgpu_torch')} | {cell(m, 'jsdgpu', '{:.0f}')} | {cell(m, 'torch_eager', '{:.0f}')} "
                     f"| {cell(m, 'torch_compile', '{:.0f}')} | {ratio(m)} |")
    if "row_kernel_gb_s" in result:
        rates = ", ".join(f"{name.replace('_', ' ')} {gb_s:.1f} GB/s ({result['row_kernel_share'][name]:.0%})"
                          for name, gb_s in result["row_kernel_gb_s"].items())
        lines += ["", f"The fused row kernel alone (T = 512, V = 32000, its gradient over the student's logits, the "
                      f"teacher the student plus N(0, 1)), and in brackets its share of a parallel copy's bandwidth "
                      f"(each call paired with a copy, the median of the pairs; the copy's best "
                      f"{result['copy_gb_s']:.1f} GB/s): {rates}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
