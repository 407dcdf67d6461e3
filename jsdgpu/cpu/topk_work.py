"""The CPU backend's row work of the top-k loss and teacher_topk (jsdgpu.backend.TopKRowWork):
the top-k's checks, one head's float32 logits by NumPy's product, the rows' work by
jsdgpu.topk_shards (NumPy, float64; with or without vocab parallelism) and the teacher's top-k by
topk.py."""

import dataclasses

import numpy as np

from .. import checks
from ..parallel import Shard
from ..topk_shards import sharded_topk_rows
from .products import matmul
from .steps import as_model_logits, f32, row_buffer
from .topk import teacher_topk_rows


class _OneRank:
    """The whole vocabulary on this rank: topk_shards' all-reduces have nothing to combine."""
    rank, size = 0, 1

    @staticmethod
    def allreduce(a, op):
        pass


_ONE_RANK = _OneRank()


@dataclasses.dataclass
class TopKWork:
    """One top-k call's buffers (or teacher_topk's): the LM head and bias in float32, and a
    chunk's logits."""
    ws: object
    bs: object
    s: object
    part: object = None  # as CpuWork's


class CheckedTopK:
    """topk_check's result on the CPU, checked at once: problem, (row, code) of the first bad row
    or None. As the GPU's: wait() raises for it; poisoned(inv_n, n_rows) gives (1/N, NaN where a
    row is bad; the first bad row, n_rows where none), for a capturable call."""

    def __init__(self, problem, vocab):
        self.problem, self._vocab = problem, vocab

    def wait(self):
        if self.problem is not None:
            raise checks.topk_error(*self.problem, self._vocab)

    def poisoned(self, inv_n, n_rows):
        if self.problem is None:
            return inv_n, np.int32(n_rows)
        return float("nan"), np.int32(self.problem[0])


class CpuTopKRows:
    """The top-k loss's row work (and teacher_topk's); static methods, as every part of the
    backend."""
    @staticmethod
    def topk_model_logits(work, rows, model):
        """The chunk's first `rows` rows of logits (biased already) as the model's, in place."""
        as_model_logits(work.s[:rows], *model)

    @staticmethod
    def topk_check(ids, lq, vocab, bucket, capturable, after=None):
        """The top-k checked (CheckedTopK)."""
        return CheckedTopK(checks.topk_problem(ids, lq, vocab, bucket), vocab)

    @staticmethod
    def topk_own_product(opts, xs, ws, k, compute_grad):
        return False

    @staticmethod
    def topk_bytes_per_row(vs, dtype, compute_grad, own=False, k=None):
        """Bytes per row of the logits chunk, of G held for all rows, and of G per chunk."""
        grad = 4 * vs if compute_grad else 0
        return 4 * vs, grad, grad

    @staticmethod
    def topk_chunk_rows(own):
        return None

    @staticmethod
    def topk_prepare(ws, bs, rows, logits_s=None, own=False, k=None, model=None):
        s = row_buffer(rows, ws.shape[0]) if logits_s is None else logits_s
        return TopKWork(f32(ws), f32(bs), s)

    @staticmethod
    def topk_gradient_rows(work, g_rows):
        return np.empty((g_rows, work.ws.shape[0]), np.float32)

    @staticmethod
    def head_logits(work, xs, at=0):
        """The logits of rows [at, at + len(xs)) of the chunk, biased, into work.s."""
        s = work.s[at:at + xs.shape[0]]
        matmul(xs.astype(np.float32), work.ws.T, s)
        if work.bs is not None:
            s += work.bs

    @staticmethod
    def topk_own_logits(work, x, ids, lq, G):
        raise NotImplementedError("the CPU backend has no logits product of its own (topk_own_product is False)")

    @staticmethod
    def topk_scales_g(opts, dtype):
        return False  # G is stored as it is

    @staticmethod
    def topk_rows(work, ids, lq, target, opts, missing_mass, ce, soft, G, label_terms, g_scale=None, x=None):
        """The top-k row work: jsdgpu.topk_shards' on a shard of the whole vocabulary (the
        categories' code of vocab parallelism's, in one place); the label's one-hot term stays in
        G (float32)."""
        vs = work.ws.shape[0]
        CpuTopKRows.topk_rows_sharded(work, ids, lq, target, opts, missing_mass, Shard(_ONE_RANK, 0, vs, vs, vs),
                                      ce, soft, G, label_terms)

    @staticmethod
    def topk_rows_sharded(work, ids, lq, target, opts, missing_mass, shard, ce, soft, G, label_terms):
        """jsdgpu.topk_shards' row work on the chunk's float32 logits (biased); the label's one-hot
        term stays in G (float32)."""
        n = len(target)
        g = sharded_topk_rows(np, work.s[:n], shard, ids, lq, target, opts, missing_mass, ce, soft, G is not None)
        if G is not None:
            G[...] = g

    @staticmethod
    def teacher_topk_rows(work, rows, k, temperature, ids, logprobs):
        ids[...], logprobs[...] = teacher_topk_rows(work.s[:rows], k, temperature)
