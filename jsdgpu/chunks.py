"""The chunk plan: how many token rows a chunk of a call takes, and whether G (the gradient
rows w.r.t. the student's logits) is held for all rows, by the bytes a row's buffers take and the
memory budget (docs/design.md, "Chunks and G"). The chunk engine (jsdgpu.engine) runs the plan.
"""

import functools


# chunks of several are cut to a multiple of this many rows where the budget allows: cuBLAS's
# tiles span 128 rows, and a chunk of 1366 rows left 3% of the last tiles' work idle
ROW_ALIGN = 128
# Where G per chunk takes memory of its own (the top-k loss), G is held for all rows where that
# leaves chunks of at least this many rows, even if more of them: the top-k loss at T = 8192 ran
# 4-6% faster in 8 chunks of 1024 rows with G held than in 3 of 2816 with float32 sums. Where
# the row kernel writes G over the logits (the online loss), more chunks cost what the sums
# spare, or more (docs/design.md, "Chunks and G")
HELD_MIN_ROWS = 8 * ROW_ALIGN
# A call of the rows' own losses (reduction "none") holds G for all rows wherever that leaves
# chunks of at least this many rows: else its backward computes the call again, two products of
# every row and the row kernel more (docs/design.md, "Token weights and the sum"). Two cuBLAS
# tiles of rows; not measured against the alternative.
ROWS_OWN_MIN_ROWS = 2 * ROW_ALIGN


def _split(n_rows, most):
    """(rows per chunk, number of chunks) for chunks of at most `most` rows (at least 1): of
    near-equal sizes (the last one is not a sliver), rounded up to ROW_ALIGN rows where that fits."""
    n_chunks = -(-n_rows // max(1, most))
    rows = -(-n_rows // n_chunks)
    aligned = -(-rows // ROW_ALIGN) * ROW_ALIGN
    return (aligned if n_chunks > 1 and aligned <= most else rows), n_chunks


def spared_sum_bytes(vs, hs, dtype, run_opts):
    """The bytes of grad_weight's float32 sum over chunks ([vs, hs], beyond the budget) where it
    is not itself the gradient returned: a 16-bit weight's gradient is a cast of it. G held for
    all rows spares the sum, so it may take the sum's room as well as the budget's
    (plan_chunks): a call holding G then never takes more memory than one summing."""
    if not run_opts.compute_grad or run_opts.grad_weight_float32 or dtype.itemsize >= 4:
        return 0
    return 4 * vs * hs


@functools.lru_cache(maxsize=256)  # a pure function of its numbers, met again call after call
def plan_chunks(n_rows, chunk_size, logits_bytes, g_bytes, chunk_g_bytes, memory_budget, most_rows=None,
                rows_own=False, spared_sum=0):
    """(rows per chunk, hold_g) for n_rows > 0 rows, with logits_bytes per row of a chunk, g_bytes
    per row of G held for all rows and chunk_g_bytes per row of G held per chunk (0 without
    gradients, or where G is written over the logits), chunks of at most most_rows rows (None:
    as the budget allows). hold_g: G is held for all rows, which spares grad_weight's float32
    sum over chunks (spared_sum bytes beyond the budget: spared_sum_bytes); it is where G and
    the logits chunks fit the budget and the sum's room together and G takes no room that would
    cut the logits into more chunks (more chunks cost as much as the sum spares, or more:
    docs/design.md, "Chunks and G"), or, where G per chunk takes room of its own, into chunks
    shorter than HELD_MIN_ROWS; with rows_own (a call of the rows' own losses), wherever it
    leaves chunks of ROWS_OWN_MIN_ROWS. chunk_size, where given, is the chunk."""
    held, room = n_rows * g_bytes, memory_budget + spared_sum
    if chunk_size is not None:
        return int(chunk_size), 0 < held and held + chunk_size * logits_bytes <= room
    most_rows = most_rows or n_rows
    rows, n_chunks = _split(n_rows, min(most_rows, memory_budget // (logits_bytes + chunk_g_bytes)))
    if 0 < held < room:
        rows_held, n_chunks_held = _split(n_rows, min(most_rows, (room - held) // logits_bytes))
        if (n_chunks_held <= n_chunks or (chunk_g_bytes and rows_held >= HELD_MIN_ROWS)
                or (rows_own and rows_held >= min(n_rows, ROWS_OWN_MIN_ROWS))):
            return rows_held, True
    return rows, False


def cut_chunks(products, xs, other, head, most, per_row, memory_budget, spared_sum=0):
    """(rows per chunk, hold_g) for the call's rows (xs, and other: the rows that go with them,
    as queue_head's), with the rest of the first chunk's products queued after the head's
    (products(xs, other, at=row)): before the caller makes its other buffers, so that the GPU runs
    them meanwhile, where it would idle.

    The chunks are of `most` rows (the plan for all of the call's rows, its buffers'), the last
    one shorter, however many rows are valid: so the head (sized by the calls before, at most
    `most` rows) is never longer than the first chunk, and the chunks depend on the call's own
    rows alone (so do its bits). Planned anew for the valid rows' count, the chunks of a step
    with 30% of 4096 rows ignored were 1536 rows, and 512 rows of a 2048-row head were computed
    for nothing. hold_g: where G for all the rows fits the budget and the float32 sum's room
    (spared_sum) beside chunks of `most` rows."""
    n_rows = xs.shape[0]
    if not n_rows:
        return 0, False
    chunk = min(most, n_rows)
    hold_g = plan_chunks(n_rows, most, *per_row, memory_budget, spared_sum=spared_sum)[1]
    if head < chunk:
        products(xs[head:chunk], other[head:chunk], at=head)
    return chunk, hold_g
