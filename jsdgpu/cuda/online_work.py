"""The GPU backend's row work of the online loss (jsdgpu.backend.OnlineRowWork): both models'
logits a chunk by cuBLAS (products.py), and the fused row kernel or, for rows it does not take,
the three phase kernels (kernels.py)."""

import dataclasses

import cupy
import numpy as np

from . import kernels, products
from .sources import fused_shape
from .steps import leading_dim, padded_bias


def fused_holds(vt, dtype):
    """Whether the fused kernel takes rows of vt teacher columns on this GPU: one of its shapes
    holds them (sources.fused_shape: up to 327680 columns) and a cluster of that shape fits the
    GPU (FusedKernel.fits). Elsewhere the three phase kernels run."""
    shape = fused_shape(vt)
    return shape is not None and kernels.fused_kernel(cupy.cuda.Device().id, dtype, shape).fits()


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


def _row_inputs(work, target):
    """What every row kernel takes of the chunk: both logits, both biases, the targets, both
    vocabularies."""
    return (work.logits_s, work.logits_t, work.bias_s, work.bias_t, target, work.ws.shape[0],
            work.wt.shape[0])


class CudaOnlineRows:
    """The online loss's row work; static methods, as every part of the backend."""
    @staticmethod
    def bytes_per_row(vs, vt, dtype, compute_grad, fused):
        """Bytes per row of the logits chunk, of G held for all rows, and of G per chunk (0
        where the fused kernel writes it over the logits; both 0 without gradients)."""
        grad = np.dtype(dtype).itemsize * leading_dim(vs) if compute_grad else 0
        fused = fused and fused_holds(vt, dtype)
        return 4 * (leading_dim(vs) + leading_dim(vt)), grad, 0 if fused else grad

    @staticmethod
    def prepare(ws, wt, bs, bt, rows, fused, logits_s=None, models=None):
        """The buffers for chunks of `rows` rows (logits_s: the student logits', where
        logits_ahead made it); with fused (where it holds the teacher's rows: fused_holds), the
        fused row kernel of the teacher vocabulary's shape (sources.fused_shape). models:
        LossOptions.models (without the fused kernel, the biases then model_logits')."""
        vs, vt = ws.shape[0], wt.shape[0]
        fused = fused and fused_holds(vt, ws.dtype)
        biases = padded_bias(bs, vs), padded_bias(bt, vt)
        in_passes = models is not None and not fused
        return CudaWork(
            ws=ws, wt=wt, bias_s=None if in_passes else biases[0], bias_t=None if in_passes else biases[1],
            model_bias=biases if in_passes else (None, None),
            logits_s=cupy.empty((rows, leading_dim(vs)), np.float32) if logits_s is None else logits_s,
            logits_t=cupy.empty((rows, leading_dim(vt)), np.float32),
            ones=cupy.ones(rows, ws.dtype) if bs is not None else None,
            fused=kernels.fused_kernel(cupy.cuda.Device().id, ws.dtype, fused_shape(vt)) if fused else None)

    @staticmethod
    def gradient_rows(work, g_rows, own_g):
        """G for g_rows rows. With the fused kernel it is the student logits' memory (the kernel
        writes a row's gradient over the row once every CTA of its cluster has read it; a 16-bit
        row takes the first half of the float32 one) unless own_g: G held for all rows, or kept
        apart so that the logits can be used again."""
        if work.fused is not None and not own_g:
            return work.logits_s.view(work.ws.dtype)[:g_rows]
        columns, dtype = CudaOnlineRows.g_row_layout(work.ws.shape[0], work.ws.dtype)
        return cupy.empty((g_rows, columns), dtype)

    @staticmethod
    def g_row_layout(vs, dtype):
        """(columns, dtype) of a row of G of its own (gradient_rows' own_g): the vocabulary padded
        to the row pitch, in the weights' dtype."""
        return leading_dim(vs), np.dtype(dtype)

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
    def fused_rows(work, target, opts, ce, jsd, G, label_terms):
        """The fused row kernel over the chunk's logits (G None: the loss alone), on the models'
        logits (opts.models: the kernel makes them, and G is the gradient in the raw logits)."""
        if work.row_counter is None:  # made at the first launch, not before the call's first product
            work.row_counter = cupy.empty(1, np.int32)  # zeroed by each launch
        kernels.launch_fused_rows(work.fused, len(target), *_row_inputs(work, target), opts, ce, jsd, G,
                                  label_terms, work.row_counter)

    @staticmethod
    def row_stats(work, target, opts):
        return kernels.phase_stats(_row_inputs(work, target), opts)

    @staticmethod
    def row_kl(work, target, stats, opts):
        return kernels.phase_kl(_row_inputs(work, target), opts, stats)

    @staticmethod
    def row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms):
        kernels.phase_finish(work.ws.dtype, _row_inputs(work, target), opts, stats, kl,
                             ce, jsd, G, label_terms)
