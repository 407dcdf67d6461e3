"""The benchmark's report: the table and plot of a results file (bench.py writes and renders
them), against the speed targets. Needs no GPU: `python bench/bench.py --render FILE` redraws them.
"""

import json


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
