"""Queuing ahead: a default call's first products queued before the host waits for its
selection of valid rows, and, in a call like the thread's last, before its checks (docs/design.md,
"The host before the first product"). The chunk engine (jsdgpu.engine) calls queue_head once a
call; FirstProduct is made by the API before anything else.

What a head may hold is guessed from the thread's last default calls (planned_head); a guess
that the call's rows prove wrong costs the products of its rows, never its bits: the engine
computes again whatever the head's guess did not cover.
"""

import threading

from .chunks import ROW_ALIGN

# the least rows of a default call's head: the products of its first rows, queued before the host
# reads the selection (queue_head). Two ROW_ALIGNs: the rest of a chunk cut at 128 rows left
# cuBLAS's 256-row tiles half idle (docs/design.md, "The host before the first product")
HEAD_ROWS = 2 * ROW_ALIGN
# A default call's head is sized by the thread's last HEAD_HISTORY default calls (planned_head):
# by the least of their shares of leading valid rows and of valid rows. Sized by the last call
# alone, a run whose ignored rows change from step to step (bench/bench_run.py) guessed the whole
# first chunk valid after each step with none ignored, and threw those products away at the next
# step with 40% ignored: 2.1 times that step's floor at T = 1024 (docs/design.md, "A run's inputs")
HEAD_HISTORY = 4
# per thread: the last HEAD_HISTORY default calls' (leading valid rows, valid rows, rows) (queue_head),
# and what the last one's first product was made for (FirstProduct)
_last_rows = threading.local()


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


def queue_head(loss, xs, other, most, first=None):
    """Queue the call's first products, then select its rows: (head, Rows), head the rows of
    the first chunk whose products are queued (the engine queues the rest of that chunk's once
    it knows the rows: chunks.cut_chunks). loss: the engine.ChunkLoss, whose products(xs, other,
    at=0, student=True) queue the products of those rows of xs (and of other, the teacher's input
    or the top-k's ids: the rows that go with them) into the chunk's rows from `at` on
    (student=False leaves out the student's logits), and whose select gives the rows. most: the
    rows of the largest chunk. first: the call's FirstProduct (the student's logits of the head,
    queued ahead of the call's setup where it could be), or None.

    A capturable call's head is its first chunk (its rows are the call's own). A default call's
    head is sized by the thread's last HEAD_HISTORY default calls (planned_head): where each one's
    leading rows were valid (a share of its rows that gives HEAD_ROWS of this call's, or all), its
    head is its first rows as they are, as many as the least share gives (kept as far as this
    call's own leading rows go; the loop computes the others again); else its first selected
    rows, as many as the least share of valid rows gives, gathered on the device from the
    selection kernel's output (the rows past its count are computed for nothing); never more
    than the first chunk (cut_chunks). Either way the products are queued before the host reads
    the selection, so that the host's wait is for the selection alone and the GPU runs the head
    meanwhile, and while the host queues what follows (docs/design.md, "The host before the first
    product"): the head of first rows as they are runs beside the selection (backend.mark,
    select_rows' after), a gathered head after it on the caller's stream, where nothing of the call
    comes before it (beside a mark made just before, it would wait for the same work, through a
    side stream's four more CUDA calls of host time). A backend
    that does not queue ahead (the CPU's, queues_ahead) selects first: its head is empty. In a
    default call whose head is its first rows as they are, loss.before_wait queues the loss's own
    work before the host's wait (the top-k loss's first row kernel)."""
    backend, products, select = loss.backend, loss.products, loss.select
    normalizer = loss.run_opts.normalizer
    n_all = xs.shape[0]
    if loss.capturable:
        if n_all:
            products(xs[:most], other[:most])
        return most, select()
    if not backend.queues_ahead:
        return 0, select(backend.mark()).wait(normalizer)
    as_they_are, head = planned_head(most, n_all)
    after = None if first is None or not as_they_are else first.queued(most, head)
    queued_ahead = after is not None
    if not queued_ahead and as_they_are:  # before the head: the selection waits for what was queued before it only
        after = backend.mark()
    if n_all and as_they_are:
        products(xs[:head], other[:head], student=not queued_ahead)
    selection = select(after)
    if n_all and not as_they_are:  # the first selected rows' products, queued before the selection is read
        products(*backend.take_rows(selection.rows[:head], xs, other))
    if n_all and as_they_are:
        loss.before_wait(selection, head, xs, other, most)
    rows = selection.wait(normalizer)
    if first is not None:
        first.remember(backend, most)
    if n_all:
        _last_rows.seen = (*getattr(_last_rows, "seen", ())[1 - HEAD_HISTORY:], (rows.leading, rows.count, n_all))
        head = min(head, rows.leading if as_they_are else rows.count)  # the rows whose products are right
    return head, rows
