"""The CPU backend: NumPy float32 matrix products and the Numba row kernels of rows.py, through
the chunk loop's steps (jsdgpu.backend.Backend)."""

import contextlib
import dataclasses

import numpy as np

from .. import checks
from ..backend import HeldG, Rows
from ..options import divisor
from .rows import finish_kernel, fused_kernel, kl_kernel, stats_kernel
from .topk import teacher_topk_rows, topk_rows


@dataclasses.dataclass
class CpuWork:
    """One call's buffers: both heads in float32, and a chunk's logits (s, t)."""
    ws: object
    wt: object
    bs: object
    bt: object
    s: object
    t: object
    fused: bool = False  # the fused row kernel (where no communicator combines ranks), else the three phases
    part: object = None  # a block of a chunk's part of grad_weight, made at the second chunk (grad_products)


def _f32(a):
    return None if a is None else a.astype(np.float32, copy=False)


@dataclasses.dataclass
class TopKWork:
    """One top-k call's buffers (or teacher_topk's): the LM head and bias in float32, and a
    chunk's logits."""
    ws: object
    bs: object
    s: object
    part: object = None  # as CpuWork's


class CheckedTopK:
    """topk_check's result on the CPU, checked at once: problem, (row, code) of the first bad row
    or None. As the GPU's: wait() raises for it; poisoned(inv_n, n_rows) gives (1/N, NaN where a
    row is bad; the first bad row, n_rows where none), for a capturable call."""

    def __init__(self, problem, vocab):
        self.problem, self._vocab = problem, vocab

    def wait(self):
        if self.problem is not None:
            raise checks.topk_error(*self.problem, self._vocab)

    def poisoned(self, inv_n, n_rows):
        if self.problem is None:
            return inv_n, np.int32(n_rows)
        return float("nan"), np.int32(self.problem[0])


# what the finish kernel takes for G and label_terms without gradients: arrays of the types Numba
# compiled it for (one compiled kernel), which it does not touch
_NO_G, _NO_TERMS = np.empty((0, 0), np.float32), np.empty(0, np.float32)


class Selection:
    """The valid rows, selected on the host at once (nothing to overlap, and no head queued ahead
    of it: CpuBackend.queues_ahead)."""

    def __init__(self, target, vocab, ignore_index, weights):
        self._valid = checks.check_target(target, vocab, ignore_index)
        self._target = target
        self._weights = None if weights is None else np.ascontiguousarray(weights, dtype=np.float32)
        if self._weights is not None:
            bad = np.flatnonzero(~checks.good_weights(np, self._weights))
            if len(bad):
                raise checks.weight_error(int(bad[0]), float(self._weights[bad[0]]))

    def wait(self, normalizer):
        n, valid = len(self._target), self._valid
        count = len(valid)
        return Rows(None if count == n else valid, self._target[valid].astype(np.int32), 1.0 / normalizer(count),
                    count, weights=self._weights)


# rows of the vocabulary a block of a chunk's part of grad_weight takes (CpuBackend.grad_products):
# 16 MiB at H = 256
PART_ROWS = 16384


class CpuBackend:
    xp = np
    default_memory_budget = 256 * 2**20
    # No head ahead of the selection: nothing runs meanwhile, and NumPy's float32 products give a
    # row different last bits in products of different row counts, so a head sized by the last
    # call would make a call's bits depend on the calls before it
    queues_ahead = False

    @staticmethod
    def on_device(device):
        return contextlib.nullcontext()

    @staticmethod
    def select_rows(target, vocab, ignore_index, after=None, weights=None):
        """The rows whose target is not ignore_index; checks.target_error's ValueError for a bad
        target, then checks.weight_error's for a bad token weight."""
        return Selection(target, vocab, ignore_index, weights)

    @staticmethod
    def mark():
        """Nothing to wait for: the CPU's work is done as it is called."""
        return None

    @staticmethod
    def ahead_key(xs, ws):
        """None: nothing is queued ahead here (queues_ahead)."""
        return None

    @staticmethod
    def logits_ahead(xs, ws, rows, head):
        raise NotImplementedError("the CPU backend queues nothing ahead (its ahead_key is None)")

    @staticmethod
    def mark_rows(target, vocab, ignore_index, num_valid_tokens):
        """Every row, the ignored ones (and any bad one) masked with target -1, as a capturable
        call on the GPU computes them: a bad target makes 1/N NaN (status: the count, the first
        bad row, len(target) where none)."""
        valid, bad = checks.target_masks(target, vocab, ignore_index)
        first_bad = int(np.flatnonzero(bad)[0]) if bad.any() else len(target)
        count = int(valid.sum())
        inv_n = float("nan") if bad.any() else 1.0 / divisor(num_valid_tokens, count)
        row_target = np.where(valid, np.asarray(target, np.int64), -1).astype(np.int32)
        return Rows(None, row_target, inv_n, None, masked=True, status=np.array([count, first_bad], np.int32))

    @staticmethod
    def take_rows(rows, a, b):
        """The given rows of a and of b."""
        return a[rows], b[rows]

    @staticmethod
    def scale_cast(a, scale, dtype, out=None):
        """a * scale (a float32 array of ours, scale None for 1) as dtype (into out, where given)."""
        if scale is not None:
            a *= scale
        if out is None:
            return a.astype(dtype, copy=False)
        out[...] = a
        return out

    @staticmethod
    def bytes_per_row(vs, vt, dtype, compute_grad, fused):
        """Bytes per row of the logits chunk, of G held for all rows and of G per chunk (0
        without gradients)."""
        grad = 4 * vs if compute_grad else 0
        return 4 * (vs + vt), grad, grad

    @staticmethod
    def prepare(ws, wt, bs, bt, rows, fused, logits_s=None, models=None):
        s = np.empty((rows, ws.shape[0]), np.float32) if logits_s is None else logits_s
        return CpuWork(_f32(ws), _f32(wt), _f32(bs), _f32(bt), s, np.empty((rows, wt.shape[0]), np.float32), fused)

    @staticmethod
    def gradient_rows(work, g_rows, own_g):
        return np.empty((g_rows, work.ws.shape[0]), np.float32)

    @staticmethod
    def model_logits(work, rows, models):
        """The chunk's first `rows` rows of both models' logits (biased already) as the models'
        (models: LossOptions.models), in place."""
        for z, model in zip((work.s[:rows], work.t[:rows]), models):
            _model_logits(z, *model)

    @staticmethod
    def topk_model_logits(work, rows, model):
        """The chunk's first `rows` rows of logits (biased already) as the model's, in place."""
        _model_logits(work.s[:rows], *model)

    @staticmethod
    def model_gradient(work, G, model, target, label_terms):
        """G, the chunk's gradient in the student's logits as its model's (model: its (scale, cap);
        model_logits' logits there), to the gradient in its raw logits, in place, with the rows'
        label terms (None: none) at their labels (target >= 0)."""
        scale, cap = model
        if cap is None:  # the scale alone: one factor for every column
            G *= np.float32(scale)
            if label_terms is not None:
                label_terms *= np.float32(scale)
            return
        factor = scale * (1.0 - np.square(work.s[:len(G)] / np.float32(cap)))
        G *= factor
        if label_terms is not None:
            owned = np.flatnonzero(target >= 0)
            label_terms[owned] *= factor[owned, target[owned]]

    @staticmethod
    def logits(work, xs, xt, at=0, student=True):
        """The logits of rows [at, at + len(xs)) of the chunk (the teacher's alone where not
        student, as the protocol says; the CPU queues nothing ahead, so its calls ask for both)."""
        rows = slice(at, at + xs.shape[0])
        if student:
            np.matmul(xs.astype(np.float32), work.ws.T, out=work.s[rows])
            if work.bs is not None:
                work.s[rows] += work.bs
        np.matmul(xt.astype(np.float32), work.wt.T, out=work.t[rows])
        if work.bt is not None:
            work.t[rows] += work.bt

    # ---- the top-k loss (jsdgpu.topk) and teacher_topk ----

    @staticmethod
    def topk_check(ids, lq, vocab, bucket, capturable, after=None):
        """The top-k checked (CheckedTopK)."""
        return CheckedTopK(checks.topk_problem(ids, lq, vocab, bucket), vocab)

    @staticmethod
    def topk_own_product(opts, xs, ws, k, compute_grad):
        return False

    @staticmethod
    def topk_bytes_per_row(vs, dtype, compute_grad, own=False, k=None):
        """Bytes per row of the logits chunk, of G held for all rows, and of G per chunk."""
        grad = 4 * vs if compute_grad else 0
        return 4 * vs, grad, grad

    @staticmethod
    def topk_chunk_rows(own):
        return None

    @staticmethod
    def topk_prepare(ws, bs, rows, logits_s=None, own=False, k=None, model=None):
        s = np.empty((rows, ws.shape[0]), np.float32) if logits_s is None else logits_s
        return TopKWork(_f32(ws), _f32(bs), s)

    @staticmethod
    def topk_gradient_rows(work, g_rows):
        return np.empty((g_rows, work.ws.shape[0]), np.float32)

    @staticmethod
    def head_logits(work, xs, at=0):
        """The logits of rows [at, at + len(xs)) of the chunk, biased, into work.s."""
        s = work.s[at:at + xs.shape[0]]
        np.matmul(xs.astype(np.float32), work.ws.T, out=s)
        if work.bs is not None:
            s += work.bs

    @staticmethod
    def topk_own_logits(work, x, ids, lq, G):
        raise NotImplementedError("the CPU backend has no logits product of its own (topk_own_product is False)")

    @staticmethod
    def topk_scales_g(opts, dtype):
        return False  # G is stored as it is

    @staticmethod
    def topk_rows(work, ids, lq, target, opts, missing_mass, ce, soft, G, label_terms, g_scale=None, x=None):
        """The top-k row work (cpu/topk.py); the label's one-hot term stays in G (float32)."""
        topk_rows(work.s[:len(target)], ids, lq, target, opts, missing_mass, ce, soft, G)

    @staticmethod
    def teacher_topk_rows(work, rows, k, temperature, ids, logprobs):
        ids[...], logprobs[...] = teacher_topk_rows(work.s[:rows], k, temperature)

    @staticmethod
    def fused_rows(work, target, opts, ce, jsd, G, label_terms):
        """The fused row kernel on the models' logits (opts.models: made in place first, and G
        taken back to the raw logits' after)."""
        n = len(target)
        compute_grad = G is not None
        if opts.models is not None:
            CpuBackend.model_logits(work, n, opts.models)
        fused_kernel(work.s[:n], work.t[:n], target, 1.0 / opts.temperature, int(opts.divergence), opts.beta,
                     opts.weight_hard_loss, opts.w_soft_over_t, ce, jsd, G if compute_grad else _NO_G,
                     label_terms if compute_grad else _NO_TERMS, compute_grad)
        if opts.models is not None and compute_grad:
            CpuBackend.model_gradient(work, G, opts.models[0], target, label_terms)

    @staticmethod
    def row_stats(work, target, opts):
        n = len(target)
        stats = np.empty((7, n))
        stats_kernel(work.s[:n], work.t[:n], target, 1.0 / opts.temperature, stats)
        return stats

    @staticmethod
    def row_kl(work, target, stats, opts):
        n = len(target)
        kl = np.empty((2, n))
        kl_kernel(work.s[:n], work.t[:n], 1.0 / opts.temperature, int(opts.divergence), opts.beta, stats, kl)
        return kl

    @staticmethod
    def row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms):
        n = len(target)
        compute_grad = G is not None
        finish_kernel(work.s[:n], work.t[:n], target, 1.0 / opts.temperature, int(opts.divergence), opts.beta,
                      opts.weight_hard_loss, opts.w_soft_over_t, stats, kl, ce, jsd,
                      G if compute_grad else _NO_G, label_terms if compute_grad else _NO_TERMS, compute_grad)

    @staticmethod
    def zero_masked_rows(G, target):
        G[target < 0] = 0.0

    @staticmethod
    def grad_products(work, G, xs, inv_n, grads, start, stop, input_made=False):
        """The chunk's rows of grad_input, and its parts of grad_weight (where G is not held) and
        grad_bias, 1/N applied, into the sums and one block buffer made once a call: a fresh
        [V, H] product a chunk (its pages faulted in anew) and its scaled copy took 0.5 s of a
        1.4 s step at T = 512, V = 128256, and held the sum's memory twice (docs/design.md, "The
        CPU backend")."""
        inv_n = np.float32(inv_n)
        grad_input = grads.grad_input[start:stop]
        if not input_made:
            np.matmul(G, work.ws, out=grad_input)
        # G's row scales (the token weights) go with the rows of grad_input and of Xs
        rows = inv_n if grads.g_scale is None else grads.g_scale[start:stop, None] * inv_n
        grad_input *= rows
        if grads.grad_weight is not None:  # else weight_product makes it
            # 1/N on the chunk's inputs, which are small ([rows, H]): the first chunk writes, the
            # others add their product, PART_ROWS rows of the vocabulary at a time (a [V, H]
            # product would hold the sum's memory twice)
            xs_n = xs.astype(np.float32) * rows
            if start == 0:
                np.matmul(G.T, xs_n, out=grads.grad_weight)
            else:
                if work.part is None:
                    work.part = np.empty((min(PART_ROWS, G.shape[1]), xs.shape[1]), np.float32)
                for v0 in range(0, G.shape[1], PART_ROWS):
                    part = work.part[:min(PART_ROWS, G.shape[1] - v0)]
                    np.matmul(G[:, v0:v0 + len(part)].T, xs_n, out=part)
                    grads.grad_weight[v0:v0 + len(part)] += part
        if grads.grad_bias is not None:
            part = G.sum(axis=0) if grads.g_scale is None else grads.g_scale[start:stop] @ G
            if start == 0:
                np.multiply(part, inv_n, out=grads.grad_bias)
            else:
                grads.grad_bias += part * inv_n

    @staticmethod
    def input_product(work, G, out):
        np.matmul(G, work.ws, out=out)

    @staticmethod
    def add_label_terms(work, label_terms, target, xs, inv_n, grads):
        """The label terms the row kernel left out of G, added exactly, for the rows whose label
        this rank owns (target >= 0; np.add.at adds in row order, so the result does not vary)."""
        owned, labels, terms = _owned_label_terms(label_terms, target, np.float32(inv_n))
        grads.grad_input[owned] += terms[:, None] * work.ws[labels]
        if grads.grad_weight is not None:
            _add_label_rows(grads.grad_weight, owned, labels, terms, xs)
        if grads.grad_bias is not None:
            np.add.at(grads.grad_bias, labels, terms)

    @staticmethod
    def hold_g(work, G, xs, inv_n, label_terms, target, g_scale=None):
        return HeldG(G, work.ws.shape[0], xs, inv_n, label_terms, target, g_scale)

    @staticmethod
    def weight_product(held, scale, dtype, out=None):
        """grad_weight = inv_n scale (G.T @ Xs + the label terms) in dtype, from G over all rows
        (scale None for 1): summed in float32, rounded once."""
        xs = held.xs
        xs_g = xs.astype(np.float32) if held.g_scale is None else xs.astype(np.float32) * held.g_scale[:, None]
        product = held.G.T @ xs_g
        _add_label_rows(product, *_owned_label_terms(held.label_terms, held.target, np.float32(1.0)), xs)
        product *= np.float32(held.inv_n) if scale is None else np.float32(held.inv_n) * scale
        if out is None:
            return product.astype(dtype, copy=False)
        out[...] = product
        return out


def _model_logits(z, scale, cap):
    """z (float32 logits) as a model's, in place: scale z, then cap tanh(z / cap) where cap is not
    None."""
    if cap is None:
        z *= np.float32(scale)
        return
    z *= np.float32(scale / cap)  # in place, no copy of the chunk's logits
    np.tanh(z, out=z)
    z *= np.float32(cap)


def _owned_label_terms(label_terms, target, k):
    """(rows, labels, terms): the rows whose label this rank owns (target >= 0), their labels,
    and k times their label terms."""
    owned = np.flatnonzero(target >= 0)
    return owned, target[owned], label_terms[owned] * k


def _add_label_rows(grad_weight, owned, labels, terms, xs):
    """grad_weight[labels[j]] += terms[j] xs[owned[j]]; np.add.at adds in row order, so the
    result does not vary."""
    np.add.at(grad_weight, labels, terms[:, None] * xs[owned].astype(np.float32))
