"""The CPU backend's teacher top-k (jsdgpu.teacher_topk) of a chunk's logits. The top-k loss's
row work is jsdgpu.topk_shards' (cpu/topk_work.py). Its own code: the tests compare it with
jsdgpu.reference, which it does not import."""

import math

import numba
import numpy as np

from .threads import rows_in_parallel


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


@rows_in_parallel
@numba.njit(parallel=True, cache=True)
def row_logsumexp(x):
    """logsumexp of each row of the float64 [n, m] x."""
    out = np.empty(x.shape[0])
    for i in numba.prange(x.shape[0]):
        out[i] = _lse(x[i])
    return out


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
