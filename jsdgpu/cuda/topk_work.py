"""The GPU backend's row work of the top-k loss and teacher_topk (jsdgpu.backend.TopKRowWork):
the top-k's checks, one head's logits (cuBLAS's, or the product of our own whose epilogue does
the row kernel's streaming work: topk_logits.cu) and the top-k row kernels (topk_kernels.py)."""

import dataclasses
import functools
import os

import cupy
import ml_dtypes
import numpy as np

from .. import checks
from ..topk_shards import sharded_topk_rows
from . import kernels, products, sources, topk_kernels
from .steps import leading_dim, padded_bias


@functools.lru_cache(maxsize=None)
def _compute_capability(device_id):
    return cupy.cuda.Device(device_id).compute_capability


@dataclasses.dataclass
class TopKWork:
    """One top-k call's buffers (or teacher_topk's): the LM head, its bias as float32 padded with
    zeros, a chunk's float32 logits, and ones for grad_bias's product; with the own product
    (OwnProduct) its buffers instead of the logits."""
    ws: object
    bias_s: object
    logits_s: object
    ones: object
    own: object = None
    model_bias: object = None  # as CudaWork's, of the one head


# The top-k loss's logits product of our own (topk_logits.cu), whose epilogue does the row
# kernel's streaming work, where it can run: by default for calls of OWN_TOPK_MIN_ROWS rows or
# more, else cuBLAS's product and the row kernel. Per chunk the own one is faster, but its call
# starts later (its product waits for the call's checks and setup, where cuBLAS's is queued ahead
# of them: ahead.FirstProduct): in turns in one process, whole steps were 2-5% faster with it at
# T = 4096 and 8192, 0-3% at 2048, 1-2% at 1024 and the same at 512 (docs/design.md, "Top-k: the
# logits product of our own").
# JSDGPU_TOPK_PRODUCT=own (or =cublas) in the environment takes it (or not) at every T:
# OWN_TOPK_PRODUCT True (False), None by rows.
OWN_TOPK_PRODUCT = {"own": True, "cublas": False}.get(os.environ.get("JSDGPU_TOPK_PRODUCT"))
OWN_TOPK_MIN_ROWS = 1024
# Its chunks: at most this many rows (per 1024 rows the product took 0.929, 0.905 and 0.911 ms in
# chunks of 1024, 2048 and 4096; the step at T = 4096 0.2 ms longer in one chunk than in two), and
# k at most this many slots (topk_finish holds each slot's logit, id and log-probability in shared
# memory: 96 KiB at 8192)
OWN_TOPK_CHUNK_ROWS = 2048
OWN_TOPK_MAX_SLOTS = 8192


class OwnProduct:
    """The own product's buffers for chunks of `rows` rows of k slots: the slots' bitmap and, per
    column tile, the row's slot columns before it (topk_slot_bits'), the slots' logits (k a row,
    packed in the order topk_rows.cu's FromProduct::place gives), the rows' G~ references and
    their flags, the tiles' partials (topk_logits.cu), and the LM head's tensor map. The flags
    start zeroed, and topk_finish clears them after each chunk; topk_slot_bits writes every word
    of a chunk's bitmap."""

    def __init__(self, ws, rows, k):
        vs = ws.shape[0]
        n_tiles = self.column_tiles(vs)
        self.bitmap = cupy.empty((rows, n_tiles * sources.TOPK_LOGITS_TILE[1] // 32), np.uint32)
        self.slots_before = cupy.empty((rows, n_tiles), np.int32)
        self.ready = cupy.zeros(-(-rows // 64), np.int32)  # a flag per 64 rows
        self.ref = cupy.empty(rows, np.float32)
        self.partials = cupy.empty((rows, n_tiles, 4), np.float32)
        self.slot_logits = cupy.empty((rows, k), np.float32)
        self.map_w = topk_kernels.topk_head_map(ws)

    @staticmethod
    def column_tiles(vs):
        return -(-vs // sources.TOPK_LOGITS_TILE[1])

    @classmethod
    def bytes_per_row(cls, vs, k):
        n_tiles = cls.column_tiles(vs)
        return (16 + 4 * 8 + 4) * n_tiles + 4 * k + 8


class PendingTopKCheck:
    """The top-k's checks launched. Default call: wait() (after the selection's wait, which
    follows them on the stream) raises checks.topk_error's ValueError for the first bad row.
    Capturable call: poisoned(inv_n, n_rows) gives 1/N, NaN where a row is bad, and the first bad
    row (n_rows where none), on the device."""

    def __init__(self, ids, lq, vocab, bucket, capturable, after):
        self._vocab = vocab
        self._pending = topk_kernels.PendingTopKCheck(ids, lq, vocab, bucket, checks.TOPK_SUM_SLACK, not capturable,
                                                      after)

    def wait(self):
        problem = self._pending.result()
        if problem is not None:
            raise checks.topk_error(*problem, self._vocab)

    def poisoned(self, inv_n, n_rows):
        return self._pending.poisoned(inv_n, n_rows)


class CudaTopKRows:
    """The top-k loss's row work (and teacher_topk's); static methods, as every part of the
    backend."""
    @staticmethod
    def topk_check(ids, lq, vocab, bucket, capturable, after=None):
        """The checks of the top-k, launched (PendingTopKCheck; `after` as select_rows'); a default
        call's wait() must follow the selection's."""
        return PendingTopKCheck(ids, lq, vocab, bucket, capturable, after)

    @staticmethod
    def topk_own_product(opts, xs, ws, k, compute_grad):
        """Where topk_logits.cu runs: sm_90 (wgmma), bf16, temperature 1 (the rest's gradient one
        exponential of the logits: G~ for every column), the plain logits (no scale or soft cap:
        its epilogue takes the product as it comes), with gradients (its finishing kernel
        writes G), k up to OWN_TOPK_MAX_SLOTS, and rows whose 16-byte pieces the Tensor Memory
        Accelerator can address; by default from OWN_TOPK_MIN_ROWS rows on."""
        bf16 = np.dtype(ml_dtypes.bfloat16)
        chosen = OWN_TOPK_PRODUCT if OWN_TOPK_PRODUCT is not None else xs.shape[0] >= OWN_TOPK_MIN_ROWS
        return (chosen and compute_grad and opts.temperature == 1.0 and opts.models is None and ws.dtype == bf16
                and k <= OWN_TOPK_MAX_SLOTS
                and xs.dtype == bf16 and ws.shape[1] % 8 == 0 and xs.data.ptr % 16 == 0 and ws.data.ptr % 16 == 0
                and _compute_capability(ws.data.device_id) == "90")

    @staticmethod
    def topk_bytes_per_row(vs, dtype, compute_grad, own=False, k=None):
        """Bytes per row of the logits chunk (the own product's buffers for k slots where own), of
        G held for all rows, and of G per chunk (G is apart from the logits: the slots' pass reads
        the logits after G's streaming pass)."""
        grad = np.dtype(dtype).itemsize * leading_dim(vs) if compute_grad else 0
        return OwnProduct.bytes_per_row(vs, k) if own else 4 * leading_dim(vs), grad, grad

    @staticmethod
    def topk_chunk_rows(own):
        return OWN_TOPK_CHUNK_ROWS if own else None

    @staticmethod
    def topk_prepare(ws, bs, rows, logits_s=None, own=False, k=None, model=None):
        vs = ws.shape[0]
        if own:
            logits_s = None
        elif logits_s is None:
            logits_s = cupy.empty((rows, leading_dim(vs)), np.float32)
        bias = padded_bias(bs, vs)
        return TopKWork(ws, None if model else bias, logits_s, cupy.ones(rows, ws.dtype) if bs is not None else None,
                        OwnProduct(ws, rows, k) if own else None, bias if model else None)

    @staticmethod
    def topk_model_logits(work, rows, model):
        """The chunk's first `rows` rows of logits as the model's (model: its (scale, cap)), in
        place, its bias added (topk_prepare's model)."""
        kernels.model_logits(work.logits_s, rows, work.ws.shape[0], work.model_bias, *model)

    @staticmethod
    def topk_gradient_rows(work, g_rows):
        return cupy.empty((g_rows, leading_dim(work.ws.shape[0])), work.ws.dtype)

    @staticmethod
    def head_logits(work, xs, at=0):
        """The logits of rows [at, at + len(xs)) of the chunk (unbiased: the kernels add the bias)
        into work.logits_s (none with the own product: topk_own_logits stands for them)."""
        if work.own is None:
            products.logits(xs, work.ws, work.logits_s[at:at + xs.shape[0]])

    @staticmethod
    def topk_scales_g(opts, dtype):
        """Where the rest's gradient is one exponential of the logits (no temperature, or no hard
        part), the row kernel reads the row once, writing G scaled (topk_rows.cu); not in float16,
        whose range would not hold it."""
        return np.dtype(dtype) != np.float16 and (opts.temperature == 1.0 or opts.weight_hard_loss == 0.0)

    @staticmethod
    def topk_own_logits(work, x, ids, lq, G):
        own, vs = work.own, work.ws.shape[0]
        topk_kernels.topk_slot_bits(ids, lq, vs, own.bitmap[:len(x)], own.slots_before[:len(x)])
        topk_kernels.topk_logits(x, own.map_w, G, vs, work.bias_s, own.bitmap, own.ref, own.ready, own.partials,
                            own.slot_logits, own.slots_before)

    @staticmethod
    def topk_rows(work, ids, lq, target, opts, missing_mass, ce, soft, G, label_terms, g_scale=None, x=None):
        vs, own = work.ws.shape[0], work.own
        if own is None:
            topk_kernels.topk_rows(work.logits_s, work.bias_s, target, vs, ids, lq, opts, missing_mass == "bucket",
                              ce, soft, G, label_terms, g_scale)
            return
        topk_kernels.topk_finish(target, vs, ids, lq, opts, missing_mass == "bucket", ce, soft, G, label_terms, g_scale,
                            own.partials, own.ref, own.slot_logits, x, work.ws, work.bias_s, own.bitmap, own.ready,
                            own.slots_before)

    @staticmethod
    def topk_rows_sharded(work, ids, lq, target, opts, missing_mass, shard, ce, soft, G, label_terms):
        """jsdgpu.topk_shards' row work, in CuPy's array operations (no kernel of its own), on the
        chunk's logits with their bias; a 16-bit G keeps the label's one-hot term apart where it
        would dominate (label_terms), as topk_rows does."""
        n, vs = len(target), work.ws.shape[0]
        s = work.logits_s[:n, :vs]
        if work.bias_s is not None:
            s = s + work.bias_s[:vs]
        sixteen = G is not None and G.dtype != np.float32
        g = sharded_topk_rows(cupy, s, shard, ids, lq, target, opts, missing_mass, ce, soft, G is not None,
                              label_terms if sixteen else None)
        if g is None:
            return
        if not sixteen:
            G[:, :vs] = g
            return
        padded = cupy.zeros(G.shape, np.float32)  # G's rows whole (its pad columns 0), cast in one pass
        padded[:, :vs] = g
        kernels.scale_cast(padded, None, G.dtype, G)

    @staticmethod
    def teacher_topk_rows(work, rows, k, temperature, ids, logprobs):
        if k > topk_kernels.TEACHER_TOPK_MAX_K:
            raise ValueError(f"k = {k}: on the GPU, teacher_topk sorts each row's k in shared memory, which holds "
                             f"at most {topk_kernels.TEACHER_TOPK_MAX_K}")
        topk_kernels.teacher_topk(work.logits_s[:rows], work.bias_s, work.ws.shape[0], k, temperature, ids, logprobs)
