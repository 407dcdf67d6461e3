"""The chunk engine: the one loop that every loss (jsdgpu.online's JSD against a teacher's head,
jsdgpu.topk's against stored top-k log-probabilities) runs on every backend (the steps it takes
of one: jsdgpu.backend).

Per chunk of valid token rows: the loss's logits products, its row work (the per-row CE and soft
values, and the gradient rows G w.r.t. the student's logits), then the gradient products
(grad_input = G @ Ws, and grad_weight's and grad_bias's parts). Ignored rows are dropped before
the loop, so every matrix product shrinks with them; in a capturable call (no host
synchronization) every row is computed, and the ignored ones are masked: their G rows zeroed,
their values counted for nothing.

grad_weight = G.T @ Xs: where the memory budget holds G for all rows (jsdgpu.chunks; with the
room of the float32 sum below, which it spares), it is one product over all of them, run by
backward (which knows grad_output) straight into the output dtype; else G lives per chunk (with
the fused kernel, written over the chunk's student logits) and each chunk adds its product to a
float32 sum, which backward converts. The float32 sum costs a write and read of [Vs, Hs] float32
per chunk and a conversion (at the benchmark shape 0.47 ms at T <= 2048, 0.66 at 4096:
docs/design.md, "Chunks and G"). After the loop, the
label terms the row kernel kept out of G (where the one-hot dominates a 16-bit G entry) are
added exactly.

G is written without the 1/N of the mean: it stays O(1), which keeps float16 G clear of
underflow, and 1/N goes into the matrix products' alpha. Nor does it hold the rows' token weights:
those scale the rows of the products' small operands (grad_input's rows, Xs's rows in
grad_weight's product, grad_bias's ones), as a G stored with row scales does (Gradients.g_scale),
and the rows' values before their sums.

A loss is a ChunkLoss: its buffers, a chunk's products, a chunk's row work and gradient products,
and what it queues ahead of the host's wait of its own. The engine plans the chunks
(jsdgpu.chunks), queues the first products and selects the rows (jsdgpu.ahead), and runs the loop.
"""

import numpy as np

from . import checks
from .ahead import queue_head
from .backend import Gradients
from .chunks import cut_chunks, plan_chunks


class ChunkLoss:
    """What the engine asks of a loss, with the defaults of one that queues nothing ahead of its
    own. Set by the loss: backend; opts (LossOptions) and run_opts (RunOptions); capturable (as
    resolved: call.runs_capturable); target (the call's labels, as given) and vocab (their range);
    vs, hs and has_bias (the student head's); per_row ((logits, G held for all rows, G per chunk)
    bytes a row); work (the buffers, from prepare). Methods the loss supplies: prepare(most,
    buffers), products(x, other, at=0, student=True), gradient_rows(g_rows, hold_g),
    row_work(out, G, start, stop, x, other, target) and gradient_products(out, G, x, inv_n, start,
    stop, made_ahead) (jsdgpu.online.OnlineLoss, jsdgpu.topk.TopKLoss).

    ahead: (rows, hold_g, outputs) where the loss queued the first chunk's row work before the
    host's wait (queue_first, before_wait): the engine keeps it where the call's rows and chunks
    are the ones guessed, else computes that chunk again."""
    most_rows = None        # a chunk's most rows (None: as the budget allows)
    token_weights = None    # the call's rows' weights, [rows] as given (None: ones)
    spared_sum = 0          # the bytes of grad_weight's float32 sum that G held spares (chunks.spared_sum_bytes)
    row_scales = None       # float32 [rows] times the weights, any values, unchecked: backward's
                            # grad_output of a call of the rows' own losses (call.rows_own_backward)
    g_memory = None         # a call of the rows' own losses': G's memory for all of its rows, where
                            # a front end gives it (api.forward_with), else the engine's own
    weight_memory = None    # a function that returns grad_weight's float32 sum's memory ([vs, hs]),
                            # where a front end gives it (api.forward_with: its gradient's buffer)
    takes_first_product = True  # whether its student logits may be queued ahead (ahead.FirstProduct)
    scales_g = False        # whether its G is stored with row scales (Gradients.g_scale)
    bad_topk_row = None     # a capturable top-k call's first bad row of the top-k (TopKLoss)
    shard = None            # under vocab parallelism, this rank's parallel.Shard of the vocabulary
    ahead = None
    work = None

    def budget(self, n_rows):
        """The bytes of per-chunk buffers of a call of n_rows rows (options.RunOptions.budget)."""
        return self.run_opts.budget(self.backend, n_rows * self.per_row[0])

    def plan(self, n_rows):
        """(rows per chunk, hold_g) for n_rows > 0 rows (chunks.plan_chunks)."""
        run_opts = self.run_opts
        return plan_chunks(n_rows, run_opts.chunk_size, *self.per_row, self.budget(n_rows), self.most_rows,
                           run_opts.rows_own, self.spared_sum)

    def keeps_row_gradients(self, n_rows):
        """Whether a call of the rows' own losses (reduction "none") of n_rows rows can compute its
        gradients in forward, for backward to scale by each row's grad_output: where G is held
        for all rows (grad_weight's product then takes the rows' scales with Xs's rows, and
        grad_input's rows are each their own row's) and there is no bias (grad_bias is a sum over
        the rows)."""
        return n_rows > 0 and not self.has_bias and self.plan(n_rows)[1]

    def select(self, after=None):
        """The rows: in a default call the backend's select_rows (the valid rows, known once
        waited for; after: a backend.mark() from before the head's products), in a capturable
        one the Rows of its mark_rows (every row computed, the ignored ones masked)."""
        backend, ignore_index = self.backend, self.opts.ignore_index
        if self.capturable:
            return backend.mark_rows(self.target, self.vocab, ignore_index, self.run_opts.given_divisor)
        return backend.select_rows(self.target, self.vocab, ignore_index, after, self.token_weights)

    def queue_first(self, xs, other, most):
        """Where the loss has work of its own to queue before the selection: queue it (setting
        ahead)."""

    def before_wait(self, selection, head, xs, other, most):
        """Called in a default call whose head is its first rows as they are, before the host's
        wait for the selection: row work of the loss's own to queue there (setting ahead)."""

    def selected(self, rows, other):
        """other (the rows that go with xs) once the rows are known; the loss's own checks."""
        return other

    def take_rows(self, valid_rows, xs, other):
        """The valid rows of xs and other."""
        return self.backend.take_rows(valid_rows, xs, other)

    def local_target(self, target):
        """The rows' labels as the row work takes them: under vocab parallelism, as columns of this
        rank's shard, -1 where another rank holds the label."""
        shard = self.shard
        if shard is None:
            return target
        xp = self.backend.xp
        owned = (target >= shard.v0) & (target < shard.v0 + self.vs)
        return xp.where(owned, target - shard.v0, -1).astype(np.int32)

    def finished(self, grads):
        """After the loop and the label terms: what the loss's gradient sums still need; under
        vocab parallelism, grad_input summed over the ranks (each rank's is its shard's part)."""
        if grads is not None and self.shard is not None:
            self.shard.comm.allreduce(grads.grad_input, "sum")

    def outputs(self, n_rows, chunk, hold_g, G_all=None, held_rows=None):
        """(G_all, ce, soft, Gradients, label_terms) for n_rows rows in chunks of `chunk` rows: G of
        all of them where hold_g (the first n_rows of g_memory where given, else of memory for
        held_rows, where given), else of a chunk (None without gradients), the per-row results,
        and with gradients their sums and the label terms (row_outputs)."""
        xp, compute_grad = self.backend.xp, self.run_opts.compute_grad
        if G_all is None and compute_grad and n_rows:
            if not hold_g:
                G_all = self.gradient_rows(chunk, False)
            elif self.g_memory is not None:
                G_all = self.g_memory[:n_rows]
            else:
                G_all = self.gradient_rows(max(n_rows, held_rows or 0), True)[:n_rows]
        ce, soft, grads, label_terms = row_outputs(xp, n_rows, self.hs, self.vs, hold_g, self.has_bias, compute_grad,
                                                   self.weight_memory)
        if G_all is not None and self.scales_g:  # G's rows stored scaled: read once
            grads.g_scale = xp.empty(n_rows, np.float32)
        return G_all, ce, soft, grads, label_terms


def plan_keeps_row_gradients(backend, run_opts, has_bias, n_rows, per_row, spared_sum, most_rows=None):
    """ChunkLoss.keeps_row_gradients(n_rows) of a loss known by its plan's numbers alone (per_row,
    spared_sum, most_rows: ChunkLoss's), no arrays: what a front end that carries the kept
    gradients from forward to backward decides as it traces (online's and topk's
    keeps_row_gradients)."""
    plan = ChunkLoss()
    plan.backend, plan.run_opts, plan.has_bias = backend, run_opts, has_bias
    plan.per_row, plan.spared_sum, plan.most_rows = per_row, spared_sum, most_rows
    return plan.keeps_row_gradients(n_rows)


def run(loss, xs, other, first=None):
    """Compute the loss's per-row values and, with run_opts.compute_grad, the gradient sums: xs
    the call's student inputs, other the rows that go with them (the teacher's inputs, the
    top-k's ids), first the call's ahead.FirstProduct or None. Returns (hard_loss, soft_loss,
    Gradients or None, Rows); the losses are 0-d float32 backend arrays.

    Nothing here waits for the GPU but the selection (and a torch process group's all-reduces,
    parallel.py, and the first product of each shape class in a process, jsdgpu.cuda.products).
    So that the GPU does not idle while the host sets the call up and reads the selection, the
    first products are the call's first GPU work, queued with as little host work before them as
    there can be (ahead.queue_head; in a call like the last, the student's before the checks:
    ahead.FirstProduct). The buffers are made for the most rows the call can have, the chunks cut
    once their count is known.
    """
    backend = loss.backend
    n_all = xs.shape[0]
    most = min(loss.plan(n_all)[0], n_all) if n_all else 0
    if first is not None and not loss.takes_first_product:  # none to queue, in this call or the next
        first.remember(backend, 0)
        first = None
    if n_all:
        loss.prepare(most, {} if first is None else first.buffers(most))
        loss.queue_first(xs, other, most)
    head, rows = queue_head(loss, xs, other, most, first)
    other = loss.selected(rows, other)
    if rows.valid_rows is not None:
        xs, other = loss.take_rows(rows.valid_rows, xs, other)
    weights = row_weights(backend.xp, loss.token_weights, loss.row_scales, rows)
    inv_n, n_rows = rows.inv_n, xs.shape[0]
    chunk, hold_g = cut_chunks(loss.products, xs, other, head, most, loss.per_row, loss.budget(n_all),
                               loss.spared_sum)
    ahead = loss.ahead
    if ahead is not None and (rows.valid_rows is not None or ahead[:2] != (chunk, hold_g)):
        ahead = None  # the guess was wrong: the rows or their chunks are others
    # a call of the rows' own losses holds G in memory of all of its rows (valid or not), as its
    # plan counted (keeps_row_gradients): the front end's own where it carries G from forward to
    # backward (ChunkLoss.g_memory: jsdgpu.torch_rows, jsdgpu.jax)
    out = loss.outputs(n_rows, chunk, hold_g, held_rows=n_all if loss.run_opts.rows_own else None) \
        if ahead is None else ahead[2]
    G_all, ce, soft, grads, label_terms = out
    if weights is not None and grads is not None and not loss.scales_g:
        grads.g_scale = weights  # the rows' scales of the gradient products
    target = loss.local_target(rows.target)
    for start in range(0, n_rows, chunk or 1):
        stop = min(start + chunk, n_rows)
        x, x_other, x_target = xs[start:stop], other[start:stop], target[start:stop]
        if start:  # the first chunk's products are queued above
            loss.products(x, x_other)
        G = chunk_g(G_all, hold_g, start, stop)
        made_ahead = not start and ahead is not None  # the first chunk's row work, queued by the loss
        if not made_ahead:
            loss.row_work(out, G, start, stop, x, x_other, x_target)
            if rows.masked and G is not None:
                backend.zero_masked_rows(G, x_target)
        if weights is not None and grads is not None and loss.scales_g:  # G's own row scales, and the weights
            grads.g_scale[start:stop] *= weights[start:stop]
        if grads is not None:
            loss.gradient_products(out, G, x, inv_n, start, stop, made_ahead)
    if weights is not None:
        ce, soft = ce * weights, soft * weights
        if label_terms is not None:
            label_terms *= weights
    finish_gradients(backend, loss.work, grads, G_all, hold_g, label_terms, target, xs, inv_n)
    loss.finished(grads)
    if loss.run_opts.reduction == "none":
        hard, soft = call_rows(backend.xp, ce, soft, rows, n_all)
    else:
        hard, soft = row_means(backend.xp, ce, soft, inv_n, target if rows.masked else None)
    return hard, soft, grads, rows


def row_weights(xp, token_weights, row_scales, rows):
    """The computed rows' weights in float32 (the token weights times the row scales), or None for
    ones. A token weight not finite or below 0 has raised ValueError in a default call's selection
    (select_rows: checked beside its first products, read at its one wait); in a capturable one
    (no host wait) it makes 1/N, and so the loss and gradients, NaN."""
    weights = rows.weights
    if token_weights is not None and rows.masked:
        weights = xp.ascontiguousarray(token_weights, dtype=np.float32)
        rows.inv_n = xp.where(checks.good_weights(xp, weights).all(), rows.inv_n, np.nan).astype(np.float32)
    if row_scales is not None:
        weights = row_scales if weights is None else weights * row_scales
    return weights if weights is None or rows.valid_rows is None else weights[rows.valid_rows]


def call_rows(xp, ce, soft, rows, n_all):
    """(hard, soft) of each of the call's n_all rows, as [n_all] float32 arrays: the computed rows'
    values where valid, 0 where ignored."""
    if rows.masked:
        valid = rows.target >= 0
        return xp.where(valid, ce, 0.0).astype(np.float32), xp.where(valid, soft, 0.0).astype(np.float32)
    if rows.valid_rows is None:
        return ce, soft
    hard_all, soft_all = xp.zeros(n_all, np.float32), xp.zeros(n_all, np.float32)
    hard_all[rows.valid_rows], soft_all[rows.valid_rows] = ce, soft
    return hard_all, soft_all


def row_outputs(xp, n_rows, hs, vs, hold_g, has_bias, compute_grad, weight_memory=None):
    """(ce, soft, Gradients, label_terms) for n_rows rows: the per-row losses, and with
    compute_grad the float32 sums (grad_weight's only where G is not held for all rows, in
    weight_memory()'s where given) and the per-row label terms the row kernel writes (else None,
    None)."""
    ce, soft = xp.zeros(n_rows, dtype=np.float32), xp.zeros(n_rows, dtype=np.float32)
    if not compute_grad:
        return ce, soft, None, None
    # the first chunk writes the sums, the others add to them; with no chunk, they are zero
    new = xp.empty if n_rows else xp.zeros
    grad_weight = None
    if not hold_g:
        grad_weight = new((vs, hs), np.float32) if weight_memory is None else weight_memory()
        if not n_rows:
            grad_weight[...] = 0
    grads = Gradients(new((n_rows, hs), np.float32), grad_weight, new(vs, np.float32) if has_bias else None)
    return ce, soft, grads, xp.zeros(n_rows, dtype=np.float32)


def chunk_g(G_all, hold_g, start, stop):
    """The chunk's rows of G: its own rows of G held for all rows, else the per-chunk buffer's
    first ones; None without gradients."""
    if G_all is None:
        return None
    return G_all[start:stop] if hold_g else G_all[:stop - start]


def finish_gradients(backend, work, grads, G_all, hold_g, label_terms, target, xs, inv_n):
    """After the chunks: the label terms the row kernel kept out of G added exactly, and where G
    is held for all rows, what backward's one grad_weight product needs of it."""
    if grads is None:
        return
    if len(target):
        backend.add_label_terms(work, label_terms, target, xs, inv_n, grads)
    if hold_g:  # work (the logits buffers) is not kept: only what the product needs
        grads.held = backend.hold_g(work, G_all, xs, inv_n, label_terms, target, grads.g_scale)


def row_means(xp, ce, jsd, inv_n, masked_target=None):
    """(hard_loss, soft_loss): the rows' sums times 1/N, as 0-d float32 arrays, in a fixed order
    (two runs on the same inputs give the same bits). masked_target: in a capturable call, the
    rows' targets; the ignored rows' (-1) results are whatever their rows gave, and count for
    nothing."""
    if masked_target is not None:
        ce, jsd = xp.where(masked_target >= 0, ce, 0.0), xp.where(masked_target >= 0, jsd, 0.0)
    hard = xp.asarray(ce.sum(dtype=np.float64) * inv_n, dtype=np.float32)
    soft = xp.asarray(jsd.sum(dtype=np.float64) * inv_n, dtype=np.float32)
    return hard, soft
