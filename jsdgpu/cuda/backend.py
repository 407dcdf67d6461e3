"""The GPU backend: the chunk loop's steps (jsdgpu.backend.Backend) over CuPy arrays, by the
products of products.py and the row kernels of kernels.py. Everything is queued on CuPy's current
stream; nothing in the chunk loop waits for the GPU, but the first product of each shape class in
a process, which times cuBLASLt's candidate algorithms (products.py)."""

import dataclasses

import cupy
import numpy as np

from .. import checks
from ..backend import HeldG
from . import kernels, products
from .sources import FUSED

FUSED_MAX_VOCAB = FUSED.max_vocab  # 131072 columns; wider rows take the phase kernels


def leading_dim(n):
    """Row pitch in elements: a multiple of 32, so every row starts 128-byte aligned."""
    return -(-n // 32) * 32


@dataclasses.dataclass
class CudaWork:
    """One call's buffers: both models' float32 logits for a chunk (rows padded to leading_dim),
    the biases as float32 padded with zeros, G (or None), and the fused kernel where it runs."""
    ws: object
    wt: object
    bias_s: object
    bias_t: object
    logits_s: object
    logits_t: object
    G: object
    ones: object         # [rows] of ones, for grad_bias's product (None without a student bias)
    fused: object        # the kernels.FusedKernel, or None: the three phase kernels run
    row_counter: object  # the fused kernel's counter of rows handed out


def _padded_bias(b, v):
    if b is None:
        return None
    out = cupy.zeros(leading_dim(v), np.float32)
    out[:v] = b
    return out


class CudaBackend:
    xp = cupy
    default_memory_budget = 5 * 2**29  # 2.5 GiB: T = 8192 at V = 128256 in 4 chunks

    @staticmethod
    def on_device(device):
        return cupy.cuda.Device(device)

    @staticmethod
    def select_rows(target, vocab, ignore_index):
        """(valid_rows, row_target, count): the indices of the rows whose target is not
        ignore_index (None where that is every row), their targets as int32, and their count, by
        one kernel (kernels.select_rows). Raises checks.target_error's ValueError for a bad
        target. Its wait for the kernel is the step's one wait for the GPU. (Reading all the
        targets, checking and selecting them on the host, copying the selection back and
        gathering the rows by CuPy took 0.15-0.25 ms more a step at T = 1024 with half of the
        rows ignored: docs/design.md, "Ignored rows".)"""
        n = len(target)
        targets = target if target.dtype in (np.int32, np.int64) else target.astype(np.int64)
        rows, row_target, count, first_bad = kernels.select_rows(cupy.ascontiguousarray(targets), vocab,
                                                                 ignore_index)
        if first_bad < n:
            raise checks.target_error(first_bad, int(target[first_bad]), vocab, ignore_index)
        if count == n:
            return None, row_target, n
        return rows[:count], row_target[:count], count

    take_rows = staticmethod(kernels.gather_rows)

    @staticmethod
    def scale_cast(a, scale, dtype):
        """a * scale (a float32 array of ours, scale None for 1) as dtype, in one pass."""
        if np.dtype(dtype) == np.float32:
            if scale is not None:
                a *= scale
            return a
        return kernels.scale_cast(a, scale, dtype)

    @staticmethod
    def bytes_per_row(vs, vt, dtype, compute_grad, fused):
        """Bytes per row of the logits chunk, of G held for all rows, and of G per chunk (0
        where the fused kernel writes it over the logits; both 0 without gradients)."""
        grad = np.dtype(dtype).itemsize * leading_dim(vs) if compute_grad else 0
        fused = fused and vt <= FUSED_MAX_VOCAB
        return 4 * (leading_dim(vs) + leading_dim(vt)), grad, 0 if fused else grad

    @staticmethod
    def prepare(ws, wt, bs, bt, rows, g_rows, fused, own_g=False):
        """The buffers: logits for chunks of rows, G for g_rows (0: no G); with fused (and a
        teacher vocabulary of at most FUSED_MAX_VOCAB), the fused row kernel. There G is the
        student logits' memory (the kernel writes a row's gradient over the row once every CTA of
        its cluster has read it; a 16-bit row takes the first half of the float32 one) unless
        own_g: G held for all rows, or kept apart so that the logits can be used again."""
        vs, vt = ws.shape[0], wt.shape[0]
        fused = fused and vt <= FUSED_MAX_VOCAB
        logits_s = cupy.empty((rows, leading_dim(vs)), np.float32)
        if not g_rows:
            G = None
        elif fused and not own_g:
            G = logits_s.view(ws.dtype)[:g_rows]
        else:
            G = cupy.empty((g_rows, leading_dim(vs)), ws.dtype)
        return CudaWork(
            ws=ws, wt=wt, bias_s=_padded_bias(bs, vs), bias_t=_padded_bias(bt, vt), logits_s=logits_s,
            logits_t=cupy.empty((rows, leading_dim(vt)), np.float32), G=G,
            ones=cupy.ones(rows, ws.dtype) if bs is not None else None,
            fused=kernels.fused_kernel(cupy.cuda.Device().id, ws.dtype) if fused else None,
            row_counter=cupy.empty(1, np.int32) if fused else None)  # zeroed by each launch

    @staticmethod
    def logits(work, xs, xt):
        c = xs.shape[0]
        products.logits(xs, work.ws, work.logits_s[:c])
        products.logits(xt, work.wt, work.logits_t[:c])

    @staticmethod
    def _row_inputs(work, target):
        return (work.logits_s, work.logits_t, work.bias_s, work.bias_t, target, work.ws.shape[0],
                work.wt.shape[0])

    @staticmethod
    def fused_rows(work, target, opts, ce, jsd, G, label_terms):
        """The fused row kernel over the chunk's logits (G None: the loss alone)."""
        kernels.launch_fused_rows(work.fused, len(target), *CudaBackend._row_inputs(work, target), opts,
                                  ce, jsd, G, label_terms, work.row_counter)

    @staticmethod
    def row_stats(work, target, opts):
        return kernels.phase_stats(*CudaBackend._row_inputs(work, target), opts)

    @staticmethod
    def row_kl(work, target, stats, opts):
        return kernels.phase_kl(*CudaBackend._row_inputs(work, target), opts, stats)

    @staticmethod
    def row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms):
        kernels.phase_finish(work.ws.dtype, *CudaBackend._row_inputs(work, target), opts, stats, kl,
                             ce, jsd, G, label_terms)

    @staticmethod
    def add_label_terms(work, label_terms, target, xs, inv_n, grads):
        """The label terms the row kernel left out of G, added exactly in float32 for the rows
        whose label this rank owns (target >= 0; label_terms is 0 elsewhere): to grad_input, and
        to the grad_weight sums (where there are) and grad_bias."""
        kernels.label_rows(label_terms, target, work.ws, inv_n, grads.grad_input)
        if grads.grad_weight is not None or grads.grad_bias is not None:
            kernels.label_scatter(label_terms, target, xs, inv_n, None, grads.grad_weight, grads.grad_bias)

    @staticmethod
    def grad_products(work, G, xs, inv_n, grads, start, stop):
        """grad_input rows, and the chunk's part of the grad_weight and grad_bias sums (where
        grad_weight is None, weight_product makes it later)."""
        vs = work.ws.shape[0]
        accumulate = 0.0 if start == 0 else 1.0
        products.input_gradient(G, work.ws, inv_n, grads.grad_input[start:stop])
        if grads.grad_weight is not None:
            products.weight_gradient(G, vs, xs, inv_n, accumulate, grads.grad_weight)
        if grads.grad_bias is not None:
            products.bias_gradient(G, vs, work.ones[:stop - start], inv_n, accumulate, grads.grad_bias)

    @staticmethod
    def hold_g(work, xs, inv_n, label_terms, target):
        """What weight_product needs of G held for all rows (work's logits are not kept)."""
        return HeldG(work.G, work.ws.shape[0], xs, inv_n, label_terms, target)

    @staticmethod
    def weight_product(held, scale, dtype):
        """grad_weight = inv_n scale (G.T @ Xs + the label terms), G over all rows; scale: a 0-d
        float32 device array, or None for 1. The product is written in dtype by cuBLAS; in 16
        bits, the rows of labels kept out of G are rounded twice (the product, then with the
        label terms added), the others once."""
        out = cupy.empty((held.vocab, held.xs.shape[1]), dtype)
        alpha = held.inv_n if scale is None else scale * np.float32(held.inv_n)
        products.weight_gradient(held.G, held.vocab, held.xs, alpha, 0.0, out)
        kernels.label_scatter(held.label_terms, held.target, held.xs, held.inv_n, scale, out, None)
        return out
