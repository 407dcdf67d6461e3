"""The CPU backend's top-k row work (offline distillation, docs/contract.md): each row's
categories by a Numba kernel, then NumPy in float64 over them, from a chunk's student logits; and
the teacher's top-k of a chunk's logits. Its own code throughout: the tests compare it with
jsdgpu.reference, which it does not import."""

import math

import numba
import numpy as np

from .divergences import topk_rest_dz, topk_slot_dz, topk_terms


@numba.njit(cache=True)
def _lse(x):
    """logsumexp of the float64 row x: -inf for a row of -infs (a NaN stays NaN)."""
    m = -np.inf
    for v in x:
        m = max(m, v)
    if m == -np.inf:
        return -np.inf
    total = 0.0
    for v in x:
        total += math.exp(v - m)
    return m + math.log(total)


@numba.njit(parallel=True, cache=True)
def row_logsumexp(x):
    """logsumexp of each row of the float64 [n, m] x."""
    out = np.empty(x.shape[0])
    for i in numba.prange(x.shape[0]):
        out[i] = _lse(x[i])
    return out


@numba.njit(parallel=True, cache=True)
def _categories(logp, ids, lq, bucket, LP, LQ, used):
    """Each row's categories: the k slots (log P of the student's log-softmax logp at the slot's
    id, log q the teacher's; -inf in both where the slot is unused, log q = -inf), then, with
    bucket, the rest (column k): the student's mass on every id in no used slot, summed over
    those ids (no cancellation), and the teacher's left over, log(1 - sum q) (-inf where no id
    is left); without bucket, both renormalized over the used slots."""
    n, k = ids.shape
    vs = logp.shape[1]
    for i in numba.prange(n):
        for c in range(k):
            used[i, c] = lq[i, c] != -np.inf
            LP[i, c] = logp[i, ids[i, c]] if used[i, c] else -np.inf
            LQ[i, c] = lq[i, c] if used[i, c] else -np.inf
        lse_q = _lse(LQ[i, :k])
        if not bucket:
            lse_p = _lse(LP[i, :k])
            for c in range(k):
                if used[i, c]:
                    LP[i, c] -= lse_p
                    LQ[i, c] -= lse_q
            continue
        in_slot = np.zeros(vs, np.bool_)
        for c in range(k):
            if used[i, c]:
                in_slot[ids[i, c]] = True
        rest = np.full(vs, -np.inf)
        any_rest = False
        for j in range(vs):
            if not in_slot[j]:
                rest[j] = logp[i, j]
                any_rest = True
        LP[i, k] = _lse(rest)
        if lse_q != lse_q:
            LQ[i, k] = np.nan
        elif lse_q < 0.0 and any_rest:
            LQ[i, k] = math.log(-math.expm1(lse_q))
        else:  # where the slots hold every id, the teacher's mass left over is its rounding
            LQ[i, k] = -np.inf
        used[i, k] = True


def topk_categories(logp, ids, lq, missing_mass):
    """(log P, log q, used) [n, k + 1] (bucket; [n, k] renormalized) of the rows' categories
    (_categories)."""
    n, k = ids.shape
    width = k + 1 if missing_mass == "bucket" else k
    LP, LQ, used = np.empty((n, width)), np.empty((n, width)), np.empty((n, width), np.bool_)
    _categories(logp, np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(lq, np.float64),
                missing_mass == "bucket", LP, LQ, used)
    return LP, LQ, used


def topk_rows(s, ids, lq, target, opts, missing_mass, ce, soft, G):
    """The rows' CE and soft part, and (G not None) their gradient rows without 1/N, from the
    float32 student logits s [n, Vs] (biased). The gradient in the tempered logits is
    p_j (u_j - u_bar), u the divergence's dD/dP of column j's category (constants dropped: they
    cancel), u_bar its mean under P; the label's one-hot term is in G."""
    n, vs = s.shape
    s = s.astype(np.float64)
    z = s / opts.temperature
    logp = z - row_logsumexp(z)[:, None]
    LP, LQ, used = topk_categories(logp, ids, lq, missing_mass)
    P, Q = np.exp(LP), np.exp(LQ)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        soft[:], u, u_bar = topk_terms(opts.divergence, opts.beta, LP, LQ, P, Q)
        soft[soft < 0] = 0.0  # a divergence is >= 0; below that by rounding alone (NaN passes)
        lse_s = row_logsumexp(s)
        rows = np.arange(n)
        ce[:] = lse_s - s[rows, target]
        if G is None:
            return
        k = lq.shape[1]
        p = np.exp(logp)
        if missing_mass == "renormalize":  # the other ids are no category: no soft gradient
            dz = np.zeros_like(s)
        else:
            dz = topk_rest_dz(opts.divergence, p, logp, u, u_bar, LP, Q, k)
        slot = topk_slot_dz(opts.divergence, P, Q, u, u_bar, k)
        r, c = np.nonzero(used[:, :k])
        dz[r, ids[r, c]] = slot[r, c]
        hard = np.exp(s - lse_s[:, None])
        hard[rows, target] -= 1.0
        G[:] = opts.weight_hard_loss * hard + opts.w_soft_over_t * dz


def teacher_topk_rows(t, k, temperature):
    """(indices [n, k] int64, log-probabilities [n, k] float32) of the k largest of each row of
    the float32 logits t [n, V] (biased), by descending log-probability (ties: the lower id)."""
    n, v = t.shape
    part = np.argpartition(-t, k - 1, axis=1)[:, :k] if k < v else np.broadcast_to(np.arange(v), (n, v))
    values = np.take_along_axis(t, part, axis=1)
    order = np.lexsort((part, -values), axis=1)
    ids = np.take_along_axis(part, order, axis=1)
    z = t.astype(np.float64) / temperature
    lse = row_logsumexp(z)
    return ids.astype(np.int64), (np.take_along_axis(z, ids, axis=1) - lse[:, None]).astype(np.float32)
