"""The matrix products, through cuBLASLt with the fastest of its heuristic's candidate
algorithms for each shape class.

For the products of the benchmark (bf16 in, float32 logits and grad_input, V = 128256) the
algorithm cuBLAS picks by default ran 5-17% slower on the H200 than the best of the other
candidates its heuristic offers (docs/design.md, "Products"). So the first product of each shape
class times the candidates once, on its own operands, and the fastest is kept for the process,
and on disk for the processes after it (tuning_cache: a process takes a class's kept choice
instead of timing it).
A class is the transposes, data types and leading dimensions, with each of m, n, k rounded up to
one of eight steps an octave (_bucket): a row count that changes from call to call (ignored rows)
tunes again only where it enters a class not met before, and a class's shapes are within 12.5% of
each other, so that the choice its first product makes serves its later ones. The
timing waits for the GPU, once per class; a product that adds to its output (beta != 0) is not
timed (that would add to it again and again), nor one inside a CUDA-graph capture: it takes its
class's choice where there is one (the first chunk's product, beta = 0, made it), else the
heuristic's first candidate becomes its class's choice. A class's choice never changes, so a call
gives the same bits every time it runs in the process (chosen later by a timed product, an
algorithm other than the one an earlier call took would change them in the last bits).

The logits products (logits) take more: a row's logits the same bits whatever rows they are
computed with. A call's first chunk is computed as a head and the rest (jsdgpu.ahead), whose
sizes follow the calls before; a head of 256 rows and a rest of 44 fall in other classes than one
product of 300 rows, and two calls on the same inputs gave gradients that differed in the last
bits where those classes' algorithms differed. An algorithm gives a row the same bits at every
row count, and at the benchmark's shapes all of cuBLASLt's candidates give the same bits; where
the sum over k is split, or cut in other steps, they differ (experiments/logits_bits.py). So a
logits class chooses among the candidates whose results on its first product are the bits of
one reference algorithm, the same for every row count of a head (the heuristic's first for
TUNE_ROWS rows); untimed, it takes the reference itself.

JSDGPU_GEMM_TUNING=0 in the environment keeps the heuristic's first candidate: no timing, and the
same algorithm (and bits) in every process, and the disk is neither read nor written. With
tuning, two processes that do not share the cache's file (JSDGPU_GEMM_CACHE) may pick different
algorithms, whose float32 results differ in the last bits.

cuBLASLt is called through ctypes (CuPy does not wrap it, and CuPy's cuBLAS has loaded it) on a
handle of its own, so the products can be captured in a CUDA graph, which CuPy's cuBLAS refuses.
The candidates include algorithms that take a workspace (up to WORKSPACE_BYTES): those that split
the sum over k need one, and grad_input's product, whose [T, Hs] output is too few tiles to fill
the GPU at T = 1024, runs fastest by one (docs/design.md, "Products"). A product whose algorithm
takes one allocates it from the current allocator as it is queued (CuPy's pool hands the same
block to the next product on the stream; in a capture, the memory is the caller's).
cublasGemmEx (CuPy's) serves only a shape for which the heuristic offers no candidate.
"""

import contextlib
import ctypes
import functools
import os
import statistics
import threading

import cupy
import numpy as np
from cupy_backends.cuda.libs import cublas

from . import tuning_cache
from .sources import FORMATS

TUNING = os.environ.get("JSDGPU_GEMM_TUNING", "1") != "0"

# cudaDataType of each dtype; cublasLt.h: cublasComputeType_t, and attribute numbers
_CUDA_TYPE = {dtype: {0: 0, 1: 2, 2: 14}[code] for dtype, code in FORMATS.items()}
_COMPUTE_32F, _R_32F = 68, 0
_GEMM_DEFAULT = -1
_DESC_POINTER_MODE, _DESC_TRANSA, _DESC_TRANSB = 2, 3, 4
_POINTER_MODE_DEVICE = 1
_PREF_MAX_WORKSPACE_BYTES = 1
N, T = 0, 1  # cublasOperation_t: as stored, transposed
_CANDIDATES = 8  # heuristic results asked for (8 came back for the benchmark's shapes)
WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommended workspace on Hopper
_ROUNDS = 5  # of timing, each timing every candidate once
TUNE_ROWS = 1024  # the row count whose heuristic's first algorithm is a logits class's reference


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _check(status, what):
    if status:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.lru_cache(maxsize=None)
def _library(device_id):
    """(cuBLASLt, a handle of it for the device)."""
    cupy.cuda.device.get_cublas_handle()  # CuPy's cuBLAS loads its cuBLASLt
    lib = ctypes.CDLL(f"libcublasLt.so.{cupy.cuda.runtime.runtimeGetVersion() // 1000}")
    p, i = ctypes.c_void_p, ctypes.c_int  # handles, descriptors and pointers; enums and counts
    for name, args in (("Create", [p]), ("MatmulDescCreate", [p, i, i]), ("MatmulDescDestroy", [p]),
                       ("MatmulDescSetAttribute", [p, i, p, ctypes.c_size_t]),
                       ("MatrixLayoutCreate", [p, i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]),
                       ("MatrixLayoutDestroy", [p]), ("MatmulPreferenceCreate", [p]),
                       ("MatmulPreferenceDestroy", [p]),
                       ("MatmulPreferenceSetAttribute", [p, i, p, ctypes.c_size_t]),
                       ("MatmulAlgoGetHeuristic", [p] * 7 + [i, p, p]), ("MatmulAlgoCheck", [p] * 8),
                       ("Matmul", [p] * 14 + [ctypes.c_size_t, p])):
        getattr(lib, "cublasLt" + name).argtypes = args
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    handle = ctypes.c_void_p()
    _check(lib.cublasLtCreate(ctypes.byref(handle)), "create")
    return lib, handle


_UNSET = object()


class _Product:
    """D [m, n] (ldd) = op(A) [m, k] @ op(B) [k, n], column-major, op a transpose where trans_a
    (trans_b) is T, float32 accumulation: the descriptors of one shape, and (candidates)
    cuBLASLt's algorithms for it, best first by its heuristic."""

    def __init__(self, device_id, trans_a, trans_b, m, n, k, lda, ldb, ldd, a_type, b_type, d_type,
                 device_scalars, workspace_bytes):
        self.lib, self.handle = _library(device_id)
        self.device_scalars = device_scalars  # alpha and beta: device pointers, else host floats
        self.workspace_bytes = workspace_bytes  # the most an algorithm may take
        self.desc = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        attributes = [(_DESC_TRANSA, trans_a), (_DESC_TRANSB, trans_b)]
        if device_scalars:
            attributes.append((_DESC_POINTER_MODE, _POINTER_MODE_DEVICE))
        for attr, setting in attributes:
            value = ctypes.c_int32(setting)
            _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4),
                   "desc attribute")
        # stored shapes: op(A) = A^T takes A as [k, m]
        self.a_layout = self._layout(a_type, *((k, m) if trans_a == T else (m, k)), lda)
        self.b_layout = self._layout(b_type, *((n, k) if trans_b == T else (k, n)), ldb)
        self.d_layout = self._layout(d_type, m, n, ldd)
        self.algo = _UNSET  # the algorithm this shape runs with (None: cuBLAS's default)
        self.workspace = 0  # the bytes of workspace it takes

    def candidates(self):
        """The heuristic's algorithms that need no workspace, then the others of those that fit
        workspace_bytes (asked for apart: with room for a workspace, the heuristic's list may
        leave out the fastest of those that need none)."""
        found = {}
        for most in sorted({0, self.workspace_bytes}):
            found.update((bytes(algo), algo) for algo in self._heuristic(most) if bytes(algo) not in found)
        return list(found.values())

    def _heuristic(self, most_bytes):
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        most = ctypes.c_uint64(most_bytes)
        _check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES,
                                                             ctypes.byref(most), 8), "preference attribute")
        results, n = (_Heuristic * _CANDIDATES)(), ctypes.c_int()
        _check(self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, self.a_layout, self.b_layout, self.d_layout, self.d_layout, pref,
            _CANDIDATES, results, ctypes.byref(n)), "heuristic")
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i].algo for i in range(n.value) if results[i].state == 0]

    def _layout(self, dtype_code, rows, cols, ld):
        layout = ctypes.c_void_p()
        _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype_code, rows, cols, ld), "layout")
        return layout

    def workspace_of(self, algo):
        """The workspace bytes algo takes for this shape; None where it cannot run this shape (or
        needs more than workspace_bytes)."""
        result = _Heuristic()
        if self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a_layout, self.b_layout, self.d_layout,
                                            self.d_layout, ctypes.byref(algo), ctypes.byref(result)):
            return None
        return result.workspace_size if result.workspace_size <= self.workspace_bytes else None

    def run(self, algo, a, b, d, alpha, beta, workspace):
        """d = alpha op(a) op(b) + beta d by algo; alpha, beta: floats, or with device_scalars
        0-d float32 device arrays; workspace: a uint8 device array, or None."""
        if self.device_scalars:
            alpha, beta = alpha.data.ptr, beta.data.ptr
        else:
            alpha, beta = ctypes.byref(ctypes.c_float(alpha)), ctypes.byref(ctypes.c_float(beta))
        space, size = (None, 0) if workspace is None else (workspace.data.ptr, workspace.nbytes)
        _check(self.lib.cublasLtMatmul(
            self.handle, self.desc, alpha, a.data.ptr, self.a_layout, b.data.ptr, self.b_layout, beta,
            d.data.ptr, self.d_layout, d.data.ptr, self.d_layout, ctypes.byref(algo), space, size,
            cupy.cuda.get_current_stream().ptr), "matmul")

    def __del__(self):  # what __init__ made, where it failed part way
        for layout in ("a_layout", "b_layout", "d_layout"):
            if hasattr(self, layout):
                self.lib.cublasLtMatrixLayoutDestroy(getattr(self, layout))
        if hasattr(self, "desc"):
            self.lib.cublasLtMatmulDescDestroy(self.desc)


def _fastest(runs):
    """The index of the fastest of the products runs (callables): after one untimed run of each,
    _ROUNDS rounds that time each once, the median of each kept. In rounds, not one candidate
    after another, so that a drift of the GPU's clocks (tuning runs in a process's first steps)
    falls on every candidate alike."""
    for run in runs:
        run()
    events = [[(cupy.cuda.Event(), cupy.cuda.Event()) for _ in runs] for _ in range(_ROUNDS)]
    for round_ in events:
        for run, (start, stop) in zip(runs, round_):
            start.record()
            run()
            stop.record()
    events[-1][-1][1].synchronize()  # the last stop: every run is done
    times = [statistics.median(cupy.cuda.get_elapsed_time(*round_[i]) for round_ in events)
             for i in range(len(runs))]
    return times.index(min(times))


# the descriptors of every shape met, kept: a run's steps each have other valid row counts (and
# chunks of several shapes, four products each), and a cache smaller than the shapes a run cycles
# through (it had held 64) makes each product's descriptors and algorithm check again, host time
# the GPU idles
_product = functools.lru_cache(maxsize=4096)(_Product)
_tuned = {}  # shape class -> its algorithm (None where there is no candidate)
_references = {}  # a logits product's shape without its rows -> the algorithm its classes' bits follow


def _bucket(n):
    """n's class: n rounded up to 2^e times 1, 1.125, 1.25, ... or 2 (eight classes an octave, from
    16), so that the shapes of a class run alike: with four, 1408 rows took the algorithm that 1536
    chose and a step 6% longer (docs/design.md, "Products")."""
    if n <= 8:
        return 1 << max(n - 1, 0).bit_length()
    unit = 1 << max((n - 1).bit_length() - 4, 0)
    return -(-n // unit) * unit


def _device_constant(value):
    """A 0-d float32 device array holding value (beta where alpha is on the device: filling one
    per product took a launch and an allocation), made once per device outside a CUDA-graph
    capture, in CuPy's own pool, not the caller's allocator: a block kept for the process must
    not sit in memory a graph owns (torch.compile's CUDA-graph trees refuse a live block of their
    pool that is not a graph's output, and their warm-up allocates in that pool too). During a
    capture before that, one of the call's own, its fill part of the graph."""
    key = (cupy.cuda.Device().id, float(value))
    constant = _constants.get(key)
    if constant is None:
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            return cupy.full((), value, np.float32)
        with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            constant = cupy.full((), value, np.float32)
        stream.synchronize()  # filled before any stream reads it
        _constants[key] = constant
    return constant


_constants = {}  # (device, value) -> its 0-d float32 array (_device_constant)


_observed = threading.local()


@contextlib.contextmanager
def observing(callback, queued=None):
    """For the block, callback(m, n, k) as each product of this thread is about to be queued, and
    queued(m, n, k), where given, once it is (how experiments/host_time.py marks the host's time
    to a step's first product, and to that product's launch's return)."""
    before = getattr(_observed, "observers", None)
    _observed.observers = callback, queued
    try:
        yield
    finally:
        _observed.observers = before


def _choose(product, key, run, timed, reference=None, output=None):
    """(algorithm, workspace bytes) for the product's shape (algorithm None: no cuBLASLt
    candidate), kept for the shape: its class's choice, made by the class's first product, the
    fastest candidate where it is timed (run(algo) runs the product by it), else the first; where
    an earlier process timed the class, its choice kept on disk (_kept).
    reference: where given (and able to run the shape), the candidates are those whose output
    (the product's, a view of its d) is the reference's bits, and untimed the reference itself."""
    if key not in _tuned and (kept := _kept(key)) is not None:
        _tuned[key] = kept
    if key not in _tuned:
        candidates = product.candidates()
        tune = TUNING and timed
        if reference is not None and product.workspace_of(reference) is not None:
            candidates = _same_bits(run, reference, candidates, output) if tune else [reference]
        _tuned[key] = None if not candidates else candidates[
            _fastest([functools.partial(run, c) for c in candidates]) if tune else 0]
        if tune and candidates:
            _keep(key, _tuned[key])
    algo = _tuned[key]
    need = None if algo is None else product.workspace_of(algo)
    if algo is not None and need is None:  # its class's choice, which this shape cannot run
        candidates = product.candidates()
        algo = candidates[0] if candidates else None
        need = None if algo is None else product.workspace_of(algo)
    product.algo, product.workspace = algo, need or 0
    return product.algo, product.workspace


@functools.lru_cache(maxsize=None)
def _disk(device_id):
    """The tuning cache of the device's scope (its GPU and cuBLASLt's version), or None where
    JSDGPU_GEMM_CACHE is 0 (jsdgpu/cuda/tuning_cache.py)."""
    path = tuning_cache.default_path()
    if path is None:
        return None
    properties = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = properties["name"].decode() if isinstance(properties["name"], bytes) else properties["name"]
    version = _library(device_id)[0].cublasLtGetVersion()
    return tuning_cache.TuningCache(path, f"{name} sm_{properties['major']}{properties['minor']} cublasLt {version}")


def _kept(key):
    """The class's algorithm as an earlier process timed it (key: the class, its device first), or
    None. With tuning off, none: the heuristic's first in every process."""
    disk = _disk(key[0]) if TUNING else None
    kept = None if disk is None else disk.get(key[1:])
    return None if kept is None else _Algo.from_buffer_copy(kept)


def _keep(key, algo):
    """The class's timed algorithm, kept on disk for later processes."""
    disk = _disk(key[0])
    if disk is not None:
        disk.put(key[1:], bytes(algo))


def _same_bits(run, reference, candidates, output):
    """The reference, then those of the candidates whose output is the reference's bits."""
    run(reference)
    want = output.copy()
    kept = [reference]
    for algo in candidates:
        if bytes(algo) != bytes(reference):
            run(algo)
            if bool(cupy.array_equal(output, want)):  # (a wait: tuning waits anyway, once a class)
                kept.append(algo)
    return kept


def _reference(device, trans_a, trans_b, m, k, lda, ldb, ldd, types, device_scalars, workspace_bytes):
    """The algorithm a logits class's bits follow, for every row count of its shape: the
    heuristic's first for TUNE_ROWS rows (None where there is none)."""
    family = (device, trans_a, trans_b, m, k, lda, ldb, ldd, types, device_scalars, workspace_bytes)
    if family not in _references:
        candidates = _product(device, trans_a, trans_b, m, TUNE_ROWS, k, lda, ldb, ldd, *types, device_scalars,
                              workspace_bytes).candidates()
        _references[family] = candidates[0] if candidates else None
    return _references[family]


def gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, d, ldd, workspace_bytes=WORKSPACE_BYTES,
         row_bits=False):
    """d [m, n] = alpha op(a) op(b) + beta d, column-major, float32 accumulation; a, b, d CuPy
    arrays (views allowed) whose dtypes give the cuBLAS data types. alpha: a float, or a 0-d
    float32 device array (read by cuBLAS when the product runs: no wait for the GPU); beta: a
    float. By the cuBLASLt algorithm that ran fastest for the shape class (above), among those
    that take at most workspace_bytes of workspace. row_bits: each of the n columns the same bits
    whatever n is (the logits' rows, above; d then holds n rows of ldd, row-major)."""
    observers = getattr(_observed, "observers", None)
    if observers is not None:
        observers[0](m, n, k)
    types = (_CUDA_TYPE[a.dtype], _CUDA_TYPE[b.dtype], _CUDA_TYPE[d.dtype])
    device = cupy.cuda.Device().id
    device_scalars = isinstance(alpha, cupy.ndarray)
    product = _product(device, trans_a, trans_b, m, n, k, lda, ldb, ldd, *types, device_scalars, workspace_bytes)
    algo, workspace = product.algo, product.workspace
    if algo is _UNSET:
        key = (device, trans_a, trans_b, _bucket(m), _bucket(n), _bucket(k), lda, ldb, ldd, types, workspace_bytes)
        room = cupy.empty(workspace_bytes, np.uint8) if workspace_bytes else None  # for every candidate
        reference = None if not row_bits else _reference(device, trans_a, trans_b, m, k, lda, ldb, ldd, types,
                                                        device_scalars, workspace_bytes)
        algo, workspace = _choose(product, key, functools.partial(
            product.run, a=a, b=b, d=d, alpha=alpha, beta=_device_constant(0.0) if device_scalars else 0.0,
            workspace=room), timed=beta == 0.0 and not cupy.cuda.get_current_stream().is_capturing(),
            reference=reference, output=d[:, :m] if row_bits else None)
    if algo is None:  # no cuBLASLt candidate for the shape
        _gemm_default(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, d, ldd)
    else:
        product.run(algo, a, b, d, alpha, _device_constant(beta) if device_scalars else beta,
                    cupy.empty(workspace, np.uint8) if workspace else None)
    if observers is not None and observers[1] is not None:
        observers[1](m, n, k)


def _gemm_default(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """gemm by cublasGemmEx with cuBLAS's default algorithm, on CuPy's handle."""
    handle = cupy.cuda.device.get_cublas_handle()
    on_device = isinstance(alpha, cupy.ndarray)
    if on_device:
        beta = _device_constant(beta)
        pointer = lambda x: x.data.ptr  # noqa: E731
        # CuPy's handle is shared: its pointer mode is put back below
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_DEVICE)
    else:
        alpha, beta = np.array(alpha, np.float32), np.array(beta, np.float32)
        pointer = lambda x: x.ctypes.data  # noqa: E731
    try:
        cublas.gemmEx(handle, transa, transb, m, n, k, pointer(alpha), a.data.ptr, _CUDA_TYPE[a.dtype],
                      lda, b.data.ptr, _CUDA_TYPE[b.dtype], ldb, pointer(beta),
                      c.data.ptr, _CUDA_TYPE[c.dtype], ldc, _COMPUTE_32F, _GEMM_DEFAULT)
    finally:
        if on_device:
            cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)


# ---- the products of the loss, row-major arrays ----

def logits(x, w, out):
    """out[:, :V] = x @ w.T in float32; x [c, H], w [V, H] row-major, out [c, ld]."""
    (c, h), v = x.shape, w.shape[0]
    # column-major: out^T [V, c] = w [H, V]^T @ x [H, c]
    gemm(T, N, v, c, h, 1.0, w, h, x, h, 0.0, out, out.shape[1], row_bits=True)


def input_gradient(G, ws, alpha, out):
    """out [c, Hs] = alpha G @ Ws; G [c, ld] (its first Vs columns), Ws [Vs, Hs]."""
    (c, hs), vs = out.shape, ws.shape[0]
    # column-major: Ws [Hs, V] @ G^T [V, c]
    gemm(N, N, hs, c, vs, alpha, ws, hs, G, G.shape[1], 0.0, out, hs)


def weight_gradient(G, vs, xs, alpha, beta, out):
    """out [Vs, Hs] = alpha G^T @ Xs + beta out; column-major: Xs^T [Hs, c] @ G [c, V]."""
    c, hs = xs.shape
    gemm(N, T, hs, vs, c, alpha, xs, hs, G, G.shape[1], beta, out, hs)


def bias_gradient(G, vs, ones, alpha, beta, out):
    """out [Vs] = alpha G^T @ ones + beta out; column-major: G^T [V, c] @ ones [c, 1]."""
    c = ones.shape[0]
    gemm(N, N, vs, 1, c, alpha, G, G.shape[1], ones, c, beta, out, vs)
