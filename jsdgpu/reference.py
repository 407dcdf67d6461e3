"""The loss of docs/contract.md in float64, in the plainest code: the yardstick of the tests.

It holds the full logits. NumPy arrays in, NumPy out; CuPy arrays run it on the GPU (the tests
use that for the benchmark shape, where NumPy would take minutes).
"""

import sys

import numpy as np

from .options import REDUCTIONS, LossOptions


def row_logsumexp(x):
    """logsumexp over each row's last axis (NumPy or CuPy), -inf for a row of -infs (NaN stays
    NaN)."""
    xp = _array_module(x)
    m = x.max(axis=-1, keepdims=True)
    m_safe = xp.where(xp.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (m_safe + xp.log(xp.exp(x - m_safe).sum(axis=-1, keepdims=True)))[..., 0]


def _log_softmax(x):
    return x - row_logsumexp(x)[:, None]


def _xlogy_diff(xp, w, a, b):
    """sum of w * (a - b) over each row, with 0 where w == 0 (the limit 0 log 0 = 0); a NaN
    weight stays NaN."""
    return xp.where(w != 0, w * (a - b), 0.0).sum(axis=1)


def reference(student_input, student_weight, teacher_input, teacher_weight, target,
              student_bias=None, teacher_bias=None, *, student_logit_scale=1.0, teacher_logit_scale=1.0,
              student_logit_softcap=None, teacher_logit_softcap=None, token_weights=None, reduction="mean",
              grad_output=None, **options):
    """Return (loss, hard_loss, soft_loss, grad_input, grad_weight, grad_bias), all float64.

    options: those of jsdgpu.LossOptions. grad_bias is None when student_bias is None.
    Gradients are those of `loss`, times grad_output (None: 1; with reduction "none", an array
    [T] or None for ones). Each model's logits are model_logits' of x @ W.T + b (its scale and
    soft cap); token_weights and reduction as _reduced_loss's.
    """
    xp = _array_module(student_input)
    f = lambda a: None if a is None else xp.asarray(a).astype(xp.float64)  # noqa: E731
    xs, ws, xt, wt = f(student_input), f(student_weight), f(teacher_input), f(teacher_weight)
    bs, bt = f(student_bias), f(teacher_bias)
    s, ds = model_logits(xs @ ws.T + (0.0 if bs is None else bs), student_logit_scale, student_logit_softcap)
    t, _ = model_logits(xt @ wt.T + (0.0 if bt is None else bt), teacher_logit_scale, teacher_logit_softcap)
    loss, hard, soft, G = reference_logits(s, t, target, token_weights=token_weights, reduction=reduction,
                                           grad_output=grad_output, **options)
    return (loss, hard, soft, *_student_gradients(G * ds, xs, ws, bs))


def model_logits(raw, scale=1.0, softcap=None):
    """(z, dz / draw): a model's logits z = scale * raw, then c tanh(z / c) where a soft cap c is
    given (Gemma's final_logit_softcapping), and their derivative in raw, elementwise."""
    xp = _array_module(raw)
    z = scale * raw
    if softcap is None:
        return z, scale
    th = xp.tanh(z / softcap)
    return softcap * th, scale * (1.0 - th * th)


def _student_gradients(G, xs, ws, bs):
    """(grad_input, grad_weight, grad_bias) from G, the gradient in the student's logits."""
    return G @ ws, G.T @ xs, None if bs is None else G.sum(axis=0)


def _reduced_loss(xp, opts, valid, n, ce, soft, d_hard, dz, token_weights=None, reduction="mean",
                  grad_output=None):
    """(loss, hard_loss, soft_loss, G) from the rows' CE and soft part and their gradients in s
    (hard) and z = s / T (soft); G the gradient in the student's logits, times grad_output.

    Each valid row's hard and soft parts are times its token weight (token_weights [T], finite
    and >= 0; None for ones); ignored rows count for nothing. reduction "mean": their sums over
    N (the valid rows' count, at least 1); "sum": the sums; "none": the rows' own, as arrays [T]
    (0 where ignored), the loss each row's w_hard hard + w_soft soft, and grad_output an array
    [T] (None: ones)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    T = len(ce)
    w = xp.ones(T) if token_weights is None else xp.asarray(token_weights).astype(xp.float64)
    if w.shape != (T,) or not bool(xp.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"token_weights must be a finite array of shape ({T},) >= 0")
    w = xp.where(valid, w, 0.0)
    hard_rows, soft_rows = xp.where(valid, w * ce, 0.0), xp.where(valid, w * soft, 0.0)
    G = w[:, None] * (opts.weight_hard_loss * d_hard + (opts.weight_soft_loss / opts.temperature) * dz)
    if reduction == "none":
        go = xp.ones(T) if grad_output is None else xp.asarray(grad_output).astype(xp.float64)
        G = go[:, None] * G
        hard, soft = hard_rows, soft_rows
    else:
        divisor = n if reduction == "mean" else 1.0
        hard, soft = float(hard_rows.sum()) / divisor, float(soft_rows.sum()) / divisor
        G = G * ((1.0 if grad_output is None else float(grad_output)) / divisor)
    G[~valid] = 0.0
    return opts.weight_hard_loss * hard + opts.weight_soft_loss * soft, hard, soft, G


def _array_module(a):
    return sys.modules["cupy"] if type(a).__module__.startswith("cupy") else np


def _centered(xp, p, h):
    """h - sum p h over each row (the 0 log 0 limit where p == 0), taken about h at the row's
    largest p: the same number, but where p is near one-hot (a saturated JSD, a sharp row) not
    the difference of two sums near that h, whose rounding the gradient there is below."""
    h_ref = xp.take_along_axis(h, p.argmax(axis=1)[:, None], axis=1)
    h = h - h_ref
    return h - xp.where(p != 0, p * h, 0.0).sum(axis=1, keepdims=True)


def _hard_part(xp, s, target, ignore_index):
    """(valid, N, ce, d_hard): the valid rows, N = max(1, their count), each row's cross-entropy on
    the untempered student logits and its gradient softmax(s) - onehot(target)."""
    T = s.shape[0]
    valid = target != ignore_index
    safe_target = xp.where(valid, target, 0)
    log_sm = _log_softmax(s)
    ce = -log_sm[xp.arange(T), safe_target]
    onehot = xp.zeros_like(s)
    onehot[xp.arange(T), safe_target] = 1.0
    return valid, max(1, int(valid.sum())), ce, xp.exp(log_sm) - onehot


def reference_logits(s, t, target, token_weights=None, reduction="mean", grad_output=None, **options):
    """The loss from the logits: (loss, hard_loss, soft_loss, G), G [T, Vs] the gradient of the
    loss with respect to the student logits s [T, Vs]; t [T, Vt] the teacher's; float64
    (token_weights, reduction, grad_output: _reduced_loss's)."""
    opts = LossOptions(**options)
    beta, temperature = opts.beta, opts.temperature
    xp = _array_module(s)
    s, t = xp.asarray(s).astype(xp.float64), xp.asarray(t).astype(xp.float64)
    target = xp.asarray(target).astype(xp.int64)
    T, Vs, Vt = s.shape[0], s.shape[1], t.shape[1]
    valid, n, ce, d_hard = _hard_part(xp, s, target, opts.ignore_index)

    # soft part: tempered logits, the student padded with zero logits up to Vt
    z = xp.concatenate([s / temperature, xp.zeros((T, Vt - Vs))], axis=1)
    logp = _log_softmax(z)
    logq = _log_softmax(t / temperature)
    p, q = xp.exp(logp), xp.exp(logq)
    if beta == 0:  # forward KL(q || p)
        jsd = _xlogy_diff(xp, q, logq, logp)
        dz = p - q
    elif beta == 1:  # reverse KL(p || q)
        jsd = _xlogy_diff(xp, p, logp, logq)
        dz = p * _centered(xp, p, logp - logq)
    else:
        # log m in log space: finite where p and q both underflow (low temperatures, large logits)
        logm = xp.logaddexp(np.log1p(-beta) + logp, np.log(beta) + logq)
        jsd = beta * _xlogy_diff(xp, q, logq, logm) + (1 - beta) * _xlogy_diff(xp, p, logp, logm)
        dz = (1 - beta) * p * _centered(xp, p, logp - logm)
    dz = dz[:, :Vs]  # the pad columns are constants: no gradient

    return _reduced_loss(xp, opts, valid, n, ce, jsd, d_hard, dz, token_weights, reduction, grad_output)


# ---- offline distillation: the teacher as stored top-k log-probabilities ----

def reference_topk(student_input, student_weight, teacher_indices, teacher_logprobs, target,
                   student_bias=None, missing_mass="bucket", *, student_logit_scale=1.0, student_logit_softcap=None,
                   token_weights=None, reduction="mean", grad_output=None, **options):
    """The top-k loss of docs/contract.md ("Offline distillation"): (loss, hard_loss, soft_loss,
    grad_input, grad_weight, grad_bias), all float64, the gradients those of `loss` (times
    grad_output). The student's scale and soft cap, token_weights and reduction as reference's
    (the stored log-probabilities are the teacher's already)."""
    xp = _array_module(student_input)
    f = lambda a: None if a is None else xp.asarray(a).astype(xp.float64)  # noqa: E731
    xs, ws, bs = f(student_input), f(student_weight), f(student_bias)
    s, ds = model_logits(xs @ ws.T + (0.0 if bs is None else bs), student_logit_scale, student_logit_softcap)
    loss, hard, soft, G = reference_topk_logits(s, teacher_indices, teacher_logprobs, target, missing_mass,
                                                token_weights=token_weights, reduction=reduction,
                                                grad_output=grad_output, **options)
    return (loss, hard, soft, *_student_gradients(G * ds, xs, ws, bs))


def topk_categories(logp, teacher_indices, teacher_logprobs, missing_mass):
    """(log P, log q, used, rest) over each row's categories: the k slots, then (bucket) the rest.
    logp: the student's log-softmax [T, Vs] (float64); unused slots (log-probability -inf) hold
    -inf in both. rest [T, Vs]: the ids in no used slot (bucket; None where renormalized)."""
    xp = _array_module(logp)
    T, vs = logp.shape
    lq = xp.asarray(teacher_logprobs).astype(xp.float64)
    used = lq != -np.inf
    ids = xp.where(used, xp.asarray(teacher_indices).astype(xp.int64), 0)
    rows = xp.arange(T)[:, None]
    lp = xp.where(used, logp[rows, ids], -np.inf)
    lse_q = row_logsumexp(lq)
    if missing_mass == "renormalize":  # a row with no used slot has no category
        with np.errstate(invalid="ignore"):
            return (xp.where(used, lp - row_logsumexp(lp)[:, None], -np.inf),
                    xp.where(used, lq - lse_q[:, None], -np.inf), used, None)
    # the rest: the student's mass on every other id, summed over those ids (no cancellation)
    rest = xp.ones((T, vs), bool)
    rest[xp.broadcast_to(rows, ids.shape)[used], ids[used]] = False
    lp_rest = row_logsumexp(xp.where(rest, logp, -np.inf))
    with np.errstate(divide="ignore", invalid="ignore"):
        lq_rest = xp.where(lse_q < 0, xp.log(-xp.expm1(xp.minimum(lse_q, 0.0))), -np.inf)
        lq_rest = xp.where(xp.isnan(lse_q), np.nan, lq_rest)
    # where the slots hold every id there is no rest: the teacher's mass left over is its rounding
    lq_rest = xp.where(rest.any(axis=1), lq_rest, -np.inf)
    return (xp.concatenate([lp, lp_rest[:, None]], axis=1), xp.concatenate([lq, lq_rest[:, None]], axis=1),
            xp.concatenate([used, xp.ones((T, 1), bool)], axis=1), rest)


def reference_topk_logits(s, teacher_indices, teacher_logprobs, target, missing_mass="bucket", token_weights=None,
                          reduction="mean", grad_output=None, **options):
    """The top-k loss from the student's logits s [T, Vs]: (loss, hard_loss, soft_loss, G), G the
    gradient of the loss with respect to s; float64. The gradient is the chain rule written out:
    dD/dP per category, times dP/dz, the Jacobian of the categories' probabilities in the
    tempered logits z = s / temperature."""
    opts = LossOptions(**options)
    beta, temperature = opts.beta, opts.temperature
    xp = _array_module(s)
    s = xp.asarray(s).astype(xp.float64)
    target = xp.asarray(target).astype(xp.int64)
    T = s.shape[0]
    valid, n, ce, d_hard = _hard_part(xp, s, target, opts.ignore_index)

    logp = _log_softmax(s / temperature)
    p = xp.exp(logp)
    LP, LQ, used, rest = topk_categories(logp, teacher_indices, teacher_logprobs, missing_mass)
    P, Q = xp.exp(LP), xp.exp(LQ)
    # PdD: P dD/dP per category, formed so that an underflowing P gives 0, not 0 * inf
    with np.errstate(divide="ignore", invalid="ignore"):
        if beta == 0:  # forward KL(q || P); dD/dP = -q / P
            soft = _xlogy_diff(xp, Q, LQ, LP)
            PdD = -Q
        elif beta == 1:  # reverse KL(P || q); dD/dP = log(P / q) + 1
            soft = _xlogy_diff(xp, P, LP, LQ)
            PdD = xp.where(P != 0, P * (LP - LQ + 1.0), 0.0)
        else:  # dD/dP = (1 - beta) log(P / m)
            LM = xp.logaddexp(np.log1p(-beta) + LP, np.log(beta) + LQ)
            soft = beta * _xlogy_diff(xp, Q, LQ, LM) + (1 - beta) * _xlogy_diff(xp, P, LP, LM)
            PdD = xp.where(P != 0, (1 - beta) * P * (LP - LM), 0.0)
    PdD = xp.where(used, PdD, 0.0)
    k = xp.asarray(teacher_logprobs).shape[1]
    ids = xp.where(used[:, :k], xp.asarray(teacher_indices).astype(xp.int64), 0)
    rows = xp.arange(T)[:, None]
    at_ids = (xp.broadcast_to(rows, ids.shape), ids)
    # dz_j = sum_c dD/dP_c dP_c/dz_j
    dz = xp.zeros_like(s)
    if missing_mass == "renormalize":
        # P_c = p[id_c] / S over the used slots: dP_c/dz_j = P_c (onehot(id_c)_j - P(j)), P(j) the
        # renormalized probability of j where j is a slot's id, else 0
        Pj = xp.zeros_like(s)
        xp.add.at(Pj, at_ids, xp.where(used, P, 0.0))
        xp.add.at(dz, at_ids, PdD)
        dz -= PdD.sum(axis=1, keepdims=True) * Pj
    else:
        # P_c = p[id_c]: dP_c/dz_j = P_c (onehot(id_c)_j - p_j); P_rest, the sum of p over the
        # rest's ids: dP_rest/dz_j = p_j (rest_j - P_rest), the first term as P_rest times
        # p_j / P_rest (not as -sum_c dP_c/dz_j, which cancels where P_rest is tiny)
        w = xp.where(used[:, :k], PdD[:, :k], 0.0)
        xp.add.at(dz, at_ids, w)
        with np.errstate(over="ignore", invalid="ignore"):  # an infinite divergence: no gradient
            dz += xp.where(rest, PdD[:, k:] * xp.exp(logp - LP[:, k:]), 0.0)
            dz -= (w.sum(axis=1, keepdims=True) + PdD[:, k:]) * p

    return _reduced_loss(xp, opts, valid, n, ce, soft, d_hard, dz, token_weights, reduction, grad_output)
