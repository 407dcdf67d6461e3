"""CPU backend: NumPy float32 matrix products and Numba row kernels, parallel over rows.

The row kernels keep their sums in float64 (cheap on a CPU). They are the three phases of the
row work that the driver runs (and, under vocab parallelism, combines across ranks between):
the row statistics, the KL sums, then the row results and the gradient row.
"""

import contextlib
import math

import numba
import numpy as np

from . import _checks
from ._driver import FORWARD_KL, JSD


@numba.njit(parallel=True, cache=True)
def _stats_kernel(s, t, target, inv_temp, stats):
    """stats [7, n]: the maxima of s, z = s / temperature (padded with zeros to vt) and
    t / temperature; the sums of exp(x - max) of each; the target logit (0 where target < 0)."""
    n, vs = s.shape
    vt = t.shape[1]
    for i in numba.prange(n):
        ms = -np.inf
        for j in range(vs):
            ms = max(ms, s[i, j])
        mt = -np.inf
        for j in range(vt):
            mt = max(mt, t[i, j])
        mz = ms * inv_temp
        if vt > vs:
            mz = max(mz, 0.0)
        mt = mt * inv_temp
        sum_s = 0.0
        sum_z = (vt - vs) * math.exp(-mz)
        for j in range(vs):
            x = np.float64(s[i, j])
            sum_s += math.exp(x - ms)
            sum_z += math.exp(x * inv_temp - mz)
        sum_t = 0.0
        for j in range(vt):
            sum_t += math.exp(t[i, j] * inv_temp - mt)
        stats[0, i], stats[1, i], stats[2, i] = ms, mz, mt
        stats[3, i], stats[4, i], stats[5, i] = sum_s, sum_z, sum_t
        stats[6, i] = s[i, target[i]] if target[i] >= 0 else 0.0


@numba.njit(cache=True)
def _lse(stats, i):
    return (stats[0, i] + math.log(stats[3, i]), stats[1, i] + math.log(stats[4, i]),
            stats[2, i] + math.log(stats[5, i]))


@numba.njit(cache=True)
def _kl_terms(z, tt, lse_z, lse_t, mode, beta):
    """One column's share of a = sum p (log p - log m) and b = sum q (log q - log m), with m the
    mixture (JSD), p (forward KL) or q (reverse KL); then p, and h, what the gradient needs of
    the teacher. z, tt: the tempered student (0 in a pad column) and teacher logits."""
    lp = z - lse_z
    lq = tt - lse_t
    p = math.exp(lp)
    q = math.exp(lq)
    if mode == FORWARD_KL:
        lm = lp
        h = q
    elif mode == JSD:
        lm = math.log((1.0 - beta) * p + beta * q)
        h = lp - lm
    else:
        lm = lq
        h = lp - lq
    # 0 log 0 = 0; "!= 0" so that a NaN reaches the loss
    a = p * (lp - lm) if p != 0.0 else 0.0
    b = q * (lq - lm) if q != 0.0 else 0.0
    return a, b, p, h


@numba.njit(parallel=True, cache=True)
def _kl_kernel(s, t, inv_temp, mode, beta, stats, kl):
    """kl [2, n]: a and b of each row."""
    n, vs = s.shape
    vt = t.shape[1]
    for i in numba.prange(n):
        _, lse_z, lse_t = _lse(stats, i)
        a = 0.0
        b = 0.0
        for j in range(vt):
            z = np.float64(s[i, j]) * inv_temp if j < vs else 0.0
            da, db, _, _ = _kl_terms(z, t[i, j] * inv_temp, lse_z, lse_t, mode, beta)
            a += da
            b += db
        kl[0, i] = a
        kl[1, i] = b


@numba.njit(parallel=True, cache=True)
def _finish_kernel(s, t, target, inv_temp, mode, beta, w_hard, w_soft_t, stats, kl, ce, jsd, G,
                   label_terms, write_grad):
    """The row's CE and JSD values, and with write_grad its gradient row without the 1/N of
    the mean; the label's one-hot term kept apart where it dominates (as rows.cu does, where G
    is 16-bit)."""
    n, vs = s.shape
    c_jsd = 1.0 - beta if mode == JSD else 1.0
    for i in numba.prange(n):
        lse_s, lse_z, lse_t = _lse(stats, i)
        a = kl[0, i]
        b = kl[1, i]
        ce[i] = lse_s - stats[6, i]
        if mode == FORWARD_KL:
            jsd[i] = b
        elif mode == JSD:
            jsd[i] = beta * b + (1.0 - beta) * a
        else:
            jsd[i] = a
        if write_grad:
            y = target[i]
            label_apart = y >= 0 and math.exp(stats[6, i] - lse_s) < 0.5
            label_terms[i] = -w_hard if label_apart else 0.0
            for j in range(vs):
                x = np.float64(s[i, j])
                _, _, p, h = _kl_terms(x * inv_temp, t[i, j] * inv_temp, lse_z, lse_t, mode, beta)
                dz = p - h if mode == FORWARD_KL else c_jsd * p * (h - a)
                hard = math.exp(x - lse_s) - (1.0 if j == y and not label_apart else 0.0)
                G[i, j] = w_hard * hard + w_soft_t * dz


class NumpyBackend:
    xp = np
    default_memory_budget = 256 * 2**20

    @staticmethod
    def on_device(device):
        return contextlib.nullcontext()

    @staticmethod
    def select_rows(target, vocab, ignore_index):
        """(valid_rows, row_target, count): the indices of the rows whose target is not
        ignore_index (None where that is every row), their targets as int32, and their count.
        Raises _checks.target_error's ValueError for a bad target."""
        valid = _checks.check_target(target, vocab, ignore_index)
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
        f32 = lambda a: None if a is None else a.astype(np.float32, copy=False)
        # fused False: the driver runs the three phases
        return dict(ws=f32(ws), wt=f32(wt), bs=f32(bs), bt=f32(bt), fused=False,
                    G=np.empty((g_rows, ws.shape[0]), np.float32))

    @staticmethod
    def logits(work, xs, xt):
        s = xs.astype(np.float32) @ work["ws"].T
        t = xt.astype(np.float32) @ work["wt"].T
        if work["bs"] is not None:
            s += work["bs"]
        if work["bt"] is not None:
            t += work["bt"]
        work["s"], work["t"] = s, t

    @staticmethod
    def row_stats(work, target, opts):
        stats = np.empty((7, len(target)))
        _stats_kernel(work["s"], work["t"], target, 1.0 / opts.temperature, stats)
        return stats

    @staticmethod
    def row_kl(work, target, stats, opts):
        kl = np.empty((2, stats.shape[1]))
        _kl_kernel(work["s"], work["t"], 1.0 / opts.temperature, opts.mode, opts.beta, stats, kl)
        return kl

    @staticmethod
    def row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms):
        compute_grad = G is not None
        # without gradients, G and label_terms are placeholders of the types Numba compiled
        # for (one compiled kernel); the kernel does not touch them
        _finish_kernel(work["s"], work["t"], target, 1.0 / opts.temperature, opts.mode, opts.beta,
                       opts.weight_hard_loss, opts.weight_soft_loss / opts.temperature, stats, kl,
                       ce, jsd, G if compute_grad else work["G"], label_terms if compute_grad else ce,
                       compute_grad)

    @staticmethod
    def grad_products(work, G, xs, norm, grads, start, stop):
        norm = np.float32(norm)
        grads.grad_input[start:stop] = (G @ work["ws"]) * norm
        parts = []
        if grads.grad_weight is not None:  # else weight_product makes it
            parts.append((grads.grad_weight, G.T @ xs.astype(np.float32)))
        if grads.grad_bias is not None:
            parts.append((grads.grad_bias, G.sum(axis=0)))
        for total, part in parts:  # the first chunk writes, the others add
            if start == 0:
                np.multiply(part, norm, out=total)
            else:
                total += part * norm

    @staticmethod
    def add_label_terms(work, label_terms, target, xs, norm, grads):
        """The label terms the row kernel left out of G, added exactly, for the rows whose label
        this rank owns (target >= 0; np.add.at adds in row order, so the result does not vary)."""
        owned, labels, terms = _owned_label_terms(label_terms, target, np.float32(norm))
        grads.grad_input[owned] += terms[:, None] * work["ws"][labels]
        if grads.grad_weight is not None:
            _add_label_rows(grads.grad_weight, owned, labels, terms, xs)
        if grads.grad_bias is not None:
            np.add.at(grads.grad_bias, labels, terms)

    @staticmethod
    def weight_product(G, vs, xs, norm, label_terms, target, scale, dtype):
        """grad_weight = norm scale (G.T @ Xs + the label terms) in dtype, from G over all rows
        (scale None for 1): summed in float32, rounded once."""
        out = G.T @ xs.astype(np.float32)
        _add_label_rows(out, *_owned_label_terms(label_terms, target, np.float32(1.0)), xs)
        out *= np.float32(norm) if scale is None else np.float32(norm) * scale
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
