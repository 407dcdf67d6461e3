"""Loading and launching the row kernels: each family of jsdgpu/cuda/src compiled by NVRTC
(CuPy's RawModule, lazily, once per device and instantiation list), the fused kernel's cluster
attributes and occupancy, and one launcher per kernel, which alone knows its argument order.
Everything is queued on CuPy's current stream.
"""

import contextlib
import ctypes
import functools
import threading

import cupy
import numpy as np
from cupy.cuda import driver

from . import sources

_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15
_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING = 2
_NULL = np.uint64(0)
_TENSOR_MAP_BFLOAT16, _TENSOR_MAP_SWIZZLE_128B, _TENSOR_MAP_L2_256B = 9, 3, 3  # cuda.h's enums


def _pointer(a):
    """A kernel argument for an optional array: the array, or a null pointer."""
    return _NULL if a is None else a


@functools.lru_cache(maxsize=None)
def _module(device_id, family, names, source=None):
    """The family's RawModule for the device, with the instantiations `names`; source: the
    family's text (sources.source), where a variant replaces the library's."""
    return cupy.RawModule(code=sources.source(family) if source is None else source,
                          options=sources.OPTIONS, name_expressions=names)


def function(family, name):
    """A kernel of the family, by its name expression (sources.FAMILIES), for the current device."""
    return _function(cupy.cuda.Device().id, family, name)


@functools.lru_cache(maxsize=None)
def _function(device_id, family, name):
    # kept: RawModule.get_function looks the name expression up anew each time (tens of µs a call
    # on the H200's host, several calls a step)
    return _module(device_id, family, tuple(sources.FAMILIES[family])).get_function(name)


@functools.lru_cache(maxsize=None)
def sm_count(device_id):
    # one attribute, once: Device().attributes queries every attribute on each call
    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


class _LaunchConfig(ctypes.Structure):
    """The driver API's CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class FusedKernel:
    """The fused row kernel of one dtype and shape on one device, a function per divergence
    (compiled at its first launch), and how many of its clusters fit the GPU at once (the most it
    is launched with)."""

    def __init__(self, device_id, dtype, shape=sources.FUSED, source=None):
        self.device_id, self.dtype, self.shape, self.source = device_id, dtype, shape, source
        self._functions = {}
        self.max_clusters = None

    def function(self, divergence):
        if divergence not in self._functions:
            self._functions[divergence] = self._load(divergence)
        return self._functions[divergence]

    def _load(self, divergence):
        shape = self.shape
        name = sources.fused_rows(self.dtype, divergence, shape)
        function = _module(self.device_id, "fused_rows", (name,), self.source).get_function(name)
        ptr = function.kernel.ptr
        if shape.cluster > 8:  # beyond the portable cluster size: allowed on Hopper, asked for explicitly
            driver.funcSetAttribute(ptr, _FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        # By default the H200 fits 14 clusters of 16 CTAs (each on 16 SMs, two clusters' CTAs per
        # SM: 116 SMs in use); load balancing lets one more in, on 8 SMs of its own. That one runs
        # slower, and the kernel hands out rows as they are asked for, so it takes fewer:
        # -10% time per row at 2048 rows (docs/design.md, "The fused row kernel").
        driver.funcSetAttribute(ptr, _FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                                _CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING)
        function.max_dynamic_shared_size_bytes = shape.shared_bytes
        config = _LaunchConfig((shape.cluster, 1, 1), (shape.threads, 1, 1), shape.shared_bytes, None, None, 0)
        n = ctypes.c_int()
        # not wrapped by CuPy: the driver's own entry point (cluster dims are the kernel's own)
        err = _driver().cuOccupancyMaxActiveClusters(
            ctypes.byref(n), ctypes.c_void_p(ptr), ctypes.byref(config))
        if err or n.value < 1:
            raise RuntimeError(f"cuOccupancyMaxActiveClusters for {name} failed (CUresult {err}, {n.value})")
        # the same for every divergence (the same registers, shared memory and cluster)
        self.max_clusters = n.value if self.max_clusters is None else min(self.max_clusters, n.value)
        return function

    def slice(self, vt):
        """Columns per CTA: a multiple of 4 (16-byte loads), cluster * slice >= vt."""
        return -(-vt // (4 * self.shape.cluster)) * 4


@functools.lru_cache(maxsize=None)
def fused_kernel(device_id, dtype, shape=sources.FUSED, source=None):
    """The FusedKernel, made once per device, dtype, shape and source."""
    return FusedKernel(device_id, dtype, shape, source)


# ---- the row kernels ----

def _row_args(logits_s, logits_t, bias_s, bias_t, target, vs, vt):
    """The arguments every row kernel begins with: both logits and their row pitches, both
    biases (or null), the targets and both vocabulary sizes."""
    return (logits_s, np.int64(logits_s.shape[1]), logits_t, np.int64(logits_t.shape[1]),
            _pointer(bias_s), _pointer(bias_t), target, np.int32(vs), np.int32(vt))


def launch_fused_rows(kernel, rows, logits_s, logits_t, bias_s, bias_t, target, vs, vt, opts,
                      ce, jsd, G, label_terms, row_counter):
    """The fused row kernel over the first `rows` rows of the chunk's logits (G None: the loss
    alone): as many clusters as fit the GPU at once, each taking rows until none is left."""
    function = kernel.function(opts.divergence)
    row_counter.fill(0)  # the kernel hands out rows past each cluster's first two from it
    args = _row_args(logits_s, logits_t, bias_s, bias_t, target, vs, vt) + (
        np.int32(kernel.slice(vt)), np.int32(rows), np.float32(1.0 / opts.temperature),
        np.float32(opts.beta), np.float32(opts.one_minus_beta),
        np.float32(opts.weight_hard_loss), np.float32(opts.w_soft_over_t), ce, jsd, _pointer(G),
        np.int64(0 if G is None else G.shape[1]), _NULL if G is None else label_terms, row_counter,
        *sources.soft_terms(opts.divergence, opts.beta))
    shape = kernel.shape
    function((shape.cluster * min(rows, kernel.max_clusters),), (shape.threads,), args,
             shared_mem=shape.shared_bytes)


def launch_phase(phase, row_inputs, opts, *more_args):
    """A phase kernel over the chunk's rows, one CTA per row."""
    target = row_inputs[4]
    args = _row_args(*row_inputs) + (np.float32(1.0 / opts.temperature), np.int32(len(target)))
    function("phase_rows", phase)((len(target),), (sources.PHASE_THREADS,), args + more_args)


def phase_stats(row_inputs, opts):
    """stats [8, rows] of this rank's columns (phase_rows.cu); row_inputs: _row_args' arrays."""
    stats = cupy.empty((8, len(row_inputs[4])), np.float32)
    launch_phase(sources.phase_stats(), row_inputs, opts, stats)
    return stats


def phase_kl(row_inputs, opts, stats):
    """kl [6, rows]: this rank's part of the fast sums a and b, the precise sum and its weights',
    and the sums of p and q (phase_rows.cu)."""
    kl = cupy.empty((6, stats.shape[1]), np.float32)
    launch_phase(sources.phase_kl(), row_inputs, opts, np.int32(opts.divergence), np.float32(opts.beta),
                 np.float32(opts.one_minus_beta), *sources.soft_terms(opts.divergence, opts.beta), stats, kl)
    return kl


def phase_finish(dtype, row_inputs, opts, stats, kl, ce, jsd, G, label_terms):
    """The rows' CE and JSD values, and with G this rank's gradient columns."""
    launch_phase(sources.phase_finish(dtype), row_inputs, opts, np.int32(opts.divergence),
                 np.float32(opts.beta), np.float32(opts.one_minus_beta), sources.soft_terms(opts.divergence, opts.beta)[0],
                 np.float32(opts.weight_hard_loss), np.float32(opts.w_soft_over_t), stats, kl, ce, jsd, _pointer(G),
                 np.int64(0 if G is None else G.shape[1]), _NULL if G is None else label_terms)


# ---- the gradient sums ----

def scale_cast(a, scale, dtype, out=None):
    """a * scale (float32; scale a 0-d float32 device array, or None for 1) in a 16-bit dtype,
    in one pass (into out, where given)."""
    out = cupy.empty(a.shape, dtype) if out is None else out
    n = a.size
    blocks = max(1, min(-(-n // 1024), 8 * sm_count(cupy.cuda.Device().id)))
    function("gradient_sums", sources.scale_cast(dtype))((blocks,), (256,), (a, out, np.int64(n), _pointer(scale)))
    return out


def scale_rows(x, scale):
    """scale[i] x[i] for each row of x (2-D, C-contiguous; scale float32 [rows]), in x's dtype."""
    out = cupy.empty_like(x)
    if len(x):
        function("gradient_sums", sources.scale_rows(x.dtype))((len(x),), (256,), (x, scale, np.int32(x.shape[1]), out))
    return out


def label_rows(label_terms, target, ws, inv_n, grad_input):
    """grad_input[i] += inv_n label_terms[i] ws[target[i]] where target[i] >= 0; inv_n: a 0-d
    float32 device array."""
    n, hs = grad_input.shape
    function("gradient_sums", sources.label_rows(ws.dtype))(
        (n,), (256,), (label_terms, target, ws, np.int32(hs), inv_n, grad_input))


def label_order(target):
    """The rows in the order of their labels, stably: as a stable argsort, with no host wait."""
    n = len(target)
    order = cupy.empty(n, np.int32)
    if n:
        blocks = -(-n // (sources.ORDER_THREADS // 32))  # a warp per row
        function("gradient_sums", sources.label_order())((blocks,), (sources.ORDER_THREADS,), (target, np.int32(n), order))
    return order


def label_scatter(label_terms, target, xs, inv_n, scale, grad_weight, grad_bias):
    """The label terms into grad_weight (float32 sums, or the output in xs's dtype) and grad_bias
    (either may be None), over the rows in the order of their labels (label_order: the same
    order, and bits, every run). inv_n: a 0-d float32 device array."""
    order = label_order(target)
    out = np.float32 if grad_weight is None else grad_weight.dtype
    if len(order):
        function("gradient_sums", sources.label_scatter(xs.dtype, out))(
            (len(order),), (256,),
            (label_terms, order, target[order], np.int32(len(order)), xs, np.int32(xs.shape[1]),
             inv_n, _pointer(scale), _pointer(grad_weight), _pointer(grad_bias)))


# ---- the valid rows ----

class _SelectionOutput:
    """select_rows's three results (the count, the first bad row and the first ignored row) in 12
    bytes of page-locked host memory, which the kernel writes straight into (with unified
    addressing, CUDA maps it into the devices' address space at the same address), and an event
    recorded after the kernel, which the host waits on (not on the stream: the products queued
    after the kernel keep running). One per thread and device, made once (an allocation a call
    took tens of µs inside a step)."""

    def __init__(self):
        self.view = np.frombuffer(cupy.cuda.alloc_pinned_memory(12), np.int32, 3)  # keeps it alive
        self.address = np.uint64(self.view.ctypes.data)
        self.done = _new_event()


_per_thread = threading.local()


def _per_thread_and_device(make):
    """make() made once per thread and current device (page-locked buffers the host reads back:
    one call's, until its wait, on this thread alone)."""
    made = _per_thread.__dict__.setdefault("made", {})
    key = (make, cupy.cuda.Device().id)
    if key not in made:
        made[key] = make()
    return made[key]


def _ignore_args(ignore_index):
    has_ignore = -2**63 <= ignore_index < 2**63  # else no int64 target equals it
    return np.int64(ignore_index if has_ignore else 0), np.int32(has_ignore)


def _new_event():
    return cupy.cuda.Event(block=False, disable_timing=True)


def _new_joined_event():  # a second per-thread event: beside's, apart from mark's
    return _new_event()


def _new_side_stream():
    return cupy.cuda.Stream(non_blocking=True)


def mark():
    """An event recorded now on the current stream (one per thread and device, recorded again by
    each call): a point that work on the side stream (beside) can wait for."""
    event = _per_thread_and_device(_new_event)
    event.record()
    return event


@contextlib.contextmanager
def beside(after):
    """For the block, a side stream (one per thread and device) as CuPy's current stream: it
    first waits for `after` (mark's event of the current stream), not for what the current
    stream queued since; after the block the current stream waits for what the block queued.
    So a default call's selection runs beside its first products, and the host's wait for it
    is not a wait for them. Memory the block allocates comes from the side stream's arena (or,
    under jsdgpu.torch, from torch's allocator on torch's stream): it must be held until the
    host's wait (PendingSelection, PendingTopKCheck), as the side stream's work reads it."""
    caller = cupy.cuda.get_current_stream()
    side = _per_thread_and_device(_new_side_stream)
    side.wait_event(after)
    with side:
        yield
    caller.wait_event(side.record(_per_thread_and_device(_new_joined_event)))


def kernel_ids(ids):
    """Ids (targets, top-k ids) as the kernels take them: int32 or int64, C-contiguous."""
    if ids.dtype not in (np.int32, np.int64):
        ids = ids.astype(np.int64)
    return cupy.ascontiguousarray(ids)


class PendingSelection:
    """select_rows launched: rows [n] (the valid rows' indices first, in order; 0 past their count,
    so any prefix can be gathered before the count is known) and row_target [n] (their int32
    targets; -1 where out of range and past the count, so any prefix can be read as labels).
    wait() waits for the kernel and returns (count, first bad row, first ignored row), each row n
    where there is none. With `after` (mark's event), the kernel runs beside the
    current stream's work queued since that mark (a head's products), so wait() does not wait for
    that work; else it is queued on the current stream, and wait() waits for what it holds too."""

    def __init__(self, targets, vocab, ignore_index, after=None):
        n = len(targets)
        self._out = _per_thread_and_device(_SelectionOutput)
        with contextlib.nullcontext() if after is None else beside(after):
            # made beside too: a block of the current stream's arena may still be in use by its
            # work queued since `after` (a product's workspace, freed as soon as it was queued),
            # which the kernel here would write over (a run whose row counts changed from step
            # to step read rows of garbage and faulted)
            selected = cupy.empty(2 * n, np.int32)  # one allocation: the rows, then their targets
            self.rows, self.row_target = selected[:n], selected[n:]
            self._targets = kernel_ids(targets)  # held until the wait (beside)
            function("targets", sources.select_rows(self._targets.dtype))(
                (1,), (sources.SELECT_THREADS,),
                (self._targets, np.int32(n), *_ignore_args(ignore_index), np.int64(vocab), self.rows,
                 self.row_target, self._out.address))
            self._out.done.record()

    def wait(self):
        self._out.done.synchronize()
        self._targets = None
        return tuple(int(x) for x in self._out.view)


def mark_rows(targets, vocab, ignore_index, normalizer):
    """A capturable call's rows, with no host wait: (row_target [n]: the target where valid, else
    -1; status [2]: the valid rows' count and the first bad row, n where none; inv_n: a 0-d
    float32 device array, 1 / N, NaN where a target is bad). normalizer: N, or None for the
    count."""
    targets, n = kernel_ids(targets), len(targets)
    row_target, status, inv_n = cupy.empty(n, np.int32), cupy.empty(2, np.int32), cupy.empty((), np.float32)
    function("targets", sources.mark_rows(targets.dtype))(
        (1,), (sources.MARK_THREADS,),
        (targets, np.int32(n), *_ignore_args(ignore_index), np.int64(vocab),
         np.float32(0.0 if normalizer is None else normalizer), row_target, status, inv_n))
    return row_target, status, inv_n


def zero_rows(row_target, G):
    """G's rows whose row_target is -1, zeroed (G's rows 16-byte aligned)."""
    if len(row_target):
        function("targets", "zero_rows")((len(row_target),), (256,),
                                         (row_target, G, np.int64(G.shape[1] * G.itemsize // 16)))


def gather_rows(rows, a, b):
    """The given rows of a and of b (2-D, C-contiguous), by one launch."""
    out_a = cupy.empty((len(rows), a.shape[1]), a.dtype)
    out_b = cupy.empty((len(rows), b.shape[1]), b.dtype)
    if len(rows):
        row_bytes = (a.shape[1] * a.itemsize, b.shape[1] * b.itemsize)
        word = 16 if all(n % 16 == 0 for n in row_bytes) else 2  # every dtype here is even-sized
        function("targets", sources.gather_rows(word))(
            (len(rows), 2), (256,), (rows, a, out_a, np.int64(row_bytes[0] // word), b, out_b,
                                     np.int64(row_bytes[1] // word)))
    return out_a, out_b


# ---- offline distillation: the top-k loss's row work, its checks, the teacher's top-k ----

def _with_shared(kernel, nbytes):
    """kernel, allowed nbytes of dynamic shared memory (beyond what every kernel may take: 48 KiB
    with its static shared memory, which is at most 16 KiB here)."""
    if nbytes > 32 * 1024:
        kernel.max_dynamic_shared_size_bytes = nbytes
    return kernel


def _bitmap_bytes(vocab):
    return 4 * (-(-vocab // 32))


def topk_rows(logits_s, bias_s, target, vs, ids, lq, opts, bucket, ce, soft, G, label_terms, row_scale=None):
    """The top-k row work over the chunk's rows (topk_rows.cu; G None: the loss alone; row_scale:
    G stored as row_scale[i] times its rows, read once, where the kernel can)."""
    rows, k = ids.shape
    if not rows:
        return
    shared = sources.topk_ring_bytes() + (_bitmap_bytes(vs) if bucket else 0)
    kernel = _with_shared(function("topk_rows", sources.topk_rows(G.dtype if G is not None else np.float32)), shared)
    kernel((rows,), (sources.TOPK_THREADS,),
           (logits_s, np.int64(logits_s.shape[1]), _pointer(bias_s), target, np.int32(vs), ids, lq, np.int32(k),
            np.float32(np.log2(np.e) / opts.temperature), np.int32(opts.divergence), np.int32(bucket),
            np.float64(opts.beta), np.float64(opts.one_minus_beta), np.float32(opts.weight_hard_loss),
            np.float32(opts.w_soft_over_t), ce, soft, _pointer(G), np.int64(0 if G is None else G.shape[1]),
            _NULL if G is None else label_terms, _pointer(row_scale)),
           shared_mem=shared)


# ---- the top-k loss's own logits product (topk_logits.cu, sm_90a) and its finishing kernel ----

@functools.lru_cache(maxsize=None)
def _topk_logits_function(device_id):
    """topk_logits (an sm_90a family: sources.SM90A), compiled by NVRTC for sm_90a and loaded as a
    module of the driver's (CuPy's RawModule compiles for the device's sm_90, without wgmma)."""
    from cupy_backends.cuda.libs import nvrtc
    family, name = "topk_logits", sources.topk_logits()
    prog = nvrtc.createProgram(sources.source(family), f"{family}.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, ["-arch=sm_90a", *sources.NVRTC_OPTIONS])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{family}.cu: {nvrtc.getProgramLog(prog)}") from e
        module = cupy.cuda.function.Module()
        module.load(nvrtc.getCUBIN(prog))
        function = module.get_function(nvrtc.getLoweredName(prog, name))
    finally:
        nvrtc.destroyProgram(prog)
    driver.funcSetAttribute(function.ptr, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            sources.topk_logits_shared_bytes())
    return module, function  # the module kept loaded with its function


class _TensorMap(ctypes.Structure):
    """The driver's CUtensorMap: 128 opaque bytes, passed to a kernel by value."""
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    u32, u64, p = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.cuTensorMapEncodeTiled.argtypes = [p, ctypes.c_int, u32, p, ctypes.POINTER(u64), ctypes.POINTER(u64),
                                           ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [p, u32, u32, u32, u32, u32, u32, u32, p, ctypes.POINTER(p), p]
    return lib


def tensor_map(a, columns, box_rows, box_columns):
    """The CUtensorMap of the first `columns` columns of a C-contiguous bf16 matrix (its row pitch
    a multiple of 16 bytes, its start 16-byte aligned), in boxes of box_rows x box_columns with the
    128-byte swizzle; a box reads zeros outside the matrix and writes nothing there."""
    return _encoded_map(a.data.ptr, columns, a.shape[0], a.strides[0], box_rows, box_columns)


@functools.lru_cache(maxsize=64)
def _encoded_map(ptr, columns, rows, pitch, box_rows, box_columns):
    # kept: a map is a pure function of these numbers (it holds no resource), and a step's buffers
    # come back at the same addresses from the memory pool, step after step; each encoding is a
    # driver call through ctypes on the host's path to the own product's launch
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    out = _TensorMap()
    err = _driver().cuTensorMapEncodeTiled(
        ctypes.byref(out), _TENSOR_MAP_BFLOAT16, 2, ctypes.c_void_p(ptr), (u64 * 2)(columns, rows), (u64 * 1)(pitch),
        (u32 * 2)(box_columns, box_rows), (u32 * 2)(1, 1), 0, _TENSOR_MAP_SWIZZLE_128B, _TENSOR_MAP_L2_256B, 0)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {err})")
    return out


def _launch(function, grid, block, shared, args):
    """function<<<grid, block, shared, the current stream>>>(args), each a ctypes value (the tensor
    maps by value: CuPy's launcher takes no struct)."""
    params = (ctypes.c_void_p * len(args))(*map(ctypes.addressof, args))
    err = _driver().cuLaunchKernel(ctypes.c_void_p(function.ptr), grid, 1, 1, block, 1, 1, shared,
                                   ctypes.c_void_p(cupy.cuda.get_current_stream().ptr), params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernel failed (CUresult {err})")


def _ptr(a):
    return ctypes.c_void_p(0 if a is None else a.data.ptr)


def topk_slot_bits(ids, lq, vs, bitmap, slots_before):
    """The slots' bitmap of the chunk's rows (every word written), ids outside [0, vs) left out,
    and slots_before [rows, column tiles]: the row's slot columns in the tiles before."""
    rows, k = ids.shape
    if rows:
        n_tiles, words = slots_before.shape[1], bitmap.shape[1]
        shared = 4 * (words + n_tiles)  # the row's bitmap and its slots per tile
        _with_shared(function("topk_rows", sources.topk_slot_bits()), shared)(
            (rows,), (sources.TOPK_THREADS,),
            (ids, lq, np.int32(k), np.int32(vs), bitmap, np.int32(words), slots_before, np.int32(n_tiles)),
            shared_mem=shared)


def topk_head_map(ws):
    """The LM head's tensor map for topk_logits (made once a call)."""
    return tensor_map(ws, ws.shape[1], sources.TOPK_LOGITS_TILE[1], sources.TOPK_LOGITS_K_STEP)


def topk_logits(x, map_w, G, vs, bias, bitmap, ref, ready, partials, slot_logits, slots_before):
    """The chunk's rows x of the student's input through the product with the row work's epilogue
    (topk_logits.cu), G~ into G's first vs columns; map_w: topk_head_map's."""
    device_id = cupy.cuda.Device().id
    _, fn = _topk_logits_function(device_id)
    rows, hs = x.shape
    bm, bn = sources.TOPK_LOGITS_TILE
    maps = tensor_map(x, hs, bm, sources.TOPK_LOGITS_K_STEP), map_w, tensor_map(G, vs, 64, 64)  # G~ in 64 x 64 boxes
    tiles = -(-rows // bm) * -(-vs // bn)
    i32 = ctypes.c_int
    _launch(fn, min(tiles, sm_count(device_id)), 384, sources.topk_logits_shared_bytes(),
            (*maps, i32(rows), i32(vs), i32(hs), _ptr(bias), ctypes.c_float(np.log2(np.e)),
             _ptr(bitmap), i32(bitmap.shape[1]), _ptr(ref), _ptr(ready), _ptr(partials), _ptr(slot_logits),
             ctypes.c_longlong(slot_logits.shape[1]), _ptr(slots_before)))


def topk_finish(target, vs, ids, lq, opts, bucket, ce, soft, G, label_terms, row_scale, partials, ref, slot_logits,
                xs, ws, bias, bitmap, ready, slots_before, kernel=None):
    """The rows' results after topk_logits (topk_rows.cu, FUSED): ce, soft, label_terms, and G
    (G~ kept or rescaled, the slots' and label's columns written over) with its row scales.
    kernel: the compiled kernel, where an experiment times a variant's (None: the library's)."""
    rows, k = ids.shape
    if rows:
        shared = 12 * k  # per slot its logit, id and log-probability
        _with_shared(function("topk_rows", sources.topk_finish()) if kernel is None else kernel, shared)(
            (rows,), (sources.TOPK_FINISH_THREADS,),
            (slot_logits, np.int64(slot_logits.shape[1]), target, np.int32(vs), ids, lq, np.int32(k),
             np.int32(opts.divergence), np.int32(bucket), np.float64(opts.beta), np.float64(opts.one_minus_beta),
             np.float32(opts.weight_hard_loss), np.float32(opts.w_soft_over_t), ce, soft, G, np.int64(G.shape[1]),
             label_terms, row_scale, partials, np.int32(partials.shape[1]), ref, xs, ws, np.int32(ws.shape[1]),
             _pointer(bias), bitmap, np.int32(bitmap.shape[1]), ready, slots_before),
            shared_mem=shared)


class PendingTopKCheck:
    """topk_check launched: first, a 1-element uint64 device array, (first bad row << 2 | its code),
    or all ones where there is none. With to_host, it is copied into page-locked memory on the
    stream, so the host reads it at the call's one wait (select_rows', queued after it) without
    waiting again; without (a capturable call), nothing crosses to the host. With `after`, both
    run beside the current stream (as PendingSelection's kernel, before it)."""

    def __init__(self, ids, lq, vocab, bucket, slack, to_host, after=None):
        rows, k = ids.shape
        with contextlib.nullcontext() if after is None else beside(after):
            self._ids = kernel_ids(ids)  # held until the wait (beside)
            self.first = cupy.full(1, _NONE_BAD, np.uint64)
            if rows:
                name = sources.topk_check(self._ids.dtype)
                kernel = _with_shared(function("topk_rows", name), _bitmap_bytes(vocab))
                kernel((rows,), (sources.TOPK_THREADS,),
                       (self._ids, lq, np.int32(k), np.int32(vocab), np.int32(bucket), np.float64(slack), self.first),
                       shared_mem=_bitmap_bytes(vocab))
            self._host = None
            if to_host:
                self._host = _per_thread_and_device(_pinned_uint64)
                cupy.cuda.runtime.memcpyAsync(self._host.ctypes.data, self.first.data.ptr, 8,
                                              cupy.cuda.runtime.memcpyDeviceToHost,
                                              cupy.cuda.get_current_stream().ptr)

    def result(self):
        """(row, code) of the first bad row, or None; valid once a later wait on the stream returned."""
        self._ids = None
        value = int(self._host[0])
        return None if value == _NONE_BAD else (value >> 2, value & 3)

    def poisoned(self, inv_n, n_rows):
        """(1/N, NaN where a row is bad; the first bad row, n_rows where none), 0-d device arrays,
        with no host wait."""
        return _poison(self.first.reshape(()), inv_n, np.int32(n_rows))


_NONE_BAD = np.iinfo(np.uint64).max
_poison = cupy.ElementwiseKernel(
    "uint64 first, float32 inv_n, int32 n_rows", "float32 poisoned, int32 bad_row",
    "const bool bad = first != 0xffffffffffffffffull; poisoned = bad ? __int_as_float(0x7fc00000) : inv_n; "
    "bad_row = bad ? (int)(first >> 2) : n_rows;", "jsdgpu_topk_poison")


def _pinned_uint64():
    return np.frombuffer(cupy.cuda.alloc_pinned_memory(8), np.uint64, 1)


TEACHER_TOPK_MAX_K = 16384  # its sort's 8 bytes per entry, rounded up to a power of 2: 128 KiB of shared memory


def teacher_topk(logits, bias, v, k, temperature, ids, logprobs):
    """The k largest of each row of the chunk's float32 logits (biased by bias, or not), by
    descending value, with their log-softmax at the temperature, into ids and logprobs."""
    rows = ids.shape[0]
    if not rows:
        return
    k2 = 1 << (k - 1).bit_length()
    kernel = _with_shared(function("topk_rows", sources.teacher_topk()), 8 * k2)
    kernel((rows,), (sources.TOPK_THREADS,),
           (logits, np.int64(logits.shape[1]), _pointer(bias), np.int32(v), np.int32(k), np.int32(k2),
            np.float32(np.log2(np.e) / temperature), ids, logprobs), shared_mem=8 * k2)
