"""The loss of docs/contract.md in float64, in the plainest code: the yardstick of the tests.

It holds the full logits. NumPy arrays in, NumPy out; CuPy arrays run it on the GPU (the tests
use that for the benchmark shape, where NumPy would take minutes).
"""

import sys

import numpy as np

from .options import LossOptions


def _logsumexp(xp, x):
    m = x.max(axis=1, keepdims=True)
    return (m + xp.log(xp.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]


def _log_softmax(xp, x):
    return x - _logsumexp(xp, x)[:, None]


def _xlogy_diff(xp, w, a, b):
    """sum of w * (a - b) over each row, with 0 where w == 0 (the limit 0 log 0 = 0); a NaN
    weight stays NaN."""
    return xp.where(w != 0, w * (a - b), 0.0).sum(axis=1)


def reference(student_input, student_weight, teacher_input, teacher_weight, target,
              student_bias=None, teacher_bias=None, **options):
    """Return (loss, hard_loss, soft_loss, grad_input, grad_weight, grad_bias), all float64.

    options: those of jsdgpu.LossOptions. grad_bias is None when student_bias is None.
    Gradients are those of `loss` (grad_output = 1).
    """
    xp = _array_module(student_input)
    f = lambda a: None if a is None else xp.asarray(a).astype(xp.float64)  # noqa: E731
    xs, ws, xt, wt = f(student_input), f(student_weight), f(teacher_input), f(teacher_weight)
    bs, bt = f(student_bias), f(teacher_bias)
    s = xs @ ws.T + (0.0 if bs is None else bs)
    t = xt @ wt.T + (0.0 if bt is None else bt)
    loss, hard, soft, G = reference_logits(s, t, target, **options)
    grad_bias = None if bs is None else G.sum(axis=0)
    return loss, hard, soft, G @ ws, G.T @ xs, grad_bias


def _array_module(a):
    return sys.modules["cupy"] if type(a).__module__.startswith("cupy") else np


def reference_logits(s, t, target, **options):
    """The loss from the logits: (loss, hard_loss, soft_loss, G), G [T, Vs] the gradient of the
    loss with respect to the student logits s [T, Vs]; t [T, Vt] the teacher's; float64."""
    opts = LossOptions(**options)
    beta, temperature, ignore_index = opts.beta, opts.temperature, opts.ignore_index
    weight_hard_loss, weight_soft_loss = opts.weight_hard_loss, opts.weight_soft_loss
    xp = _array_module(s)
    s, t = xp.asarray(s).astype(xp.float64), xp.asarray(t).astype(xp.float64)
    target = xp.asarray(target).astype(xp.int64)
    T, Vs, Vt = s.shape[0], s.shape[1], t.shape[1]
    valid = target != ignore_index
    n = max(1, int(valid.sum()))
    safe_target = xp.where(valid, target, 0)
    # hard part: cross-entropy on the untempered student logits
    log_sm = _log_softmax(xp, s)
    ce = -log_sm[xp.arange(T), safe_target]
    onehot = xp.zeros_like(s)
    onehot[xp.arange(T), safe_target] = 1.0
    d_hard = xp.exp(log_sm) - onehot

    # soft part: tempered logits, the student padded with zero logits up to Vt
    z = xp.concatenate([s / temperature, xp.zeros((T, Vt - Vs))], axis=1)
    logp = _log_softmax(xp, z)
    logq = _log_softmax(xp, t / temperature)
    p, q = xp.exp(logp), xp.exp(logq)
    if beta == 0:  # forward KL(q || p)
        jsd = _xlogy_diff(xp, q, logq, logp)
        dz = p - q
    elif beta == 1:  # reverse KL(p || q)
        kl = _xlogy_diff(xp, p, logp, logq)
        jsd = kl
        dz = p * ((logp - logq) - kl[:, None])
    else:
        # log m in log space: finite where p and q both underflow (low temperatures, large logits)
        logm = xp.logaddexp(np.log1p(-beta) + logp, np.log(beta) + logq)
        kl_pm = _xlogy_diff(xp, p, logp, logm)
        jsd = beta * _xlogy_diff(xp, q, logq, logm) + (1 - beta) * kl_pm
        g = (1 - beta) * (logp - logm)
        dz = p * (g - (1 - beta) * kl_pm[:, None])
    dz = dz[:, :Vs]  # the pad columns are constants: no gradient

    hard = float(xp.where(valid, ce, 0.0).sum()) / n
    soft = float(xp.where(valid, jsd, 0.0).sum()) / n
    loss = weight_hard_loss * hard + weight_soft_loss * soft

    G = (weight_hard_loss * d_hard + (weight_soft_loss / temperature) * dz) / n
    G[~valid] = 0.0
    return loss, hard, soft, G
