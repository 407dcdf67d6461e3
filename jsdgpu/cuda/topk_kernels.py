"""Loading and launching the top-k loss's kernels (topk_rows.cu, topk_logits.cu): its row work, its
checks, the own logits product (compiled for sm_90a and launched through the driver, its operands
by tensor map) and its finishing kernel, and the teacher's top-k. The loading and the selection's
streams are jsdgpu.cuda.kernels'. Everything is queued on CuPy's current stream.
"""

import contextlib
import ctypes
import functools

import cupy
import numpy as np
from cupy.cuda import driver

from . import sources
from .kernels import (_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, _NULL, _driver, _per_thread_and_device, _pointer,
                      beside, function, kernel_ids, sm_count)

_TENSOR_MAP_BFLOAT16, _TENSOR_MAP_SWIZZLE_128B, _TENSOR_MAP_L2_256B = 9, 3, 3  # cuda.h's enums


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


def topk_finish_launch(target, vs, ids, lq, opts, bucket, ce, soft, G, label_terms, row_scale, partials, ref,
                       slot_logits, xs, ws, bias, bitmap, ready, slots_before):
    """(grid, block, arguments, dynamic shared bytes) of topk_finish's kernel over the chunk's rows,
    None where it has none (how experiments/finish_phases.py launches a variant of the kernel)."""
    rows, k = ids.shape
    if not rows:
        return None
    return ((rows,), (sources.TOPK_FINISH_THREADS,),
            (slot_logits, np.int64(slot_logits.shape[1]), target, np.int32(vs), ids, lq, np.int32(k),
             np.int32(opts.divergence), np.int32(bucket), np.float64(opts.beta), np.float64(opts.one_minus_beta),
             np.float32(opts.weight_hard_loss), np.float32(opts.w_soft_over_t), ce, soft, G, np.int64(G.shape[1]),
             label_terms, row_scale, partials, np.int32(partials.shape[1]), ref, xs, ws, np.int32(ws.shape[1]),
             _pointer(bias), bitmap, np.int32(bitmap.shape[1]), ready, slots_before),
            12 * k)  # per slot its logit, id and log-probability


def topk_finish(*args):
    """The rows' results after topk_logits (topk_rows.cu, FUSED): ce, soft, label_terms, and G
    (G~ kept or rescaled, the slots' and label's columns written over) with its row scales
    (arguments: topk_finish_launch's)."""
    launch = topk_finish_launch(*args)
    if launch is not None:
        grid, block, arguments, shared = launch
        _with_shared(function("topk_rows", sources.topk_finish()), shared)(grid, block, arguments, shared_mem=shared)


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
