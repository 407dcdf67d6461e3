"""The online loss as a chunk loss (jsdgpu.engine): the JSD between the student's head and a
teacher's head, both applied to their hidden states chunk by chunk (the four products: the two
logits, grad_input and grad_weight; docs/contract.md, "Forward").

The row work is one fused kernel where the backend has one for the vocabulary and the whole
vocabulary is here; otherwise three phases (statistics, KL sums, results and G). Under vocab
parallelism each rank holds a shard of the vocabulary, and the phases' per-row vectors are
combined across ranks between the phases; grad_input is summed across ranks at the end.
"""

from .chunks import spared_sum_bytes
from .engine import ChunkLoss, plan_keeps_row_gradients
from .parallel import combine_stats


def _row_bytes(backend, vs, vt, hs, dtype, run_opts, fused):
    """(ChunkLoss.per_row, ChunkLoss.spared_sum) of the online loss."""
    return (backend.bytes_per_row(vs, vt, dtype, run_opts.compute_grad, fused=fused),
            spared_sum_bytes(vs, hs, dtype, run_opts))


def keeps_row_gradients(backend, vs, vt, hs, dtype, n_rows, has_bias, run_opts):
    """OnlineLoss.keeps_row_gradients(n_rows) of a call on one device (no vocab parallelism) with
    weights of these shapes and dtype, from the shapes alone: what a front end that carries the
    kept gradients from forward to backward decides as it traces (jsdgpu.torch_rows, jsdgpu.jax)."""
    return plan_keeps_row_gradients(backend, run_opts, has_bias, n_rows,
                                    *_row_bytes(backend, vs, vt, hs, dtype, run_opts, True))


class OnlineLoss(ChunkLoss):
    """The online loss of one call: ws, wt, bs, bt the heads (under vocab parallelism this rank's
    shards of the vocabulary, shard its parallel.Shard, else None), target the call's labels."""

    def __init__(self, backend, ws, wt, bs, bt, target, opts, run_opts, capturable, shard=None):
        self.backend, self.opts, self.run_opts, self.capturable = backend, opts, run_opts, capturable
        self.ws, self.wt, self.bs, self.bt, self.target, self.shard = ws, wt, bs, bt, target, shard
        self.vs, self.hs = ws.shape
        self.has_bias = bs is not None
        self.vocab = self.vs if shard is None else shard.vs_total
        # every rank must cut the same chunks: size them by the largest shard
        widest = (self.vs, wt.shape[0]) if shard is None else (shard.max_vs, shard.max_vt)
        self.models = opts.models
        self.per_row, self.spared_sum = _row_bytes(backend, *widest, self.hs, ws.dtype, run_opts, shard is None)

    def prepare(self, most, buffers):
        self.work = self.backend.prepare(self.ws, self.wt, self.bs, self.bt, most, fused=self.shard is None,
                                         models=self.models, **buffers)

    def products(self, xs, xt, at=0, student=True):
        self.backend.logits(self.work, xs, xt, at, student)

    def gradient_rows(self, g_rows, hold_g):
        # around the phases the models' logits (scaled, soft-capped) stay in place through the row
        # work, for their gradient after it: G apart from them
        return self.backend.gradient_rows(self.work, g_rows, own_g=hold_g or self._model_passes())

    def _model_passes(self):
        """Whether the models' logits are made by passes around the row work: where they are not
        the plain logits and the phases run (the fused kernel makes them itself)."""
        return self.models is not None and not self.work.fused

    def row_work(self, out, G, start, stop, xs, xt, target):
        """The rows' results and, where G is not None, the gradient rows written into G: on the
        models' logits where they are scaled or soft-capped (LossOptions.models), G then taken
        back to the raw logits'."""
        _, ce, jsd, _, label_terms = out
        backend, work, models = self.backend, self.work, self.models
        ce, jsd = ce[start:stop], jsd[start:stop]
        label_terms = None if label_terms is None else label_terms[start:stop]
        passes = self._model_passes()
        if passes:
            backend.model_logits(work, stop - start, models)
        self._rows(work, target, ce, jsd, G, label_terms)
        if passes and G is not None:
            backend.model_gradient(work, G, models[0], target, label_terms)

    def _rows(self, work, target, ce, jsd, G, label_terms):
        backend, opts = self.backend, self.opts
        comm = None if self.shard is None else self.shard.comm
        if work.fused:  # prepare gave the fused kernel only where there is no communicator
            backend.fused_rows(work, target, opts, ce, jsd, G, label_terms)
            return
        stats = backend.row_stats(work, target, opts)
        if comm is not None:
            combine_stats(backend.xp, comm, stats)
        kl = backend.row_kl(work, target, stats, opts)
        if comm is not None:
            comm.allreduce(kl, "sum")
        backend.row_finish(work, target, stats, kl, opts, ce, jsd, G, label_terms)

    def gradient_products(self, out, G, xs, inv_n, start, stop, made_ahead):
        self.backend.grad_products(self.work, G, xs, inv_n, out[3], start, stop)
