"""The CPU backend: NumPy float32 matrix products and the Numba row kernels of rows.py, through
the chunk loop's steps (jsdgpu.backend.Backend)."""

import contextlib
import dataclasses

import numpy as np

from .. import checks
from ..backend import HeldG
from .rows import finish_kernel, kl_kernel, stats_kernel


@dataclasses.dataclass
class CpuWork:
    """One call's buffers: both heads in float32, G, and the chunk's logits (s, t)."""
    ws: object
    wt: object
    bs: object
    bt: object
    G: object
    fused: object = None  # no fused kernel here: the chunk loop runs the three phases
    s: object = None
    t: object = None


def _f32(a):
    return None if a is None else a.astype(np.float32, copy=False)


class CpuBackend:
    xp = np
    default_memory_budget = 256 * 2**20

    @staticmethod
    def on_device(device):
        return contextlib.nullcontext()

    @staticmethod
    def select_rows(target, vocab, ignore_index):
        """(valid_rows, row_target, count): the indices of the rows whose target is not
        ignore_index (None where that is every row), their targets as int32, and their count.
        Raises checks.target_error's ValueError for a bad target."""
        valid = checks.check_target(target, vocab, ignore_index)
        if len(valid) == len(target):
            return None, target.astype(np.int32), len(target)
        return valid, target[valid].astype(np.int32), len(valid)

    @staticmethod
    def take_rows(rows, a, b):
        """The given rows of a and of b."""
        return a[rows], b[rows]

    @staticmethod
    def scale_cast(a, scale, dtype):
        """a * scale (a float32 array of ours, scale None for 1) as dtype."""
        if scale is not None:
            a *= scale
        return a.astype(dtype, copy=False)

    @staticmethod
    def bytes_per_row(vs, vt, dtype, compute_grad, fused):
        """Bytes per row of the logits chunk, of G held for all rows and of G per chunk (0
        without gradients)."""
        grad = 4 * vs if compute_grad else 0
        return 4 * (vs + vt), grad, grad

    @staticmethod
    def prepare(ws, wt, bs, bt, rows, g_rows, fused, own_g=False):
        return CpuWork(_f32(ws), _f32(wt), _f32(bs), _f32(bt), np.empty((g_rows, ws.shape[0]), np.float32))

    @staticmethod
    def logits(work, xs, xt):
        s = xs.astype(np.float32) @ work.ws.T
        t = xt.astype(np.float32) @ work.wt.T
        if work.bs is not None:
            s += work.bs
        if work.bt is not None:
            t += work.bt
        work.s, work.t = s, t

    @staticmethod
    def row_stats(work, target, opts):
        stats = np.empty((7, len(target)))
        stats_kernel(work.s, work.t, target, 1.0 / opts.temperature, stats)
        return stats

    @staticmethod
    def row_kl(work, target, stats, opts):
        kl = np.empty((2, stats.shape[1]))
        kl_kernel(work.s, work.t, 1.0 / opts.temperature, int(opts.divergence), opts.beta, stats, kl)
        return kl

    @staticmethod
    def row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms):
        compute_grad = G is not None
        # without gradients, G and label_terms are placeholders of the types Numba compiled
        # for (one compiled kernel); the kernel does not touch them
        finish_kernel(work.s, work.t, target, 1.0 / opts.temperature, int(opts.divergence), opts.beta,
                      opts.weight_hard_loss, opts.w_soft_over_t, stats, kl, ce, jsd,
                      G if compute_grad else work.G, label_terms if compute_grad else ce, compute_grad)

    @staticmethod
    def grad_products(work, G, xs, inv_n, grads, start, stop):
        inv_n = np.float32(inv_n)
        grads.grad_input[start:stop] = (G @ work.ws) * inv_n
        parts = []
        if grads.grad_weight is not None:  # else weight_product makes it
            parts.append((grads.grad_weight, G.T @ xs.astype(np.float32)))
        if grads.grad_bias is not None:
            parts.append((grads.grad_bias, G.sum(axis=0)))
        for total, part in parts:  # the first chunk writes, the others add
            if start == 0:
                np.multiply(part, inv_n, out=total)
            else:
                total += part * inv_n

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
    def hold_g(work, xs, inv_n, label_terms, target):
        return HeldG(work.G, work.ws.shape[0], xs, inv_n, label_terms, target)

    @staticmethod
    def weight_product(held, scale, dtype):
        """grad_weight = inv_n scale (G.T @ Xs + the label terms) in dtype, from G over all rows
        (scale None for 1): summed in float32, rounded once."""
        xs = held.xs
        out = held.G.T @ xs.astype(np.float32)
        _add_label_rows(out, *_owned_label_terms(held.label_terms, held.target, np.float32(1.0)), xs)
        out *= np.float32(held.inv_n) if scale is None else np.float32(held.inv_n) * scale
        return out.astype(dtype, copy=False)


def _owned_label_terms(label_terms, target, k):
    """(rows, labels, terms): the rows whose label this rank owns (target >= 0), their labels,
    and k times their label terms."""
    owned = np.flatnonzero(target >= 0)
    return owned, target[owned], label_terms[owned] * k


def _add_label_rows(grad_weight, owned, labels, terms, xs):
    """grad_weight[labels[j]] += terms[j] xs[owned[j]]; np.add.at adds in row order, so the
    result does not vary."""
    np.add.at(grad_weight, labels, terms[:, None] * xs[owned].astype(np.float32))
