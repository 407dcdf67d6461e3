"""python -m jsdgpu: one forward and backward on random inputs of a realistic shape, checked
against the float64 reference on a slice of rows, with the time and the peak memory."""

import argparse
import resource
import sys
import time

import ml_dtypes
import numpy as np

import jsdgpu
from jsdgpu.checks import gpu_available
from jsdgpu.options import DEFAULTS

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def parse_args(argv):
    gpu = gpu_available()
    p = argparse.ArgumentParser(
        prog="python -m jsdgpu", description=__doc__,
        epilog="Defaults: on a GPU the benchmark workload (T=1024, V=128256, teacher hidden 4096, "
               "student hidden 2048, bfloat16); on the CPU a small one.")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    p.add_argument("--tokens", "-T", type=int, help="token rows T")
    p.add_argument("--vocab", type=int, help="student vocabulary Vs")
    p.add_argument("--teacher-vocab", type=int, help="teacher vocabulary Vt (default Vs)")
    p.add_argument("--student-hidden", type=int)
    p.add_argument("--teacher-hidden", type=int)
    p.add_argument("--dtype", choices=list(DTYPES))
    p.add_argument("--logit-std", type=float, default=4.0, help="scale of the random logits")
    p.add_argument("--ignored", type=float, default=0.0, help="fraction of rows ignored")
    p.add_argument("--bias", action="store_true", help="add random biases to both heads")
    p.add_argument("--beta", type=float, default=DEFAULTS.beta)
    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    p.add_argument("--weight-hard-loss", type=float, default=DEFAULTS.weight_hard_loss)
    p.add_argument("--weight-soft-loss", type=float, default=DEFAULTS.weight_soft_loss)
    p.add_argument("--chunk-size", type=int)
    p.add_argument("--check-rows", type=int, default=16, help="rows checked against float64")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.device = ("gpu" if gpu else "cpu") if a.device == "auto" else a.device
    if a.device == "gpu" and not gpu:
        p.error("--device gpu: no CUDA GPU is available")
    big = a.device == "gpu"
    a.tokens = a.tokens or (1024 if big else 256)
    a.vocab = a.vocab or (128256 if big else 32000)
    a.teacher_vocab = a.teacher_vocab or a.vocab
    a.student_hidden = a.student_hidden or (2048 if big else 256)
    a.teacher_hidden = a.teacher_hidden or (4096 if big else 512)
    a.dtype = a.dtype or ("bfloat16" if big else "float32")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    rng = np.random.default_rng(a.seed)
    dtype = DTYPES[a.dtype]
    T, vs, vt, hs, ht = a.tokens, a.vocab, a.teacher_vocab, a.student_hidden, a.teacher_hidden

    def arr(shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    inputs = dict(student_input=arr((T, hs), 1.0), student_weight=arr((vs, hs), a.logit_std / hs**0.5),
                  teacher_input=arr((T, ht), 1.0), teacher_weight=arr((vt, ht), a.logit_std / ht**0.5),
                  target=np.where(rng.random(T) < a.ignored, -100, rng.integers(0, vs, T)),
                  student_bias=arr(vs, 0.5) if a.bias else None,
                  teacher_bias=arr(vt, 0.5) if a.bias else None)
    options = dict(beta=a.beta, temperature=a.temperature, weight_hard_loss=a.weight_hard_loss,
                   weight_soft_loss=a.weight_soft_loss)
    print(f"jsdgpu {jsdgpu.__version__} on the {a.device.upper()}: T={T} Vs={vs} Vt={vt} "
          f"Hs={hs} Ht={ht} {a.dtype}, {options}")

    if a.device == "gpu":
        import cupy
        xp_inputs = {k: None if v is None else cupy.asarray(v) for k, v in inputs.items()}
        sync = cupy.cuda.get_current_stream().synchronize
        pool = cupy.get_default_memory_pool()
        base = pool.used_bytes()
    else:
        xp_inputs, sync = inputs, lambda: None

    def step():
        loss, ctx = jsdgpu.forward(**xp_inputs, chunk_size=a.chunk_size, **options)
        return loss, ctx, jsdgpu.backward(ctx)

    step()  # warm-up: kernel compilation (NVRTC or Numba) and cuBLAS handles
    sync()
    if a.device == "gpu":
        # the pool never gives memory back by itself: emptied here, what it holds after the
        # step is the step's peak
        pool.free_all_blocks()
    t0 = time.perf_counter()
    loss, ctx, (gi, gw, gb) = step()
    sync()
    ms = 1e3 * (time.perf_counter() - t0)

    host = (lambda x: x.get()) if a.device == "gpu" else (lambda x: x)
    print(f"loss {float(loss):.6f}  (hard {float(ctx.hard_loss):.6f}, soft {float(ctx.soft_loss):.6f})")
    print(f"forward + backward: {ms:.2f} ms")
    if a.device == "gpu":
        print(f"peak GPU memory: {(pool.total_bytes() - base) / 2**20:.0f} MiB beyond the inputs' "
              f"{base / 2**20:.0f} MiB")
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak resident memory of this process: {rss:.0f} MiB")

    # check a slice of rows against the float64 reference: per-row results need only N
    rows = np.sort(rng.choice(T, size=min(a.check_rows, T), replace=False))
    target = inputs["target"]
    sub = dict(inputs, student_input=inputs["student_input"][rows],
               teacher_input=inputs["teacher_input"][rows], target=target[rows])
    ref = jsdgpu.reference(**sub, **options)
    n_all, n_sub = max(1, int((target != -100).sum())), max(1, int((target[rows] != -100).sum()))
    got = host(gi)[rows].astype(np.float64) * (n_all / n_sub)
    err = np.linalg.norm(got - ref[3]) / max(np.linalg.norm(ref[3]), 1e-30)
    print(f"grad_input on {len(rows)} rows against float64: relative error {err:.2e}")
    ok = err <= (1e-4 if dtype == np.float32 else 2.0**-7)
    print("check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
