"""The CPU backend's row kernels (Numba, parallel over rows): the three phases of the row work
that the chunk loop runs (and, under vocab parallelism, combines across ranks between): the row
statistics, the KL sums, then the row results and the gradient row. Their sums are float64
(cheap on a CPU)."""

import math

import numba
import numpy as np

from ..options import Divergence

FORWARD_KL, JSD = int(Divergence.FORWARD_KL), int(Divergence.JSD)


@numba.njit(parallel=True, cache=True)
def stats_kernel(s, t, target, inv_temp, stats):
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
        # log m in log space: finite where p and q both underflow, or where (1 - beta) p does
        lm = np.logaddexp(math.log1p(-beta) + lp, math.log(beta) + lq)
        h = lp - lm
    else:
        lm = lq
        h = lp - lq
    # 0 log 0 = 0; "!= 0" so that a NaN reaches the loss
    a = p * (lp - lm) if p != 0.0 else 0.0
    b = q * (lq - lm) if q != 0.0 else 0.0
    return a, b, p, h


@numba.njit(parallel=True, cache=True)
def kl_kernel(s, t, inv_temp, mode, beta, stats, kl):
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
def finish_kernel(s, t, target, inv_temp, mode, beta, w_hard, w_soft_over_t, stats, kl, ce, jsd, G,
                   label_terms, write_grad):
    """The row's CE and JSD values, and with write_grad its gradient row without the 1/N of
    the mean; the label's one-hot term kept apart where it dominates (as the fused kernel does, where G
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
                G[i, j] = w_hard * hard + w_soft_over_t * dz
