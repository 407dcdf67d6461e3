"""jsdgpu benchmark: the loss against the GEMM floor, Liger-Kernel and plain PyTorch.

    python bench/bench.py                 # T = 1024, 2048, 4096, 8192; writes bench/results/
    python bench/bench.py --tokens 1024 --impls jsdgpu gemm_floor --out /tmp/r
    python bench/bench.py --render bench/results/h200.json   # its table and plot again

Workload (DESIGN.md): V = 128256, teacher hidden 4096, student hidden 2048, bf16. Times are
medians of CUDA-event timings after warm-up, the inputs rotated over several sets so the L2
cache does not flatter anyone; peak memory is that of a separate, untimed run, beyond the inputs.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402

import jsdgpu  # noqa: E402

V, HS, HT = 128256, 2048, 4096
BF16 = ml_dtypes.bfloat16
ALL_IMPLS = ["jsdgpu", "gemm_floor", "liger", "torch"]


# ---- measuring ----

class PeakHook(cupy.cuda.MemoryHook):
    """Bytes of CuPy's pool in use, and their peak."""
    name = "PeakHook"

    def __init__(self):
        self.in_use = self.peak = 0

    def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
        self.in_use += mem_size
        self.peak = max(self.peak, self.in_use)

    def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
        self.in_use -= mem_size


def time_ms(fn, n_sets, warmup, repeats):
    """Median milliseconds of fn(i) over repeats, i rotating over n_sets input sets."""
    for i in range(warmup):
        fn(i % n_sets)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(repeats):
        start.record()
        fn(i % n_sets)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def peak_mib(fn, torch_too=False):
    """Peak device memory of one call of fn beyond what was allocated before it."""
    cupy.cuda.Device().synchronize()
    hook = PeakHook()
    if torch_too:
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with hook:
        fn(0)
        cupy.cuda.Device().synchronize()
    peak = hook.peak
    if torch_too:
        peak += torch.cuda.max_memory_allocated() - base
    return peak / 2**20


def copy_bandwidth():
    """Device-to-device copy, bytes read plus written per second."""
    a = cupy.ones(2**30, np.float32)
    b = cupy.empty_like(a)
    ms = time_ms(lambda i: cupy.copyto(b, a), 1, 3, 20)
    return 2 * a.nbytes / (ms * 1e-3)


# ---- inputs ----

def make_weights(n_sets, seed=0):
    """n_sets (ws, wt) pairs drawn on the GPU, shared by every T: logits of std about 4."""
    rng = cupy.random.default_rng(seed)
    return [((rng.standard_normal((V, HS), dtype=np.float32) * (4.0 / HS**0.5)).astype(BF16),
             (rng.standard_normal((V, HT), dtype=np.float32) * (4.0 / HT**0.5)).astype(BF16))
            for _ in range(n_sets)]


def make_sets(T, weights, rng, valid_fraction=1.0):
    """One input set per weight pair: [(xs, ws, xt, wt, target)]."""
    sets = []
    for ws, wt in weights:
        target = rng.integers(0, V, T)
        target[rng.permutation(T)[: int(round(T * (1 - valid_fraction)))]] = -100
        crng = cupy.random.default_rng(int(rng.integers(2**31)))
        sets.append((crng.standard_normal((T, HS), dtype=np.float32).astype(BF16), ws,
                     crng.standard_normal((T, HT), dtype=np.float32).astype(BF16), wt,
                     cupy.asarray(target)))
    return sets


# ---- implementations: each returns fn(i) running one step on input set i ----

def impl_jsdgpu(sets, mode, **options):
    def fn(i):
        loss, ctx = jsdgpu.forward(*sets[i], compute_grad=mode == "fwd_bwd", **options)
        if mode == "fwd_bwd":
            jsdgpu.backward(ctx)
    return fn


def impl_gemm_floor(sets, mode):
    """The four products at full size, bf16 in and out, through CuPy (cuBLAS)."""
    T = sets[0][0].shape[0]
    G = (cupy.random.standard_normal((T, V), dtype=np.float32) * 1e-3).astype(BF16)

    def fn(i):
        xs, ws, xt, wt, _ = sets[i]
        xs @ ws.T
        xt @ wt.T
        if mode == "fwd_bwd":
            G @ ws
            G.T @ xs
    return fn


def _torch_sets(sets, requires_grad):
    import torch
    out = []
    for xs, ws, xt, wt, target in sets:
        t = [torch.from_dlpack(a) for a in (xs, ws, xt, wt)]
        t[0] = t[0].detach().requires_grad_(requires_grad)
        t[1] = t[1].detach().requires_grad_(requires_grad)
        out.append((*t, torch.from_dlpack(target)))
    return out


def _torch_step(sets, mode, loss_fn):
    """fn(i): loss_fn on input set i as torch tensors, and its backward for fwd_bwd."""
    import torch
    tsets = _torch_sets(sets, True)

    def fn(i):
        xs, ws, xt, wt, target = tsets[i]
        with torch.set_grad_enabled(mode == "fwd_bwd"):
            loss = loss_fn(xs, ws, xt, wt, target)
            if mode == "fwd_bwd":
                loss.backward()
                xs.grad = ws.grad = None
    return fn


def impl_liger(sets, mode):
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    return _torch_step(sets, mode, LigerFusedLinearJSDLoss())  # compiled, chunk_size=1024: its defaults


def torch_loss(xs, ws, xt, wt, target, beta=0.5, ignore_index=-100):
    """SPEC.md's loss with full logits in plain PyTorch (default options)."""
    import torch
    s = (xs @ ws.T).float()
    t = (xt @ wt.T).float()
    valid = target != ignore_index
    n = valid.sum().clamp(min=1)
    ce = torch.nn.functional.cross_entropy(s, target, ignore_index=ignore_index, reduction="sum") / n
    logp, logq = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    logm = torch.logsumexp(torch.stack([logp + np.log(1 - beta), logq + np.log(beta)]), 0)
    jsd = beta * (logq.exp() * (logq - logm)).sum(-1) + (1 - beta) * (logp.exp() * (logp - logm)).sum(-1)
    return 0.5 * ce + 0.5 * (jsd * valid).sum() / n


def impl_torch(sets, mode):
    return _torch_step(sets, mode, torch_loss)


# ---- one chunk, stage by stage ----

def one_chunk(T, rng):
    """One all-valid chunk of T rows as the library runs it, its logits computed: (xs, ws, xt, wt,
    the int32 targets, the backend, its work dict). G has memory of its own (not the logits'), so
    the row kernel can run again and again on the same logits."""
    from jsdgpu._cupy_backend import CupyBackend
    xs, ws, xt, wt, target = make_sets(T, make_weights(1), rng)[0]
    be = CupyBackend()
    work = be.prepare(ws, wt, None, None, T, T, fused=True, own_g=True)
    be.logits(work, xs, xt)
    return xs, ws, xt, wt, target.astype(np.int32), be, work


# Launches of a row kernel before it is timed alone: after the products its clocks take a while
# to settle (session 9: 0.46 µs per row alone, 0.55-0.58 right after the logits products)
ROW_KERNEL_WARMUP = 20


def row_kernel_record(kernel, fn, T, bytes_per_logit, copy_bytes_per_s):
    """A row kernel's time alone over T rows, and its bandwidth: the bytes it must move (per
    logit of the student and teacher rows) over its time, and that against the copy bandwidth."""
    ms = time_ms(fn, 1, ROW_KERNEL_WARMUP, 20)
    rate = T * V * bytes_per_logit / (ms * 1e-3)
    return dict(kernel=kernel, T=T, ms=round(ms, 4), bytes_per_s=rate, fraction_of_copy=rate / copy_bytes_per_s)


def stage_breakdown(T, rng, copy_bytes_per_s, row_kernel_rows=(1024, 2048)):
    """Time each stage of one all-valid chunk of T rows; and the row kernels alone with their
    bandwidth: the fused one on chunks of each of row_kernel_rows (it must read the float32
    student and teacher logits once and write the bf16 gradient rows once: 10 bytes per logit),
    the vocab-parallel phases on T rows. The fused kernel is timed once per chunk size: the
    stage's time is its record's."""
    from jsdgpu._cupy_backend import _logits, launch_rows
    from jsdgpu._driver import Gradients, LossOptions
    opts = LossOptions(0.5, 0.5, 0.5, 1.0, -100)
    chunks = {rows: one_chunk(rows, rng) for rows in sorted({T, *row_kernel_rows})}

    def fused(rows):
        *_, tgt, _, work = chunks[rows]
        ce, jsd, terms = (cupy.empty(rows, np.float32) for _ in range(3))
        return row_kernel_record("fused", lambda i: launch_rows(work, rows, tgt, opts, ce, jsd, work["G"], terms),
                                 rows, 4 + 4 + 2, copy_bytes_per_s)
    fused_records = {rows: fused(rows) for rows in chunks}
    row_kernel = [fused_records[rows] for rows in row_kernel_rows]

    xs, ws, xt, wt, tgt, be, work = chunks[T]
    ce, jsd, terms = (cupy.empty(T, np.float32) for _ in range(3))
    G = work["G"]  # written by the fused kernel above (one_chunk's G is not the logits')
    grads = Gradients(cupy.empty((T, HS), np.float32), None, None)  # G held: grad_weight apart

    # the vocab-parallel path's three phase kernels on one GPU (no communicator): they read the
    # logits three times and write G once, 26 bytes per logit
    def phases(i):
        stats = be.row_stats(work, tgt, opts)
        kl = be.row_kl(work, tgt, stats, opts)
        be.row_finish(work, tgt, stats, kl, opts, ce, jsd, G, terms)
    row_kernel.append(row_kernel_record("phases", phases, T, 3 * 8 + 2, copy_bytes_per_s))

    def timed(fn):
        return round(time_ms(lambda i: fn(), 1, 3, 20), 4)
    times = {"student logits": timed(lambda: _logits(xs, ws, work["logits_s"][:T])),
             "teacher logits": timed(lambda: _logits(xt, wt, work["logits_t"][:T])),
             "row kernel": fused_records[T]["ms"],
             "grad_input (G @ Ws)": timed(lambda: be.grad_products(work, G, xs, 1.0 / T, grads, 0, T)),
             "backward: grad_weight (G.T @ Xs, bf16)": timed(lambda: be.weight_product(
                 G, V, xs, 1.0 / T, terms, tgt, None, BF16))}
    return times, row_kernel


# ---- the run ----

def device_name():
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    return name.replace("NVIDIA", "").strip().lower().replace(" ", "-")


def available(impl):
    if impl in ("jsdgpu", "gemm_floor"):
        return True
    try:
        import torch  # noqa: F401
        if impl == "liger":
            import liger_kernel  # noqa: F401
        return True
    except ImportError:
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--impls", nargs="+", default=ALL_IMPLS, choices=ALL_IMPLS)
    p.add_argument("--sets", type=int, default=2, help="input sets rotated between runs")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", help="result file name (default: the device's name)")
    p.add_argument("--budgets-gib", type=float, nargs="*", default=[0.25, 0.5, 1.0, 5.0],
                   help="memory_budget values (GiB) timed at the largest T beside the default")
    p.add_argument("--render", type=pathlib.Path, metavar="JSON",
                   help="time nothing: write the table and plot of a results file again, beside it")
    a = p.parse_args(argv)
    if a.render:
        render(a.render)
        return

    rng = np.random.default_rng(0)
    name = a.name or device_name()
    impls = [i for i in a.impls if available(i)]
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
        fn = {"jsdgpu": lambda: impl_jsdgpu(sets, mode, memory_budget=budget), "gemm_floor": lambda: impl_gemm_floor(sets, mode),
              "liger": lambda: impl_liger(sets, mode), "torch": lambda: impl_torch(sets, mode)}[impl]()
        torch_based = impl in ("liger", "torch")
        try:
            ms = time_ms(fn, a.sets, a.warmup, a.repeats)
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
    render(a.out / f"{name}.json")


def render(path):
    """The table (printed, and written beside the results file) and the plot of a results file."""
    result = json.loads(path.read_text())
    table = markdown_table(result)
    path.with_suffix(".md").write_text(table)
    plot(result, path.with_suffix(".png"))
    print(table)


# The speed issue's targets (forward + backward, default options, bf16): a ratio of two
# (impl, mode, valid fraction) timings at each T, its goal (per T where it differs), and whether a
# smaller or a larger ratio is better.
_DENSE, _FLOOR = ("jsdgpu", "fwd_bwd", 1.0), ("gemm_floor", "fwd_bwd", 1.0)
TARGETS = [("jsdgpu ÷ floor", _DENSE, _FLOOR, {}, 1.10, "≤"),
           ("Liger ÷ jsdgpu", ("liger", "fwd_bwd", 1.0), _DENSE, {1024: 2.0, 8192: 1.7}, None, "≥"),
           ("half ignored ÷ floor", ("jsdgpu", "fwd_bwd", 0.5), _FLOOR, {}, 0.60, "≤"),
           ("forward only ÷ floor", ("jsdgpu", "fwd", 1.0), _FLOOR, {}, 0.65, "≤")]
PEAK_GOAL_MIB = 4e9 / 2**20  # below 4 GB beyond the inputs at T = 8192
ROW_KERNEL_GOAL = 0.70  # of the copy bandwidth


def targets_table(result):
    """The issue's targets against this run's numbers: markdown lines."""
    records = {(r["impl"], r["mode"], r["valid_fraction"], r["T"]): r
               for r in result["records"] if "memory_budget" not in r}
    Ts = sorted({key[3] for key in records})

    def ratio(num, den, T):
        a, b = records.get((*num, T)), records.get((*den, T))
        return a["ms"] / b["ms"] if a and b else None

    lines = ["| target | goal | " + " | ".join(f"T = {T}" for T in Ts) + " | met at |",
             "| --- | --- | " + "--- | " * len(Ts) + "--- |"]
    for name, num, den, goal_at, goal, sign in TARGETS:
        goals = {T: goal_at.get(T, goal) for T in Ts}
        values = {T: ratio(num, den, T) for T in Ts}
        met = [T for T in Ts if goals[T] is not None and values[T] is not None
               and (values[T] <= goals[T] if sign == "≤" else values[T] >= goals[T])]
        asked = [T for T in Ts if goals[T] is not None]
        goal_text = (", ".join(f"{sign} {g:.2f} at {T}" for T, g in goal_at.items()) if goal_at
                     else f"{sign} {goal:.2f}")
        cells = " | ".join("" if values[T] is None else f"{values[T]:.3f}" for T in Ts)
        measured = [T for T in asked if values[T] is not None]
        met_text = ("not measured" if not measured else "all" if met == asked
                    else ", ".join(map(str, met)) or "none")
        lines.append(f"| {name} | {goal_text} | {cells} | {met_text} |")
    peak = records.get((*_DENSE, 8192))
    # the fused kernel on the largest chunk measured (the chunk of T = 2048 to 8192)
    fused = sorted((r["T"], r["fraction_of_copy"]) for r in result.get("row_kernel", []) if r["kernel"] == "fused")
    if peak:
        mib = peak["peak_mib"]
        lines.append(f"| peak MiB at T = 8192 | < {PEAK_GOAL_MIB:.0f} (4 GB) | {mib:.0f} | "
                     + "| " * (len(Ts) - 1) + f"{'yes' if mib < PEAK_GOAL_MIB else 'no'} |")
    if fused:
        rows, fraction = fused[-1]
        lines.append(f"| row kernel on {rows} rows, of copy bandwidth | ≥ {ROW_KERNEL_GOAL:.0%} | {fraction:.0%} | "
                     + "| " * (len(Ts) - 1) + f"{'yes' if fraction >= ROW_KERNEL_GOAL else 'no'} |")
    return lines


def markdown_table(result):
    recs = result["records"]
    floor = {(r["T"], r["mode"]): r["ms"] for r in recs if r["impl"] == "gemm_floor"}
    lines = [f"Device {result['device']}, {result['date']}; V={result['V']}, Hs={result['Hs']}, "
             f"Ht={result['Ht']}, bf16. `{result['command']}`", "",
             "| impl | T | mode | valid rows | memory_budget | ms | × floor (fwd+bwd) | × floor of its mode | peak MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ratio = lambda ms, f: f"{ms / f:.3f}" if f else ""
    for r in recs:
        dense, same = floor.get((r["T"], "fwd_bwd")), floor.get((r["T"], r["mode"]))
        budget = f"{r['memory_budget'] / 2**30:g} GiB" if "memory_budget" in r else "default"
        lines.append(f"| {r['impl']} | {r['T']} | {r['mode']} | {r['valid_fraction']:.0%} | {budget} | "
                     f"{r['ms']:.2f} | {ratio(r['ms'], dense)} | {ratio(r['ms'], same)} | "
                     f"{r['peak_mib']:.0f} |")
    lines += ["", "The speed issue's targets (forward + backward, default options):", ""]
    lines += targets_table(result)
    lines += ["", "One chunk of T = 1024 rows, stage by stage:", "", "| stage | ms |", "| --- | --- |"]
    lines += [f"| {name} | {ms:.3f} |" for name, ms in result["stages_T1024"].items()]
    lines += ["", f"Copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s. Row kernel alone "
              "(fused: reads 8 B, writes 2 B per logit; the vocab-parallel phases: 26 B):", "",
              "| kernel | rows | ms | TB/s | of copy bandwidth |", "| --- | --- | --- | --- | --- |"]
    for r in result["row_kernel"]:
        lines.append(f"| {r['kernel']} | {r['T']} | {r['ms']:.3f} | {r['bytes_per_s'] / 1e12:.2f} | "
                     f"{r['fraction_of_copy']:.0%} |")
    return "\n".join(lines) + "\n"


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in result["records"]:
        if "memory_budget" in r:
            continue
        label = r["impl"] + ("" if r["mode"] == "fwd_bwd" else " fwd") + \
            ("" if r["valid_fraction"] == 1.0 else f" {r['valid_fraction']:.0%} valid")
        series.setdefault(label, []).append((r["T"], r["ms"]))
    for label, pts in series.items():
        pts.sort()
        style = dict(color="black", linestyle="--") if label == "gemm_floor" else dict(marker="o")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"fused linear JSD loss, V={result['V']}, bf16, {result['device']}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
