"""The CPU backend's row kernels (Numba, parallel over rows): the fused kernel, which does a
row's whole work while the row is in the core's cache (statistics, KL sums, results and gradient
row), and the three phases of the same work that vocab parallelism combines across ranks between
(row statistics; KL sums; results and gradient). Their math is float64 (sums and per-column
terms), with an exp and a log of their own (fastmath.py); each divergence's terms are
divergences.py's.

Non-finite inputs give non-finite results, as the contract says: the kernels are compiled without
the no-NaN and no-infinity assumptions of fast math, keeping only reassociation (the vectorized
sums) and contraction, and `exp64` keeps a NaN."""

import math

import numba
import numpy as np

from .divergences import FORWARD_KL, JSD, REVERSE_KL, column, grad_dz, soft
from .fastmath import FAST, exp64
from .threads import rows_in_parallel


@numba.njit(fastmath=FAST, inline="always")
def _row_max(x):
    """The largest of x (-inf where empty), as float64, in eight chains: one chain of dependent
    max took twice as long (LLVM keeps it scalar: a max with NaN is not reassociable). A NaN is
    passed over here; it reaches the results through the sums."""
    n = len(x)
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.float32(-np.inf)
    for j in range(0, n - 7, 8):
        m0, m1, m2, m3 = max(m0, x[j]), max(m1, x[j + 1]), max(m2, x[j + 2]), max(m3, x[j + 3])
        m4, m5, m6, m7 = max(m4, x[j + 4]), max(m5, x[j + 5]), max(m6, x[j + 6]), max(m7, x[j + 7])
    for j in range(n - n % 8, n):
        m0 = max(m0, x[j])
    return np.float64(max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7))))


@numba.njit(fastmath=FAST, inline="always")
def _row_stats(s, t, y, inv_temp, vs, vt, e_z, e_t):
    """(max s, max z, max t / T, sum exp(s - max), sum exp(z - max z), sum exp(t / T - max), the
    target logit) of one row: z = s / temperature padded with zeros to vt. Where e_z and e_t have
    room (the fused kernel's), the student columns' exp(z - max z) and exp(t / T - max) are kept
    there (its KL sums take p and q from them)."""
    ms = _row_max(s[:vs])
    mt = _row_max(t[:vt])
    mz = ms * inv_temp
    if vt > vs:
        mz = max(mz, 0.0)
    mt = mt * inv_temp
    keep = len(e_z) >= vs
    sum_s = 0.0
    for j in range(vs):
        e = exp64(np.float64(s[j]) - ms)
        sum_s += e
        if keep:
            e_z[j] = e
    if inv_temp == 1.0 and vt == vs:
        sum_z = sum_s
    else:
        sum_z = (vt - vs) * exp64(-mz)
        for j in range(vs):
            e = exp64(np.float64(s[j]) * inv_temp - mz)
            sum_z += e
            if keep:
                e_z[j] = e
    sum_t = 0.0
    for j in range(vs):  # (vt >= vs: the student is padded, never the teacher)
        e = exp64(t[j] * inv_temp - mt)
        sum_t += e
        if keep:
            e_t[j] = e
    for j in range(vs, vt):
        sum_t += exp64(t[j] * inv_temp - mt)
    return ms, mz, mt, sum_s, sum_z, sum_t, (np.float64(s[y]) if y >= 0 else 0.0)


@numba.njit(fastmath=FAST, inline="always")
def _kl_columns(s, t, inv_temp, mode, beta, lse_z, lse_t, inv_z, inv_t, p, h):
    """(a, b) of one row's columns for one divergence (mode: a constant where _row_kl calls it)."""
    vs, vt = len(s), len(t)
    keep = len(p) >= vs
    a = 0.0
    b = 0.0
    for j in range(vs):
        lp = np.float64(s[j]) * inv_temp - lse_z
        lq = t[j] * inv_temp - lse_t
        pj = p[j] * inv_z if keep else exp64(lp)
        qj = h[j] * inv_t if keep else exp64(lq)
        da, db, hj = column(lp, lq, pj, qj, mode, 1.0 - beta, beta)
        a += da
        b += db
        if keep:
            p[j] = pj
            h[j] = hj
    for j in range(vs, vt):  # the teacher's pad: z = 0
        lp, lq = -lse_z, t[j] * inv_temp - lse_t
        da, db, _ = column(lp, lq, exp64(lp), exp64(lq), mode, 1.0 - beta, beta)
        a += da
        b += db
    return a, b


@numba.njit(fastmath=FAST, inline="always")
def _row_kl(s, t, inv_temp, mode, beta, stats, p, h):
    """(a, b) of one row with its statistics (_row_stats'). Where p and h have room (the fused
    kernel's), they hold the student columns' exp(z - max z) and exp(t / T - max) (_row_stats),
    and their p and h are written over them (the gradient reads them there). One loop a
    divergence, each with its mode a constant: with the mode a variable, LLVM if-converts
    column's branch on it in the vectorized loop, and every divergence paid for the JSD's log."""
    mz, mt, sum_z, sum_t = stats[1], stats[2], stats[4], stats[5]
    lse_z, lse_t = mz + math.log(sum_z), mt + math.log(sum_t)
    inv_z, inv_t = 1.0 / sum_z, 1.0 / sum_t
    if mode == FORWARD_KL:
        return _kl_columns(s, t, inv_temp, FORWARD_KL, beta, lse_z, lse_t, inv_z, inv_t, p, h)
    if mode == JSD:
        return _kl_columns(s, t, inv_temp, JSD, beta, lse_z, lse_t, inv_z, inv_t, p, h)
    return _kl_columns(s, t, inv_temp, REVERSE_KL, beta, lse_z, lse_t, inv_z, inv_t, p, h)


@numba.njit(fastmath=FAST, inline="always")
def _label_apart(y, target_logit, lse_s):
    """Whether the label's one-hot term is kept out of G (as the fused GPU kernel does, where G is
    16-bit): where softmax(s)[label] < 1/2."""
    return y >= 0 and math.exp(target_logit - lse_s) < 0.5


def model_derivative(z, model_scale, model_inv_cap):
    """dz / dx of a model's logit z = c tanh(scale x / c), from z: scale (1 - (z / c)^2); scale
    alone where there is no cap (inv_cap 0), 1 for the plain logits. Of a number or an array (the
    phases' pass over G: CpuSteps.model_gradient); compiled for the kernels below (z float32 and
    inv_cap float64: in float64)."""
    zc = z * model_inv_cap
    return model_scale * (1.0 - zc * zc)


_model_derivative = numba.njit(fastmath=FAST, inline="always")(model_derivative)


@numba.njit(fastmath=FAST, inline="always")
def _gradient_row(s, y, lse_s, softmax_is_p, mode, beta, a, w_hard, w_soft_over_t, label_apart, p, h, model_scale,
                  model_inv_cap, label_derivative, G):
    """G's row from the columns' p and h: w_hard (softmax(s) - onehot) + (w_soft / T) dz
    (softmax_is_p: no temperature and no pad, so that softmax(s) is p), times the student model's
    derivative where its logits are the model's (label_derivative: the derivative at the label).
    G may be s's own memory: a column's s is read before its G is written."""
    for j in range(len(G)):
        x = np.float64(s[j])
        dz = grad_dz(p[j], h[j], a, mode, beta)
        softmax = p[j] if softmax_is_p else exp64(x - lse_s)
        G[j] = (w_hard * softmax + w_soft_over_t * dz) * _model_derivative(x, model_scale, model_inv_cap)
    if y >= 0 and not label_apart:
        G[y] -= w_hard * label_derivative


@numba.njit(fastmath=FAST, inline="always")
def _results(s, i, y, stats, a, b, inv_temp, mode, beta, w_hard, w_soft_over_t, ce, jsd, G, label_terms, write_grad,
             p, h, model_scale, model_inv_cap):
    """Row i's CE and soft part from its statistics and KL sums a, b, and with write_grad its
    gradient row and label term from its columns' p and h, in the raw logits where the student's
    are its model's (model_scale, model_inv_cap: _model_derivative's)."""
    lse_s, lse_z = stats[0] + math.log(stats[3]), stats[1] + math.log(stats[4])
    ce[i] = lse_s - stats[6]
    jsd[i] = soft(a, b, mode, beta)
    if write_grad:
        apart = _label_apart(y, stats[6], lse_s)
        label_derivative = _model_derivative(s[y], model_scale, model_inv_cap) if y >= 0 else 1.0
        label_terms[i] = -w_hard * label_derivative if apart else 0.0
        # softmax(s) is p where z is s (no temperature) and no pad widens z's sum (here or on
        # another rank)
        _gradient_row(s, y, lse_s, inv_temp == 1.0 and lse_z == lse_s, mode, beta, a, w_hard, w_soft_over_t, apart,
                      p, h, model_scale, model_inv_cap, label_derivative, G[i])


@rows_in_parallel
@numba.njit(parallel=True, fastmath=FAST, cache=True)
def fused_kernel(s, t, target, inv_temp, mode, beta, w_hard, w_soft_over_t, ce, jsd, G, label_terms, write_grad,
                 model_scale, model_inv_cap):
    """Each row's CE and soft part, and with write_grad its gradient row (without the 1/N of the
    mean; in the raw logits where s is the student model's: _model_derivative) and label term:
    the three phases' work on one row at a time, read from memory once. G may be s's memory."""
    n, vs = s.shape
    vt = t.shape[1]
    for i in numba.prange(n):
        y = target[i]
        p = np.empty(vs)  # exp(z - max z), then p (_row_stats, _row_kl)
        h = np.empty(vs)  # exp(t / T - max), then h
        stats = _row_stats(s[i], t[i], y, inv_temp, vs, vt, p, h)
        a, b = _row_kl(s[i], t[i], inv_temp, mode, beta, stats, p, h)
        _results(s[i], i, y, stats, a, b, inv_temp, mode, beta, w_hard, w_soft_over_t, ce, jsd, G, label_terms,
                 write_grad, p, h, model_scale, model_inv_cap)


# ---- the three phases (vocab parallelism: each rank's shard, combined between them) ----

@rows_in_parallel
@numba.njit(parallel=True, fastmath=FAST, cache=True)
def stats_kernel(s, t, target, inv_temp, stats):
    """stats [7, n]: the maxima of s, z = s / temperature (padded with zeros to vt) and
    t / temperature; the sums of exp(x - max) of each; the target logit (0 where target < 0)."""
    n, vs = s.shape
    vt = t.shape[1]
    none = np.empty(0)
    for i in numba.prange(n):
        (stats[0, i], stats[1, i], stats[2, i], stats[3, i], stats[4, i], stats[5, i],
         stats[6, i]) = _row_stats(s[i], t[i], target[i], inv_temp, vs, vt, none, none)


@numba.njit(fastmath=FAST, inline="always")
def _stats_of(stats, i):
    return stats[0, i], stats[1, i], stats[2, i], stats[3, i], stats[4, i], stats[5, i], stats[6, i]


@rows_in_parallel
@numba.njit(parallel=True, fastmath=FAST, cache=True)
def kl_kernel(s, t, inv_temp, mode, beta, stats, kl):
    """kl [2, n]: a and b of each row."""
    n = s.shape[0]
    none = np.empty(0)
    for i in numba.prange(n):
        kl[0, i], kl[1, i] = _row_kl(s[i], t[i], inv_temp, mode, beta, _stats_of(stats, i), none, none)


@rows_in_parallel
@numba.njit(parallel=True, fastmath=FAST, cache=True)
def finish_kernel(s, t, target, inv_temp, mode, beta, w_hard, w_soft_over_t, stats, kl, ce, jsd, G,
                  label_terms, write_grad):
    """The row's CE and JSD values, and with write_grad its gradient row without the 1/N of
    the mean; the label's one-hot term kept apart where it dominates (as the fused GPU kernel does,
    where G is 16-bit)."""
    n, vs = s.shape
    for i in numba.prange(n):
        row = _stats_of(stats, i)
        p = np.empty(vs if write_grad else 0)
        h = np.empty(vs if write_grad else 0)
        for j in range(len(p)):  # what _row_kl takes p and h from (the rows' statistics, all ranks')
            p[j] = exp64(np.float64(s[i, j]) * inv_temp - row[1])
            h[j] = exp64(t[i, j] * inv_temp - row[2])
        if write_grad:
            _row_kl(s[i], t[i], inv_temp, mode, beta, row, p, h)  # (this rank's sums: not needed)
        _results(s[i], i, target[i], row, kl[0, i], kl[1, i], inv_temp, mode, beta, w_hard, w_soft_over_t, ce, jsd,
                  G, label_terms, write_grad, p, h, 1.0, 0.0)  # (the models' passes are around the phases)
