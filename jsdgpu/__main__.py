"""python -m jsdgpu: one forward and backward on random inputs of a realistic shape, checked
against the float64 reference on a slice of rows, with the time and the peak memory. What it is
doing (building inputs, the first call's compiling and tuning) goes to stderr."""

import argparse
import resource
import sys
import time

import ml_dtypes
import numpy as np

import jsdgpu
from jsdgpu.checks import gpu_available
from jsdgpu.options import DEFAULTS, LossOptions, RunOptions

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
# (GPU, CPU) defaults of the shape: on a GPU the benchmark workload, on the CPU a small one
SHAPE_DEFAULTS = {"tokens": (1024, 256), "vocab": (128256, 32000), "student_hidden": (2048, 256),
                  "teacher_hidden": (4096, 512), "dtype": ("bfloat16", "float32")}
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def _bytes(text):
    """A byte count, with an optional K, M or G (binary) suffix: 512M, 2.5G, 1048576."""
    unit = text[-1:].lower() if text[-1:].lower() in "kmg" else ""
    try:
        return int(float(text[:len(text) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 512M, 2.5G)") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, as argparse's without its usage block; exit status 2."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def parse_args(argv):
    gpu = gpu_available()
    p = _Parser(
        prog="python -m jsdgpu", description=__doc__,
        epilog="Shape defaults are the GPU's / the CPU's: on a GPU the benchmark workload, on the CPU "
               "a small one.")

    def shape(flag, key, text, **kw):
        g, c = SHAPE_DEFAULTS[key]
        p.add_argument(flag, *kw.pop("aliases", ()), help=f"{text} (default {g} / {c})", **kw)

    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                   help="where to run; auto: the GPU where CuPy sees one (default auto)")
    shape("--tokens", "tokens", "token rows T; 0 gives loss 0", type=int, aliases=("-T",))
    shape("--vocab", "vocab", "student vocabulary Vs", type=int)
    p.add_argument("--teacher-vocab", type=int, help="teacher vocabulary Vt >= Vs (default Vs)")
    shape("--student-hidden", "student_hidden", "student hidden size Hs", type=int)
    shape("--teacher-hidden", "teacher_hidden", "teacher hidden size Ht", type=int)
    shape("--dtype", "dtype", "inputs' dtype", choices=list(DTYPES))
    p.add_argument("--logit-std", type=float, default=4.0, help="std of the random logits (default 4.0)")
    p.add_argument("--ignored", type=float, default=0.0, help="fraction of rows ignored, in [0, 1] (default 0)")
    p.add_argument("--bias", action="store_true", help="add random biases to both heads")
    p.add_argument("--beta", type=float, default=DEFAULTS.beta,
                   help=f"in [0, 1]; 0 forward KL, 1 reverse KL (default {DEFAULTS.beta})")
    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature,
                   help=f"> 0, of the soft part (default {DEFAULTS.temperature})")
    p.add_argument("--weight-hard-loss", type=float, default=DEFAULTS.weight_hard_loss,
                   help=f"(default {DEFAULTS.weight_hard_loss})")
    p.add_argument("--weight-soft-loss", type=float, default=DEFAULTS.weight_soft_loss,
                   help=f"(default {DEFAULTS.weight_soft_loss})")
    p.add_argument("--chunk-size", type=int, help="token rows per chunk (default: by the memory budget)")
    p.add_argument("--memory-budget", type=_bytes,
                   help="bytes of working buffers, e.g. 512M or 2.5G (default 2.5G on the GPU, 256M on the CPU)")
    p.add_argument("--check-rows", type=int, default=16, help="rows checked against float64 (default 16)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    a = p.parse_args(argv)
    a.device = ("gpu" if gpu else "cpu") if a.device == "auto" else a.device
    if a.device == "gpu" and not gpu:
        p.error("--device gpu: no CUDA GPU is available")
    column = 0 if a.device == "gpu" else 1
    for key, defaults in SHAPE_DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, defaults[column])
    a.teacher_vocab = a.vocab if a.teacher_vocab is None else a.teacher_vocab
    for flag, value, least in (("--tokens", a.tokens, 0), ("--vocab", a.vocab, 1),
                               ("--student-hidden", a.student_hidden, 1), ("--teacher-hidden", a.teacher_hidden, 1),
                               ("--check-rows", a.check_rows, 0)):
        if value < least:
            p.error(f"{flag} must be at least {least}, got {value}")
    if a.teacher_vocab < a.vocab:
        p.error(f"--teacher-vocab must be at least --vocab ({a.vocab}), got {a.teacher_vocab}")
    if not 0.0 <= a.ignored <= 1.0:
        p.error(f"--ignored must be in [0, 1], got {a.ignored}")
    if not (a.logit_std > 0.0 and np.isfinite(a.logit_std)):
        p.error(f"--logit-std must be finite and > 0, got {a.logit_std}")
    # the library's own checks, with its own messages
    for flag, build in (("--beta", lambda: LossOptions(beta=a.beta)),
                        ("--temperature", lambda: LossOptions(temperature=a.temperature)),
                        ("--weight-hard-loss", lambda: LossOptions(weight_hard_loss=a.weight_hard_loss)),
                        ("--weight-soft-loss", lambda: LossOptions(weight_soft_loss=a.weight_soft_loss)),
                        ("--chunk-size", lambda: RunOptions(chunk_size=a.chunk_size)),
                        ("--memory-budget", lambda: RunOptions(memory_budget=a.memory_budget))):
        try:
            build()
        except (TypeError, ValueError) as e:
            p.error(f"{flag}: {e}")
    return a


def say(text, start=None):
    """What the run is doing, on stderr (with the seconds since start, where given)."""
    took = "" if start is None else f" ({time.perf_counter() - start:.1f} s)"
    print(f"[jsdgpu] {text}{took}", file=sys.stderr, flush=True)


def make_inputs(a, xp):
    """The random inputs, made where they are used (on the GPU by CuPy's generator)."""
    rng = xp.random.default_rng(a.seed)
    dtype = DTYPES[a.dtype]

    def arr(shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dtype)

    T, vs, vt, hs, ht = a.tokens, a.vocab, a.teacher_vocab, a.student_hidden, a.teacher_hidden
    target = rng.integers(0, vs, T)
    target[rng.random(T) < a.ignored] = -100
    return dict(student_input=arr((T, hs), 1.0), student_weight=arr((vs, hs), a.logit_std / hs**0.5),
                teacher_input=arr((T, ht), 1.0), teacher_weight=arr((vt, ht), a.logit_std / ht**0.5),
                target=target, student_bias=arr(vs, 0.5) if a.bias else None,
                teacher_bias=arr(vt, 0.5) if a.bias else None)


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    options = dict(beta=a.beta, temperature=a.temperature, weight_hard_loss=a.weight_hard_loss,
                   weight_soft_loss=a.weight_soft_loss)
    T = a.tokens
    print(f"jsdgpu {jsdgpu.__version__} on the {a.device.upper()}: T={T} Vs={a.vocab} Vt={a.teacher_vocab} "
          f"Hs={a.student_hidden} Ht={a.teacher_hidden} {a.dtype}, {options}")
    if a.device == "gpu":
        import cupy as xp
        sync = xp.cuda.get_current_stream().synchronize
        pool = xp.get_default_memory_pool()
    else:
        xp, sync = np, (lambda: None)

    say(f"building the inputs on the {a.device.upper()}")
    inputs = make_inputs(a, xp)
    sync()
    base = pool.used_bytes() if a.device == "gpu" else 0
    run = dict(chunk_size=a.chunk_size, memory_budget=a.memory_budget)

    def step():
        loss, ctx = jsdgpu.forward(**inputs, **run, **options)
        return loss, ctx, jsdgpu.backward(ctx)

    start = time.perf_counter()
    say("first call: " + ("compiling the CUDA kernels (NVRTC, once per process) and timing the products' "
                          "algorithms (once per shape class)" if a.device == "gpu" else
                          "compiling the row kernels (Numba, cached on disk after the first run)"))
    step()
    sync()
    say("first call done", start)
    if a.device == "gpu":
        # the pool never gives memory back by itself: emptied here, what it holds after the
        # step is the step's peak
        pool.free_all_blocks()
    say("timed call")
    t0 = time.perf_counter()
    loss, ctx, (gi, gw, gb) = step()
    sync()
    ms = 1e3 * (time.perf_counter() - t0)

    print(f"loss {float(loss):.6f}  (hard {float(ctx.hard_loss):.6f}, soft {float(ctx.soft_loss):.6f})")
    print(f"forward + backward: {ms:.2f} ms")
    if a.device == "gpu":
        print(f"peak GPU memory: {(pool.total_bytes() - base) / 2**20:.0f} MiB beyond the inputs' "
              f"{base / 2**20:.0f} MiB")
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak resident memory of this process: {rss:.0f} MiB")
    if T == 0 or a.check_rows == 0:
        return 0

    # a slice of rows against the float64 reference, computed where the inputs are: per-row
    # results need only N
    say(f"checking {min(a.check_rows, T)} rows against float64")
    rows = np.sort(np.random.default_rng(a.seed).choice(T, size=min(a.check_rows, T), replace=False))
    target = inputs["target"]
    sub = dict(inputs, student_input=inputs["student_input"][rows], teacher_input=inputs["teacher_input"][rows],
               target=target[rows])
    ref = jsdgpu.reference(**sub, **options)
    n_all, n_sub = max(1, int((target != -100).sum())), max(1, int((target[rows] != -100).sum()))
    got = gi[rows].astype(np.float64) * (n_all / n_sub)
    err = float(xp.linalg.norm(got - ref[3]) / max(float(xp.linalg.norm(ref[3])), 1e-30))
    print(f"grad_input on {len(rows)} rows against float64: relative error {err:.2e}")
    ok = err <= (1e-4 if DTYPES[a.dtype] == np.float32 else 2.0**-7)
    print("check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
