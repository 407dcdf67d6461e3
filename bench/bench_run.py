"""jsdgpu on the inputs a distillation run feeds it, against the GEMM floor and Liger-Kernel.

    python bench/bench_run.py                   # both tables; writes bench/results/<device>_run.{json,md}
    python bench/bench_run.py --tokens 2048 --impls jsdgpu gemm_floor --out /tmp/r
    python bench/bench_run.py --no-run --tokens 2048 8192 --name h200_fresh   # the distributions, fresh
    # the history's effect with the products' choices shared (docs/design.md, "A run's inputs"):
    JSDGPU_GEMM_CACHE=/tmp/c.jsonl python bench/bench_run.py --tokens 2048 8192 --impls jsdgpu gemm_floor
    JSDGPU_GEMM_CACHE=/tmp/c.jsonl python bench/bench_run.py --no-run --tokens 2048 8192 --impls jsdgpu gemm_floor
    python bench/bench_run.py --vocab 151936 --name h200_qwen_vocab   # both vocabularies Qwen's

The benchmark's own inputs (bench.py: student and teacher drawn independently, every row's JSD
near its largest, a fresh process at one shape) are the easy case. Here, at the benchmark's
shapes (harness.py: V = 128256, hidden 2048 / 4096, bf16), forward + backward:

- Distributions, at each T: independent (logits of std 1 and of std 6), and a converging student:
  the teacher's hidden state is the student's with noise beside it ([x_s | x_n], W_t =
  [W_s | delta W_n], logits of std 4), so that its logits are the student's plus delta times
  independent ones; delta sets the mean row JSD (printed: about 0.3, 0.05 and 0.01 nats).
- The run: at each T, ten distinct steps in one process after calls at other shapes (T = 1000
  and 3000 with a quarter of the rows ignored: a run's first batches), the teacher's delta
  falling from step to step (mean row JSD from about 0.3 to 0.01 nats) and 0-40% of the rows
  ignored, other rows at every step. The ten steps are run in turn, again and again; each step's
  time is its median, and its floor the four products at its valid rows (the GEMM floor of the
  rows that count).

Implementations: jsdgpu (CuPy arrays), the floor, Liger-Kernel's LigerFusedLinearJSDLoss (its
defaults: compiled, chunks of 1024 rows) and jsdgpu through jsdgpu.torch's module in eager
PyTorch, on the same buffers (DLPack); on request (--impls), jsdgpu with one of the model
features (OPTIONAL: token weights, soft caps, each token's own loss), each in a table of its own
against jsdgpu without it, the two run in turns step by step (timed_cases). The distributions run
after the run, so they are measured
in a process that has seen other shapes; with --no-run they are measured in a fresh one (the
history's effect: the two runs' times of each distribution).

Times are CUDA-event medians after a second of warm-up (the GPU at its power cap). Each ratio
compares numbers of this one run.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

IMPLS = ["jsdgpu", "gemm_floor", "liger", "jsdgpu_torch"]  # jsdgpu_torch: jsdgpu.torch, eager
# jsdgpu with one of the model features, asked for by --impls: name -> what its table says
OPTIONAL = {"jsdgpu_weighted": "token weights (uniform in [0, 2), other ones each step)",
            "jsdgpu_softcap": "soft caps of 30 on both models' logits (Gemma's)",
            "jsdgpu_none": 'reduction="none" (each token\'s loss, backward with ones)'}
# name: (logit std, delta: None for an independent teacher)
DISTRIBUTIONS = {"independent, std 1": (1.0, None), "independent, std 6": (6.0, None),
                 "converging, JSD ~0.3": (4.0, 2.0), "converging, JSD ~0.05": (4.0, 0.7),
                 "converging, JSD ~0.01": (4.0, 0.3)}  # delta 2, 0.7, 0.3 at logit std 4
RUN_DELTAS = np.geomspace(2.0, 0.3, 10)  # the run's steps: mean row JSD about 0.3 down to 0.01
RUN_IGNORED = (0.0, 0.4, 0.1, 0.3, 0.2, 0.0, 0.35, 0.15, 0.25, 0.05)
HISTORY = ((1000, 0.25), (3000, 0.25))  # (T, ignored fraction) called before the run


def heads(cupy, std, seed):
    """(ws [V, Hs], wn [V, Ht - Hs]) in bf16, from hidden states of std 1: the student's logits of
    std `std`, the noise's of std 1 (so that delta is the std of the teacher's logits' noise)."""
    from harness import BF16, HS, HT, V
    rng = cupy.random.default_rng(seed)
    return ((rng.standard_normal((V, HS), dtype=np.float32) * (std / HS**0.5)).astype(BF16),
            (rng.standard_normal((V, HT - HS), dtype=np.float32) * (1.0 / (HT - HS)**0.5)).astype(BF16))


def step_inputs(cupy, T, ws, wn, delta, ignored, seed, ws_other=None):
    """One step's (xs, ws, xt, wt, target): xt = [xs | noise], wt = [ws | delta wn]; where delta
    is None an independent teacher: xt fresh, wt = [ws_other | wn]."""
    from harness import BF16, HS, HT, V
    rng = cupy.random.default_rng(seed)
    xs = rng.standard_normal((T, HS), dtype=np.float32).astype(BF16)
    noise = rng.standard_normal((T, HT - HS), dtype=np.float32).astype(BF16)
    if delta is None:
        xt = cupy.concatenate([rng.standard_normal((T, HS), dtype=np.float32).astype(BF16), noise], axis=1)
        wt = cupy.concatenate([ws_other, wn], axis=1)
    else:
        xt = cupy.concatenate([xs, noise], axis=1)
        wt = cupy.concatenate([ws, (wn.astype(np.float32) * delta).astype(BF16)], axis=1)
    host = np.random.default_rng(seed)
    target = host.integers(0, V, T)
    target[host.permutation(T)[: int(round(T * ignored))]] = -100
    return xs, ws, xt, wt, cupy.asarray(target)


def history_steps(cupy, ws, wn):
    """The inputs of the calls before the run (HISTORY), one step each."""
    return [step_inputs(cupy, T, ws, wn, 1.0, ignored, 7) for T, ignored in HISTORY]


def run_steps(cupy, T, ws, wn):
    """The run's ten steps at T, their inputs (step_inputs): the JSD falling (RUN_DELTAS), other
    rows ignored each step (RUN_IGNORED)."""
    return [step_inputs(cupy, T, ws, wn, float(d), ig, 100 * T + i)
            for i, (d, ig) in enumerate(zip(RUN_DELTAS, RUN_IGNORED))]


def implementation(name, step, mode="fwd_bwd"):
    """fn() running one forward + backward of `step` by the implementation; the floor at its
    valid rows."""
    import harness
    if name == "gemm_floor":
        xs, ws, xt, wt, target = step
        valid = target != -100
        step = (xs[valid], ws, xt[valid], wt, target[valid])
    if name in OPTIONAL:
        import cupy
        options = {"jsdgpu_softcap": dict(student_logit_softcap=30.0, teacher_logit_softcap=30.0),
                   "jsdgpu_none": dict(reduction="none")}.get(name)
        if options is None:  # jsdgpu_weighted
            rng = cupy.random.default_rng(len(step[0]))
            options = dict(token_weights=rng.uniform(0.0, 2.0, len(step[0]), dtype=np.float32))
        fn = harness.impl_jsdgpu([step], mode, **options)
        return lambda i=0: fn(0)
    fn = {"jsdgpu": harness.impl_jsdgpu, "gemm_floor": harness.impl_gemm_floor,
          "liger": harness.impl_liger, "jsdgpu_torch": harness.impl_jsdgpu_torch}[name]([step], mode)
    return lambda i=0: fn(0)


def soft_part(step):
    import jsdgpu
    return float(jsdgpu.forward(*step, compute_grad=False)[1].soft_loss)


def timed_turns(fns, repeats, warm_s):
    """Median ms of each fn, run in turns (fn 0, 1, ..., 0, 1, ...) repeats times after one turn
    and then warm_s of turns: a run's steps, one after another. The first turn is not of the
    warm_s: in a fresh process its one-time work (kernels loaded, products tuned) took most of
    a second with the GPU idle, and the steps timed after it met the GPU's clock falling to its
    power cap: the first distribution of a process whose products' choices came from disk took
    7.94-11.08 ms where the others took 9.1-9.4 (docs/design.md, "A run's inputs")."""
    import cupy
    for fn in fns:
        fn()
    cupy.cuda.Device().synchronize()
    until = time.perf_counter() + warm_s
    while time.perf_counter() < until:
        for fn in fns:
            fn()
        cupy.cuda.Device().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            t.append(cupy.cuda.get_elapsed_time(start, stop))
    return [statistics.median(t) for t in times]


def timed_cases(impls, steps, repeats, warm_s):
    """{implementation: median ms of each of the steps}, the steps run in turn (timed_turns). A
    feature of OPTIONAL runs in turns with jsdgpu without it, step by step, whose times are kept
    beside it as "<feature>/jsdgpu": the two meet the GPU's clocks and the products' state at the
    same moments, so that their ratio is the feature's own cost."""
    ms = {}
    for impl in impls:
        if impl in OPTIONAL:
            fns = [fn for s in steps for fn in (implementation("jsdgpu", s), implementation(impl, s))]
            times = timed_turns(fns, repeats, warm_s)
            ms[impl + "/jsdgpu"], ms[impl] = times[0::2], times[1::2]
        else:
            ms[impl] = timed_turns([implementation(impl, s) for s in steps], repeats, warm_s)
    return ms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    p.add_argument("--run-tokens", type=int, nargs="*", default=[1024, 4096, 8192])
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS + list(OPTIONAL))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warm-seconds", type=float, default=1.0)
    p.add_argument("--no-run", action="store_true",
                   help="the distributions alone, in a fresh process (no history, no run): the history's "
                        "effect is their times here against a default run's")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", help="result file name (default: the device's name, then _run)")
    p.add_argument("--vocab", type=int, help="both vocabularies, in place of harness.V (128256)")
    a = p.parse_args(argv)

    import cupy  # the GPU is needed from here on

    import harness
    if a.vocab:
        harness.V = a.vocab  # read by harness's and this file's functions as they run
    impls = [i for i in a.impls if i in OPTIONAL or harness.available(i)]
    name = a.name or harness.device_name() + "_run"
    result = dict(device=harness.device_name(), date=time.strftime("%Y-%m-%d"),
                  command="python bench/bench_run.py " + " ".join(argv or sys.argv[1:]), impls=impls,
                  vocab=harness.V, distributions=[], run=[])
    a.out.mkdir(parents=True, exist_ok=True)

    def save():
        (a.out / f"{name}.json").write_text(json.dumps(result, indent=1))

    # the run first: its history must be the process's first calls
    ws, wn = heads(cupy, 4.0, 1)
    for step in () if a.no_run else history_steps(cupy, ws, wn):
        harness.time_ms(implementation("jsdgpu", step), 1, 2, 3)
    for T in [] if a.no_run else a.run_tokens:
        steps = run_steps(cupy, T, ws, wn)
        ms = timed_cases(impls, steps, a.repeats, a.warm_seconds)
        record = dict(T=T, soft=[soft_part(s) for s in steps], ignored=list(RUN_IGNORED), ms=ms)
        result["run"].append(record)
        save()
        print(f"run T={T}: " + ", ".join(f"{impl} {sum(v):.2f} ms" for impl, v in ms.items()), flush=True)
        del steps
        cupy.get_default_memory_pool().free_all_blocks()

    for T in a.tokens:
        for dist, (std, delta) in DISTRIBUTIONS.items():
            ws, wn = heads(cupy, std, 2)
            step = step_inputs(cupy, T, ws, wn, delta, 0.0, 3, heads(cupy, std, 4)[0] if delta is None else None)
            ms = {impl: t[0] for impl, t in timed_cases(impls, [step], a.repeats, a.warm_seconds).items()}
            result["distributions"].append(dict(T=T, inputs=dist, soft=soft_part(step), ms=ms))
            save()
            print(f"T={T} {dist}: " + ", ".join(f"{impl} {v:.2f} ms" for impl, v in ms.items()), flush=True)
            del step
            cupy.get_default_memory_pool().free_all_blocks()
    (a.out / f"{name}.md").write_text(render(result))
    print(render(result))


def render(result):
    """The two tables of a result, as markdown."""
    lines = [f"`{result['command']}` ({result['device']}, {result['date']}), forward + backward, bf16, "
             f"V = {result.get('vocab', 128256)}, hidden 2048 / 4096.", "",
             "The run: ten steps in turn, the row JSD falling, 0-40% of the rows ignored, after calls at "
             "other shapes; the floor is the four products at each step's valid rows.", "",
             "| T a step | mean row JSD, first / last step | jsdgpu, ms for the ten | floor | × floor "
             "| Liger | Liger ÷ jsdgpu | torch eager | ÷ jsdgpu |", "| --- " * 9 + "|"]
    for r in result["run"]:
        ms = {k: sum(v) for k, v in r["ms"].items()}
        lines.append(_row([r["T"], f"{r['soft'][0]:.3f} / {r['soft'][-1]:.4f}"], ms))
    lines += ["", "Each input distribution alone (all rows valid):", "",
              "| T | inputs | mean row JSD | jsdgpu ms | floor | × floor | Liger | Liger ÷ jsdgpu "
              "| torch eager | ÷ jsdgpu |", "| --- " * 10 + "|"]
    for r in result["distributions"]:
        lines.append(_row([r["T"], r["inputs"], f"{r['soft']:.4f}"], r["ms"]))
    for impl in (i for i in result["impls"] if i in OPTIONAL):
        lines += ["", f"With {OPTIONAL[impl]} ({impl}), in turns with jsdgpu without it, step by step:", "",
                  "| case | jsdgpu ms | with it | ÷ jsdgpu |", "| --- " * 4 + "|"]
        for r in result["run"] + result["distributions"]:
            ms = {k: sum(v) if isinstance(v, list) else v for k, v in r["ms"].items()}
            case = f"run, T = {r['T']}" if "inputs" not in r else f"T = {r['T']}, {r['inputs']}"
            ours, other = ms.get(impl + "/jsdgpu"), ms.get(impl)
            if ours and other:
                lines.append(f"| {case} | {ours:.2f} | {other:.2f} | {other / ours:.3f} |")
    return "\n".join(lines) + "\n"


def _row(head, ms):
    ours, floor, liger, eager = (ms.get(k) for k in ("jsdgpu", "gemm_floor", "liger", "jsdgpu_torch"))
    cells = [f"{ours:.2f}" if ours else "", f"{floor:.2f}" if floor else "",
             f"{ours / floor:.3f}" if ours and floor else "", f"{liger:.2f}" if liger else "",
             f"{liger / ours:.2f}" if liger and ours else "", f"{eager:.2f}" if eager else "",
             f"{eager / ours:.3f}" if eager and ours else ""]
    return "| " + " | ".join(str(h) for h in head + cells) + " |"


if __name__ == "__main__":
    main()
