"""The CPU backend's row work of the online loss (jsdgpu.backend.OnlineRowWork): both models'
float32 logits a chunk by NumPy's products, and the Numba row kernels of rows.py."""

import dataclasses

import numba
import numpy as np

from .divergences import precise_terms
from .products import matmul
from .rows import finish_kernel, fused_kernel, kl_kernel, stats_kernel
from .steps import as_model_logits, f32, row_buffer


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


# what the finish kernel takes for G and label_terms without gradients: arrays of the types Numba
# compiled it for (one compiled kernel), which it does not touch
_NO_G, _NO_TERMS = np.empty((0, 0), np.float32), np.empty(0, np.float32)


class CpuOnlineRows:
    """The online loss's row work; static methods, as every part of the backend."""
    @staticmethod
    def bytes_per_row(vs, vt, dtype, compute_grad, fused):
        """Bytes per row of the logits chunk, of G held for all rows, and of G per chunk (0 where
        the fused kernel writes it over the student's logits; both 0 without gradients)."""
        grad = 4 * vs if compute_grad else 0
        return 4 * (vs + vt), grad, 0 if fused else grad

    @staticmethod
    def prepare(ws, wt, bs, bt, rows, fused, logits_s=None, models=None):
        s = row_buffer(rows, ws.shape[0]) if logits_s is None else logits_s
        return CpuWork(f32(ws), f32(wt), f32(bs), f32(bt), s, row_buffer(rows, wt.shape[0]), fused)

    @staticmethod
    def gradient_rows(work, g_rows, own_g):
        """G for g_rows rows: with the fused kernel the student logits' memory (it writes a
        column's gradient once it has read the column), unless own_g (G held for all rows, or
        kept apart from the logits)."""
        if work.fused and not own_g:
            return work.s[:g_rows]
        columns, dtype = CpuOnlineRows.g_row_layout(work.ws.shape[0], work.ws.dtype)
        return np.empty((g_rows, columns), dtype)

    @staticmethod
    def g_row_layout(vs, dtype):
        """(columns, dtype) of a row of G of its own (gradient_rows' own_g): float32, unpadded."""
        return vs, np.dtype(np.float32)

    @staticmethod
    def model_logits(work, rows, models):
        """The chunk's first `rows` rows of both models' logits (biased already) as the models'
        (models: LossOptions.models), in place."""
        for z, model in zip((work.s[:rows], work.t[:rows]), models):
            as_model_logits(z, *model)

    @staticmethod
    def logits(work, xs, xt, at=0, student=True):
        """The logits of rows [at, at + len(xs)) of the chunk (the teacher's alone where not
        student, as the protocol says; the CPU queues nothing ahead, so its calls ask for both)."""
        rows = slice(at, at + xs.shape[0])
        if student:
            matmul(xs.astype(np.float32), work.ws.T, work.s[rows])
            if work.bs is not None:
                work.s[rows] += work.bs
        matmul(xt.astype(np.float32), work.wt.T, work.t[rows])
        if work.bt is not None:
            work.t[rows] += work.bt

    @staticmethod
    def fused_rows(work, target, opts, ce, jsd, G, label_terms):
        """The fused row kernel on the models' logits (opts.models: made in place first; the
        kernel takes G back to the raw logits', with the student model's derivative)."""
        n = len(target)
        compute_grad = G is not None
        scale, inv_cap = 1.0, 0.0
        if opts.models is not None:
            CpuOnlineRows.model_logits(work, n, opts.models)
            scale, cap = opts.models[0]
            inv_cap = 0.0 if cap is None else 1.0 / cap
        soft_b, poly = precise_terms(opts.divergence, opts.beta)
        fused_kernel(work.s[:n], work.t[:n], target, 1.0 / opts.temperature, int(opts.divergence), opts.beta,
                     opts.one_minus_beta, soft_b, poly, opts.weight_hard_loss, opts.w_soft_over_t, ce, jsd,
                     G if compute_grad else _NO_G, label_terms if compute_grad else _NO_TERMS, compute_grad, scale,
                     inv_cap, numba.get_num_threads())

    @staticmethod
    def row_stats(work, target, opts):
        n = len(target)
        stats = np.empty((8, n))
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
