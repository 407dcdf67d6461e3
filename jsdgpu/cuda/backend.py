"""The GPU backend: the chunk loop's steps (jsdgpu.backend.Backend) over CuPy arrays, by the
products of products.py and the row kernels of kernels.py. Everything is queued on CuPy's current
stream; nothing in the chunk loop waits for the GPU, but the first product of each shape class in
a process, which times cuBLASLt's candidate algorithms (products.py)."""

import dataclasses
import functools
import os

import cupy
import ml_dtypes
import numpy as np

from .. import checks
from ..backend import HeldG, Rows
from . import kernels, products, sources, topk_kernels
from .sources import FUSED

FUSED_MAX_VOCAB = FUSED.max_vocab  # 131072 columns; wider rows take the phase kernels


@functools.lru_cache(maxsize=None)
def _compute_capability(device_id):
    return cupy.cuda.Device(device_id).compute_capability


def leading_dim(n):
    """Row pitch in elements: a multiple of 32, so every row starts 128-byte aligned."""
    return -(-n // 32) * 32


@dataclasses.dataclass
class CudaWork:
    """One call's buffers: both models' float32 logits for a chunk (rows padded to leading_dim),
    the biases as float32 padded with zeros, and the fused kernel where it runs."""
    ws: object
    wt: object
    bias_s: object
    bias_t: object
    logits_s: object
    logits_t: object
    ones: object         # [rows] of ones, for grad_bias's product (None without a student bias)
    fused: object        # the kernels.FusedKernel, or None: the three phase kernels run
    # where the phase kernels take the models' logits (LossOptions.models): the biases
    # model_logits adds (bias_s and bias_t, which the row kernels add, are then None); the fused
    # kernel adds the biases and makes the models' logits itself
    model_bias: tuple = (None, None)
    # made by the fused kernel's first launch (after the call's first products), not by prepare:
    row_counter: object = None  # its counter of rows handed out


class Selection:
    """The valid rows of a default call: select_rows launched (kernels.PendingSelection); rows:
    their indices, and row_target their targets, any prefix of which can be read on the device
    before wait(), the call's one wait for the GPU, gives the Rows."""

    def __init__(self, target, vocab, ignore_index, after, weights):
        self._target, self._vocab, self._ignore_index = target, vocab, ignore_index
        self._pending = kernels.PendingSelection(target, vocab, ignore_index, after, weights)
        self.rows, self.row_target = self._pending.rows, self._pending.row_target

    def wait(self, normalizer):
        """The Rows (normalizer(count): N); raises checks.target_error's ValueError for a bad
        target, then checks.weight_error's for a bad token weight."""
        n, weights = len(self._target), self._pending.weights
        count, first_bad, first_ignored, first_bad_weight = self._pending.wait()
        if first_bad < n:
            raise checks.target_error(first_bad, int(self._target[first_bad]), self._vocab, self._ignore_index)
        if first_bad_weight < n:
            raise checks.weight_error(first_bad_weight, float(weights[first_bad_weight]))
        valid_rows = None if count == n else self.rows[:count]
        return Rows(valid_rows, self._pending.row_target[:count], 1.0 / normalizer(count), count,
                    leading=first_ignored, weights=weights)


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


def _device_scalar(x):
    """x (a float, or a 0-d float32 device array) as a 0-d float32 device array."""
    return x if isinstance(x, cupy.ndarray) else cupy.full((), x, np.float32)


def _padded_bias(b, v):
    if b is None:
        return None
    out = cupy.zeros(leading_dim(v), np.float32)
    out[:v] = b
    return out


class CudaBackend:
    xp = cupy
    default_memory_budget = 5 * 2**29  # 2.5 GiB: T = 8192 at V = 128256 in 4 chunks
    queues_ahead = True

    @staticmethod
    def on_device(device):
        return cupy.cuda.Device(device)

    @staticmethod
    def select_rows(target, vocab, ignore_index, after=None, weights=None):
        """The valid rows, by one kernel whose results the host reads once it has run (Selection);
        with `after` (mark's), beside the stream's work since (kernels.beside). (Reading all the
        targets, checking and selecting them on the host, copying the selection back and gathering
        the rows by CuPy took 0.15-0.25 ms more a step at T = 1024 with half of the rows ignored:
        docs/design.md, "Ignored rows".)"""
        return Selection(target, vocab, ignore_index, after, weights)

    mark = staticmethod(kernels.mark)

    @staticmethod
    def mark_rows(target, vocab, ignore_index, num_valid_tokens):
        """Every row, the ignored ones masked, with nothing read by the host (a capturable call):
        the Rows, with 1/N on the device (NaN where a target is bad) and the status of
        kernels.mark_rows."""
        row_target, status, inv_n = kernels.mark_rows(target, vocab, ignore_index, num_valid_tokens)
        return Rows(None, row_target, inv_n, None, masked=True, status=status)

    take_rows = staticmethod(kernels.gather_rows)

    @staticmethod
    def scale_cast(a, scale, dtype, out=None):
        """a * scale (a float32 array of ours, scale None for 1) as dtype, in one pass (into out,
        where given)."""
        if np.dtype(dtype) != np.float32:
            return kernels.scale_cast(a, scale, dtype, out)
        if scale is not None:
            a *= scale
        if out is None:
            return a
        cupy.copyto(out, a)
        return out

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def bytes_per_row(vs, vt, dtype, compute_grad, fused):
        """Bytes per row of the logits chunk, of G held for all rows, and of G per chunk (0
        where the fused kernel writes it over the logits; both 0 without gradients)."""
        grad = np.dtype(dtype).itemsize * leading_dim(vs) if compute_grad else 0
        fused = fused and vt <= FUSED_MAX_VOCAB
        return 4 * (leading_dim(vs) + leading_dim(vt)), grad, 0 if fused else grad

    @staticmethod
    def ahead_key(xs, ws):
        """What queueing xs @ ws.T ahead of a call's checks depends on (ahead.FirstProduct): both
        CuPy arrays, C-contiguous (the product reads them as they are), their shapes, dtypes and
        strides, on the current device, with the current stream not capturing (a capture takes
        the capturable path, which queues nothing ahead); None where that is not so."""
        if (type(xs) is not cupy.ndarray or type(ws) is not cupy.ndarray or not xs.flags.c_contiguous
                or not ws.flags.c_contiguous):
            return None
        device = xs.data.device_id
        if device != cupy.cuda.runtime.getDevice() or cupy.cuda.get_current_stream().is_capturing():
            return None
        return xs.shape, xs.dtype, xs.strides, ws.shape, ws.dtype, ws.strides, ws.data.device_id, device

    @staticmethod
    def logits_ahead(xs, ws, rows, head):
        """The student logits' buffer for chunks of `rows` rows, with the products of xs's first
        head rows queued into it."""
        logits = cupy.empty((rows, leading_dim(ws.shape[0])), np.float32)
        # no slice where the head is all of an array: each took 2-4 µs of this host time
        products.logits(xs if head == len(xs) else xs[:head], ws, logits if head == rows else logits[:head])
        return logits

    @staticmethod
    def prepare(ws, wt, bs, bt, rows, fused, logits_s=None, models=None):
        """The buffers for chunks of `rows` rows (logits_s: the student logits', where
        logits_ahead made it); with fused (and a teacher vocabulary of at most FUSED_MAX_VOCAB),
        the fused row kernel. models: LossOptions.models (without the fused kernel, the biases
        then model_logits')."""
        vs, vt = ws.shape[0], wt.shape[0]
        fused = fused and vt <= FUSED_MAX_VOCAB
        biases = _padded_bias(bs, vs), _padded_bias(bt, vt)
        in_passes = models is not None and not fused
        return CudaWork(
            ws=ws, wt=wt, bias_s=None if in_passes else biases[0], bias_t=None if in_passes else biases[1],
            model_bias=biases if in_passes else (None, None),
            logits_s=cupy.empty((rows, leading_dim(vs)), np.float32) if logits_s is None else logits_s,
            logits_t=cupy.empty((rows, leading_dim(vt)), np.float32),
            ones=cupy.ones(rows, ws.dtype) if bs is not None else None,
            fused=kernels.fused_kernel(cupy.cuda.Device().id, ws.dtype) if fused else None)

    @staticmethod
    def gradient_rows(work, g_rows, own_g):
        """G for g_rows rows. With the fused kernel it is the student logits' memory (the kernel
        writes a row's gradient over the row once every CTA of its cluster has read it; a 16-bit
        row takes the first half of the float32 one) unless own_g: G held for all rows, or kept
        apart so that the logits can be used again."""
        if work.fused is not None and not own_g:
            return work.logits_s.view(work.ws.dtype)[:g_rows]
        return cupy.empty((g_rows, leading_dim(work.ws.shape[0])), work.ws.dtype)

    @staticmethod
    def logits(work, xs, xt, at=0, student=True):
        """The logits of rows [at, at + len(xs)) of the chunk (the teacher's alone where not
        student)."""
        stop = at + xs.shape[0]
        if student:
            products.logits(xs, work.ws, work.logits_s[at:stop])
        products.logits(xt, work.wt, work.logits_t[at:stop])

    @staticmethod
    def model_logits(work, rows, models):
        """The chunk's first `rows` rows of both models' logits as the models' (models:
        LossOptions.models), in place, their biases added."""
        for logits, w, bias, (scale, cap) in zip((work.logits_s, work.logits_t), (work.ws, work.wt), work.model_bias,
                                                 models):
            kernels.model_logits(logits, rows, w.shape[0], bias, scale, cap)

    @staticmethod
    def model_gradient(work, G, model, target, label_terms):
        """G, the chunk's gradient in the student's logits as its model's (model: its (scale, cap);
        model_logits' logits there), to the gradient in its raw logits, in place, with the rows'
        label terms (None: none) at their labels (target >= 0)."""
        kernels.model_gradient(G, work.logits_s, work.ws.shape[0], *model, target, label_terms)

    @staticmethod
    def _row_inputs(work, target):
        return (work.logits_s, work.logits_t, work.bias_s, work.bias_t, target, work.ws.shape[0],
                work.wt.shape[0])

    @staticmethod
    def fused_rows(work, target, opts, ce, jsd, G, label_terms):
        """The fused row kernel over the chunk's logits (G None: the loss alone), on the models'
        logits (opts.models: the kernel makes them, and G is the gradient in the raw logits)."""
        if work.row_counter is None:  # made at the first launch, not before the call's first product
            work.row_counter = cupy.empty(1, np.int32)  # zeroed by each launch
        kernels.launch_fused_rows(work.fused, len(target), *CudaBackend._row_inputs(work, target), opts, ce, jsd, G,
                                  label_terms, work.row_counter)

    # ---- the top-k loss (jsdgpu.topk) and teacher_topk ----

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
        bias = _padded_bias(bs, vs)
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
    def teacher_topk_rows(work, rows, k, temperature, ids, logprobs):
        if k > topk_kernels.TEACHER_TOPK_MAX_K:
            raise ValueError(f"k = {k}: on the GPU, teacher_topk sorts each row's k in shared memory, which holds "
                             f"at most {topk_kernels.TEACHER_TOPK_MAX_K}")
        topk_kernels.teacher_topk(work.logits_s[:rows], work.bias_s, work.ws.shape[0], k, temperature, ids, logprobs)

    @staticmethod
    def row_stats(work, target, opts):
        return kernels.phase_stats(CudaBackend._row_inputs(work, target), opts)

    @staticmethod
    def row_kl(work, target, stats, opts):
        return kernels.phase_kl(CudaBackend._row_inputs(work, target), opts, stats)

    @staticmethod
    def row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms):
        kernels.phase_finish(work.ws.dtype, CudaBackend._row_inputs(work, target), opts, stats, kl,
                             ce, jsd, G, label_terms)

    @staticmethod
    def zero_masked_rows(G, target):
        """G's rows whose target is -1 zeroed (a capturable call's ignored rows)."""
        kernels.zero_rows(target, G)

    @staticmethod
    def add_label_terms(work, label_terms, target, xs, inv_n, grads):
        """The label terms the row kernel left out of G, added exactly in float32 for the rows
        whose label this rank owns (target >= 0; label_terms is 0 elsewhere): to grad_input, and
        to the grad_weight sums (where there are) and grad_bias."""
        inv_n = _device_scalar(inv_n)
        kernels.label_rows(label_terms, target, work.ws, inv_n, grads.grad_input)
        if grads.grad_weight is not None or grads.grad_bias is not None:
            kernels.label_scatter(label_terms, target, xs, inv_n, None, grads.grad_weight, grads.grad_bias)

    @staticmethod
    def grad_products(work, G, xs, inv_n, grads, start, stop, input_made=False):
        """grad_input rows, and the chunk's part of the grad_weight and grad_bias sums (where
        grad_weight is None, weight_product makes it later)."""
        vs = work.ws.shape[0]
        accumulate = 0.0 if start == 0 else 1.0
        grad_input = grads.grad_input[start:stop]
        if not input_made:
            products.input_gradient(G, work.ws, inv_n, grad_input)
        ones = work.ones[:stop - start] if grads.grad_bias is not None else None
        if grads.g_scale is not None:  # G's rows are scaled: grad_input's rows, and the rows G's sums take
            scale = grads.g_scale[start:stop]
            grad_input *= (scale * inv_n if input_made else scale)[:, None]
            if grads.grad_weight is not None:
                xs = kernels.scale_rows(xs, scale)
            if ones is not None:  # (not scale_cast: a chunk's slice of the scales need not be 16-byte aligned)
                ones = scale.astype(ones.dtype)
        elif input_made:
            grad_input *= inv_n
        if grads.grad_weight is not None:
            products.weight_gradient(G, vs, xs, inv_n, accumulate, grads.grad_weight)
        if ones is not None:
            products.bias_gradient(G, vs, ones, inv_n, accumulate, grads.grad_bias)

    @staticmethod
    def input_product(work, G, out):
        products.input_gradient(G, work.ws, 1.0, out)

    @staticmethod
    def hold_g(work, G, xs, inv_n, label_terms, target, g_scale=None):
        """What weight_product needs of G held for all rows (work's logits are not kept)."""
        return HeldG(G, work.ws.shape[0], xs, inv_n, label_terms, target, g_scale)

    @staticmethod
    def weight_product(held, scale, dtype, out=None):
        """grad_weight = inv_n scale (G.T @ Xs + the label terms), G over all rows; scale: a 0-d
        float32 device array, or None for 1. The product is written in dtype by cuBLAS; in 16
        bits, the rows of labels kept out of G are rounded twice (the product, then with the
        label terms added), the others once. Into out, where given."""
        out = cupy.empty((held.vocab, held.xs.shape[1]), dtype) if out is None else out
        inv_n = _device_scalar(held.inv_n)
        alpha = held.inv_n if scale is None else scale * inv_n
        # G's row scales go with the rows of Xs here, not in forward: a forward may never be backpropagated
        xs_g = held.xs if held.g_scale is None else kernels.scale_rows(held.xs, held.g_scale)
        products.weight_gradient(held.G, held.vocab, xs_g, alpha, 0.0, out)
        kernels.label_scatter(held.label_terms, held.target, held.xs, inv_n, scale, out, None)
        return out
