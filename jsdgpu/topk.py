"""Offline distillation: the loss against a teacher's stored top-k log-probabilities
(forward_topk, TopKDistillLoss; jsdgpu.backward as for the online loss), and the teacher's top-k
made chunk by chunk (teacher_topk). The math is docs/contract.md's, "Offline distillation".

Per chunk of valid rows: the student's logits (float32), one row kernel (the row's statistics
over the whole vocabulary, the gather at the k ids, the divergence over the k + 1 or k categories
and the gradient row), then the gradient products, as in the online loop (jsdgpu.chunks): three
products where the online loss has four.
"""

import numpy as np

from . import checks
from .api import Context, backend_for, backward, bridged, runs_capturable, weighted_loss
from .chunks import (FirstProduct, chunk_g, cut_chunks, expects_all_valid, finish_gradients, plan_chunks, queue_head,
                     row_means, row_outputs)
from .options import backend_budget, split_options

MISSING_MASS = ("bucket", "renormalize")


def _check_missing_mass(missing_mass):
    if missing_mass not in MISSING_MASS:
        raise ValueError(f"missing_mass must be one of {', '.join(map(repr, MISSING_MASS))}, got {missing_mass!r}")
    return missing_mass


def forward_topk(student_input, student_weight, teacher_indices, teacher_logprobs, target, student_bias=None,
                 *, missing_mass="bucket", **options):
    """Return (loss, ctx) of the student against the teacher's top-k: teacher_indices [T, k]
    (integer ids in [0, Vs), distinct within a row), teacher_logprobs [T, k] (float32, bf16 or
    fp16: the teacher's log-probabilities of those ids, used as given; -inf marks an unused slot).
    missing_mass: "bucket" (the teacher's and the student's mass outside the k ids as one more
    category) or "renormalize" (both renormalized over the k ids). options: as forward's, but
    vocab_parallel, which the top-k loss does not take. In a capturable call a bad row of the
    top-k, like a bad target, cannot raise: the loss and gradients are NaN, and ctx.bad_topk_row
    (a 0-d int32 device array) is the first such row, T where there is none (None in a default
    call). jsdgpu.backward(ctx) gives the student's gradients."""
    loss_opts, run_opts = split_options(options)
    _check_missing_mass(missing_mass)
    return forward_topk_with(student_input, student_weight, teacher_indices, teacher_logprobs, target,
                             student_bias, loss_opts, run_opts, missing_mass)


def forward_topk_with(student_input, student_weight, teacher_indices, teacher_logprobs, target, student_bias,
                      loss_opts, run_opts, missing_mass):
    """forward_topk with its options as a LossOptions and a RunOptions."""
    arrays = dict(student_input=student_input, student_weight=student_weight, teacher_indices=teacher_indices,
                  teacher_logprobs=teacher_logprobs, target=target, student_bias=student_bias)
    return bridged(arrays, lambda native: _forward_topk(native, loss_opts, run_opts, missing_mass))


def _forward_topk(arrays, opts, run_opts, missing_mass):
    # first of all, where this call is like the last: its first product (chunks.FirstProduct)
    first = FirstProduct(("topk", run_opts), arrays["student_input"], arrays["student_weight"])
    kind = checks.check_topk_arrays(arrays)
    if run_opts.vocab_parallel is not None:
        raise NotImplementedError("vocab_parallel with the top-k loss: not built; the student's logits of one "
                                  "GPU are needed")
    capturable = runs_capturable(run_opts, kind)
    backend = backend_for(kind)
    xp = backend.xp
    xs, ws, bs = arrays["student_input"], arrays["student_weight"], arrays["student_bias"]
    device = xs.device.id if kind == "cupy" else None
    with backend.on_device(device):
        xs, ws = xp.ascontiguousarray(xs), xp.ascontiguousarray(ws)
        ids = xp.ascontiguousarray(arrays["teacher_indices"], dtype=np.int32)  # checked in [0, Vs) below
        lq = xp.ascontiguousarray(arrays["teacher_logprobs"], dtype=np.float32)
        vs, hs = ws.shape
        n_all = xs.shape[0]
        compute_grad = run_opts.compute_grad
        budget = run_opts.budget(backend)
        k = ids.shape[1]
        own = backend.topk_own_product(opts, xs, ws, k, compute_grad)  # (no logits: topk_own_logits, from x)
        per_row = backend.topk_bytes_per_row(vs, ws.dtype, compute_grad, own, k)
        most_rows = backend.topk_chunk_rows(own)

        def plan(n_rows):  # (rows per chunk, hold_g)
            return plan_chunks(n_rows, run_opts.chunk_size, *per_row, budget, most_rows)
        most = min(plan(n_all)[0], n_all) if n_all else 0
        if own:  # no logits for FirstProduct to queue ahead, in this call or the next (the own product is
            # queued below, once the call's buffers are made)
            first.remember(backend, 0)
            first = None
        # the buffers for the most rows the call can have
        work = backend.topk_prepare(ws, bs, most, **(first.buffers(most) if first else {}), own=own, k=k)
        launched = []

        def select(after=None):  # the top-k's checks, then the rows (a default call reads both at one wait)
            launched.append(backend.topk_check(arrays["teacher_indices"], lq, vs, missing_mass == "bucket",
                                               capturable, after))
            if capturable:  # every row computed, the ignored ones masked
                return backend.mark_rows(arrays["target"], vs, opts.ignore_index, run_opts.num_valid_tokens)
            return backend.select_rows(arrays["target"], vs, opts.ignore_index, after)

        def products(x, _ids, at=0, student=True):  # the student's logits (the ids go with the rows, for queue_head)
            if student:
                backend.head_logits(work, x, at)

        def gradient_rows(n_rows, chunk, hold_g):  # G: of all n_rows rows where held, else of a chunk
            return backend.topk_gradient_rows(work, n_rows if hold_g else chunk) if compute_grad and n_rows else None

        def outputs(n_rows, chunk, hold_g, G_all=None):  # (G_all, ce, soft, Gradients, label_terms) for n_rows rows
            G_all = gradient_rows(n_rows, chunk, hold_g) if G_all is None else G_all
            ce, soft, grads, label_terms = row_outputs(xp, n_rows, hs, vs, hold_g, bs is not None, compute_grad)
            if G_all is not None and backend.topk_scales_g(opts, ws.dtype):  # G's rows stored scaled: read once
                grads.g_scale = xp.empty(n_rows, np.float32)
            return G_all, ce, soft, grads, label_terms

        def row_work(out, hold_g, start, stop, x, ids, lq, target, product=True):
            """The rows' kernels (x, ids, lq, target: theirs); with the own product, that product
            first where `product`."""
            G_all, ce, soft, grads, label_terms = out
            G = chunk_g(G_all, hold_g, start, stop)
            if own and product:
                backend.topk_own_logits(work, x, ids, lq, G)
            backend.topk_rows(work, ids, lq, target, opts, missing_mass, ce[start:stop], soft[start:stop], G,
                              None if label_terms is None else label_terms[start:stop],
                              None if grads is None or grads.g_scale is None else grads.g_scale[start:stop], x)

        ahead = None  # (chunk, hold_g, outputs): the first chunk's row work, queued before the host's wait
        if own and not capturable and n_all and expects_all_valid(n_all):
            # the guess below, made here: the own product, which is the call's first chunk's logits
            # and most of its row work, queued as the call's first GPU work (before the checks and
            # the selection, where the GPU would idle while the host queues them). Its ids are not
            # checked yet: one outside the vocabulary is left out (the call then raises)
            hold_g = plan(n_all)[1]
            G_all = gradient_rows(n_all, most, hold_g)  # the product's output first, the call's others after it
            backend.topk_own_logits(work, xs[:most], ids[:most], lq[:most], chunk_g(G_all, hold_g, 0, most))
            ahead = most, hold_g, outputs(n_all, most, hold_g, G_all)

        def before_wait(selection, head):
            """A default call whose head is its whole first chunk, its rows all valid by the last
            call's guess: that chunk's row kernel and G @ Ws, queued before the host reads the
            selection, so that the GPU runs them while the host reads it and queues what follows
            (where it idled 0.2-0.5 ms a step: docs/design.md, "Top-k"). Kept where the guess was
            right; the ids are clipped into the vocabulary, as a bad one (the call then raises)
            reads nothing outside its row. (The head's product is queued: cuBLAS's by queue_head,
            the own one above, which this then always finishes, so that its buffers are clean
            again.)"""
            nonlocal ahead
            chunk, hold_g = plan(n_all)
            if ahead is None and expects_all_valid(n_all) and min(chunk, most) == head:
                ahead = head, hold_g, outputs(n_all, head, hold_g)
            if ahead is not None:
                rows = ahead[0]
                row_work(ahead[2], ahead[1], 0, rows, xs[:rows], xp.clip(ids[:rows], 0, vs - 1), lq[:rows],
                         selection.row_target[:rows], product=False)
                input_product(ahead[2], ahead[1], 0, rows)

        def input_product(out, hold_g, start, stop):
            """G @ Ws of the rows, unscaled (1/N is known after the wait: grad_products scales it),
            so that the first chunk's can be queued before the wait too: the GPU then has that
            product to run while the host reads the selection and queues what follows."""
            G_all, grads = out[0], out[3]
            if grads is not None:
                backend.input_product(work, chunk_g(G_all, hold_g, start, stop), grads.grad_input[start:stop])

        head, rows = queue_head(backend, products, xs, ids, most, select, capturable, run_opts.normalizer, first,
                                before_wait)
        check, bad_topk_row = launched[0], None
        if capturable:  # a bad row makes 1/N NaN
            rows.inv_n, bad_topk_row = check.poisoned(rows.inv_n, n_all)
            ids = xp.clip(ids, 0, vs - 1)  # a bad id (its row's results NaN) is read nowhere outside the row
        else:
            check.wait()
        if rows.valid_rows is not None:
            xs, ids = backend.take_rows(rows.valid_rows, xs, ids)
            lq = lq[rows.valid_rows]
        target, inv_n = rows.target, rows.inv_n
        n_rows = len(target)
        chunk, hold_g = cut_chunks(products, xs, ids, head, most, per_row, budget)
        if ahead is not None and (rows.valid_rows is not None or ahead[:2] != (chunk, hold_g)):
            ahead = None  # the guess was wrong: the rows or their chunks are others
        out = outputs(n_rows, chunk, hold_g) if ahead is None else ahead[2]
        G_all, ce, soft, grads, label_terms = out
        for start in range(0, n_rows, chunk or 1):
            stop = min(start + chunk, n_rows)
            if start:  # the first chunk's logits are queued above
                products(xs[start:stop], ids[start:stop])
            if start or ahead is None:  # (the first chunk's row work and G @ Ws may be queued above)
                row_work(out, hold_g, start, stop, xs[start:stop], ids[start:stop], lq[start:stop], target[start:stop])
                if rows.masked and G_all is not None:
                    backend.zero_masked_rows(chunk_g(G_all, hold_g, start, stop), target[start:stop])
                input_product(out, hold_g, start, stop)
            if compute_grad:
                backend.grad_products(work, chunk_g(G_all, hold_g, start, stop), xs[start:stop], inv_n, grads,
                                      start, stop, input_made=True)
        finish_gradients(backend, work, grads, G_all, hold_g, label_terms, target, xs, inv_n)
        hard, soft = row_means(xp, ce, soft, inv_n, target if rows.masked else None)
        loss = weighted_loss(xp, opts, hard, soft)
    ctx = Context(hard, soft, grads, rows.valid_rows, arrays["student_input"].shape[0], xs.dtype, backend,
                  run_opts.grad_weight_float32, device, None if rows.status is None else rows.status[1])
    ctx.bad_topk_row = bad_topk_row
    return loss, ctx


class TopKDistillLoss:
    """The top-k loss with its options held: loss_fn = TopKDistillLoss(beta=0.5, missing_mass="bucket");
    loss, ctx = loss_fn(student_input, student_weight, teacher_indices, teacher_logprobs, target);
    jsdgpu.backward(ctx) (or loss_fn.backward(ctx)). The options are checked here."""

    def __init__(self, *, missing_mass="bucket", **options):
        self.missing_mass = _check_missing_mass(missing_mass)
        self.loss_options, self.run_options = split_options(options)

    def __call__(self, student_input, student_weight, teacher_indices, teacher_logprobs, target,
                 student_bias=None):
        return forward_topk_with(student_input, student_weight, teacher_indices, teacher_logprobs, target,
                                 student_bias, self.loss_options, self.run_options, self.missing_mass)

    backward = staticmethod(backward)

    def __repr__(self):
        return f"TopKDistillLoss(missing_mass={self.missing_mass!r}, {self.loss_options!r}, {self.run_options!r})"


def teacher_topk(teacher_input, teacher_weight, k, temperature=1.0, teacher_bias=None, *, chunk_size=None,
                 memory_budget=None):
    """(indices [T, k] int32, logprobs [T, k] float32): the k ids of the largest teacher logits of
    each row, by descending log-probability (ties: the lower id first), and their log-softmax at
    temperature, chunk by chunk: the [T, V] logits are never held. NumPy or CuPy arrays in, the
    same kind out (torch and JAX tensors through their bridges: jsdgpu.torch, jsdgpu.jax)."""
    arrays = dict(teacher_input=teacher_input, teacher_weight=teacher_weight, teacher_bias=teacher_bias)
    kind = checks.check_teacher_arrays(arrays)
    v = teacher_weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= v:
        raise ValueError(f"k must be an integer in [1, {v}] (the teacher's vocabulary), got {k!r}")
    split_options(dict(temperature=temperature, chunk_size=chunk_size, memory_budget=memory_budget))  # checks
    backend = backend_for(kind)
    xp = backend.xp
    device = teacher_input.device.id if kind == "cupy" else None
    with backend.on_device(device):
        xt, wt = xp.ascontiguousarray(teacher_input), xp.ascontiguousarray(teacher_weight)
        n = xt.shape[0]
        budget = backend_budget(memory_budget, backend)
        chunk = chunk_size or max(1, budget // backend.topk_bytes_per_row(v, wt.dtype, False)[0])
        work = backend.topk_prepare(wt, teacher_bias, min(chunk, n))
        ids = xp.empty((n, k), np.int32)
        logprobs = xp.empty((n, k), np.float32)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            backend.head_logits(work, xt[start:stop])
            backend.teacher_topk_rows(work, stop - start, int(k), float(temperature), ids[start:stop],
                                      logprobs[start:stop])
    return ids, logprobs
