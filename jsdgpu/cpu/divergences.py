"""The soft part's divergences on the CPU, each in one place (as jsdgpu/cuda/src/divergences.cuh
holds them on the GPU): for the online loss's row kernels (rows.py; Numba, inlined, switched on
the mode's code) a column's shares of the KL sums and its gradient's h, the row's soft part from
its sums, and a column's dz; for the top-k loss (jsdgpu/topk_shards.py; NumPy or CuPy, float64)
the categories' soft part and u, and the gradient's dz. Adding a divergence: docs/design.md,
"Where a divergence's math lives"."""

import numba
import numpy as np

from ..options import Divergence
from .fastmath import FAST, SMALLEST_NORMAL, log64

FORWARD_KL, JSD, REVERSE_KL = int(Divergence.FORWARD_KL), int(Divergence.JSD), int(Divergence.REVERSE_KL)


@numba.njit(fastmath=FAST, inline="always")
def column(lp, lq, p, q, mode, one_minus_beta, beta):
    """One column's shares of a = sum p (log p - log m) and b = sum q (log q - log m), with m the
    mixture (JSD), p (forward KL) or q (reverse KL), and h, what the gradient needs of the
    teacher; from the column's log-probabilities lp, lq and probabilities p, q."""
    if mode == FORWARD_KL:
        lm = lp
        h = q
    elif mode == JSD:
        # log m of m itself (p and q are float64 to a few 1e-16: one log, where log space took an
        # exp and a log1p); where m is not a normal float64, p and q are below 1e-307 and their
        # shares nothing: any finite log m will do
        m = one_minus_beta * p + beta * q
        lm = log64(m) if m >= SMALLEST_NORMAL else max(lp, lq)
        h = lp - lm
    else:
        lm = lq
        h = lp - lq
    # 0 log 0 = 0; "!= 0" so that a NaN reaches the loss
    a = p * (lp - lm) if p != 0.0 else 0.0
    b = q * (lq - lm) if q != 0.0 else 0.0
    return a, b, h


@numba.njit(fastmath=FAST, inline="always")
def soft(a, b, mode, beta):
    """The row's soft part from its sums a and b (column's)."""
    return b if mode == FORWARD_KL else (beta * b + (1.0 - beta) * a if mode == JSD else a)


@numba.njit(fastmath=FAST, inline="always")
def grad_dz(p, h, a, mode, beta):
    """A column's dz, the soft part's gradient in its tempered logit, from its p and h (column's)
    and the row's a: p - q in forward KL (h is q there), else c p (h - a), c = 1 - beta in the
    JSD, 1 in reverse KL."""
    c = 1.0 - beta if mode == JSD else 1.0
    return p - h if mode == FORWARD_KL else c * p * (h - a)


# ---- the top-k loss's categories (topk_shards.py): log P, log q, P, q [rows, categories], float64 ----

def topk_terms(mode, beta, LP, LQ, P, Q):
    """(soft, u, u_bar): each row's soft part, each category's u = dD/dP up to a constant (0 where
    P is 0; None in forward KL, whose gradient takes P u = -q) and u_bar = sum P u."""
    if mode == FORWARD_KL:  # P u = -q
        return np.where(Q != 0, Q * (LQ - LP), 0.0).sum(axis=1), None, -Q.sum(axis=1)
    if mode == REVERSE_KL:
        u = LP - LQ
        terms = np.where(P != 0, P * u, 0.0)
        soft_rows = terms.sum(axis=1)
    else:
        LM = np.logaddexp(np.log1p(-beta) + LP, np.log(beta) + LQ)
        u = (1 - beta) * (LP - LM)
        terms = np.where(P != 0, P * u, 0.0)
        soft_rows = (beta * np.where(Q != 0, Q * (LQ - LM), 0.0).sum(axis=1)
                     + (1 - beta) * np.where(P != 0, P * (LP - LM), 0.0).sum(axis=1))
    return soft_rows, np.where(P != 0, u, 0.0), terms.sum(axis=1)


def topk_rest_dz(mode, p, logp, u, u_bar, LP, Q, k):
    """dz of every column as the rest's (the slots' are written over: topk_slot_dz), the bucket's
    k + 1 categories: p_j (u_rest - u_bar), or in forward KL p_j (-u_bar - q_rest / P_rest)."""
    if mode == FORWARD_KL:
        return -u_bar[:, None] * p - Q[:, k:] * np.exp(logp - LP[:, k:])
    return p * (u[:, k:] - u_bar[:, None])


def topk_slot_dz(mode, P, Q, u, u_bar, k):
    """dz of the k slots' columns: P (u - u_bar), or in forward KL -u_bar P - q."""
    if mode == FORWARD_KL:
        return -u_bar[:, None] * P[:, :k] - Q[:, :k]
    return P[:, :k] * (u[:, :k] - u_bar[:, None])
