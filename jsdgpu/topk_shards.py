"""The top-k loss's row work under vocab parallelism (jsdgpu.parallel; docs/design.md, "Top-k under
vocab parallelism"): each rank holds a shard of the student's vocabulary. A row's statistics over
the rank's columns (the maxima and sums of the exponentials of s, of z = s / T and of z over the
columns that are no used slot's id, and the label's logit) and the logits of the slots' ids it
holds are combined across ranks; the categories' math (cpu/divergences.py's, float64) then runs
alike on every rank, and each rank writes its own columns' gradient. Array code, the same on NumPy
and CuPy (xp), in float64: three all-reduces a chunk, and no kernel of its own."""

import numpy as np

from .cpu.divergences import topk_rest_dz, topk_slot_dz, topk_terms
from .parallel import combine_stats


def _max_and_sum(xp, x):
    """(the maximum of each row of float64 x, the sum of exp(x - maximum)): (-inf, 0) for a row of
    -infs (an empty part: 2^(-inf - -inf) would be NaN)."""
    m = x.max(axis=1)
    return m, xp.exp(x - xp.where(m == -np.inf, 0.0, m)[:, None]).sum(axis=1)


def _logsumexp(xp, x):
    """logsumexp of each row of float64 x, -inf for a row of -infs."""
    m, total = _max_and_sum(xp, x)
    with np.errstate(divide="ignore"):
        return xp.where(xp.isfinite(m), m + xp.log(total), m)


def sharded_topk_rows(xp, s, shard, ids, lq, target, opts, missing_mass, ce, soft, with_grad, label_terms=None):
    """The rows' CE and soft part into ce and soft (the same on every rank), and with with_grad
    this rank's columns of their gradient without 1/N, returned (float64 [n, V_l]). s: the chunk's
    float32 logits of this rank's columns [n, V_l], biased, as the model's; shard: its
    parallel.Shard (v0, its first id; vs_total, the vocabulary); ids [n, k]: the top-k's ids in
    the whole vocabulary (checked), lq [n, k] their log-probabilities; target [n]: the labels as
    this shard's columns (-1: on another rank). label_terms [n] (for a 16-bit G): the label's
    one-hot term is kept out of the gradient where softmax(s) is below 1/2 there, and written
    into label_terms (as the GPU's kernels do); None: the one-hot term stays in."""
    n, vl = s.shape
    k = ids.shape[1]
    s = s.astype(np.float64)
    tempered = opts.temperature != 1.0  # else z is s, and its statistics and softmax are s's
    z = s / opts.temperature if tempered else s
    lq = lq.astype(np.float64)
    used = lq != -np.inf
    col = ids.astype(np.int64) - shard.v0
    here = used & (col >= 0) & (col < vl)  # the used slots whose id is this rank's
    col = xp.where(here, col, 0)
    slot_rows = xp.broadcast_to(xp.arange(n)[:, None], (n, k))
    owned = target >= 0
    label = xp.where(owned, target, 0).astype(np.int64)
    rows = xp.arange(n)
    stats = xp.zeros((7, n))  # renormalized: no rest, whose maximum and sum (2 and 5) stay 0
    stats[0], stats[3] = _max_and_sum(xp, s)
    stats[1], stats[4] = _max_and_sum(xp, z) if tempered else (stats[0], stats[3])
    if missing_mass == "bucket":
        in_slot = xp.zeros((n, vl), dtype=bool)
        in_slot[slot_rows[here], col[here]] = True
        # (-inf, 0) where every column here is a used slot's
        stats[2], stats[5] = _max_and_sum(xp, xp.where(in_slot, -np.inf, z))
    stats[6] = xp.where(owned, s[rows, label], 0.0)
    slot_z = xp.where(here, xp.take_along_axis(z, col, axis=1), 0.0)
    combine_stats(xp, shard.comm, stats)
    shard.comm.allreduce(slot_z, "sum")  # each used slot's id is one rank's

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lse_s = stats[0] + xp.log(stats[3])
        lse_z = stats[1] + xp.log(stats[4])
        LP = xp.where(used, slot_z - lse_z[:, None], -np.inf)
        LQ = lq  # (-inf at the unused slots: used is lq != -inf)
        lse_q = _logsumexp(xp, LQ)
        if missing_mass == "bucket":  # the rest: the ids in no used slot, as one more category
            lp_rest = xp.where(stats[5] > 0, stats[2] + xp.log(stats[5]), -np.inf) - lse_z
            any_rest = shard.vs_total - used.sum(axis=1) > 0
            lq_rest = xp.where(xp.isnan(lse_q), np.nan,
                               xp.where((lse_q < 0) & any_rest, xp.log(-xp.expm1(xp.minimum(lse_q, 0.0))), -np.inf))
            LP, LQ = xp.concatenate([LP, lp_rest[:, None]], axis=1), xp.concatenate([LQ, lq_rest[:, None]], axis=1)
        else:  # both renormalized over the used slots
            LP = xp.where(used, LP - _logsumexp(xp, LP)[:, None], -np.inf)
            LQ = xp.where(used, LQ - lse_q[:, None], -np.inf)
        P, Q = xp.exp(LP), xp.exp(LQ)
        soft_rows, u, u_bar = topk_terms(opts.divergence, opts.beta, LP, LQ, P, Q)
        soft[:] = xp.where(soft_rows < 0, 0.0, soft_rows)  # >= 0 but by rounding (NaN passes)
        ce[:] = xp.where(lse_s < stats[6], 0.0, lse_s - stats[6])  # >= 0 but by rounding (NaN passes)
        if not with_grad:
            return None
        logp = z - lse_z[:, None]
        p = xp.exp(logp) if missing_mass == "bucket" or not tempered else None
        if missing_mass == "bucket":
            dz = topk_rest_dz(opts.divergence, p, logp, u, u_bar, LP, Q, k)
        else:  # the other ids are no category: no soft gradient
            dz = xp.zeros_like(s)
        slot = topk_slot_dz(opts.divergence, P, Q, u, u_bar, k)
        dz[slot_rows[here], col[here]] = slot[here]
        hard = xp.exp(s - lse_s[:, None]) if tempered else p  # softmax(s), the same bits either way
        apart = owned & (hard[rows, label] < 0.5) if label_terms is not None else xp.zeros_like(owned)
        hot = owned & ~apart
        hard[rows[hot], label[hot]] -= 1.0
        if label_terms is not None:
            label_terms[:] = xp.where(apart, -opts.weight_hard_loss, 0.0)
        return opts.weight_hard_loss * hard + opts.w_soft_over_t * dz
