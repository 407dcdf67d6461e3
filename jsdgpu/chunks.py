"""The chunk loop shared by every backend (the steps it takes of a backend: jsdgpu.backend).

Per chunk of valid token rows: student and teacher logits (float32), the row work (per-row CE
and JSD values, and the gradient rows G), then grad_input = G @ Ws. Ignored rows are dropped
before the loop, so every matrix product shrinks with them; in a capturable call (no host
synchronization) every row is computed, and the ignored ones are masked: their G rows zeroed,
their CE and JSD values counted for nothing.

grad_weight = G.T @ Xs: where the memory budget holds G for all rows (plan_chunks), it is one
product over all of them, run by backward (which knows grad_output) straight into the output
dtype; else G lives per chunk (with the fused kernel, written over the chunk's student logits)
and each chunk adds its product to a float32 sum, which backward converts. The float32 sum
costs a write and read of [Vs, Hs] float32 per chunk and a conversion (at the benchmark shape
0.47 ms at T <= 2048, 0.85 ms at 8192: docs/design.md, "Chunks and G").
After the loop, the label terms the row kernel kept out of G (where the one-hot dominates a
16-bit G entry) are added exactly.

The row work is one fused kernel where the backend has one for the vocabulary and the whole
vocabulary is here; otherwise three phases (statistics, KL sums, results and G). Under vocab
parallelism each rank holds a shard of the vocabulary, and the phases' per-row vectors are
combined across ranks between the phases; grad_input is summed across ranks at the end.

G is written without the 1/N of the mean: it stays O(1), which keeps float16 G clear of
underflow, and 1/N goes into the matrix products' alpha.
"""

import functools
import threading

import numpy as np

from .backend import Gradients


# chunks of several are cut to a multiple of this many rows where the budget allows: cuBLAS's
# tiles span 128 rows, and a chunk of 1366 rows left 3% of the last tiles' work idle
ROW_ALIGN = 128
# the least rows of a default call's head: the products of its first rows, queued before the host
# reads the selection (queue_head). Two ROW_ALIGNs: the rest of a chunk cut at 128 rows left
# cuBLAS's 256-row tiles half idle (docs/design.md, "The host before the first product")
HEAD_ROWS = 2 * ROW_ALIGN
# Where G per chunk takes memory of its own (the top-k loss), G is held for all rows where that
# leaves chunks of at least this many rows, even if more of them: the top-k loss at T = 8192 ran
# 4-6% faster in 8 chunks of 1024 rows with G held than in 3 of 2816 with float32 sums. Where
# the row kernel writes G over the logits (the online loss), more chunks cost what the sums
# spare, or more (docs/design.md, "Chunks and G")
HELD_MIN_ROWS = 8 * ROW_ALIGN
# A default call's head is sized by the thread's last HEAD_HISTORY default calls (planned_head):
# by the least of their shares of leading valid rows and of valid rows. Sized by the last call
# alone, a run whose ignored rows change from step to step (bench/bench_run.py) guessed the whole
# first chunk valid after each step with none ignored, and threw those products away at the next
# step with 40% ignored: 2.1 times that step's floor at T = 1024 (docs/design.md, "A run's inputs")
HEAD_HISTORY = 4
# per thread: the last HEAD_HISTORY default calls' (leading valid rows, valid rows, rows) (queue_head),
# and what the last one's first product was made for (FirstProduct)
_last_rows = threading.local()


def _split(n_rows, most):
    """(rows per chunk, number of chunks) for chunks of at most `most` rows (at least 1): of
    near-equal sizes (the last one is not a sliver), rounded up to ROW_ALIGN rows where that fits."""
    n_chunks = -(-n_rows // max(1, most))
    rows = -(-n_rows // n_chunks)
    aligned = -(-rows // ROW_ALIGN) * ROW_ALIGN
    return (aligned if n_chunks > 1 and aligned <= most else rows), n_chunks


@functools.lru_cache(maxsize=256)  # a pure function of its numbers, met again call after call
def plan_chunks(n_rows, chunk_size, logits_bytes, g_bytes, chunk_g_bytes, memory_budget, most_rows=None):
    """(rows per chunk, hold_g) for n_rows > 0 rows, with logits_bytes per row of a chunk, g_bytes
    per row of G held for all rows and chunk_g_bytes per row of G held per chunk (0 without
    gradients, or where G is written over the logits), chunks of at most most_rows rows (None:
    as the budget allows). hold_g: G is held for all rows, which
    spares grad_weight's float32 sum over chunks; it is where G and the logits chunks fit the
    budget together and G takes no room that would cut the logits into more chunks (more chunks
    cost as much as the sum spares, or more: docs/design.md, "Chunks and G"), or, where G per
    chunk takes room of its own, into chunks shorter than HELD_MIN_ROWS. chunk_size, where given,
    is the chunk."""
    held = n_rows * g_bytes
    if chunk_size is not None:
        return int(chunk_size), 0 < held and held + chunk_size * logits_bytes <= memory_budget
    most_rows = most_rows or n_rows
    rows, n_chunks = _split(n_rows, min(most_rows, memory_budget // (logits_bytes + chunk_g_bytes)))
    if 0 < held < memory_budget:
        rows_held, n_chunks_held = _split(n_rows, min(most_rows, (memory_budget - held) // logits_bytes))
        if n_chunks_held <= n_chunks or (chunk_g_bytes and rows_held >= HELD_MIN_ROWS):
            return rows_held, True
    return rows, False


def combine_stats(xp, comm, stats):
    """The row statistics of every rank's shard merged in place: stats [7 or 8, rows] as the row
    kernels write them (maxima of s, z, t; sums of exp(x - max); the target logit; on the GPU,
    the t of the column of the largest s, which becomes the t of the rank that holds the row's
    largest s; the CPU's float64 sums need no reference column)."""
    maxima, sums = stats[:3], stats[3:6]
    local = maxima.copy()
    comm.allreduce(maxima, "max")
    # each rank's sums rescaled to the global max (every rank holds columns of s, z and t, so
    # no part is empty: its max is finite unless its logits are not)
    sums *= xp.exp(local - maxima)
    comm.allreduce(stats[3:7], "sum")
    if len(stats) > 7:  # the reference column's t: the largest of those of the ranks that hold
        # the largest s (the kernels' own choice among columns that tie)
        stats[7] = xp.where(local[0] == maxima[0], stats[7], -np.inf)
        comm.allreduce(stats[7], "max")


def _row_work(backend, work, comm, target, opts, ce, jsd, G, label_terms):
    """The rows' results and, where G is not None, the gradient rows written into G."""
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


_NOT_YET = object()


class FirstProduct:
    """A default call's first product queued ahead of its checks and setup (made by the API
    before anything else): where the call is like the thread's last default call (the same loss
    and run options, student arrays of the same types, shapes, dtypes, strides and device, which
    passed the checks then), the student logits of its head's rows (queue_head's head, sized by
    the last call's rows) are queued at once, into a logits buffer of as many rows a chunk as the
    last call's. The checks and the setup then run while the GPU runs that product, where the
    GPU idled before (docs/design.md, "The host before the first product"). A call whose own plan
    differs (other rows a chunk, another head) drops it unused; one whose checks fail raises as
    before, the product having written nothing but its own buffer.

    tag: what besides the student arrays the rows a chunk depend on (the loss, its RunOptions).
    ahead: (rows a chunk, head rows, the logits buffer, the mark from before the product) or None."""

    def __init__(self, tag, xs, ws):
        self.tag, self._xs, self._ws, self.ahead = tag, xs, ws, None
        self._key = _NOT_YET  # backend.ahead_key(xs, ws), once made (remember records it)
        last = getattr(_last_rows, "first", None)
        if last is None or last[0] != tag:
            return
        _, backend, key, most = last
        if not most or key is None:
            return
        self._key = backend.ahead_key(xs, ws)
        if self._key != key:
            return
        as_they_are, head = planned_head(most, xs.shape[0])
        if as_they_are:
            after = backend.mark()
            self.ahead = most, head, backend.logits_ahead(xs, ws, most, head), after

    def buffers(self, most):
        """prepare's keywords: the logits buffer made ahead, where it has `most` rows."""
        return {"logits_s": self.ahead[2]} if self.ahead is not None and self.ahead[0] == most else {}

    def queued(self, most, head):
        """The mark from before the product queued ahead, where it is the products of these head
        rows into chunks of `most` rows; else None."""
        return self.ahead[3] if self.ahead is not None and self.ahead[:2] == (most, head) else None

    def remember(self, backend, most):
        """Record this default call for the thread's next one (only a backend that queues ahead
        records: the key made above, if any, is this backend's)."""
        key = backend.ahead_key(self._xs, self._ws) if self._key is _NOT_YET else self._key
        _last_rows.first = self.tag, backend, key, most


def run(backend, xs, ws, xt, wt, bs, bt, opts, run_opts, *, select, capturable, shard=None, first=None):
    """Compute the per-row losses and, with run_opts.compute_grad, the gradient sums (opts: the
    LossOptions, run_opts: the RunOptions, whole; capturable: run_opts.capturable as resolved).

    select: the rows, called once the first products are queued: in a default call select(after),
    the backend's select_rows (the valid rows, known once waited for; after: a backend.mark()
    from before those products), in a capturable one select(), the Rows of its mark_rows (every
    row computed, the ignored ones masked). shard: under vocab parallelism, this rank's
    parallel.Shard (its weights and biases are then its shards of the vocabulary), else None.
    first: the call's FirstProduct, or None. Returns (hard_loss, soft_loss, Gradients or None,
    Rows); the losses are 0-d float32 backend arrays.

    Nothing here waits for the GPU but the selection (and a torch process group's all-reduces,
    parallel.py, and the first product of each shape class in a process, jsdgpu.cuda.products).
    So that the GPU does not idle while the host sets the call up and reads the selection, the
    first products are the call's first GPU work, queued with as little host work before them as
    there can be (queue_head; in a call like the last, the student's before the checks:
    FirstProduct). The buffers are made for the most rows the call can have, the
    chunks cut once their count is known.
    """
    xp = backend.xp
    compute_grad, chunk_size, memory_budget = run_opts.compute_grad, run_opts.chunk_size, run_opts.budget(backend)
    normalizer = run_opts.normalizer
    comm = None if shard is None else shard.comm
    vs, vt = ws.shape[0], wt.shape[0]
    n_all, hs = xs.shape
    # every rank must cut the same chunks: size them by the largest shard
    widest = (vs, vt) if shard is None else (shard.max_vs, shard.max_vt)
    per_row = backend.bytes_per_row(*widest, ws.dtype, compute_grad, fused=comm is None)
    most = min(plan_chunks(n_all, chunk_size, *per_row, memory_budget)[0], n_all) if n_all else 0
    buffers = {} if first is None else first.buffers(most)
    work = backend.prepare(ws, wt, bs, bt, most, fused=comm is None, **buffers) if n_all else None
    products = functools.partial(backend.logits, work)
    head, rows = queue_head(backend, products, xs, xt, most, select, capturable, normalizer, first)
    if rows.valid_rows is not None:
        xs, xt = backend.take_rows(rows.valid_rows, xs, xt)
    target, inv_n = rows.target, rows.inv_n
    n_rows = xs.shape[0]
    chunk, hold_g = cut_chunks(products, xs, xt, head, most, per_row, memory_budget)
    G_all = None
    if compute_grad and n_rows:
        G_all = backend.gradient_rows(work, n_rows if hold_g else chunk, own_g=hold_g)

    if shard is not None:  # the labels as columns of this rank's shard, -1 where not owned
        owned = (target >= shard.v0) & (target < shard.v0 + vs)
        target = xp.where(owned, target - shard.v0, -1).astype(np.int32)
    ce, jsd, grads, label_terms = row_outputs(xp, n_rows, hs, vs, hold_g, bs is not None, compute_grad)
    for start in range(0, n_rows, chunk or 1):
        stop = min(start + chunk, n_rows)
        if start:  # the first chunk's products are queued above
            products(xs[start:stop], xt[start:stop])
        G = chunk_g(G_all, hold_g, start, stop)
        _row_work(backend, work, comm, target[start:stop], opts, ce[start:stop], jsd[start:stop],
                  G, None if label_terms is None else label_terms[start:stop])
        if compute_grad:
            if rows.masked:
                backend.zero_masked_rows(G, target[start:stop])
            backend.grad_products(work, G, xs[start:stop], inv_n, grads, start, stop)
    finish_gradients(backend, work, grads, G_all, hold_g, label_terms, target, xs, inv_n)
    if compute_grad and comm is not None:
        comm.allreduce(grads.grad_input, "sum")
    hard, soft = row_means(xp, ce, jsd, inv_n, target if rows.masked else None)
    return hard, soft, grads, rows


def _head_rows(expected, most):
    """A default call's head for `expected` rows whose products are right to queue before the
    selection is read: the whole first chunk where they cover it, else rounded down to whole
    ROW_ALIGNs (a product of whole tiles; the rest of the chunk follows once the rows are known),
    at least HEAD_ROWS."""
    if expected >= most:
        return most
    return min(most, max(HEAD_ROWS, expected // ROW_ALIGN * ROW_ALIGN))


def _expected_rows(n_all):
    """(leading, count): a default call of n_all rows' guess of its leading valid rows and its
    valid rows, the least of the thread's last default calls' shares of theirs (all rows where
    there was none)."""
    seen = getattr(_last_rows, "seen", ())

    def share(part, rows):
        return n_all if part >= rows else part * n_all // rows
    return (min((share(leading, rows) for leading, _, rows in seen), default=n_all),
            min((share(count, rows) for _, count, rows in seen), default=n_all))


def planned_head(most, n_all):
    """(as_they_are, head) of a default call of n_all rows in chunks of at most `most` (queue_head),
    by the thread's last default calls' rows."""
    leading, count = _expected_rows(n_all)
    as_they_are = leading >= min(HEAD_ROWS, most)
    return as_they_are, _head_rows(leading if as_they_are else count, most)


def expects_all_valid(n_all):
    """A default call's guess that its n_all rows are all valid: the thread's last default calls'
    were (or there was none)."""
    return _expected_rows(n_all)[0] >= n_all


def queue_head(backend, products, xs, other, most, select, capturable, normalizer, first=None, before_wait=None):
    """Queue the call's first products, then select its rows: (head, Rows), head the rows of
    the first chunk whose products are queued (the caller queues the rest of that chunk's once
    it knows the rows: cut_chunks). products(xs, other, at=0, student=True): the products of
    those rows of xs (and of other, the teacher's input or the top-k's ids: the rows that go with
    them) into the chunk's rows from `at` on; student=False leaves out the student's logits.
    select: run's. most: the rows of the largest chunk. first: the call's FirstProduct (the
    student's logits of the head, queued ahead of the call's setup where it could be), or None.

    A capturable call's head is its first chunk (its rows are the call's own). A default call's
    head is sized by the thread's last HEAD_HISTORY default calls (planned_head): where each one's
    leading rows were valid (a share of its rows that gives HEAD_ROWS of this call's, or all), its
    head is its first rows as they are, as many as the least share gives (kept as far as this
    call's own leading rows go; the loop computes the others again); else its first selected
    rows, as many as the least share of valid rows gives, gathered on the device from the
    selection kernel's output (the rows past its count are computed for nothing); never more
    than the first chunk (cut_chunks). Either way the products are queued before the host reads
    the selection, and the selection runs beside them (backend.mark, select_rows' after), so that
    the host's wait is for the selection alone and the GPU runs the head meanwhile, and while the
    host queues what follows (docs/design.md, "The host before the first product"). A backend
    that does not queue ahead (the CPU's, queues_ahead) selects first: its head is empty.
    before_wait(selection, head), where given, is called in a default call whose head is its
    first rows as they are, before the host's wait (the top-k loss queues its first row kernel
    there)."""
    n_all = xs.shape[0]
    if capturable:
        if n_all:
            products(xs[:most], other[:most])
        return most, select()
    if not backend.queues_ahead:
        return 0, select(backend.mark()).wait(normalizer)
    as_they_are, head = planned_head(most, n_all)
    after = None if first is None or not as_they_are else first.queued(most, head)
    queued_ahead = after is not None
    if not queued_ahead:  # before the head: the selection waits for what was queued before it only
        after = backend.mark()
    if n_all and as_they_are:
        products(xs[:head], other[:head], student=not queued_ahead)
    selection = select(after)
    if n_all and not as_they_are:  # the first selected rows' products, queued before the selection is read
        products(*backend.take_rows(selection.rows[:head], xs, other))
    if n_all and as_they_are and before_wait is not None:
        before_wait(selection, head)
    rows = selection.wait(normalizer)
    if first is not None:
        first.remember(backend, most)
    if n_all:
        _last_rows.seen = (*getattr(_last_rows, "seen", ())[1 - HEAD_HISTORY:], (rows.leading, rows.count, n_all))
        head = min(head, rows.leading if as_they_are else rows.count)  # the rows whose products are right
    return head, rows


def cut_chunks(products, xs, other, head, most, per_row, memory_budget):
    """(rows per chunk, hold_g) for the call's rows (xs, and other: the rows that go with them,
    as queue_head's), with the rest of the first chunk's products queued after the head's
    (products(xs, other, at=row)): before the caller makes its other buffers, so that the GPU runs
    them meanwhile, where it would idle.

    The chunks are of `most` rows (the plan for all of the call's rows, its buffers'), the last
    one shorter, however many rows are valid: so the head (sized by the calls before, at most
    `most` rows) is never longer than the first chunk, and the chunks depend on the call's own
    rows alone (so do its bits). Planned anew for the valid rows' count, the chunks of a step
    with 30% of 4096 rows ignored were 1536 rows, and 512 rows of a 2048-row head were computed
    for nothing. hold_g: where G for all the rows fits the budget beside chunks of `most` rows."""
    n_rows = xs.shape[0]
    if not n_rows:
        return 0, False
    chunk = min(most, n_rows)
    hold_g = plan_chunks(n_rows, most, *per_row, memory_budget)[1]
    if head < chunk:
        products(xs[head:chunk], other[head:chunk], at=head)
    return chunk, hold_g


def row_outputs(xp, n_rows, hs, vs, hold_g, has_bias, compute_grad):
    """(ce, soft, Gradients, label_terms) for n_rows rows: the per-row losses, and with
    compute_grad the float32 sums (grad_weight's only where G is not held for all rows) and the
    per-row label terms the row kernel writes (else None, None)."""
    ce, soft = xp.zeros(n_rows, dtype=np.float32), xp.zeros(n_rows, dtype=np.float32)
    if not compute_grad:
        return ce, soft, None, None
    # the first chunk writes the sums, the others add to them; with no chunk, they are zero
    new = xp.empty if n_rows else xp.zeros
    grads = Gradients(new((n_rows, hs), np.float32), None if hold_g else new((vs, hs), np.float32),
                      new(vs, np.float32) if has_bias else None)
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
