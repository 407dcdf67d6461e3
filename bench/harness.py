"""The benchmark's harness: its workload, timing and peak memory, and the implementations it
times, each as fn(i) running one step on input set i (bench.py runs them; bench_vocab_parallel.py
too). Needs a GPU and CuPy.

Workload (docs/design.md, "The benchmark"): V = 128256, teacher hidden 4096, student hidden 2048,
bf16. Times are medians of CUDA-event timings after warm-up (by the benchmarks, a second of the
workload: the GPU at its power cap), the inputs rotated over several sets so the L2 cache does
not flatter anyone; peak memory is that of a separate, untimed run, beyond the inputs.
"""

import statistics
import time

import cupy
import ml_dtypes
import numpy as np

import jsdgpu
from jsdgpu.backend import Gradients
from jsdgpu.cuda import products
from jsdgpu.cuda.backend import CudaBackend
from plain_loss import torch_loss

V, HS, HT = 128256, 2048, 4096
BF16 = ml_dtypes.bfloat16

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


def time_ms(fn, n_sets, warmup, repeats, warm_s=0.0):
    """Median milliseconds of fn(i) over repeats, i rotating over n_sets input sets, after warmup
    calls and then more, each waited for, until warm_s seconds have passed. A GPU kept busy runs
    at its power cap, its SM clock lowered (an H200 from 1980 MHz to about 1450 under these
    products), and a training step runs there; timed from an idle GPU, the first hundreds of
    milliseconds run at the full clock (docs/design.md, "The benchmark")."""
    for i in range(warmup):
        fn(i % n_sets)
    until, i = time.perf_counter() + warm_s, 0
    while time.perf_counter() < until:
        fn(i % n_sets)
        cupy.cuda.Device().synchronize()
        i += 1
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

def impl_jsdgpu(sets, mode, lib=jsdgpu, **options):
    """lib: the package (another copy of it: experiments/design_bound.py)."""
    def fn(i):
        loss, ctx = lib.forward(*sets[i], compute_grad=mode == "fwd_bwd", **options)
        if mode == "fwd_bwd":
            lib.backward(ctx)
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


def impl_jsdgpu_torch(sets, mode, compiled=False):
    """jsdgpu through its PyTorch module (eager, or torch.compile(fullgraph=True))."""
    import torch

    import jsdgpu.torch as jtorch
    loss_fn = jtorch.FusedLinearJSDLoss()
    return _torch_step(sets, mode, torch.compile(loss_fn, fullgraph=True) if compiled else loss_fn)


def impl_jsdgpu_jax(sets, mode):
    """jsdgpu through its JAX front end under jax.jit (value_and_grad for fwd_bwd), on the same
    buffers (zero-copy); each call waits for XLA's stream, so its time is the step's wall time."""
    import os
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the loss's memory is CuPy's
    import jax
    import jax.numpy as jnp

    from jsdgpu.jax import fused_linear_jsd_loss
    jsets = [tuple(jnp.from_dlpack(a) for a in s) for s in sets]
    f = jax.jit(jax.value_and_grad(fused_linear_jsd_loss, argnums=(0, 1)) if mode == "fwd_bwd"
                else fused_linear_jsd_loss)

    def fn(i):
        jax.block_until_ready(f(*jsets[i]))
    return fn


def impl_liger(sets, mode):
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    return _torch_step(sets, mode, LigerFusedLinearJSDLoss())  # compiled, chunk_size=1024: its defaults


def impl_torch(sets, mode):
    return _torch_step(sets, mode, torch_loss)


# ---- one chunk, stage by stage ----

def one_chunk(T, rng):
    """One all-valid chunk of T rows as the library runs it, its logits computed: (xs, ws, xt, wt,
    the int32 targets, the backend, its CudaWork, G). G has memory of its own (not the logits'),
    so the row kernel can run again and again on the same logits."""
    xs, ws, xt, wt, target = make_sets(T, make_weights(1), rng)[0]
    be = CudaBackend()
    work = be.prepare(ws, wt, None, None, T, fused=True)
    be.logits(work, xs, xt)
    return xs, ws, xt, wt, target.astype(np.int32), be, work, be.gradient_rows(work, T, own_g=True)


# Launches of a row kernel before it is timed alone: after the products its clocks take a while
# to settle (0.46 µs per row alone, 0.55-0.58 right after the logits products: docs/record.md)
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
    opts = jsdgpu.LossOptions()
    chunks = {rows: one_chunk(rows, rng) for rows in sorted({T, *row_kernel_rows})}

    def fused(rows):
        *_, tgt, be, work, G = chunks[rows]
        ce, jsd, terms = (cupy.empty(rows, np.float32) for _ in range(3))
        return row_kernel_record("fused", lambda i: CudaBackend.fused_rows(work, tgt, opts, ce, jsd, G, terms),
                                 rows, 4 + 4 + 2, copy_bytes_per_s)
    fused_records = {rows: fused(rows) for rows in chunks}
    row_kernel = [fused_records[rows] for rows in row_kernel_rows]

    xs, ws, xt, wt, tgt, be, work, G = chunks[T]
    ce, jsd, terms = (cupy.empty(T, np.float32) for _ in range(3))
    # G: written by the fused kernel above (one_chunk's G is not the logits')
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
    times = {"student logits": timed(lambda: products.logits(xs, ws, work.logits_s[:T])),
             "teacher logits": timed(lambda: products.logits(xt, wt, work.logits_t[:T])),
             "row kernel": fused_records[T]["ms"],
             "grad_input (G @ Ws)": timed(lambda: be.grad_products(work, G, xs, 1.0 / T, grads, 0, T)),
             "backward: grad_weight (G.T @ Xs, bf16)": timed(lambda: be.weight_product(
                 be.hold_g(work, G, xs, 1.0 / T, terms, tgt), None, BF16))}
    return times, row_kernel


def device_name():
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    return name.replace("NVIDIA", "").strip().lower().replace(" ", "-")


def available(impl):
    if impl in ("jsdgpu", "gemm_floor"):
        return True
    try:
        if impl == "jsdgpu_jax":
            import jax  # noqa: F401
            return True
        import torch  # noqa: F401
        if impl == "liger":
            import liger_kernel  # noqa: F401
        return True
    except ImportError:
        return False
