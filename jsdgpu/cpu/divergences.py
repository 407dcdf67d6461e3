"""The soft part's divergences on the CPU, each in one place (as jsdgpu/cuda/src/divergences.cuh
holds them on the GPU): for the online loss's fused row kernel (rows.py; Numba, inlined, switched
on the mode's code, a constant at each call) a column's float32 terms, the GPU's (column32), and
the row's soft part from their sums; for its phase kernels (float64) a column's shares of the KL
sums and its gradient's h, and the row's soft part from its sums; for both, a column's dz; for
the top-k loss (jsdgpu/topk_shards.py; NumPy or CuPy, float64) the categories' soft part and u,
and the gradient's dz. Adding a divergence: docs/design.md, "Where a divergence's math lives"."""

import functools

import numba
import numpy as np

from .. import soft_poly
from ..options import Divergence
from .fastmath import F32, FAST, SMALLEST_NORMAL, log32, log64

FORWARD_KL, JSD, REVERSE_KL = int(Divergence.FORWARD_KL), int(Divergence.JSD), int(Divergence.REVERSE_KL)


@numba.njit(fastmath=FAST, inline="always")
def column(lp, lq, p, q, mode, one_minus_beta, beta, h_ref):
    """One column's shares of a = sum p (log p - log m) and b = sum q (log q - log m), with m the
    mixture (JSD), p (forward KL) or q (reverse KL), and h, what the gradient needs of the
    teacher (grad_dz's); from the column's log-probabilities lp, lq and probabilities p, q. In
    reverse KL and the JSD, h = lp - lm and a are relative to the reference column's h_ref (a
    saturated row's gradient is below float64's rounding of h: row_math.cuh, "A sharp row")."""
    if mode == FORWARD_KL:
        lm = lp
        h = p - q  # (float64: right relative to itself for |ln(q / p)| down to about 1e-9)
    elif mode == JSD:
        # log m of m itself (p and q are float64 to a few 1e-16: one log, where log space took an
        # exp and a log1p); where m is not a normal float64, p and q are below 1e-307 and their
        # shares nothing: any finite log m will do
        m = one_minus_beta * p + beta * q
        lm = log64(m) if m >= SMALLEST_NORMAL else max(lp, lq)
        h = (lp - lm) - h_ref
    else:
        lm = lq
        h = (lp - lq) - h_ref
    # 0 log 0 = 0; "!= 0" so that a NaN reaches the loss
    a = (0.0 if mode == FORWARD_KL else p * h) if p != 0.0 else 0.0
    b = q * (lq - lm) if q != 0.0 else 0.0
    return a, b, h


@numba.njit(fastmath=FAST, inline="always")
def soft(a, b, mode, beta):
    """The row's soft part from its sums a and b (column's)."""
    return b if mode == FORWARD_KL else (beta * b + (1.0 - beta) * a if mode == JSD else a)


@numba.njit(fastmath=FAST, inline="always")
def grad_dz(p, h, a, mode, c):
    """A column's dz, the soft part's gradient in its tempered logit, from its p and h (column's or
    column32's) and the row's a (its kl; relative in reverse KL and the JSD; in forward KL
    column32's sum of p - q): p - q in forward KL, h less a p there (the row's p - q sum to 0 but
    for their roundings, which a takes out: c's float32 rounding shifted every column's d alike), else
    c p (h - a), with the row's c = 1 - beta in the JSD, 1 in reverse KL (each kernel's, in its own
    precision: a float64 c would take the float32 kernel's gradient loop to float64)."""
    return h - a * p if mode == FORWARD_KL else c * p * (h - a)


# ---- the fused kernel's column terms, in float32 (jsdgpu/cuda/src/row_math.cuh, column_terms) ----
#
# As on the GPU: each soft part is a sum over the columns of w F(d) >= 0, w the probability of
# the weight distribution (p; q in reverse KL, and in the JSD with beta > 1/2: mirrored), d =
# ln(o / w) the log-ratio of the other's, formed from the logits' difference t - s, and F second
# order in d, so that no column's term cancels against another's and the exps' roundings reach a
# small divergence at second order only (docs/design.md, "Small divergences"). On |d| <
# NEAR_BELOW, F(d) = d^2 P(d) (jsdgpu/soft_poly.py, in nats here); elsewhere its formula: w
# Phi(d) = w + o (d - 1) for the KLs; for the JSD with b >= 1/6 the column's shares of the fast
# sums, and with a smaller b, b w Phi(d) - w G(y) (row_math.cuh has the math). Unlike the GPU's,
# the row's logsumexps are float64 and each p and q the exp of a float32 logit less a float32
# shift: none of the GPU's corrections for logsumexps rounded to float32 (its unrounded_sums) is
# needed.

SMALL_B_BELOW = F32(1.0 / 6.0)  # row_math.cuh's SMALL_B_BELOW
# The near columns, whose soft term and gradient take P and Q (soft_poly.py): |d| < 1/2, where
# seven terms of each are within float32's rounding, against the GPU's nine on |d| < 1. Four
# multiply-adds a column fewer (the JSD's kernel 4.5-6.6% less time: docs/design.md, "The CPU
# backend"); the far formulas then cancel by up to 11 times in a column's soft term (forward KL
# at d = -1/2, where it was 4 at -1), within the contract's precision of a small soft part.
NEAR_BELOW = F32(0.5)
NEAR_TERMS = 7
PRECISE_BELOW = 0.1  # nats: where a row's soft part is the precise sum's (row_math.cuh's PRECISE_BELOW_BITS)


# The JSD's mixture log, by the call's b (each form a column loop of its own: fused_row.row_sums):
# below SMALL_B_BELOW from the ratio of the smaller of w and o to the larger, by log32; from it as
# 2 atanh(u) by L (mixture_log_poly) of nine terms, and from SHORT_LOG_FROM (beta in [1/3, 2/3],
# the default 1/2 among them), where u^2 <= 1/4, of six: three multiply-adds a column fewer and
# the loop's registers three coefficients freer (the JSD's loop 5% fewer instructions, fewer of
# them its spills' reloads, at b = 1/2: docs/design.md, "The CPU backend")
MIXTURE_BY_RATIO, MIXTURE_BY_LOG, MIXTURE_BY_SHORT_LOG = 0, 1, 2
SHORT_LOG_FROM = F32(1.0 / 3.0)
MIXTURE_LOG_TERMS = (0, 9, 6)  # L's, by the form (a tuple: the kernels index it)


@numba.njit(fastmath=FAST, inline="always")
def mixture_form(b):
    """The JSD's mixture log's form for the float32 b (a KL's b is 0, its form unused)."""
    return MIXTURE_BY_RATIO if b < SMALL_B_BELOW else (MIXTURE_BY_LOG if b < SHORT_LOG_FROM else MIXTURE_BY_SHORT_LOG)


@functools.lru_cache(maxsize=None)
def precise_terms(divergence, beta):
    """(b, column32's float32 coefficients): P's NEAR_TERMS of its precise sum (soft_poly.py, on
    |d| < NEAR_BELOW), L's of the JSD's mixture log (mixture_log_poly: as many as its form takes,
    then zeros to nine; all zeros for the KLs and for b below SMALL_B_BELOW, whose columns take
    log32), then Q's NEAR_TERMS of the gradient's first-order part (soft_poly.py, grad_poly)."""
    b = soft_poly.mixture_weight(divergence, beta)
    log_poly = np.zeros(MIXTURE_LOG_TERMS[MIXTURE_BY_LOG])
    terms = MIXTURE_LOG_TERMS[mixture_form(F32(b))]  # (b in float32, as the kernel tests it: rows._fused_row)
    if terms:
        log_poly[:terms] = mixture_log_poly(b, terms)
    near = dict(radius=float(NEAR_BELOW), terms=NEAR_TERMS)
    return b, np.concatenate([soft_poly.soft_poly(divergence, beta, **near), log_poly,
                              soft_poly.grad_poly(divergence, beta, **near)]).astype(np.float32)


def mixture_log_poly(b, terms):
    """L's coefficients of x^0 .. x^(terms - 1) (float64), u L(u^2) = 2 atanh(u) = ln((1 + u) / (1 -
    u)) on the u that a JSD column of mixture weight b meets: u = (m - l) / (m + l), l the larger
    of w and o, m the mixture, whose m / l is in [b, 1] (b <= 1/2), so that u^2 <= ((1 - b) / (1 +
    b))^2. A Chebyshev fit in u^2 at 64 nodes, within 2e-8 relative (under float32's rounding) for
    b >= SMALL_B_BELOW with nine terms, b >= SHORT_LOG_FROM with six (tests/test_cpu_fastmath.py)."""
    top = ((1 - b) / (1 + b)) ** 2
    x = top / 2 * (1 + np.cos(np.pi * (np.arange(64) + 0.5) / 64))
    root = np.sqrt(x)
    fit = np.polynomial.Chebyshev.fit(x, 2 * np.arctanh(root) / root, terms - 1, domain=[0, top])
    return fit.convert(kind=np.polynomial.Polynomial).coef


# where each polynomial's coefficients start in precise_terms' array
_P_AT, _L_AT, _Q_AT = 0, NEAR_TERMS, NEAR_TERMS + MIXTURE_LOG_TERMS[MIXTURE_BY_LOG]


@numba.njit(fastmath=FAST, inline="always")
def _horner(poly, first, terms, x):
    """The polynomial of the float32 coefficients poly[first:first + terms] (of x^0 upwards) at x,
    by Horner (first and terms: constants where it is inlined, so that LLVM unrolls the loop)."""
    acc = poly[first + terms - 1]
    for k in range(terms - 2, -1, -1):
        acc = acc * x + poly[first + k]
    return acc


@numba.njit(fastmath=FAST, inline="always")
def mixture_log_of(poly, u, form):
    """ln((1 + u) / (1 - u)) by L (mixture_log_poly) of the float32 coefficients past P's in poly
    (precise_terms'), in u^2: as many as b's form takes (form: a constant where column32 calls
    it)."""
    return u * _horner(poly, _L_AT, MIXTURE_LOG_TERMS[form], u * u)


@numba.njit(fastmath=FAST, inline="always")
def soft_poly_of(poly, d):
    """P(d) (soft_poly.py) of the first NEAR_TERMS float32 coefficients of poly."""
    return _horner(poly, _P_AT, NEAR_TERMS, d)


@numba.njit(fastmath=FAST, inline="always")
def grad_poly_of(poly, d):
    """Q(d) (soft_poly.py, grad_poly) of the last NEAR_TERMS float32 coefficients of poly."""
    return _horner(poly, _Q_AT, NEAR_TERMS, d)


@numba.njit(fastmath=FAST, inline="always")
def log1p_small(y):
    """ln(1 + y) for |y| < 1/10, relative to float32: y (1 - y / 2 + y^2 / 3 - ...), to y^7 / 8."""
    return y * ((((((F32(1 / 7) * y - F32(1 / 6)) * y + F32(1 / 5)) * y - F32(1 / 4)) * y + F32(1 / 3)) * y
                 - F32(0.5)) * y + F32(1.0))


@numba.njit(fastmath=FAST, inline="always")
def column32(s, t, p, q, mode, form, row, poly):
    """One column's (a, b, precise, w, h), float32: its shares of the fast sums a = sum p (lp - lm)
    and b = sum q (lq - lm) (m the mixture, p in forward KL, q in reverse KL; in reverse KL and the
    JSD a relative to the reference column, as the GPU's: rows.py), of the precise sum and of the
    weights' sum, and the gradient's h (p - q in forward KL, and a their sum; lp - lm less the reference
    column's in reverse KL and the JSD: rows.py); from its logits s, t and probabilities p, q.
    mode and form (the JSD's mixture_form): constants where rows.py calls it; row: the row's (c =
    lse_z - lse_t, scale = 1 / temperature, the reference column's t - s (reverse KL's) and h
    (the JSD's; 0 where it is being found), mirrored, beta, 1 - beta, b); poly: P's coefficients,
    then L's and Q's (precise_terms')."""
    c, scale, diff_ref, h_ref, mirrored, beta, one_minus_beta, b = row
    small_b = form == MIXTURE_BY_RATIO
    diff = t - s
    # ln(q / p). c's float32 rounding (up to 3e-8 |c|, the two models' logits' offset at most)
    # shifts every column's d alike: second order in a small divergence's precise sum; in the fast
    # sums, up to that many nats, the size of the logits' own roundings there. (c in two parts,
    # (diff scale + c_hi) + c_lo, is reassociated by the fast math into one.)
    d = diff * scale + c
    # |d| < NEAR_BELOW: the gradient's first-order part as d Q(d) (soft_poly.grad_poly), relative
    # to itself, where p - q or ln(p / m) from the rounded p and q lost to their roundings what
    # they are smaller than 1 (a converging student's rows; at beta 1e-6 or 1 - 1e-6, every row)
    near = abs(d) < NEAR_BELOW
    if mode == FORWARD_KL:
        w, o, dd = p, q, d
        # h: the gradient's p - q; a: the row's sum of them (grad_dz)
        h = -p * (d * grad_poly_of(poly, d)) if near else p - q
        a, bq = h, q * d
        a_abs = a
    elif mode == REVERSE_KL:
        w, o, dd = q, p, -d
        h = (diff_ref - diff) * scale
        a, bq = p * h, F32(0.0)
        a_abs = a
    else:
        dd = -d if mirrored else d
        w, o = (q, p) if mirrored else (p, q)
        # the mixture's log relative to the larger of w and o, l = ln(m / larger) in [ln b, 0],
        # never a difference of two large logs. Which one is larger is their own word, not d's
        # sign: the two differ where one has flushed to 0 (exp32 below e^-87), and there d's sign
        # took the ratio of 0 for the other's over it, and a column's term to inf.
        o_larger = o > w
        larger = max(w, o)
        if small_b:
            # from the smaller over the larger, in [0, 1] (nothing overflows; 1 where both are
            # 0), by a division of the two where the GPU takes 2^-|d| (an exp: 2-2.5 ms more at
            # 512 rows of 32000). (min and max, not selects on o_larger: LLVM took those into a
            # division of each order, each masked.)
            ratio = min(w, o) / larger if larger > F32(0.0) else F32(1.0)
            l = log32((F32(1.0) - b) * ratio + b if o_larger else b * ratio + (F32(1.0) - b))
            y = b * (F32(1.0) / ratio - F32(1.0) if o_larger else ratio - F32(1.0))  # m / w - 1
        else:
            # as 2 atanh(u), u = (m - larger) / (m + larger) in [(b - 1) / (b + 1), 0]: one
            # division where the ratio and log32 took two, and no range reduction (the JSD 6-9%
            # faster, docs/record.md); 0 where both are 0
            m = (F32(1.0) - b) * w + b * o
            l = mixture_log_of(poly, (m - larger) / (m + larger) if larger > F32(0.0) else F32(0.0), form)
            y = F32(0.0)  # (unused where b >= 1/6)
        d_larger = dd if o_larger else F32(0.0)  # ln(larger / w)
        # ln(w / m), ln(o / m): where |d| < NEAR_BELOW from ln(m / w) = d Q(d); with a small b,
        # where |y| < 1/10, from ln(1 + y)'s series (l, the log of a number within b of 1, lost
        # it); else from l (no sum with dd, hundreds of nats in a sharp row)
        if near:
            m_w = dd * grad_poly_of(poly, dd)
            h_w, h_o = -m_w, dd - m_w
        elif small_b and abs(y) < F32(0.1):
            m_w = log1p_small(y)
            h_w, h_o = -m_w, dd - m_w
        else:
            h_w, h_o = -l - d_larger, (F32(0.0) if o_larger else dd) - l
        h_p = h_o if mirrored else h_w  # lp - lm
        h = h_p - h_ref
        a, bq = p * h, q * (h_w if mirrored else h_o)
        a_abs = p * h_p  # (the share of a not relative)
    if abs(dd) < NEAR_BELOW:
        precise = w * (dd * dd) * soft_poly_of(poly, dd)
    elif mode != JSD:
        precise = w + o * (dd - F32(1.0))  # w Phi(d)
    elif not small_b:
        # the fast shares (not relative) are w H_b(d) here, cancelling by a factor of a few at
        # most (divergences.cuh, Divergence<JSD>::column)
        precise = beta * bq + one_minus_beta * a_abs
    else:
        o_less_w = b * (o - w)  # m - w
        if abs(o_less_w) < F32(0.1) * w:  # |y| < 1/10: G(y) / y^2 by its series
            g = ((((((F32(1 / 56) * y - F32(1 / 42)) * y + F32(1 / 30)) * y - F32(1 / 20)) * y + F32(1 / 12)) * y
                  - F32(1 / 6)) * y + F32(0.5))
            w_g = w * (y * y) * g
        else:  # m ln(m / w) - (m - w)
            w_g = (w + o_less_w) * (l + d_larger) - o_less_w
        precise = b * (w + o * (dd - F32(1.0))) - w_g
    return a, bq, precise, w, h


@numba.njit(fastmath=FAST, inline="always")
def soft_of_sums(a, b, precise, weights, mode, beta, h_ref):
    """The row's soft part from its column32 sums (float64): the fast sums' value (soft's; a is
    relative to the reference column's h_ref in reverse KL and the JSD, 0 elsewhere) from
    PRECISE_BELOW nats up (and where the precise sum is NaN: a NaN reaches the loss), else the
    precise sum over the weights' (their normalization's error, common to both, cancels)."""
    fast = soft(a + h_ref, b, mode, beta)
    return fast if fast >= PRECISE_BELOW or precise != precise else precise / weights


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
