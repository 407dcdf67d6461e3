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

from ..options import Divergence
from . import sources

_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15
_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING = 2
_NULL = np.uint64(0)


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


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    u32, u64, p = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.cuTensorMapEncodeTiled.argtypes = [p, ctypes.c_int, u32, p, ctypes.POINTER(u64), ctypes.POINTER(u64),
                                           ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [p, u32, u32, u32, u32, u32, u32, u32, p, ctypes.POINTER(p), p]
    return lib


class _LaunchConfig(ctypes.Structure):
    """The driver API's CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class FusedKernel:
    """The fused row kernel of one dtype and shape on one device, a function per row mode
    (compiled at its first launch), and how many of its clusters fit the GPU at once (the most it
    is launched with)."""

    def __init__(self, device_id, dtype, shape=sources.FUSED, source=None):
        self.device_id, self.dtype, self.shape, self.source = device_id, dtype, shape, source
        self._functions = {}
        self.max_clusters = None

    def function(self, mode):
        """The kernel of this row mode (sources.row_mode's)."""
        if mode not in self._functions:
            self._functions[mode] = self._load(mode)
        return self._functions[mode]

    def fits(self):
        """Whether a cluster of this shape fits the GPU at all: the wide shapes' 16 CTAs of 1024
        threads need 16 SMs of one GPC, which a Hopper part may not have (where it does not, its
        rows take the phase kernels: online_work.fused_holds). Loads a function if none is."""
        if self.max_clusters is None:
            self.function(int(Divergence.JSD))
        return self.max_clusters > 0

    def _load(self, mode):
        shape = self.shape
        name = sources.fused_rows(self.dtype, mode, shape)
        function = _module(self.device_id, "fused_rows", (name,), self.source).get_function(name)
        ptr = function.kernel.ptr
        if shape.cluster > 8:  # beyond the portable cluster size: allowed on Hopper, asked for explicitly
            driver.funcSetAttribute(ptr, _FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        # By default the H200 fits 14 clusters of the narrow shape's 16 CTAs (each on 16 SMs, two
        # clusters' CTAs per SM: 116 SMs in use); load balancing lets one more in, on 8 SMs of its
        # own. That one runs slower, and the kernel hands out rows as they are asked for, so it
        # takes fewer: -10% time per row at 2048 rows (docs/design.md, "The fused row kernel").
        # (The wide shapes, a CTA an SM: 7 clusters, one per GPC, either way.)
        driver.funcSetAttribute(ptr, _FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                                _CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING)
        function.max_dynamic_shared_size_bytes = shape.shared_bytes
        config = _LaunchConfig((shape.cluster, 1, 1), (shape.threads, 1, 1), shape.shared_bytes, None, None, 0)
        n = ctypes.c_int()
        # not wrapped by CuPy: the driver's own entry point (cluster dims are the kernel's own)
        err = _driver().cuOccupancyMaxActiveClusters(
            ctypes.byref(n), ctypes.c_void_p(ptr), ctypes.byref(config))
        if err:
            raise RuntimeError(f"cuOccupancyMaxActiveClusters for {name} failed (CUresult {err})")
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


def _row_mode(opts):
    """The online loss's row kernels' mode for these options (sources.row_mode)."""
    return sources.row_mode(opts.divergence, opts.beta)


def launch_fused_rows(kernel, rows, logits_s, logits_t, bias_s, bias_t, target, vs, vt, opts,
                      ce, jsd, G, label_terms, row_counter):
    """The fused row kernel over the first `rows` rows of the chunk's logits (G None: the loss
    alone): as many clusters as fit the GPU at once, each taking rows until none is left."""
    function = kernel.function(_row_mode(opts))
    row_counter.fill(0)  # the kernel hands out rows past each cluster's first two from it
    args = _row_args(logits_s, logits_t, bias_s, bias_t, target, vs, vt) + (
        np.int32(kernel.slice(vt)), np.int32(rows), np.float32(1.0 / opts.temperature),
        np.float32(opts.beta), np.float32(opts.one_minus_beta),
        np.float32(opts.weight_hard_loss), np.float32(opts.w_soft_over_t), ce, jsd, _pointer(G),
        np.int64(0 if G is None else G.shape[1]), _NULL if G is None else label_terms, row_counter,
        *_model_args(opts.models or ((1.0, None), (1.0, None))), *sources.soft_terms(opts.divergence, opts.beta))
    shape = kernel.shape
    function((shape.cluster * min(rows, kernel.max_clusters),), (shape.threads,), args,
             shared_mem=shape.shared_bytes)


def _model_args(models):
    """(scale, cap, 1 / cap) of each (scale, cap) of models (LossOptions.models; a cap of None
    as 0, its inverse 0), as the kernels take them."""
    return tuple(np.float32(x) for scale, cap in models for x in (scale, cap or 0.0, 1.0 / cap if cap else 0.0))


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
    launch_phase(sources.phase_kl(), row_inputs, opts, np.int32(_row_mode(opts)), np.float32(opts.beta),
                 np.float32(opts.one_minus_beta), *sources.soft_terms(opts.divergence, opts.beta), stats, kl)
    return kl


def phase_finish(dtype, row_inputs, opts, stats, kl, ce, jsd, G, label_terms):
    """The rows' CE and JSD values, and with G this rank's gradient columns."""
    launch_phase(sources.phase_finish(dtype), row_inputs, opts, np.int32(_row_mode(opts)), np.float32(opts.beta),
                 np.float32(opts.one_minus_beta), *sources.soft_terms(opts.divergence, opts.beta),
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


def model_logits(logits, rows, v, bias, scale, cap):
    """The first `rows` rows of a chunk's float32 logits [.., ld] (their first v columns) as a
    model's, in place: scale (logits + bias), then cap tanh(. / cap) where cap is not None."""
    if rows:
        function("gradient_sums", "model_logits")(
            (rows,), (256,), (logits, np.int64(logits.shape[1]), np.int32(v), _pointer(bias),
                              *_model_args(((scale, cap),))))


def model_gradient(G, logits, v, scale, cap, target, label_terms):
    """G (its rows, the gradient in the model's logits, model_logits' there) to the gradient in the
    raw logits, in place, and the rows' label terms (None: none) likewise at their labels."""
    if len(G):
        function("gradient_sums", sources.model_gradient(G.dtype))(
            (len(G),), (256,), (G, np.int64(G.shape[1]), logits, np.int64(logits.shape[1]), np.int32(v),
                                np.float32(scale), np.float32(1.0 / cap if cap else 0.0), target,
                                _pointer(label_terms)))


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
    """select_rows's three results (the count, the first bad row and the first ignored row) and
    first_bad_weight's in 16 bytes of page-locked host memory, which the kernels write straight
    into (with unified addressing, CUDA maps it into the devices' address space at the same
    address), and an event recorded after them, which the host waits on (not on the stream: the
    products queued after the kernels keep running). One per thread and device, made once (an
    allocation a call took tens of µs inside a step)."""

    def __init__(self):
        self.view = np.frombuffer(cupy.cuda.alloc_pinned_memory(16), np.int32, 4)  # keeps it alive
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
    targets; -1 where out of range and past the count, so any prefix can be read as labels); with
    token weights, weights (float32 [n]) and first_bad_weight's check of them.
    wait() waits for the kernels and returns (count, first bad row, first ignored row, first bad
    weight), each n where there is none. With `after` (mark's event), the kernels run beside the
    current stream's work queued since that mark (a head's products), so wait() does not wait for
    that work; else they are queued on the current stream, and wait() waits for what it holds too."""

    def __init__(self, targets, vocab, ignore_index, after=None, weights=None):
        n = len(targets)
        self._out = _per_thread_and_device(_SelectionOutput)
        self.weights = None
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
            if weights is not None:
                self.weights = cupy.ascontiguousarray(weights, dtype=np.float32)
                function("targets", "first_bad_weight")((1,), (256,), (self.weights, np.int32(n),
                                                                      self._out.address + np.uint64(12)))
            self._out.done.record()

    def wait(self):
        self._out.done.synchronize()
        self._targets = None
        count, first_bad, first_ignored, first_bad_weight = (int(x) for x in self._out.view)
        return count, first_bad, first_ignored, first_bad_weight if self.weights is not None else len(self.rows)


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
