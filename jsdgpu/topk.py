"""Offline distillation: the loss against a teacher's stored top-k log-probabilities
(forward_topk, TopKDistillLoss; jsdgpu.backward as for the online loss), and the teacher's top-k
made chunk by chunk (teacher_topk). The math is docs/contract.md's, "Offline distillation".

Per chunk of valid rows: the student's logits (float32), one row kernel (the row's statistics
over the whole vocabulary, the gather at the k ids, the divergence over the k + 1 or k categories
and the gradient row), then the gradient products: TopKLoss, a loss of the chunk engine
(jsdgpu.engine) as the online loss is; three products where the online loss has four.
"""

import numpy as np

from . import checks, parallel
from .ahead import expects_all_valid
from .call import backend_for, backward, bridged, call_loss
from .chunks import spared_sum_bytes
from .engine import ChunkLoss, chunk_g, plan_keeps_row_gradients
from .options import TopKOptions, backend_budget, split_options


def forward_topk(student_input, student_weight, teacher_indices, teacher_logprobs, target, student_bias=None,
                 *, missing_mass="bucket", token_weights=None, **options):
    """Return (loss, ctx) of the student against the teacher's top-k: teacher_indices [T, k]
    (integer ids in [0, Vs), distinct within a row), teacher_logprobs [T, k] (float32, bf16 or
    fp16: the teacher's log-probabilities of those ids, used as given; -inf marks an unused slot).
    missing_mass: "bucket" (the teacher's and the student's mass outside the k ids as one more
    category) or "renormalize" (both renormalized over the k ids). token_weights: as forward's.
    options: as forward's; vocab_parallel: each rank holds the student head's rows of its range
    of the vocabulary (jsdgpu.parallel; the ids are of the whole vocabulary), and its row work is
    jsdgpu.topk_shards'. In a capturable call a bad row of the
    top-k, like a bad target, cannot raise: the loss and gradients are NaN, and ctx.bad_topk_row
    (a 0-d int32 device array) is the first such row, T where there is none (None in a default
    call). jsdgpu.backward(ctx) gives the student's gradients."""
    loss_opts, run_opts = split_options(dict(options, missing_mass=missing_mass), TopKOptions)
    return forward_topk_with(student_input, student_weight, teacher_indices, teacher_logprobs, target,
                             student_bias, loss_opts, run_opts, token_weights)


def forward_topk_with(student_input, student_weight, teacher_indices, teacher_logprobs, target, student_bias,
                      loss_opts, run_opts, token_weights=None, row_scales=None, g_memory=None, weight_memory=None):
    """forward_topk with its options as a TopKOptions and a RunOptions (row_scales, g_memory,
    weight_memory: as api.forward_with's)."""
    arrays = dict(student_input=student_input, student_weight=student_weight, teacher_indices=teacher_indices,
                  teacher_logprobs=teacher_logprobs, target=target, student_bias=student_bias,
                  token_weights=token_weights, row_scales=row_scales, g_memory=g_memory,
                  weight_memory=weight_memory)
    return bridged(arrays, lambda native: _forward_topk(native, loss_opts, run_opts))


def _forward_topk(arrays, opts, run_opts):
    def loss_for(backend, capturable):
        xp = backend.xp
        xs = xp.ascontiguousarray(arrays["student_input"])
        ids = xp.ascontiguousarray(arrays["teacher_indices"], dtype=np.int32)  # checked in [0, Vs) by the loss
        vs = arrays["student_weight"].shape[0]  # (the student's head alone: its rows as the teacher's too)
        shard = parallel.call_shard(run_opts.vocab_parallel, capturable, xp, vs, vs)
        return (lambda call_opts: TopKLoss(backend, xs, arrays, opts, call_opts, capturable, shard)), xs, ids
    return call_loss("topk", arrays, opts, run_opts, checks.check_topk_arrays, loss_for, _forward_topk)


def _plan_bytes(backend, vs, hs, dtype, k, own, run_opts):
    """(ChunkLoss.per_row, ChunkLoss.spared_sum, ChunkLoss.most_rows) of the top-k loss, its
    logits by the backend's own product where own."""
    return (backend.topk_bytes_per_row(vs, dtype, run_opts.compute_grad, own, k),
            spared_sum_bytes(vs, hs, dtype, run_opts), backend.topk_chunk_rows(own))


def keeps_row_gradients(backend, vs, hs, dtype, k, n_rows, has_bias, run_opts):
    """TopKLoss.keeps_row_gradients(n_rows) of a call on one device (no vocab parallelism) with a
    student head of these shapes and dtype and a top-k of k, from the shapes alone, whichever
    logits product the call takes (the backend's own one depends on the arrays' alignment and
    the GPU too): where the plans of both keep them. What a front end that carries the kept
    gradients from forward to backward decides as it traces (jsdgpu.torch_rows, jsdgpu.jax)."""
    return all(plan_keeps_row_gradients(backend, run_opts, has_bias, n_rows,
                                        *_plan_bytes(backend, vs, hs, dtype, k, own, run_opts))
               for own in (False, True))


class TopKLoss(ChunkLoss):
    """The top-k loss of one call as a chunk loss (jsdgpu.engine): the student's head against the
    teacher's top-k (arrays: the call's, checked), whose ids go with the rows as the engine's
    `other`. Three products where the online loss has four; with the backend's own logits
    product (topk_own_product), that product does most of the row work in its epilogue. Under
    vocab parallelism (shard: this rank's parallel.Shard of the student's vocabulary) the row work
    is jsdgpu.topk_shards', and grad_input is summed across the ranks at the end."""

    def __init__(self, backend, xs, arrays, opts, run_opts, capturable, shard=None):
        xp = backend.xp
        self.backend, self.opts, self.run_opts, self.capturable = backend, opts, run_opts, capturable
        self.missing_mass, self.arrays, self.target = opts.missing_mass, arrays, arrays["target"]
        self.ws = xp.ascontiguousarray(arrays["student_weight"])
        self.bs = arrays["student_bias"]
        self.lq = xp.ascontiguousarray(arrays["teacher_logprobs"], dtype=np.float32)
        self.vs, self.hs = self.ws.shape
        self.shard = shard
        self.vocab = self.vs if shard is None else shard.vs_total
        self.has_bias, self.n_all = self.bs is not None, xs.shape[0]
        self.k = self.lq.shape[1]
        compute_grad = run_opts.compute_grad
        # (no logits: topk_own_logits; not under vocab parallelism, whose row work is its own)
        self.own = shard is None and backend.topk_own_product(opts, xs, self.ws, self.k, compute_grad)
        self.takes_first_product = not self.own  # no student logits to queue ahead: the own product is
        # queued in queue_first, once the call's buffers are made
        # every rank must cut the same chunks: size them by the largest shard
        widest = self.vs if shard is None else shard.max_vs
        self.per_row, self.spared_sum, self.most_rows = _plan_bytes(backend, widest, self.hs, self.ws.dtype, self.k,
                                                                    self.own, run_opts)
        self.scales_g = shard is None and backend.topk_scales_g(opts, self.ws.dtype)
        self.check = self.bad_topk_row = None
        self.model = None if opts.models is None else opts.models[0]  # the student's (scale, cap), where not plain

    def prepare(self, most, buffers):
        self.work = self.backend.topk_prepare(self.ws, self.bs, most, **buffers, own=self.own, k=self.k,
                                              model=self.model)

    def select(self, after=None):
        """The top-k's checks, then the rows (a default call reads both at one wait)."""
        self.check = self.backend.topk_check(self.arrays["teacher_indices"], self.lq, self.vocab,
                                             self.missing_mass == "bucket", self.capturable, after)
        return super().select(after)

    def products(self, xs, _ids, at=0, student=True):
        """The student's logits (the ids go with the rows, for queue_head)."""
        if student:
            self.backend.head_logits(self.work, xs, at)

    def gradient_rows(self, g_rows, hold_g):
        return self.backend.topk_gradient_rows(self.work, g_rows)

    def queue_first(self, xs, ids, most):
        """The own product of the first chunk, where the rows are guessed all valid (the guess
        queue_head then makes): it is the chunk's logits and most of its row work, queued as the
        call's first GPU work (before the checks and the selection, where the GPU would idle while
        the host queues them). Its ids are not checked yet: one outside the vocabulary is left out
        (the call then raises)."""
        n_all = self.n_all
        if not self.own or self.capturable or not expects_all_valid(n_all):
            return
        hold_g = self.plan(n_all)[1]
        G_all = self.gradient_rows(n_all if hold_g else most, hold_g) if self.run_opts.compute_grad else None
        G = chunk_g(G_all, hold_g, 0, most)  # the product's output first, the call's others after it
        self.backend.topk_own_logits(self.work, xs[:most], ids[:most], self.lq[:most], G)
        self.ahead = most, hold_g, self.outputs(n_all, most, hold_g, G_all)

    def before_wait(self, selection, head, xs, ids, most):
        """A default call whose head is its whole first chunk, its rows all valid by the last
        calls' guess: that chunk's row kernel and G @ Ws, queued before the host reads the
        selection, so that the GPU runs them while the host reads it and queues what follows
        (where it idled 0.2-0.5 ms a step: docs/design.md, "Top-k"). Kept where the guess was
        right; the ids are clipped into the vocabulary, as a bad one (the call then raises)
        reads nothing outside its row. (The head's product is queued: cuBLAS's by queue_head,
        the own one by queue_first, which this then always finishes, so that its buffers are
        clean again.)"""
        if self.model is not None or self.shard is not None:  # (with a model: its model_logits would
            return  # stay on the head's logits where the guess is wrong, and the loop's row work take
            # them so again; under vocab parallelism, the row work's all-reduces wait for the rows)
        n_all = self.n_all
        hold_g = self.plan(n_all)[1]
        if self.ahead is None and expects_all_valid(n_all) and most == head:
            self.ahead = head, hold_g, self.outputs(n_all, head, hold_g)
        if self.ahead is not None:
            rows, hold_g, out = self.ahead
            G = chunk_g(out[0], hold_g, 0, rows)
            self.row_work(out, G, 0, rows, xs[:rows], self.backend.xp.clip(ids[:rows], 0, self.vs - 1),
                          selection.row_target[:rows], product=False)
            self.input_product(out, G, 0, rows)

    def selected(self, rows, ids):
        if self.capturable:  # a bad row makes 1/N NaN
            rows.inv_n, self.bad_topk_row = self.check.poisoned(rows.inv_n, self.n_all)
            return self.backend.xp.clip(ids, 0, self.vs - 1)  # a bad id (its row's results NaN) is read nowhere
        self.check.wait()
        return ids

    def take_rows(self, valid_rows, xs, ids):
        self.lq = self.lq[valid_rows]
        return self.backend.take_rows(valid_rows, xs, ids)

    def row_work(self, out, G, start, stop, x, ids, target, product=True):
        """The rows' kernels (x, ids, target: theirs); with the own product, that product first
        where `product`."""
        _, ce, soft, grads, label_terms = out
        backend, lq, model = self.backend, self.lq[start:stop], self.model
        label_terms = None if label_terms is None else label_terms[start:stop]
        if self.own and product:
            backend.topk_own_logits(self.work, x, ids, lq, G)
        if model is not None:  # the student's logits scaled or soft-capped, G taken back to the raw ones
            backend.topk_model_logits(self.work, stop - start, model)
        if self.shard is not None:
            backend.topk_rows_sharded(self.work, ids, lq, target, self.opts, self.missing_mass, self.shard,
                                      ce[start:stop], soft[start:stop], G, label_terms)
        else:
            backend.topk_rows(self.work, ids, lq, target, self.opts, self.missing_mass, ce[start:stop],
                              soft[start:stop], G, label_terms,
                              grads.g_scale[start:stop] if self.scales_g and grads is not None else None, x)
        if model is not None and G is not None:
            backend.model_gradient(self.work, G, model, target, label_terms)

    def input_product(self, out, G, start, stop):
        """G @ Ws of the rows, unscaled (1/N is known after the wait: grad_products scales it),
        so that the first chunk's can be queued before the wait too: the GPU then has that
        product to run while the host reads the selection and queues what follows."""
        grads = out[3]
        if grads is not None:
            self.backend.input_product(self.work, G, grads.grad_input[start:stop])

    def gradient_products(self, out, G, xs, inv_n, start, stop, made_ahead):
        if not made_ahead:
            self.input_product(out, G, start, stop)
        self.backend.grad_products(self.work, G, xs, inv_n, out[3], start, stop, input_made=True)


class TopKDistillLoss:
    """The top-k loss with its options held: loss_fn = TopKDistillLoss(beta=0.5, missing_mass="bucket");
    loss, ctx = loss_fn(student_input, student_weight, teacher_indices, teacher_logprobs, target);
    jsdgpu.backward(ctx) (or loss_fn.backward(ctx)). The options are checked here."""

    def __init__(self, *, missing_mass="bucket", **options):
        self.loss_options, self.run_options = split_options(dict(options, missing_mass=missing_mass), TopKOptions)

    def __call__(self, student_input, student_weight, teacher_indices, teacher_logprobs, target,
                 student_bias=None, *, token_weights=None):
        return forward_topk_with(student_input, student_weight, teacher_indices, teacher_logprobs, target,
                                 student_bias, self.loss_options, self.run_options, token_weights)

    backward = staticmethod(backward)

    def __repr__(self):
        return f"TopKDistillLoss({self.loss_options!r}, {self.run_options!r})"


def teacher_topk(teacher_input, teacher_weight, k, temperature=1.0, teacher_bias=None, *, chunk_size=None,
                 memory_budget=None, logit_scale=1.0, logit_softcap=None):
    """(indices [T, k] int32, logprobs [T, k] float32): the k ids of the largest teacher logits of
    each row, by descending log-probability (ties: the lower id first), and their log-softmax at
    temperature, chunk by chunk: the [T, V] logits are never held. The logits are the teacher
    model's: logit_scale times x @ W.T + b, soft-capped by logit_softcap where given (as
    LossOptions' teacher_logit_scale and teacher_logit_softcap). NumPy or CuPy arrays in, the
    same kind out (torch and JAX tensors through their bridges: jsdgpu.torch, jsdgpu.jax)."""
    arrays = dict(teacher_input=teacher_input, teacher_weight=teacher_weight, teacher_bias=teacher_bias)
    kind = checks.check_teacher_arrays(arrays)
    v = teacher_weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= v:
        raise ValueError(f"k must be an integer in [1, {v}] (the teacher's vocabulary), got {k!r}")
    model = split_options(dict(temperature=temperature, chunk_size=chunk_size, memory_budget=memory_budget,
                               teacher_logit_scale=logit_scale, teacher_logit_softcap=logit_softcap))[0].models
    model = None if model is None else model[1]  # (the options' checks, before any work)
    backend = backend_for(kind)
    xp = backend.xp
    device = teacher_input.device.id if kind == "cupy" else None
    with backend.on_device(device):
        xt, wt = xp.ascontiguousarray(teacher_input), xp.ascontiguousarray(teacher_weight)
        n = xt.shape[0]
        row_bytes = backend.topk_bytes_per_row(v, wt.dtype, False)[0]
        chunk = chunk_size or max(1, backend_budget(memory_budget, backend, n * row_bytes) // row_bytes)
        work = backend.topk_prepare(wt, teacher_bias, min(chunk, n), model=model)
        ids = xp.empty((n, k), np.int32)
        logprobs = xp.empty((n, k), np.float32)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            backend.head_logits(work, xt[start:stop])
            if model is not None:
                backend.topk_model_logits(work, stop - start, model)
            backend.teacher_topk_rows(work, stop - start, int(k), float(temperature), ids[start:stop],
                                      logprobs[start:stop])
    return ids, logprobs
