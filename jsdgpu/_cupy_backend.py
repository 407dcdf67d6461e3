"""GPU backend: cuBLAS products with float32 logits through CuPy, and the fused row kernel of
rows.cu. Everything is queued on CuPy's current stream; nothing in the chunk loop waits for the
GPU, but the first product of each shape class in a process, which times cuBLASLt's candidate
algorithms (_cublaslt)."""

import ctypes
import functools
import pathlib
import threading

import cupy
import ml_dtypes
import numpy as np
from cupy.cuda import driver
from cupy_backends.cuda.libs import cublas

from . import _checks, _cublaslt

# cudaDataType and cuBLAS constants
_CUDA_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float16): 2, np.dtype(ml_dtypes.bfloat16): 14}
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_N, _T = 0, 1
_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15
_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING = 2

_KERNEL_FORMAT = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
                  np.dtype(ml_dtypes.bfloat16): "bf16"}
# The fused row kernel's shape, as rows.cu defines jsd_rows_<format>: CTAs per cluster (one
# cluster per row), threads per CTA, and float4 groups of columns per thread (held in registers).
_CLUSTER, _THREADS, _GROUPS = 16, 512, 4
FUSED_MAX_VOCAB = _CLUSTER * _THREADS * _GROUPS * 4  # 131072 columns; wider rows take the phases
_SELECT_THREADS = 1024  # rows.cu's SELECT_THREADS


def _leading_dim(n):
    """Row pitch in elements: a multiple of 32, so every row starts 128-byte aligned."""
    return -(-n // 32) * 32


@functools.lru_cache(maxsize=None)
def _sm_count(device_id):
    # one attribute, once: Device().attributes queries every attribute on each call
    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


@functools.lru_cache(maxsize=None)
def _module(device_id, options=("-std=c++17",)):
    source = (pathlib.Path(__file__).with_name("rows.cu")).read_text()
    return cupy.RawModule(code=source, options=options)


def _function(name):
    """A kernel of rows.cu, for the current device."""
    return _device_function(cupy.cuda.Device().id, name)


@functools.lru_cache(maxsize=None)
def _device_function(device_id, name):
    return _module(device_id).get_function(name)


_per_thread = threading.local()


def _select_out(device_id):
    """(view, address) of select_rows's two results (the count and the first bad row): 8 bytes
    of page-locked host memory, which the kernel writes straight into (with unified addressing,
    CUDA maps it into the devices' address space at the same address). One per thread and
    device, allocated once (an allocation a call took tens of µs inside a step): select_rows
    waits for the kernel and reads them before it returns."""
    buffers = getattr(_per_thread, "select_out", None)
    if buffers is None:
        buffers = _per_thread.select_out = {}
    if device_id not in buffers:
        view = np.frombuffer(cupy.cuda.alloc_pinned_memory(8), np.int32, 2)  # keeps it alive
        buffers[device_id] = view, np.uint64(view.ctypes.data)
    return buffers[device_id]


class _LaunchConfig(ctypes.Structure):
    """The driver API's CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def fused_kernel(device_id, name, cluster, threads, groups, options=("-std=c++17",)):
    """A fused row kernel of rows.cu, as (function, dynamic shared-memory bytes, how many of its
    clusters fit the GPU at once: the grid it is launched with, at most)."""
    func = _module(device_id, options).get_function(name)
    if cluster > 8:  # beyond the portable cluster size: allowed on Hopper, asked for explicitly
        driver.funcSetAttribute(func.kernel.ptr, _FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    # By default the H200 fits 14 clusters of 16 CTAs (each on 16 SMs, two clusters' CTAs per
    # SM: 116 SMs in use); load balancing lets one more in, on 8 SMs of its own. That one runs
    # slower, and the kernel hands out rows as they are asked for, so it takes fewer:
    # -10% time per row at 2048 rows (bench/NOTES.md).
    driver.funcSetAttribute(func.kernel.ptr, _FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                            _CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING)
    smem = 2 * groups * threads * 16  # the next row's columns: a float4 per group, s and t
    func.max_dynamic_shared_size_bytes = smem
    config = _LaunchConfig((cluster, 1, 1), (threads, 1, 1), smem, None, None, 0)
    n = ctypes.c_int()
    # not wrapped by CuPy: the driver's own entry point (cluster dims are the kernel's own)
    err = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters(
        ctypes.byref(n), ctypes.c_void_p(func.kernel.ptr), ctypes.byref(config))
    if err or n.value < 1:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters for {name} failed (CUresult {err}, {n.value})")
    return func, smem, n.value


def _fused(vt, fused):
    """Whether the fused row kernel runs, where the caller allows it: the teacher vocabulary fits."""
    return fused and vt <= FUSED_MAX_VOCAB


def _slice(vt, cluster):
    """Columns per CTA: a multiple of 4 (16-byte loads), cluster * slice >= vt."""
    return -(-vt // (4 * cluster)) * 4


def _gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """C = alpha op(A) op(B) + beta C, column-major, float32 accumulation; a, b, c CuPy arrays
    (views allowed) whose dtypes give the cuBLAS data types. alpha: a number, or a 0-d float32
    device array (read by cuBLAS when the product runs: no wait for the GPU). By the cuBLASLt
    algorithm that ran fastest for the shape class (_cublaslt), or cuBLAS's default."""
    args = (transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    _cublaslt.gemm(*args, (_CUDA_TYPE[a.dtype], _CUDA_TYPE[b.dtype], _CUDA_TYPE[c.dtype]),
                   functools.partial(_gemm_default, *args))


def _gemm_default(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """_gemm by cublasGemmEx with cuBLAS's default algorithm."""
    handle = cupy.cuda.device.get_cublas_handle()
    on_device = isinstance(alpha, cupy.ndarray)
    if on_device:
        beta = cupy.full((), beta, np.float32)  # filled by a kernel: no copy from the host
        pointer = lambda x: x.data.ptr  # noqa: E731
        # CuPy's handle is shared: its pointer mode is put back below
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_DEVICE)
    else:
        alpha, beta = np.array(alpha, np.float32), np.array(beta, np.float32)
        pointer = lambda x: x.ctypes.data  # noqa: E731
    try:
        cublas.gemmEx(handle, transa, transb, m, n, k, pointer(alpha), a.data.ptr, _CUDA_TYPE[a.dtype],
                      lda, b.data.ptr, _CUDA_TYPE[b.dtype], ldb, pointer(beta),
                      c.data.ptr, _CUDA_TYPE[c.dtype], ldc, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
    finally:
        if on_device:
            cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)


def _logits(x, w, out):
    """out[:, :V] = x @ w.T in float32; x [c, H], w [V, H] row-major, out [c, ld]."""
    (c, h), v = x.shape, w.shape[0]
    # column-major: out^T [V, c] = w [H, V]^T @ x [H, c]
    _gemm(_T, _N, v, c, h, 1.0, w, h, x, h, 0.0, out, out.shape[1])


class CupyBackend:
    xp = cupy
    default_memory_budget = 5 * 2**29  # 2.5 GiB: T = 8192 at V = 128256 in 4 chunks

    @staticmethod
    def on_device(device):
        return cupy.cuda.Device(device)

    @staticmethod
    def select_rows(target, vocab, ignore_index):
        """(valid_rows, row_target, count): the indices of the rows whose target is not
        ignore_index (None where that is every row), their targets as int32, and their count,
        by rows.cu's select_rows. Raises _checks.target_error's ValueError for a bad target.
        Its wait for the kernel is the step's one wait for the GPU. (Reading all the targets,
        checking and selecting them on the host, copying the selection back and gathering the
        rows by CuPy took 0.15-0.25 ms more a step at T = 1024 with half of the rows ignored:
        bench/NOTES.md.)"""
        n = len(target)
        targets = target if target.dtype in (np.int32, np.int64) else target.astype(np.int64)
        targets = cupy.ascontiguousarray(targets)
        selected = cupy.empty(2 * n, np.int32)  # one allocation: the rows, then their targets
        rows, row_target = selected[:n], selected[n:]
        out, out_address = _select_out(cupy.cuda.Device().id)
        has_ignore = -2**63 <= ignore_index < 2**63  # else no int64 target equals it
        func = _function(f"select_rows_{'i32' if targets.dtype == np.int32 else 'i64'}")
        func((1,), (_SELECT_THREADS,), (targets, np.int32(n), np.int64(ignore_index if has_ignore else 0),
                                        np.int32(has_ignore), np.int64(vocab), rows, row_target,
                                        out_address))
        cupy.cuda.get_current_stream().synchronize()
        count, first_bad = (int(x) for x in out)
        if first_bad < n:
            raise _checks.target_error(first_bad, int(target[first_bad]), vocab, ignore_index)
        if count == n:
            return None, row_target, n
        return rows[:count], row_target[:count], count

    @staticmethod
    def take_rows(rows, a, b):
        """The given rows of a and of b (2-D, C-contiguous), by one launch of rows.cu's
        gather_rows."""
        out_a = cupy.empty((len(rows), a.shape[1]), a.dtype)
        out_b = cupy.empty((len(rows), b.shape[1]), b.dtype)
        if len(rows):
            row_bytes = (a.shape[1] * a.itemsize, b.shape[1] * b.itemsize)
            word = 16 if all(n % 16 == 0 for n in row_bytes) else 2  # every dtype here is even-sized
            func = _function(f"gather_rows_{word}")
            func((len(rows), 2), (256,), (rows, a, out_a, np.int64(row_bytes[0] // word), b, out_b,
                                          np.int64(row_bytes[1] // word)))
        return out_a, out_b

    @staticmethod
    def scale_cast(a, scale, dtype):
        """a * scale (a float32 array of ours, scale None for 1) as dtype, in one pass."""
        if np.dtype(dtype) == np.float32:
            if scale is not None:
                a *= scale
            return a
        out = cupy.empty(a.shape, dtype)
        n = a.size
        blocks = max(1, min(-(-n // 1024), 8 * _sm_count(cupy.cuda.Device().id)))
        func = _function(f"scale_cast_{_KERNEL_FORMAT[out.dtype]}")
        func((blocks,), (256,), (a, out, np.int64(n), np.uint64(0) if scale is None else scale))
        return out

    @staticmethod
    def bytes_per_row(vs, vt, dtype, compute_grad, fused):
        """Bytes per row of the logits chunk, of G held for all rows, and of G per chunk (0
        where the fused kernel writes it over the logits; both 0 without gradients)."""
        grad = np.dtype(dtype).itemsize * _leading_dim(vs) if compute_grad else 0
        return 4 * (_leading_dim(vs) + _leading_dim(vt)), grad, 0 if _fused(vt, fused) else grad

    @staticmethod
    def prepare(ws, wt, bs, bt, rows, g_rows, fused, own_g=False):
        """The buffers: logits for chunks of rows, G for g_rows (0: no G); with fused (and a
        teacher vocabulary of at most FUSED_MAX_VOCAB), the fused row kernel. There G is the
        student logits' memory (the kernel writes a row's gradient over the row once every CTA of
        its cluster has read it; a 16-bit row takes the first half of the float32 one) unless
        own_g: G held for all rows, or kept apart so that the logits can be used again."""
        vs, vt = ws.shape[0], wt.shape[0]
        fused = _fused(vt, fused)
        logits_s = cupy.empty((rows, _leading_dim(vs)), np.float32)
        if not g_rows:
            G = None
        elif fused and not own_g:
            G = logits_s.view(ws.dtype)[:g_rows]
        else:
            G = cupy.empty((g_rows, _leading_dim(vs)), ws.dtype)

        def padded_bias(b, v):
            if b is None:
                return None
            out = cupy.zeros(_leading_dim(v), np.float32)
            out[:v] = b
            return out

        return dict(
            ws=ws, wt=wt, bs=padded_bias(bs, vs), bt=padded_bias(bt, vt),
            logits_s=logits_s, logits_t=cupy.empty((rows, _leading_dim(vt)), np.float32), G=G,
            ones=cupy.ones(rows, ws.dtype) if bs is not None else None,
            row_counter=cupy.empty(1, np.int32) if fused else None,  # zeroed by each launch_rows
            fused=fused, cluster=_CLUSTER, threads=_THREADS, slice=_slice(vt, _CLUSTER),
            kernel=fused_kernel(cupy.cuda.Device().id, f"jsd_rows_{_KERNEL_FORMAT[ws.dtype]}", _CLUSTER,
                                _THREADS, _GROUPS) if fused else None)

    @staticmethod
    def logits(work, xs, xt):
        c = xs.shape[0]
        _logits(xs, work["ws"], work["logits_s"][:c])
        _logits(xt, work["wt"], work["logits_t"][:c])

    @staticmethod
    def fused_rows(work, target, opts, ce, jsd, G, label_terms):
        """The fused row kernel over the chunk's logits (G None: the loss alone)."""
        launch_rows(work, len(target), target, opts, ce, jsd, G, label_terms)

    # the three phases of the row work (vocab parallel, or a teacher vocabulary beyond
    # FUSED_MAX_VOCAB): rows.cu's vp_* kernels

    @staticmethod
    def row_stats(work, target, opts):
        stats = cupy.empty((7, len(target)), np.float32)
        _vp_launch("vp_stats", work, target, opts, (stats,))
        return stats

    @staticmethod
    def row_kl(work, target, stats, opts):
        kl = cupy.empty((2, stats.shape[1]), np.float32)
        _vp_launch("vp_kl", work, target, opts,
                   (np.int32(opts.mode), np.float32(opts.beta), stats, kl))
        return kl

    @staticmethod
    def row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms):
        null = np.uint64(0)
        _vp_launch(f"vp_finish_{_KERNEL_FORMAT[work['ws'].dtype]}", work, target, opts, (
            np.int32(opts.mode), np.float32(opts.beta), np.float32(opts.weight_hard_loss),
            np.float32(opts.weight_soft_loss / opts.temperature), stats, kl, ce, jsd,
            null if G is None else G, np.int64(0 if G is None else G.shape[1]),
            null if G is None else label_terms))

    @staticmethod
    def add_label_terms(work, label_terms, target, xs, norm, grads):
        """The label terms the row kernel left out of G, added exactly in float32 for the rows
        whose label this rank owns (target >= 0; label_terms is 0 elsewhere): rows.cu's
        label_rows for grad_input, and label_scatter for the grad_weight sums (where there are) and
        grad_bias."""
        ws = work["ws"]
        n, hs = grads.grad_input.shape
        func = _function(f"label_rows_{_KERNEL_FORMAT[ws.dtype]}")
        func((n,), (256,), (label_terms, target, ws, np.int32(hs), np.float32(norm), grads.grad_input))
        if grads.grad_weight is not None or grads.grad_bias is not None:
            _label_scatter(label_terms, target, xs, norm, None, grads.grad_weight, grads.grad_bias)

    @staticmethod
    def grad_products(work, G, xs, norm, grads, start, stop):
        """grad_input rows, and the chunk's part of the grad_weight and grad_bias sums (where
        grad_weight is None, weight_product makes it later)."""
        (c, hs), ldg = xs.shape, G.shape[1]
        vs = work["ws"].shape[0]
        accumulate = 0.0 if start == 0 else 1.0
        # grad_input rows [c, Hs] = norm G @ Ws; column-major: Ws [Hs, V] @ G^T [V, c]
        _gemm(_N, _N, hs, c, vs, norm, work["ws"], hs, G, ldg, 0.0,
              grads.grad_input[start:stop], hs)
        if grads.grad_weight is not None:
            _weight_gemm(G, vs, xs, norm, accumulate, grads.grad_weight)
        if grads.grad_bias is not None:
            # grad_bias [V] += norm G^T @ ones; column-major: G^T [V, c] @ ones [c, 1]
            _gemm(_N, _N, vs, 1, c, norm, G, ldg, work["ones"][:c], c, accumulate,
                  grads.grad_bias, vs)

    @staticmethod
    def weight_product(G, vs, xs, norm, label_terms, target, scale, dtype):
        """grad_weight = norm scale (G.T @ Xs + the label terms), G [rows, ld] over all rows;
        scale: a 0-d float32 device array, or None for 1. The product is written in dtype by
        cuBLAS; in 16 bits, the rows of labels kept out of G are rounded twice (the product,
        then with the label terms added), the others once."""
        out = cupy.empty((vs, xs.shape[1]), dtype)
        _weight_gemm(G, vs, xs, norm if scale is None else scale * np.float32(norm), 0.0, out)
        _label_scatter(label_terms, target, xs, norm, scale, out, None)
        return out


def _weight_gemm(G, vs, xs, alpha, beta, out):
    """out [Vs, Hs] = alpha G^T @ Xs + beta out; column-major: Xs^T [Hs, c] @ G [c, V]."""
    c, hs = xs.shape
    _gemm(_N, _T, hs, vs, c, alpha, xs, hs, G, G.shape[1], beta, out, hs)


def _label_scatter(label_terms, target, xs, norm, scale, grad_weight, grad_bias):
    """rows.cu's label_scatter over the rows sorted by label (a stable sort: the same order,
    and bits, every run); grad_weight (float32 sums, or the output in xs's dtype) or grad_bias
    may be None."""
    order = cupy.argsort(target).astype(np.int32)
    sorted_target = target[order]
    out = np.float32 if grad_weight is None else grad_weight.dtype
    name = f"label_scatter_{_KERNEL_FORMAT[xs.dtype]}_{_KERNEL_FORMAT[np.dtype(out)]}"
    null = np.uint64(0)
    func = _function(name)
    func((len(order),), (256,),
         (label_terms, order, sorted_target, np.int32(len(order)), xs, np.int32(xs.shape[1]),
          np.float32(norm), null if scale is None else scale, null if grad_weight is None else grad_weight,
          null if grad_bias is None else grad_bias))


def _row_args(work, target):
    """The arguments every row kernel of rows.cu begins with: both logits and their row pitches,
    both biases (or null), the targets and both vocabulary sizes."""
    ls, lt = work["logits_s"], work["logits_t"]
    null = np.uint64(0)
    return (ls, np.int64(ls.shape[1]), lt, np.int64(lt.shape[1]),
            null if work["bs"] is None else work["bs"], null if work["bt"] is None else work["bt"],
            target, np.int32(work["ws"].shape[0]), np.int32(work["wt"].shape[0]))


def _vp_launch(name, work, target, opts, more_args):
    """A vp_* kernel of rows.cu over the chunk's rows (one CTA of VP_THREADS = 256 per row)."""
    args = _row_args(work, target) + (np.float32(1.0 / opts.temperature), np.int32(len(target)))
    func = _function(name)
    func((len(target),), (256,), args + more_args)


def launch_rows(work, c, target, opts, ce, jsd, G, label_terms):
    """The fused row kernel over the first c rows of the chunk's logits (G None: the loss alone):
    as many clusters as fit the GPU at once, each taking rows until none is left."""
    func, smem, max_clusters = work["kernel"]
    counter = work["row_counter"]
    counter.fill(0)  # the kernel hands out rows past each cluster's first two from it
    null = np.uint64(0)
    args = _row_args(work, target) + (
        np.int32(work["slice"]), np.int32(c), np.float32(1.0 / opts.temperature), np.int32(opts.mode),
        np.float32(opts.beta), np.float32(opts.weight_hard_loss),
        np.float32(opts.weight_soft_loss / opts.temperature),
        ce, jsd, null if G is None else G, np.int64(0 if G is None else G.shape[1]),
        null if G is None else label_terms, counter)
    func((work["cluster"] * min(c, max_clusters),), (work["threads"],), args, shared_mem=smem)
