"""The chunk engine (jsdgpu.engine, its plan jsdgpu.chunks, its head jsdgpu.ahead): every chunk
size, with G held for all rows or per chunk, gives the reference's answer on both backends; and
the chunk plan itself."""

import ml_dtypes
import numpy as np
import pytest

import jsdgpu
from jsdgpu.ahead import HEAD_HISTORY, HEAD_ROWS
from jsdgpu.chunks import HELD_MIN_ROWS, ROW_ALIGN, ROWS_OWN_MIN_ROWS, cut_chunks, plan_chunks, spared_sum_bytes
from conftest import assert_near_float64, head_path_ignored, make_case, rel_err, to_numpy, to_xp


@pytest.mark.parametrize("memory_budget", [None, 1])  # G held for all rows; G per chunk
@pytest.mark.parametrize("chunk_size", [1, 2, 5, 7, 100])
def test_chunk_sizes_agree(xp, rng, chunk_size, memory_budget):
    case = make_case(rng, T=17, bias=True, ignored=0.3, vt=1100)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), chunk_size=chunk_size, beta=0.7, temperature=1.5,
                               memory_budget=memory_budget)
    assert (ctx._grads.held is not None) == (memory_budget is None)
    gi, gw, gb = jsdgpu.backward(ctx)
    ref = jsdgpu.reference(**case, beta=0.7, temperature=1.5)
    assert abs(float(loss) - ref[0]) <= 1e-5 * ref[0]
    for got, want in zip((gi, gw, gb), ref[3:]):
        assert rel_err(got, want) <= 1e-4


def test_grad_weight_summed_in_blocks_of_the_vocabulary(rng, monkeypatch):
    """The CPU backend adds a chunk's part of grad_weight PART_BYTES of the vocabulary's rows at a
    time (cpu.steps.CpuSteps.grad_products): blocks that do not divide the vocabulary, over chunks with
    G per chunk, give the reference's gradients."""
    from jsdgpu.cpu import steps
    monkeypatch.setattr(steps, "PART_BYTES", 300 * 4 * 16)  # 1031 rows of H = 16: blocks of 300, the last of 131
    case = make_case(rng, T=17, bias=True, ignored=0.3)
    loss, ctx = jsdgpu.forward(**case, chunk_size=4, memory_budget=1, beta=0.4)
    assert ctx._grads.held is None
    ref = jsdgpu.reference(**case, beta=0.4)
    for got, want in zip(jsdgpu.backward(ctx), ref[3:]):
        assert rel_err(got, want) <= 1e-4


def test_cpu_default_budget_grows_with_the_call(rng, monkeypatch):
    """Where no memory_budget is given, the CPU backend's is a sixteenth of the call's chunk
    buffers for all of its rows, from BUDGET_LEAST to BUDGET_MOST (cpu.steps.CpuSteps.default_budget),
    and a call's plan takes it for the call's rows, valid or not; the answer is the reference's."""
    from jsdgpu import engine
    from jsdgpu.cpu import steps
    B = steps.CpuSteps
    assert B.default_budget(0) == steps.BUDGET_LEAST
    assert B.default_budget(16 * (steps.BUDGET_LEAST + 4096)) == steps.BUDGET_LEAST + 4096
    assert B.default_budget(16 * steps.BUDGET_MOST + 16) == steps.BUDGET_MOST
    # bench_cpu.py's T = 512, V = 128256: both models' float32 logits, 8 V bytes a row, in 16 chunks
    assert plan_chunks(512, None, 8 * 128256, 0, 0, B.default_budget(512 * 8 * 128256)) == (32, False)
    budgets = []
    plan = engine.plan_chunks
    monkeypatch.setattr(engine, "plan_chunks", lambda *a, **k: budgets.append(a[5]) or plan(*a, **k))
    monkeypatch.setattr(steps, "BUDGET_LEAST", 1)
    case = make_case(rng, T=17, bias=True, ignored=0.3)
    loss, ctx = jsdgpu.forward(**case, beta=0.4)
    assert budgets and set(budgets) == {17 * 4 * (1031 + 1031) // 16}  # one row's buffers and a few bytes
    ref = jsdgpu.reference(**case, beta=0.4)
    assert abs(float(loss) - ref[0]) <= 1e-5 * ref[0]
    for got, want in zip(jsdgpu.backward(ctx), ref[3:]):
        assert rel_err(got, want) <= 1e-4
    # a call of the rows' own losses takes the largest call's, so that G held spares computing
    # the call again in backward where 192 MiB holds it (T = 300, V = 32000: G is 38 MB)
    assert B.default_budget(None) == steps.BUDGET_MOST
    monkeypatch.undo()
    from jsdgpu.online import keeps_row_gradients
    from jsdgpu.options import RunOptions
    shapes = (jsdgpu.call.backend_for("numpy"), 32000, 32000, 16, np.dtype(np.float32), 300, False)
    assert keeps_row_gradients(*shapes, RunOptions(reduction="none"))
    assert not keeps_row_gradients(*shapes, RunOptions(reduction="none", memory_budget=steps.BUDGET_LEAST))


def test_plan_chunks():
    # (n_rows, chunk_size, logits bytes per row, G bytes per row held and per chunk, budget)
    # -> (rows, hold_g)
    assert plan_chunks(100, 7, 10, 2, 2, 10**9) == (7, True)  # an explicit chunk size wins
    assert plan_chunks(100, 7, 10, 2, 2, 269) == (7, False)  # 200 + 70 > 269: G per chunk
    assert plan_chunks(100, None, 10, 2, 2, 10**9) == (100, True)  # everything fits: one chunk
    assert plan_chunks(100, None, 10, 0, 0, 10**9) == (100, False)  # no gradients: no G
    assert plan_chunks(100, None, 10, 2, 2, 1199) == (50, True)  # 2 chunks with G held or not
    assert plan_chunks(100, None, 10, 2, 2, 400) == (25, False)  # rows fit, then 33: 4 chunks of 25
    assert plan_chunks(100, None, 10, 2, 2, 5) == (1, False)  # not even one row fits: one per chunk
    # G held where it leaves the number of chunks as it is: 2 either way...
    assert plan_chunks(100, None, 10, 2, 2, 700) == (50, True)
    # ...but not where it would make more: 2 chunks with G per chunk, 3 with G held
    assert plan_chunks(100, None, 10, 2, 2, 650) == (50, False)
    # several chunks are rounded up to ROW_ALIGN rows where that fits: 1535 rows fit, so 3
    # chunks of 1366, rounded up to 1408...
    assert plan_chunks(4096, None, 10, 2, 2, 12 * 1535) == (11 * ROW_ALIGN, False)
    # ...but 2 chunks of 1100 rows are not rounded up to 1152 where 1151 rows do not fit
    assert plan_chunks(2200, None, 10, 0, 0, 11510) == (1100, False)
    assert plan_chunks(2200, None, 10, 0, 0, 11520) == (1152, False)
    # G per chunk written over the logits takes no room: 40 rows fit, so 3 chunks of 34 (4 of 25
    # where G per chunk has room of its own)...
    assert plan_chunks(100, None, 10, 2, 0, 400) == (34, False)
    # ...and one chunk where G held for all rows (200 bytes) would make 2
    assert plan_chunks(100, None, 10, 2, 0, 1000) == (100, False)
    assert plan_chunks(100, None, 10, 2, 0, 1200) == (100, True)
    # with G per chunk apart from the logits, G held in more chunks where they stay at least
    # HELD_MIN_ROWS long: 8 of 1024 rows, not 4 of 2048 with G per chunk; 9 of 911 are too short;
    # with G written over the logits, not (4 chunks of 2048 without G held, 8 with it)
    budget = 8192 * 2 + 10 * HELD_MIN_ROWS
    assert plan_chunks(8192, None, 10, 2, 2, budget) == (HELD_MIN_ROWS, True)
    assert plan_chunks(8192, None, 10, 2, 2, 8192 * 2 + 10 * 1000) == (2048, False)
    assert plan_chunks(8192, None, 10, 2, 0, budget) == (2048, False)
    # most_rows caps the chunks the budget allows (the top-k loss's own product), G held or not,
    # and an explicit chunk size still wins
    assert plan_chunks(8192, None, 10, 2, 2, 10**9, 2048) == (2048, True)
    assert plan_chunks(8192, None, 10, 2, 2, 8192 * 2 + 10 * 1000, 512) == (512, True)
    assert plan_chunks(8192, None, 10, 2, 2, 8192 * 2 + 10 * 500, 768) == (6 * ROW_ALIGN, False)
    assert plan_chunks(8192, 4096, 10, 2, 2, 10**9, 2048) == (4096, True)
    # a call of the rows' own losses holds G wherever chunks of ROWS_OWN_MIN_ROWS remain (16
    # chunks of 512 rows where a sum's call takes 4 of 2048 without G held), not where they do not
    assert plan_chunks(8192, None, 10, 2, 0, 8192 * 2 + 10 * 512, None, True) == (512, True)
    assert plan_chunks(8192, None, 10, 2, 0, 8192 * 2 + 10 * 512) == (2048, False)
    assert plan_chunks(8192, None, 10, 2, 0, 8192 * 2 + 10 * (ROWS_OWN_MIN_ROWS - 1), None, True)[1] is False
    assert plan_chunks(100, None, 10, 2, 0, 200 + 10 * 100, None, True) == (100, True)  # fewer rows than that


def test_head_sized_by_the_last_calls(monkeypatch):
    """A default call's head (ahead.planned_head) follows the least share of leading valid rows
    and of valid rows among the thread's last HEAD_HISTORY default calls, whatever their sizes: one
    step with rows ignored among steps with none is enough to gather the selected rows."""
    from jsdgpu import ahead
    monkeypatch.setattr(ahead._last_rows, "seen", (), raising=False)
    assert ahead.planned_head(1024, 1024) == (True, 1024) and ahead.expects_all_valid(1024)
    # (leading valid rows, valid rows, rows) of each call, the last one last
    ahead._last_rows.seen = ((1024, 1024, 1024),) * (HEAD_HISTORY - 1) + ((1, 614, 1024),)
    assert ahead.planned_head(1024, 1024) == (False, 4 * ROW_ALIGN)  # 614 valid: whole tiles of them
    assert not ahead.expects_all_valid(1024)
    ahead._last_rows.seen = ((2048, 2048, 2048),) * HEAD_HISTORY
    assert ahead.planned_head(2048, 4096) == (True, 2048) and ahead.expects_all_valid(4096)
    ahead._last_rows.seen = ((300, 750, 1000),) * HEAD_HISTORY  # as shares of a call of 2000 rows: 600, 1500
    assert ahead.planned_head(2048, 2000) == (True, 4 * ROW_ALIGN)
    ahead._last_rows.seen = ((100, 750, 1000),) * HEAD_HISTORY
    assert ahead.planned_head(2048, 2000) == (False, 11 * ROW_ALIGN)
    assert ahead.planned_head(1024, 2000) == (False, 1024)  # at most the first chunk


def test_held_g_takes_the_room_of_the_float32_sum():
    """grad_weight's float32 sum over chunks lies beyond the budget; where the gradient comes
    back in a 16-bit dtype the sum is not the gradient but cast into it, and G held for all rows
    spares it, so G may take its room too (chunks.spared_sum_bytes): holding G then never takes
    more memory than summing."""
    from jsdgpu.options import RunOptions
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert spared_sum_bytes(10, 3, bf16, RunOptions()) == 120
    assert spared_sum_bytes(10, 3, np.dtype(np.float16), RunOptions(reduction="none")) == 120
    assert spared_sum_bytes(10, 3, np.dtype(np.float32), RunOptions()) == 0  # the sum is the gradient
    assert spared_sum_bytes(10, 3, bf16, RunOptions(grad_weight_float32=True)) == 0
    assert spared_sum_bytes(10, 3, bf16, RunOptions(compute_grad=False)) == 0
    # 4096 rows in 2 chunks of 2048 either way; G of them all (8192 bytes) fits the budget beside
    # chunks of 1228 rows only (4 chunks), the budget and the sum's room beside 2 of 2048
    budget = 2048 * 10
    assert plan_chunks(4096, None, 10, 2, 0, budget) == (2048, False)
    assert plan_chunks(4096, None, 10, 2, 0, budget, spared_sum=8191) == (2048, False)
    assert plan_chunks(4096, None, 10, 2, 0, budget, spared_sum=8192) == (2048, True)
    assert plan_chunks(4096, 2048, 10, 2, 0, budget, spared_sum=8192) == (2048, True)
    # the rows' own losses: chunks of 1228 rows in the budget alone (aligned: 1024), 2048 with the room
    assert plan_chunks(4096, None, 10, 2, 0, budget, None, True) == (1024, True)
    assert plan_chunks(4096, None, 10, 2, 0, budget, None, True, 8192) == (2048, True)
    xs = np.zeros((4096, 4), np.float32)
    assert cut_chunks(None, xs, xs, 2048, 2048, (10, 2, 0), budget, 8192) == (2048, True)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_held_g_in_the_room_of_the_float32_sum_gives_the_reference(xp, rng, dtype, reduction):
    """A call whose budget holds G only with the float32 sum's room (a 16-bit gradient) holds it,
    in the chunks the engine cuts and in the plan of a call of the rows' own losses (which then
    keeps its gradients for backward); a float32 one sums over chunks (and computes the rows' own
    losses again in backward). Both give the float64 reference's answer."""
    from jsdgpu.call import backend_for
    from jsdgpu.options import RunOptions
    T, vs, hs = 40, 1031, 128
    case = make_case(rng, T=T, vs=vs, hs=hs, dtype=getattr(ml_dtypes, dtype, np.float32), bias=False)
    weight_dtype = np.dtype(case["student_weight"].dtype)
    backend = backend_for("numpy" if xp is np else "cupy")
    per_row = backend.bytes_per_row(vs, vs, weight_dtype, True, True)
    budget = (T // 2) * sum(per_row[::2])  # 2 chunks of 20 rows with G per chunk
    spared = spared_sum_bytes(vs, hs, weight_dtype, RunOptions())
    for own in (False, True):  # G of the 40 rows beside chunks of 40 only with the sum's room
        assert plan_chunks(T, None, *per_row, budget, None, own)[1] is False
        if spared:
            assert plan_chunks(T, None, *per_row, budget, None, own, spared) == (T, True)
    opts = dict(beta=0.3, temperature=2.0)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), memory_budget=budget, reduction=reduction, **opts)
    if reduction == "mean":
        assert (ctx._grads.held is not None) == bool(spared)
        assert_near_float64(case, dtype, opts, loss, ctx.hard_loss, ctx.soft_loss, jsdgpu.backward(ctx))
        return
    assert (ctx._recompute is None) == bool(spared)
    upstream = rng.standard_normal(T)
    grads = jsdgpu.backward(ctx, xp.asarray(upstream, dtype=np.float32))
    ref = jsdgpu.reference(**case, reduction="none", grad_output=upstream, **opts)
    np.testing.assert_allclose(to_numpy(loss), ref[0], rtol=1e-4, atol=1e-5)
    for got, want in zip(grads[:2], ref[3:5]):
        assert rel_err(got, want) <= (2.0**-7 if spared else 1e-4), rel_err(got, want)


def test_chunks_of_the_planned_rows_whatever_the_valid_rows():
    """The rows a chunk are the plan's for all of the call's rows (the buffers'), the last chunk
    shorter, whatever share of them is valid (chunks.cut_chunks): a head of the whole first chunk
    is never longer than the call's first chunk. The rest of the first chunk is queued where the
    head is shorter."""
    queued = []

    def products(x, other, at=0):
        queued.append((at, len(x)))
    xs = np.zeros((2867, 4), np.float32)
    per_row = (1000, 2, 0)  # logits, G held, G per chunk: bytes a row
    assert cut_chunks(products, xs, xs, 2048, 2048, per_row, 2048 * 1000 + 2867 * 2) == (2048, True)
    assert cut_chunks(products, xs, xs, 2048, 2048, per_row, 2048 * 1000) == (2048, False)
    assert queued == []
    assert cut_chunks(products, xs[:700], xs[:700], 512, 2048, per_row, 10**9) == (700, True)
    assert queued == [(512, 188)]


@pytest.mark.parametrize("T,chunk", [(17, 5), (HEAD_ROWS + 44, None)])  # the head a chunk, or part of one
def test_head_as_the_rows_are_or_selected(xp, rng, T, chunk):
    """A default call's first chunk products come from its first rows as they are where the last
    calls' leading rows were valid, else from its first selected rows (ahead.queue_head): a run
    of calls that takes every path (conftest.head_path_ignored; on the GPU, which queues products
    ahead of the selection) gives the reference's answer at each call."""
    for ignored in head_path_ignored(T):
        case = make_case(rng, T=T, bias=True, ignored=0.0)
        case["target"][ignored] = -100
        loss, ctx = jsdgpu.forward(**to_xp(case, xp), chunk_size=chunk, beta=0.4)
        gi, gw, gb = jsdgpu.backward(ctx)
        ref = jsdgpu.reference(**case, beta=0.4)
        assert abs(float(loss) - ref[0]) <= 1e-5 * ref[0], ignored
        for got, want in zip((gi, gw, gb), ref[3:]):
            assert rel_err(got, want) <= 1e-4, ignored


def test_a_call_gives_the_same_bits_whatever_came_before(xp, rng):
    """Two runs of a call on the same inputs give the same bits (docs/design.md, "Numerics"),
    whichever calls came before it, though a default call's head on the GPU is sized by the last
    call (ahead.queue_head): after calls that take each of its paths."""
    T = HEAD_ROWS + 44
    case = to_xp(make_case(rng, T=T, bias=True, ignored=0.3), xp)
    runs = []
    for ignored in head_path_ignored(T):
        before = make_case(rng, T=T, ignored=0.0)
        before["target"][ignored] = -100
        jsdgpu.forward(**to_xp(before, xp), compute_grad=False)
        loss, ctx = jsdgpu.forward(**case, beta=0.4)
        runs.append([to_numpy(a) for a in (loss, *jsdgpu.backward(ctx))])
    for run in runs[1:]:
        for got, first in zip(run, runs[0]):
            np.testing.assert_array_equal(got, first)


@pytest.mark.gpu
def test_a_call_like_the_last_queues_its_first_product_ahead(rng, queued_ahead):
    """A default call like the thread's last one (the same options, student arrays of the same
    types, shapes and strides) queues its first product before its checks (ahead.FirstProduct).
    It gives the bits of the same call after one that is not like it (whose first product is
    queued after the checks, the same head); it drops that product where its own plan differs
    (another teacher vocabulary, under a budget that binds); it raises the checks' error where
    they fail."""
    import cupy
    from jsdgpu.cuda.backend import CudaBackend
    queued = queued_ahead
    T, vs, vt_wide = 2 * HEAD_ROWS + 37, 1031, 4099
    # a budget under which the teacher's vocabulary changes the rows a chunk
    per_row = {vt: CudaBackend.bytes_per_row(vs, vt, np.dtype(np.float32), True, True)
               for vt in (vs, vt_wide)}
    budget = 160 * sum(per_row[vs][:2])
    rows = {vt: plan_chunks(T, None, *per_row[vt], budget)[0] for vt in per_row}
    assert rows[vs] != rows[vt_wide], rows

    def call(case, **options):
        loss, ctx = jsdgpu.forward(**to_xp(case, cupy), beta=0.3, **options)
        return [to_numpy(a) for a in (loss, *jsdgpu.backward(ctx))]

    def case(vt=vs):
        c = make_case(rng, T=T, vs=vs, vt=vt, bias=True)
        c["target"][HEAD_ROWS + 20::3] = -100  # the leading rows valid: a head of its rows as they are
        return c

    for _ in range(HEAD_HISTORY):  # the thread's last calls' leading rows valid (ahead.planned_head)
        call(case())
    for options, vt in ((dict(), vs), (dict(memory_budget=budget), vt_wide)):
        this = case(vt)
        call(case(), memory_budget=123 * 2**20)  # not like it: the same rows, other options
        queued.clear()
        unlike = call(this, **options)
        assert not queued
        call(case(), **options)  # like it
        queued.clear()
        like = call(this, **options)
        assert queued, "the call like the last queued nothing ahead"
        for got, want in zip(like, unlike):
            np.testing.assert_array_equal(got, want)
        ref = jsdgpu.reference(**this, beta=0.3)
        assert abs(float(like[0]) - ref[0]) <= 1e-5 * abs(ref[0])
        for got, want in zip(like[1:], ref[3:]):
            assert rel_err(got, want) <= 1e-4

    # student arrays that are not C-contiguous are never queued ahead (the product reads them as they are)
    strided = case()
    for _ in range(2):
        queued.clear()
        loss, ctx = jsdgpu.forward(**{**to_xp(strided, cupy), "student_input": cupy.asfortranarray(
            cupy.asarray(strided["student_input"]))}, beta=0.3)
        assert not queued
    assert abs(float(loss) - jsdgpu.reference(**strided, beta=0.3)[0]) <= 1e-5 * abs(float(loss))

    call(case())
    bad = case()
    bad["teacher_input"] = bad["teacher_input"][:, :-1].copy()
    queued.clear()
    with pytest.raises(ValueError, match="teacher_weight has hidden size"):
        call(bad)
    assert queued  # its student arrays were like the last call's: the product was queued, then the checks raised


@pytest.mark.parametrize("bias", [False, True])
def test_the_shapes_alone_tell_whether_a_call_keeps_its_rows_gradients(xp, rng, bias):
    """online.keeps_row_gradients (what a traced front end decides from the shapes:
    jsdgpu.torch_rows) is what the call of the rows' own losses then does (call.loss_of_call: its
    ctx keeps the gradients, or computes the call again in backward), at budgets on both sides of
    holding G, with rows ignored (G's memory is sized by all of the call's rows: engine.run)."""
    from jsdgpu.call import backend_for
    from jsdgpu.online import keeps_row_gradients
    from jsdgpu.options import RunOptions
    T, vs, hs = 40, 1031, 16
    case = make_case(rng, T=T, vs=vs, hs=hs, bias=bias, ignored=0.3)
    backend = backend_for("numpy" if xp is np else "cupy")
    per_row = backend.bytes_per_row(vs, vs, np.dtype(np.float32), True, True)
    seen = set()
    for rows_a_chunk in (1, 2, 3, 8, 20, 40):  # budgets from too small for G to room for all of it
        budget = T * per_row[1] + rows_a_chunk * per_row[0]
        for memory_budget in (budget - 1, budget):
            kept = keeps_row_gradients(backend, vs, vs, hs, np.dtype(np.float32), T, bias,
                                       RunOptions(memory_budget=memory_budget, reduction="none"))
            _, ctx = jsdgpu.forward(**to_xp(case, xp), memory_budget=memory_budget, reduction="none")
            assert kept == (ctx._recompute is None), (rows_a_chunk, memory_budget)
            if kept:
                assert ctx._grads.held.G.base.shape[0] == T  # all rows' memory, 30% of them ignored
            seen.add(kept)
    assert seen == ({False} if bias else {False, True})  # both sides met (a bias never keeps them)
