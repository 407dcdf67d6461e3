"""Offline distillation (docs/contract.md, "Offline distillation"): the loss against a teacher's
stored top-k log-probabilities, and teacher_topk, on both backends against the float64
reference, whose own gradient is checked by finite differences here."""

import itertools

import numpy as np
import pytest

import jsdgpu
from conftest import (DTYPES, assert_grads_near, assert_part_near, float32_logits, head_logits, head_path_ignored,
                      make_case, rel_err, to_numpy, to_xp)
from jsdgpu.ahead import HEAD_HISTORY, HEAD_ROWS
from jsdgpu.options import DEFAULTS
from jsdgpu.reference import reference_logits, reference_topk, reference_topk_logits

MODES = ("bucket", "renormalize")
BETAS = (0.0, 1e-6, 0.3, 0.5, 1.0 - 1e-6, 1.0)


def teacher_logprobs(rng, T, vs, k, std, unused=0.0, teacher_temperature=1.0):
    """(ids [T, k], logprobs [T, k]) of a random teacher over vs ids: its k most likely ids, in a
    shuffled slot order, unused slots (-inf) with ids that would be bad if they were used."""
    t = rng.standard_normal((T, vs)) * std / teacher_temperature
    logq = t - np.log(np.exp(t - t.max(1, keepdims=True)).sum(1, keepdims=True)) - t.max(1, keepdims=True)
    ids = np.argsort(-t, axis=1)[:, :k]
    ids = np.take_along_axis(ids, rng.permuted(np.tile(np.arange(k), (T, 1)), axis=1), axis=1)
    lq = np.take_along_axis(logq, ids, axis=1).astype(np.float32)
    off = rng.random((T, k)) < unused
    lq[off] = -np.inf
    ids[off] = rng.choice([-7, vs + 3, 0], off.sum())  # ignored: out of range, or a repeat
    return ids, lq


def make_topk_case(rng, *, T=11, hs=16, vs=523, k=17, dtype=np.float32, bias=True, ignored=0.2, unused=0.15,
                   logit_std=2.0, ignore_index=-100):
    dtype = np.dtype(dtype)
    ids, lq = teacher_logprobs(rng, T, vs, k, logit_std, unused)
    target = rng.integers(0, vs, T)
    target[rng.random(T) < ignored] = ignore_index
    return dict(student_input=rng.standard_normal((T, hs)).astype(dtype),
                student_weight=(rng.standard_normal((vs, hs)) * logit_std / np.sqrt(hs)).astype(dtype),
                teacher_indices=ids, teacher_logprobs=lq, target=target,
                student_bias=(rng.standard_normal(vs) * 0.5).astype(dtype) if bias else None)


def rest_slack(case, opts, missing_mass, G=None):
    """How far float64 itself leaves the soft part undetermined: in reverse KL (beta = 1) with the
    bucket, a row's part holds P_rest (log P_rest - log q_rest), and q_rest = 1 - sum q comes from
    log sum q, whose float64 rounding (a few ulps of its largest term's size) is an error of
    log q_rest of that over q_rest, large where the stored top-k hold nearly all the teacher's
    mass. The rows' mean of P_rest times that, for 4 ulps; about 0 elsewhere. With G (the
    reference's gradient in the logits): (that, the gradient's relative error that the same
    error of log q_rest makes, in norm), where a row's error is at most w_soft / T / N times
    2 P_rest times it (the rest's columns' u, and every column's u_bar)."""
    rows = []
    if missing_mass == "bucket" and opts.get("beta") == 1.0:
        lq = case["teacher_logprobs"].astype(np.float64)
        z = head_logits(case, "student") / opts.get("temperature", 1.0)
        logp = z - z.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        for row in np.flatnonzero(case["target"] != -100):
            used = lq[row] != -np.inf
            q = lq[row][used]
            m = q.max() if len(q) else 0.0
            lse_q = m + np.log(np.exp(q - m).sum())
            q_rest = -np.expm1(lse_q) if lse_q < 0 else 0.0
            p_rest = max(0.0, 1.0 - np.exp(logp[row][case["teacher_indices"][row][used]]).sum())
            rows.append(p_rest * 4 * 2.0**-52 * max(1.0, abs(m)) / q_rest if q_rest > 0 else 0.0)
    n = max(1, int((case["target"] != -100).sum()))
    value = sum(rows) / n
    if G is None:
        return value
    w_soft = opts.get("weight_soft_loss", DEFAULTS.weight_soft_loss) / opts.get("temperature", 1.0)
    grad = 2 * w_soft / n * np.sqrt(np.sum(np.square(rows))) / max(np.linalg.norm(G), 1e-300)
    return value, grad


def check_against_reference(xp, case, opts, missing_mass, dtype, chunk_size=None, sharp=0.0, memory_budget=None):
    """The loss, its parts and the gradients as the float64 reference's, about as close as the
    float64 math is on float32 logits (conftest.float32_logits: at temperature 0.05 the gradient
    magnifies a logit's error twentyfold, and a sharp row's log-ratios multiply it again), plus
    float32 (or the dtype's) rounding of the results, and float64's own rounding where the loss
    is ill-conditioned (rest_slack)."""
    loss, ctx = jsdgpu.forward_topk(**to_xp(case, xp), missing_mass=missing_mass, chunk_size=chunk_size,
                                    memory_budget=memory_budget, **opts)
    grads = jsdgpu.backward(ctx)
    s = head_logits(case, "student")
    args = (case["teacher_indices"], case["teacher_logprobs"], case["target"], missing_mass)
    ref = reference_topk_logits(s, *args, **opts)
    floors = [reference_topk_logits(s32, *args, **opts) for s32 in float32_logits(case, "student")]
    slack, grad_slack = rest_slack(case, opts, missing_mass, ref[3])
    for name, got, i, open_by in (("loss", loss, 0, opts.get("weight_soft_loss", DEFAULTS.weight_soft_loss) * slack),
                                  ("soft", ctx.soft_loss, 2, slack), ("hard", ctx.hard_loss, 1, 0.0)):
        want = ref[i]
        got = float(got)
        assert np.isfinite(got) == np.isfinite(want), (name, got, want)
        if np.isfinite(want):
            assert_part_near(name, got, want, [f[i] for f in floors], open_by)
    assert float(ctx.soft_loss) >= 0.0
    if not np.isfinite(ref[0]):
        return  # an infinite divergence (below): its gradient is not defined
    # (the gradient's slack: 4 times the rest's, for the products' mixing of G's rows)
    assert_grads_near(case, ref[3], [f[3] for f in floors], grads, np.dtype(dtype).name, slack=sharp + 4 * grad_slack)


@pytest.mark.parametrize("missing_mass", MODES)
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_reference_gradient_matches_finite_differences(rng, missing_mass, beta):
    T, vs, k = 4, 29, 6
    s = rng.standard_normal((T, vs)) * 2
    ids, lq = teacher_logprobs(rng, T, vs, k, 2.0, unused=0.2)
    target = rng.integers(0, vs, T)
    target[1] = -100
    opts = dict(beta=beta, temperature=1.7, weight_hard_loss=0.3, weight_soft_loss=0.7)
    G = reference_topk_logits(s, ids, lq, target, missing_mass, **opts)[3]
    h = 1e-6
    for i, j in zip(rng.integers(0, T, 40), rng.integers(0, vs, 40)):
        up, down = s.copy(), s.copy()
        up[i, j] += h
        down[i, j] -= h
        numeric = (reference_topk_logits(up, ids, lq, target, missing_mass, **opts)[0]
                   - reference_topk_logits(down, ids, lq, target, missing_mass, **opts)[0]) / (2 * h)
        assert abs(numeric - G[i, j]) <= 1e-7 + 1e-6 * abs(G[i, j]), (i, j, numeric, G[i, j])


def test_reference_bucket_is_the_full_divergence_where_k_is_the_vocabulary(rng):
    """With every id stored, the bucket's rest is empty and the top-k loss is the online loss
    against the teacher's full distribution."""
    T, vs = 5, 19
    s = rng.standard_normal((T, vs))
    t = rng.standard_normal((T, vs))
    logq = t - np.log(np.exp(t).sum(1, keepdims=True))
    ids = np.argsort(-t, axis=1)
    lq = np.take_along_axis(logq, ids, axis=1)
    target = rng.integers(0, vs, T)
    for beta in (0.0, 0.5, 1.0):
        got = reference_topk_logits(s, ids, lq, target, "bucket", beta=beta)
        want = reference_logits(s, t, target, beta=beta)
        assert abs(got[0] - want[0]) < 1e-9 and np.abs(got[3] - want[3]).max() < 1e-9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("missing_mass", MODES)
@pytest.mark.parametrize("beta", BETAS)
def test_against_float64(xp, rng, dtype, missing_mass, beta):
    if xp is np and dtype == "float16":
        pytest.skip("float16 on the CPU: as float32 there")
    case = make_topk_case(rng, dtype=DTYPES[dtype], T=int(rng.integers(5, 14)), k=int(rng.integers(1, 40)))
    opts = dict(beta=beta, temperature=float(rng.choice([0.7, 1.0, 2.0])), weight_hard_loss=0.3,
                weight_soft_loss=0.7)
    check_against_reference(xp, case, opts, missing_mass, DTYPES[dtype], chunk_size=int(rng.integers(1, 6)))


def test_held_g_in_the_room_of_the_float32_sum(xp, rng):
    """As the online loss's (test_chunks.py): a budget under which G of all rows fits only with
    the room of the float32 sum it spares (a 16-bit gradient: TopKLoss.spared_sum) holds G, with
    the float64 reference's answer."""
    from jsdgpu.call import backend_for
    from jsdgpu.chunks import plan_chunks, spared_sum_bytes
    from jsdgpu.options import RunOptions
    T, vs, hs, dtype = 40, 523, 64, np.dtype(DTYPES["bfloat16"])
    case = make_topk_case(rng, T=T, vs=vs, hs=hs, dtype=dtype, bias=False, ignored=0.0)
    per_row = backend_for("numpy" if xp is np else "cupy").topk_bytes_per_row(vs, dtype, True)
    budget = (T // 2) * (per_row[0] + per_row[2])  # 2 chunks of 20 rows, G per chunk
    spared = spared_sum_bytes(vs, hs, dtype, RunOptions())
    assert plan_chunks(T, None, *per_row, budget) == (T // 2, False)
    assert plan_chunks(T, None, *per_row, budget, spared_sum=spared) == (T, True)
    _, ctx = jsdgpu.forward_topk(**to_xp(case, xp), memory_budget=budget)
    assert ctx._grads.held is not None
    check_against_reference(xp, case, dict(beta=0.4), "bucket", dtype, memory_budget=budget)


@pytest.mark.parametrize("T,chunk", [(17, 5), (HEAD_ROWS + 44, None)])  # the head a chunk, or part of one
def test_head_as_the_rows_are_or_selected(xp, rng, T, chunk):
    """The first chunk's products come from the first rows as they are, where the last calls'
    leading rows were valid, else from the first selected rows (ahead.queue_head, as the online
    loss's: test_chunks): a run of calls that takes every path (conftest.head_path_ignored) gives
    the reference's answer at each call."""
    for ignored in head_path_ignored(T):
        case = make_topk_case(rng, T=T, ignored=0.0)
        case["target"][ignored] = -100
        check_against_reference(xp, case, dict(beta=0.4), "bucket", np.float32, chunk_size=chunk)


@pytest.mark.gpu
def test_a_call_like_the_last_queues_its_first_product_ahead(rng, queued_ahead):
    """As the online loss's (test_chunks): a call like the thread's last queues its student
    logits' first product before its checks, and gives the bits of the same call after one that
    is not like it."""
    import cupy
    queued = queued_ahead
    T = HEAD_ROWS + 44

    def call(case, **options):
        loss, ctx = jsdgpu.forward_topk(**to_xp(case, cupy), beta=0.4, **options)
        return [to_numpy(a) for a in (loss, *jsdgpu.backward(ctx))]

    this, other = (make_topk_case(rng, T=T, ignored=0.0) for _ in range(2))
    call(other, memory_budget=123 * 2**20)  # not like it: other options
    queued.clear()
    unlike = call(this)
    assert not queued
    call(other)  # like it
    queued.clear()
    like = call(this)
    assert queued, "the call like the last queued nothing ahead"
    for got, want in zip(like, unlike):
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [None, 128])
@pytest.mark.parametrize("own", [False, True])
def test_first_row_work_queued_before_the_wait_where_the_rows_are_guessed_valid(rng, monkeypatch, chunk_size, own):
    """A default call guessed to have every row valid (the thread's last calls had) queues its
    first chunk's row kernel before the host reads the selection (topk.py, before_wait), and
    gives the bits of the same call not guessed so; with the own product (bf16), that product
    is the call's first GPU work, before the checks are launched. Where the guess fails (ignored
    rows), or an id is bad (the call raises, its inputs untouched), that work is dropped."""
    import cupy

    import jsdgpu.topk
    from jsdgpu.cuda import topk_kernels, topk_work
    monkeypatch.setattr(topk_work, "OWN_TOPK_PRODUCT", own)
    guess, guesses, order = jsdgpu.topk.expects_all_valid, [], []
    monkeypatch.setattr(jsdgpu.topk, "expects_all_valid", lambda n: guesses.append(guess(n)) or guesses[-1])
    product, check = topk_kernels.topk_logits, topk_work.PendingTopKCheck
    monkeypatch.setattr(topk_kernels, "topk_logits", lambda *a: order.append("product") or product(*a))
    monkeypatch.setattr(topk_work, "PendingTopKCheck", lambda *a: order.append("check") or check(*a))
    T, dtype = 300, DTYPES["bfloat16"] if own else np.float32

    def call(case):
        loss, ctx = jsdgpu.forward_topk(**to_xp(case, cupy), beta=0.3, chunk_size=chunk_size)
        return [to_numpy(a) for a in (loss, *jsdgpu.backward(ctx))]

    def same(got, want):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)

    valid = make_topk_case(rng, T=T, ignored=0.0, unused=0.0, dtype=dtype)
    half = make_topk_case(rng, T=T, ignored=0.5, dtype=dtype)
    call(half)
    guesses.clear()
    order.clear()
    plain = call(valid)
    assert not any(guesses)
    assert order[:2] == (["check", "product"] if own else ["check"])
    for _ in range(HEAD_HISTORY - 1):  # the thread's last HEAD_HISTORY calls all valid (ahead.planned_head)
        call(valid)
    guesses.clear()
    order.clear()
    same(call(valid), plain)
    assert guesses == [True]
    assert order[:2] == (["product", "check"] if own else ["check"])
    plain_half = call(half)
    for _ in range(HEAD_HISTORY):
        call(valid)
    guesses.clear()
    same(call(half), plain_half)
    assert guesses == [True]
    bad = {name: a.copy() if a is not None else None for name, a in valid.items()}
    bad["teacher_indices"][5, 3] = 523  # in the first chunk, whose row kernel is queued before the checks are read
    arrays = to_xp(bad, cupy)
    # so that the bad call's rows are guessed valid: its first chunk queued before its checks
    for _ in range(HEAD_HISTORY):
        call(valid)
    with pytest.raises(ValueError, match="outside"):
        jsdgpu.forward_topk(**arrays, beta=0.3, chunk_size=chunk_size)
    np.testing.assert_array_equal(to_numpy(arrays["teacher_indices"]), bad["teacher_indices"])
    same(call(valid), plain)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("missing_mass", MODES)
@pytest.mark.parametrize("temperature,weight_hard", [(1.0, 0.3), (2.0, 0.0)])
def test_rows_read_once_or_twice(rng, dtype, missing_mass, temperature, weight_hard):
    """Where the rest's gradient is one exponential of the logits (no temperature, or no hard
    part), the GPU kernel reads a row once and stores G as a row scale times values taken against
    its first batch's max (topk_rows.cu); a row whose max lies far above that batch's takes the
    second pass (its scale 1: at temperature 1 the max is over 64 bits above, at 2 the rest's
    factor is too small for G~), as does every row where the rest's gradient is 0 (renormalized,
    no hard part). Both kinds of row in one call, against the reference; with a bias, in chunks
    of 5 rows (a chunk's slice of the scales not 16-byte aligned)."""
    import cupy
    T = 11
    case = make_topk_case(rng, T=T, vs=5003, hs=256, k=9, dtype=DTYPES[dtype], ignored=0.0)
    # these rows' logit of one id past the first batch (4096 columns), 80 above the rest; an id in
    # no slot of theirs, so that their rest holds nearly all the mass and its gradient factor is
    # near 0, which G~ cannot hold at temperature 2 (as a slot, the row would be read once)
    far = [0, 4]
    far_id = next(j for j in range(4500, 5003) if j not in case["teacher_indices"][far])
    w = case["student_weight"].astype(np.float64)
    case["student_input"][far] = (80.0 * w[far_id] / (w[far_id] @ w[far_id])).astype(case["student_input"].dtype)
    opts = dict(beta=0.4, temperature=temperature, weight_hard_loss=weight_hard, weight_soft_loss=0.7)
    check_against_reference(cupy, case, opts, missing_mass, DTYPES[dtype], chunk_size=5)
    _, ctx = jsdgpu.forward_topk(**to_xp(case, cupy), missing_mass=missing_mass, chunk_size=5, **opts)
    scale = to_numpy(ctx._grads.g_scale)
    twice = np.isin(np.arange(T), far) | (missing_mass == "renormalize" and weight_hard == 0.0)
    np.testing.assert_array_equal(scale[twice], 1.0)
    assert np.all(scale[~twice] != 1.0)


@pytest.fixture
def launched(monkeypatch):
    """A list that grows by one at each launch of the own logits product (topk_kernels.topk_logits),
    for the test's duration."""
    from jsdgpu.cuda import topk_kernels
    launches, launch = [], topk_kernels.topk_logits
    monkeypatch.setattr(topk_kernels, "topk_logits", lambda *a: launches.append(1) or launch(*a))
    return launches


@pytest.mark.gpu
@pytest.mark.parametrize("missing_mass", MODES)
def test_own_product_with_slots_dense_in_its_tiles(rng, monkeypatch, launched, missing_mass):
    """The own product's epilogue packs each row's slots' logits by column tile, by the thread
    of the tile's row that holds the column, then by column (topk_logits.cu; topk_finish finds
    them again: topk_rows.cu, FromProduct::place): rows whose slots fill whole tiles, take every
    other column or every eighth (one thread's), in any order and with unused slots among them,
    against the reference; k past OWN_TOPK_MAX_SLOTS takes cuBLAS's product instead."""
    import cupy

    from jsdgpu.cuda import topk_work
    T, vs, k = 20, 3001, 600
    case = make_topk_case(rng, T=T, vs=vs, hs=128, k=k, dtype=DTYPES["bfloat16"], ignored=0.0)
    rest = np.setdiff1d(np.arange(vs), np.arange(256, 768))
    dense = {0: np.r_[256:768, rng.choice(rest, k - 512, replace=False)],  # tiles 1 and 2 whole
             1: np.arange(0, 2 * k, 2), 2: np.arange(3, 8 * k, 8)[:k] % vs, 3: np.arange(vs - k, vs)}
    for row, ids in dense.items():
        case["teacher_indices"][row] = rng.permutation(ids)
    assert all(len(set(ids)) == k for ids in dense.values())
    opts = dict(beta=0.5, weight_hard_loss=0.3, weight_soft_loss=0.7)
    monkeypatch.setattr(topk_work, "OWN_TOPK_PRODUCT", True)
    check_against_reference(cupy, case, opts, missing_mass, DTYPES["bfloat16"])
    assert launched
    launched.clear()
    monkeypatch.setattr(topk_work, "OWN_TOPK_MAX_SLOTS", k - 1)
    check_against_reference(cupy, case, opts, missing_mass, DTYPES["bfloat16"])
    assert not launched


@pytest.mark.gpu
@pytest.mark.parametrize("missing_mass", MODES)
def test_own_product_at_its_most_slots(rng, monkeypatch, launched, missing_mass):
    """k = OWN_TOPK_MAX_SLOTS (topk_finish holds each row's slots in shared memory, past the 48 KiB
    every kernel may take) still takes the own product, against the reference; in a vocabulary
    of more column tiles than topk_finish loads ahead of its first wait (8 a thread: tiles past
    V = 131072 are read after it)."""
    import cupy

    from jsdgpu.cuda import topk_work
    k = topk_work.OWN_TOPK_MAX_SLOTS
    case = make_topk_case(rng, T=5, vs=131072 + 1003, hs=128, k=k, dtype=DTYPES["bfloat16"], ignored=0.0)
    monkeypatch.setattr(topk_work, "OWN_TOPK_PRODUCT", True)
    check_against_reference(cupy, case, dict(beta=0.5), missing_mass, DTYPES["bfloat16"])
    assert launched


@pytest.mark.gpu
@pytest.mark.parametrize("missing_mass", MODES)
@pytest.mark.parametrize("beta,weight_hard", [(0.0, 0.3), (0.5, 0.3), (1.0, 0.0)])
@pytest.mark.parametrize("chunk_size,capturable", [(None, False), (130, False), (None, True)])
def test_own_product_against_the_reference(rng, monkeypatch, launched, missing_mass, beta, weight_hard, chunk_size,
                                           capturable):
    """bf16 at temperature 1 takes the logits product of our own (topk_logits.cu, its epilogue the
    row kernel's streaming work; topk_finish after it): against the reference and the cuBLAS
    product with the row kernel, on rows not a multiple of its 64-row tiles, in chunks, a
    vocabulary not a multiple of its 256 columns, a bias, ignored rows, slots in every tile, and
    rows whose max lies far above their first tile's (their tile takes a reference of its own,
    and topk_finish rescales the row: its scale 1), or whose rest is far below it."""
    import cupy

    from jsdgpu.cuda import topk_work
    T, vs, k = 300, 5003, 40
    case = make_topk_case(rng, T=T, vs=vs, hs=256, k=k, dtype=DTYPES["bfloat16"], ignored=0.1)
    edges = [0, 1, 255, 256, vs - 1]  # a first tile's ids, the tiles' edges, the last (distinct in the row)
    case["teacher_indices"][3] = edges + list(rng.choice(np.setdiff1d(np.arange(vs), edges), k - 5, replace=False))
    # these rows' logit of one id past the first tile 100 above the rest (about 70 above the first
    # tile's max: its tile's max over 64 bits above ref)
    far = [0, 130]
    far_id = next(j for j in range(4500, vs) if j not in case["teacher_indices"][far])
    w = case["student_weight"].astype(np.float64)
    case["student_input"][far] = (100.0 * w[far_id] / (w[far_id] @ w[far_id])).astype(case["student_input"].dtype)
    case["target"][far] = far_id
    opts = dict(beta=beta, weight_hard_loss=weight_hard, weight_soft_loss=0.7)

    def call(own):
        monkeypatch.setattr(topk_work, "OWN_TOPK_PRODUCT", own)
        loss, ctx = jsdgpu.forward_topk(**to_xp(case, cupy), missing_mass=missing_mass, chunk_size=chunk_size,
                                        capturable=capturable, **opts)
        return loss, jsdgpu.backward(ctx)

    loss, grads = call(True)
    assert launched
    if not capturable:  # (OWN_TOPK_PRODUCT still True, as call(True) left it)
        check_against_reference(cupy, case, opts, missing_mass, DTYPES["bfloat16"], chunk_size=chunk_size)
    _, ctx = jsdgpu.forward_topk(**to_xp(case, cupy), missing_mass=missing_mass, chunk_size=chunk_size,
                                 capturable=capturable, **opts)
    valid = case["target"] != -100
    scale = to_numpy(ctx._grads.g_scale)  # the valid rows' (every row's where capturable)
    scale = scale[valid] if capturable else scale
    rescaled = (np.isin(np.arange(T), far) | (missing_mass == "renormalize" and weight_hard == 0.0))[valid]
    np.testing.assert_array_equal(scale[rescaled], 1.0)
    assert np.all(scale[~rescaled] != 1.0)
    launched.clear()
    loss_c, grads_c = call(False)
    assert not launched
    np.testing.assert_allclose(float(loss), float(loss_c), rtol=2e-6)
    # within twice bf16's rounding of G, both G; grad_bias within 4 times: its column sums of G
    # cancel (a row's G sums to about 0), so that G's rounding weighs more in it (2.6 times, seen)
    for got, want, times in zip(grads, grads_c, (2, 2, 4)):
        got, want = to_numpy(got).astype(np.float64), to_numpy(want).astype(np.float64)
        assert np.linalg.norm(got - want) <= times * 2.0**-8 * np.linalg.norm(want)


@pytest.mark.gpu
def test_own_product_by_default_from_its_rows(rng, monkeypatch, launched):
    """By default (OWN_TOPK_PRODUCT None) the own product runs for calls of OWN_TOPK_MIN_ROWS rows
    or more (bf16, temperature 1, with gradients), cuBLAS's product below; both as the reference."""
    import cupy

    from jsdgpu.cuda import topk_work
    monkeypatch.setattr(topk_work, "OWN_TOPK_PRODUCT", None)
    monkeypatch.setattr(topk_work, "OWN_TOPK_MIN_ROWS", 200)
    for T, own in ((199, False), (200, True)):
        launched.clear()
        case = make_topk_case(rng, T=T, hs=64, dtype=DTYPES["bfloat16"])
        check_against_reference(cupy, case, dict(beta=0.4), "bucket", DTYPES["bfloat16"])
        assert bool(launched) == own


@pytest.mark.gpu
def test_the_row_kernel_with_its_ring_alone_launches_first(rng):
    """topk_rows in the renormalize mode takes 48 KiB of dynamic shared memory (its ring, no bitmap)
    beside its static memory: as a process's first launch of it, its limit must be raised too
    (it was only above 48 KiB, which a bucket-mode launch happened to do first)."""
    import cupy

    from jsdgpu.cuda import kernels
    kernels._module.cache_clear()  # the kernels loaded anew: their limits as the driver's defaults
    kernels._function.cache_clear()
    check_against_reference(cupy, make_topk_case(rng, dtype=DTYPES["bfloat16"]), dict(temperature=2.0),
                            "renormalize", DTYPES["bfloat16"])


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,own", [(1.0, False), (1.0, True), (2.0, False)])  # G stored scaled
# (one pass; by the row kernel or the own product's epilogue); as it is (two)
def test_benchmark_shape_gradients_near_bf16_rounding(rng, monkeypatch, temperature, own):
    """T = 1024, V = 128256, Hs = 2048, bf16, logits of std 8, k = 64: the gradients' error
    against float64 on the same inputs is at most twice the error of merely rounding the float64
    gradients to bf16, with G stored scaled (grad_weight then takes the rows scaled in bf16: one
    more rounding), by cuBLAS's product and the row kernel or by the logits product of our own,
    and as it is."""
    import cupy

    from jsdgpu.cuda import topk_work
    monkeypatch.setattr(topk_work, "OWN_TOPK_PRODUCT", own)
    T, hs, vs, k = 1024, 2048, 128256, 64
    xs = cupy.asarray(rng.standard_normal((T, hs)), dtype=DTYPES["bfloat16"])
    ws = cupy.asarray(rng.standard_normal((vs, hs)) * 8.0 / np.sqrt(hs), dtype=DTYPES["bfloat16"])
    ids = (np.arange(k)[None, :] * (vs // k) + np.arange(T)[:, None] * 7919) % vs  # distinct in a row
    z = rng.standard_normal((T, k)) * 3
    lq = np.log(0.9 * np.exp(z) / np.exp(z).sum(1, keepdims=True)).astype(np.float32)
    target = rng.integers(0, vs, T)
    target[rng.random(T) < 0.1] = -100
    case = dict(student_input=xs, student_weight=ws, teacher_indices=cupy.asarray(ids, dtype=np.int32),
                teacher_logprobs=cupy.asarray(lq), target=cupy.asarray(target))
    _, ctx = jsdgpu.forward_topk(**case, beta=0.5, temperature=temperature)
    assert (ctx._grads.g_scale is not None) == (temperature == 1.0)
    grads = jsdgpu.backward(ctx)
    ref = reference_topk(**case, beta=0.5, temperature=temperature)
    for name, got, want in (("grad_input", grads[0], ref[3]), ("grad_weight", grads[1], ref[4])):
        err = float(cupy.linalg.norm(got.astype(np.float64) - want) / cupy.linalg.norm(want))
        floor = float(cupy.linalg.norm(want.astype(DTYPES["bfloat16"]).astype(np.float64) - want)
                      / cupy.linalg.norm(want))
        print(f"temperature {temperature}, own product {own}, {name}: error {err:.3e}, bf16 rounding {floor:.3e}, "
              f"ratio {err / floor:.2f}")
        assert err <= 2.0 * floor, (name, err, floor)


SCALES, TEMPERATURES = (1.0, 8.0, 40.0), (0.05, 1.0, 50.0)


@pytest.mark.parametrize("missing_mass", MODES)
@pytest.mark.parametrize("scale,temperature,beta", list(itertools.product(SCALES, TEMPERATURES, BETAS)))
def test_extreme_scales_and_temperatures(xp, rng, scale, temperature, beta, missing_mass):
    """Logits of std 1 to 40 at temperatures 0.05 to 50: finite wherever float64 is, within the
    float32 floor of float64."""
    case = make_topk_case(rng, T=7, vs=515, k=33, logit_std=scale)
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.3, weight_soft_loss=0.7)
    check_against_reference(xp, case, opts, missing_mass, np.float32)


@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_forward_kl_with_a_rest_below_float32s_normals(xp, rng, temperature):
    """Forward KL with the bucket, the student's mass outside the k ids 2^-100 to 2^-126 (its
    argmax among them, the rest about 90 nats lower), so that each rest column's probability is
    subnormal in float32 while the teacher's rest, 0.3, spreads over them by their shares: the
    gradient of the rest's columns is formed from p / P_rest itself (a JSDGPU_SEED=986597038 draw
    of test_extreme_scales_and_temperatures had such a row, where the GPU flushed those columns'
    gradient away)."""
    T, vs, k = 3, 301, 5
    logits = np.empty((T, vs))
    logits[:, :k] = [0.0, -10.0, -20.0, -30.0, -40.0]  # the ids' (z, at the temperature)
    logits[:, k:] = -rng.uniform(88.0, 96.0, (T, vs - k))  # P_rest = 296 e^-92 or so: about 2^-124
    ids = np.stack([rng.permutation(vs)[:k] for _ in range(T)]).astype(np.int32)
    z = np.empty_like(logits)
    for row in range(T):  # the ids' columns take the top values; the rest's are placed in the others
        z[row, ids[row]] = logits[row, :k]
        z[row, np.setdiff1d(np.arange(vs), ids[row])] = logits[row, k:]
    case = dict(student_input=np.eye(T, dtype=np.float32), student_weight=(z.T * temperature).astype(np.float32),
                teacher_indices=ids, teacher_logprobs=np.log(np.tile([0.3, 0.2, 0.1, 0.06, 0.04], (T, 1))).astype(
                    np.float32), target=np.array([ids[0, 0], -100, ids[2, 3]]), student_bias=None)
    check_against_reference(xp, case, dict(beta=0.0, temperature=temperature, weight_hard_loss=0.3,
                                           weight_soft_loss=0.7), "bucket", np.float32)


@pytest.mark.parametrize("shape", [dict(T=1, k=1), dict(T=1, k=64, vs=61), dict(T=9, k=1), dict(T=6, k=61, vs=61)])
def test_edge_shapes(xp, rng, shape):
    """T = 1, k = 1, and k = Vs (the bucket's rest empty)."""
    case = make_topk_case(rng, ignored=0.0, unused=0.0, **{"vs": 37, **shape}) if shape["k"] <= shape.get("vs", 37) \
        else None
    if case is None:
        pytest.skip("k > Vs")
    for missing_mass in MODES:
        check_against_reference(xp, case, dict(beta=0.5, temperature=1.3), missing_mass, np.float32)


def test_every_row_ignored(xp, rng):
    case = make_topk_case(rng, T=4)
    case["target"][:] = -100
    loss, ctx = jsdgpu.forward_topk(**to_xp(case, xp))
    gi, gw, gb = jsdgpu.backward(ctx)
    assert float(loss) == 0.0 and not to_numpy(gi).any() and not to_numpy(gw).any() and not to_numpy(gb).any()


def test_k_of_a_thousand_and_more(xp, rng):
    case = make_topk_case(rng, T=5, vs=3001, k=1500, unused=0.3)
    for missing_mass in MODES:
        check_against_reference(xp, case, dict(beta=0.5, temperature=2.0), missing_mass, np.float32)


def test_unused_slots_are_ignored(xp, rng):
    """A row's unused slots (-inf) count for nothing, whatever their ids: the loss is the one of
    the row with those slots left out (here: put at the end, with valid ids)."""
    case = make_topk_case(rng, T=6, k=9, unused=0.0, ignored=0.0)
    lq = case["teacher_logprobs"]
    lq[:, 6:] = -np.inf
    with_junk = dict(case, teacher_indices=case["teacher_indices"].copy())
    with_junk["teacher_indices"][:, 6:] = [-3, 10**6, 0]
    loss_a, _ = jsdgpu.forward_topk(**to_xp(case, xp), compute_grad=False)
    loss_b, _ = jsdgpu.forward_topk(**to_xp(with_junk, xp), compute_grad=False)
    cut = dict(case, teacher_indices=case["teacher_indices"][:, :6].copy(), teacher_logprobs=lq[:, :6].copy())
    loss_c, _ = jsdgpu.forward_topk(**to_xp(cut, xp), compute_grad=False)
    assert float(loss_a) == float(loss_b)
    assert abs(float(loss_a) - float(loss_c)) <= 1e-6 * abs(float(loss_c))


def test_ignored_rows_and_num_valid_tokens(xp, rng):
    case = make_topk_case(rng, T=12, ignored=0.5)
    n_valid = int((case["target"] != -100).sum())
    loss, ctx = jsdgpu.forward_topk(**to_xp(case, xp), num_valid_tokens=2 * max(1, n_valid))
    ref = reference_topk(**case)
    assert abs(2 * float(loss) - ref[0] * max(1, n_valid) / max(1, n_valid)) <= 1e-5 * abs(ref[0])
    gi = to_numpy(jsdgpu.backward(ctx)[0])
    assert np.all(gi[case["target"] == -100] == 0)


def test_the_loss_object_grad_output_and_options(xp, rng):
    """TopKDistillLoss with another ignore_index, grad_weight_float32 and a grad_output."""
    case = make_topk_case(rng, dtype=DTYPES["bfloat16"], ignore_index=7)
    loss_fn = jsdgpu.TopKDistillLoss(beta=0.3, missing_mass="renormalize", chunk_size=4, ignore_index=7,
                                     grad_weight_float32=True)
    loss, ctx = loss_fn(**to_xp(case, xp))
    gi, gw, gb = loss_fn.backward(ctx, 2.5)
    ref = reference_topk(**case, missing_mass="renormalize", beta=0.3, ignore_index=7)
    assert abs(float(loss) - ref[0]) <= 1e-5 * abs(ref[0])
    assert gw.dtype == np.float32 and gb.dtype == np.float32 and gi.dtype == DTYPES["bfloat16"]
    assert rel_err(gw, 2.5 * ref[4]) <= 2.0**-7
    assert "renormalize" in repr(loss_fn)


def test_nan_logprobs_propagate(xp, rng):
    case = make_topk_case(rng, ignored=0.0, unused=0.0)  # a NaN makes its slot used: its id must be valid
    case["teacher_logprobs"][2, 0] = np.nan
    loss, _ = jsdgpu.forward_topk(**to_xp(case, xp), compute_grad=False)
    assert np.isnan(float(loss))


BAD = {
    "id out of range": (lambda c: c["teacher_indices"].__setitem__((3, 2), 523), ValueError, "outside"),
    "negative id": (lambda c: c["teacher_indices"].__setitem__((0, 0), -1), ValueError, "outside"),
    "repeated id": (lambda c: c["teacher_indices"].__setitem__((4, 1), c["teacher_indices"][4, 0]), ValueError,
                    "twice"),
    "sum above 1": (lambda c: c["teacher_logprobs"].__setitem__((5, slice(None)), np.log(0.25)), ValueError,
                    "sum above 1"),
    "shapes differ": (lambda c: c.__setitem__("teacher_logprobs", c["teacher_logprobs"][:, :-1].copy()), ValueError,
                      "shape"),
    "float ids": (lambda c: c.__setitem__("teacher_indices", c["teacher_indices"].astype(np.float32)), TypeError,
                  "integer"),
    "rows differ": (lambda c: c.__setitem__("teacher_indices", c["teacher_indices"][:-1].copy()), ValueError, "rows"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_inputs_raise_before_any_work(xp, rng, bad):
    case = make_topk_case(rng, T=8, k=5, unused=0.0, ignored=0.0)
    spoil, error, words = BAD[bad]
    spoil(case)
    arrays = to_xp(case, xp)
    before = {k: to_numpy(v).copy() for k, v in arrays.items() if v is not None}
    with pytest.raises(error, match=words):
        jsdgpu.forward_topk(**arrays)
    for k, v in before.items():
        np.testing.assert_array_equal(to_numpy(arrays[k]), v)


def test_sum_above_one_is_allowed_renormalized_and_within_slack(xp, rng):
    """A row whose stored probabilities sum to 1 up to their float32 rounding (renormalized), or
    to 1 + 5e-4 (within the slack of 1e-3; the bucket's rest then empty), is taken and gives the
    reference's loss and gradients."""
    case = make_topk_case(rng, T=8, k=5, unused=0.0, ignored=0.0)
    case["teacher_logprobs"][5] = np.log(0.2)
    check_against_reference(xp, case, {}, "renormalize", np.float32)
    case["teacher_logprobs"][5] = np.log(1.0005 / 5)
    check_against_reference(xp, case, {}, "bucket", np.float32)


def test_unknown_missing_mass(rng):
    with pytest.raises(ValueError, match="missing_mass"):
        jsdgpu.forward_topk(**make_topk_case(rng), missing_mass="drop")
    with pytest.raises(ValueError, match="missing_mass"):
        jsdgpu.TopKDistillLoss(missing_mass="rest")
    with pytest.raises(ValueError, match="missing_mass"):
        jsdgpu.TopKOptions(beta=0.3, missing_mass="Bucket")
    with pytest.raises(TypeError, match="missing_mass"):  # an option of the top-k loss alone
        jsdgpu.forward(**make_case(rng), missing_mass="bucket")


@pytest.mark.parametrize("front_end", ["torch function", "torch module", "jax"])
def test_unknown_missing_mass_in_the_front_ends(rng, front_end):
    """Each front end raises the options' ValueError before any work."""
    case = make_topk_case(rng)
    if front_end == "jax":
        jnp = pytest.importorskip("jax.numpy")
        from jsdgpu.jax import fused_linear_topk_jsd_loss
        arrays = {k: None if v is None else jnp.asarray(v) for k, v in case.items()}
        call = lambda: fused_linear_topk_jsd_loss(**arrays, missing_mass="drop")  # noqa: E731
    else:
        torch = pytest.importorskip("torch")
        from jsdgpu.torch import FusedLinearTopKJSDLoss, fused_linear_topk_jsd_loss
        t = {k: None if v is None else torch.from_numpy(v) for k, v in case.items()}
        args = (t["student_input"], t["student_weight"], t["teacher_indices"], t["teacher_logprobs"], t["target"])
        if front_end == "torch module":
            call = lambda: FusedLinearTopKJSDLoss(missing_mass="drop")  # noqa: E731
        else:
            call = lambda: fused_linear_topk_jsd_loss(*args, missing_mass="drop")  # noqa: E731
    with pytest.raises(ValueError, match="missing_mass"):
        call()


# ---- without host synchronization (capturable) ----

@pytest.mark.parametrize("missing_mass", MODES)
@pytest.mark.parametrize("memory_budget", [None, 1])  # G held for all rows; G per chunk
def test_capturable_masks_rows_as_the_reference(xp, rng, missing_mass, memory_budget):
    case = make_topk_case(rng, T=17, ignored=0.4)
    opts = dict(beta=0.3, temperature=1.5)
    loss, ctx = jsdgpu.forward_topk(**to_xp(case, xp), missing_mass=missing_mass, capturable=True, chunk_size=5,
                                    memory_budget=memory_budget, **opts)
    gi, gw, gb = jsdgpu.backward(ctx, 2.0)
    ref = reference_topk(**case, missing_mass=missing_mass, **opts)
    assert int(ctx.bad_topk_row) == 17 and int(ctx.bad_target_row) == 17
    for got, want in ((loss, ref[0]), (ctx.hard_loss, ref[1]), (ctx.soft_loss, ref[2])):
        assert abs(float(got) - want) <= 1e-5 * max(1.0, abs(want)), (float(got), want)
    for got, want in zip((gi, gw, gb), ref[3:]):
        assert rel_err(got, 2.0 * want) <= 1e-4
    assert not to_numpy(gi)[case["target"] == -100].any()  # exactly zero: their G rows were zeroed


@pytest.mark.parametrize("bad", ["id out of range", "repeated id", "sum above 1"])
def test_capturable_bad_topk_gives_nan_and_the_row(xp, rng, bad):
    """No ValueError (a capture cannot raise): the loss and every gradient NaN, and
    ctx.bad_topk_row the first bad row."""
    case = make_topk_case(rng, T=8, k=5, unused=0.0, ignored=0.0)
    BAD[bad][0](case)
    row = {"id out of range": 3, "repeated id": 4, "sum above 1": 5}[bad]
    loss, ctx = jsdgpu.forward_topk(**to_xp(case, xp), capturable=True)
    assert int(ctx.bad_topk_row) == row and int(ctx.bad_target_row) == 8
    assert np.isnan(float(loss))
    assert all(np.isnan(to_numpy(g)).all() for g in jsdgpu.backward(ctx))


def test_default_call_has_no_bad_topk_row(xp, rng):
    assert jsdgpu.forward_topk(**to_xp(make_topk_case(rng), xp))[1].bad_topk_row is None


@pytest.mark.gpu
def test_cuda_graph_replays_on_new_inputs(rng):
    """forward_topk + backward captured once (capturable by itself: the stream is capturing),
    replayed after new inputs, top-k and targets are copied into the captured buffers: the same
    bits as a capturable eager call, and the reference's answer; then a bad row copied in: NaN
    and the row, with no exception."""
    import cupy
    shape = dict(T=40, hs=32, vs=1031, k=24, dtype=DTYPES["bfloat16"])
    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with stream, cupy.cuda.using_allocator(pool.malloc):
        static = to_xp(make_topk_case(rng, **shape), cupy)
        run = dict(beta=0.5, temperature=2.0, chunk_size=16)
        for _ in range(2):  # warm-up: the kernels compiled, the products' algorithms chosen
            jsdgpu.backward(jsdgpu.forward_topk(**static, capturable=True, **run)[1])
        stream.synchronize()
        stream.begin_capture()
        try:
            loss, ctx = jsdgpu.forward_topk(**static, **run)
            outputs = (loss, ctx.bad_topk_row, *jsdgpu.backward(ctx))
        finally:
            graph = stream.end_capture()
        case = make_topk_case(rng, **shape)
        for k, v in case.items():
            static[k][...] = cupy.asarray(v)
        graph.launch(stream)
        captured = [to_numpy(a).copy() for a in outputs]
        eager_loss, ctx = jsdgpu.forward_topk(**static, capturable=True, **run)
        eager = [to_numpy(a) for a in (eager_loss, ctx.bad_topk_row, *jsdgpu.backward(ctx))]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(captured, eager))
        ref = reference_topk(**case, beta=0.5, temperature=2.0)
        assert abs(float(captured[0]) - ref[0]) <= 1e-5 * ref[0] and int(captured[1]) == shape["T"]
        for got, want in zip(captured[2:], ref[3:]):
            assert rel_err(got, want) <= 2.0**-7
        ids = to_numpy(static["teacher_indices"]).copy()
        first, second = np.flatnonzero(np.isfinite(case["teacher_logprobs"][13]))[:2]  # used slots: an
        ids[13, second] = ids[13, first]  # unused one's id is not checked, so a repeat of it is no error
        static["teacher_indices"][...] = cupy.asarray(ids)
        graph.launch(stream)
        assert np.isnan(float(outputs[0])) and int(outputs[1]) == 13


# ---- the teacher's top-k ----

@pytest.mark.parametrize("k", [1, 7, 64, 523])
def test_teacher_topk_against_float64(xp, rng, k):
    T, ht, v = 9, 24, 523
    xt = rng.standard_normal((T, ht)).astype(np.float32)
    wt = (rng.standard_normal((v, ht)) * 3 / np.sqrt(ht)).astype(np.float32)
    bt = (rng.standard_normal(v) * 0.5).astype(np.float32)
    ids, logprobs = jsdgpu.teacher_topk(xp.asarray(xt), xp.asarray(wt), k, temperature=1.5,
                                        teacher_bias=xp.asarray(bt), chunk_size=4)
    ids, logprobs = to_numpy(ids), to_numpy(logprobs)
    assert ids.shape == logprobs.shape == (T, k) and ids.dtype == np.int32 and logprobs.dtype == np.float32
    t = (xt.astype(np.float64) @ wt.T.astype(np.float64) + bt) / 1.5
    logq = t - np.log(np.exp(t - t.max(1, keepdims=True)).sum(1, keepdims=True)) - t.max(1, keepdims=True)
    # a top-k of the float32 logits: distinct ids, their log-softmax, by descending value, no id
    # left out above the k-th (within float32 rounding, which may order near-ties otherwise)
    assert all(len(set(r)) == k for r in ids.tolist())
    np.testing.assert_allclose(logprobs, np.take_along_axis(logq, ids.astype(np.int64), axis=1), rtol=1e-5, atol=1e-5)
    assert (np.diff(logprobs, axis=1) <= 1e-6).all()
    if k < v:
        next_best = -np.sort(-logq, axis=1)[:, k]
        assert (logprobs[:, -1] >= next_best - 1e-5).all()
    exact = np.argsort(-t, axis=1, kind="stable")[:, :k]
    assert (ids == exact).mean() > 0.95  # the order itself, but for near-ties


def test_teacher_topk_bad_k(rng):
    xt, wt = np.zeros((2, 4), np.float32), np.zeros((10, 4), np.float32)
    for k in (0, 11, 2.0, True):
        with pytest.raises(ValueError, match="k must be"):
            jsdgpu.teacher_topk(xt, wt, k)


def test_teacher_topk_round_trip_trains(xp, rng):
    """The README's offline path: the teacher's top-k stored, then the student trained against
    it by plain gradient descent: the loss decreases."""
    T, hs, ht, v = 64, 16, 24, 301
    xt = rng.standard_normal((T, ht)).astype(np.float32)
    wt = (rng.standard_normal((v, ht)) * 2 / np.sqrt(ht)).astype(np.float32)
    ids, logprobs = jsdgpu.teacher_topk(xp.asarray(xt), xp.asarray(wt), 16)
    xs = xp.asarray(rng.standard_normal((T, hs)).astype(np.float32))
    ws = xp.asarray((rng.standard_normal((v, hs)) * 0.1).astype(np.float32))
    target = xp.asarray(rng.integers(0, v, T))
    losses = []
    for _ in range(30):
        loss, ctx = jsdgpu.forward_topk(xs, ws, ids, logprobs, target, beta=0.0, weight_hard_loss=0.0,
                                        weight_soft_loss=1.0)
        ws = ws - 20.0 * jsdgpu.backward(ctx)[1]
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0], losses


# ---- the front ends, as a user's training step uses them ----

def _torch_case(case, device):
    from jsdgpu.torch import from_native  # NumPy to torch, bfloat16 included
    return {name: None if a is None else from_native(a).to(device) for name, a in case.items()}


@pytest.mark.parametrize("missing_mass", MODES)
def test_torch_module_against_reference(rng, torch_device, missing_mass):
    pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    case = make_topk_case(rng)
    t = _torch_case(case, torch_device)
    for name in ("student_input", "student_weight", "student_bias"):
        t[name].requires_grad_(True)
    opts = dict(beta=0.3, temperature=1.5, weight_hard_loss=0.4, weight_soft_loss=0.6)
    loss_fn = jtorch.FusedLinearTopKJSDLoss(**opts, missing_mass=missing_mass, chunk_size=4,
                                            return_soft_hard_loss=True)
    loss, soft, hard = loss_fn(t["student_input"], t["student_weight"], t["teacher_indices"], t["teacher_logprobs"],
                               t["target"], t["student_bias"])
    (2.0 * loss).backward()
    ref = reference_topk(**case, missing_mass=missing_mass, **opts)
    for got, want in ((loss, ref[0]), (hard, ref[1]), (soft, ref[2])):
        assert abs(float(got.detach()) - want) <= 1e-5 * max(1.0, abs(want))
    for name, want in zip(("student_input", "student_weight", "student_bias"), ref[3:]):
        assert rel_err(t[name].grad.cpu().numpy(), 2.0 * want) <= 1e-4
    # the mean's N per call (a data-parallel batch's count)
    n = max(1, int((case["target"] != -100).sum()))
    loss_fn.return_soft_hard_loss = False
    loss = loss_fn(t["student_input"], t["student_weight"], t["teacher_indices"], t["teacher_logprobs"], t["target"],
                   t["student_bias"], num_valid_tokens=3.0 * n)
    assert abs(float(loss.detach()) - ref[0] / 3.0) <= 1e-5 * max(1.0, abs(ref[0]))


def test_torch_training_step_compiled_and_under_autocast(rng, torch_device):
    """A student (a linear body and an fp32 LM head) trained against a stored top-k with AdamW:
    eager, torch.compile(fullgraph=True) and autocast(bfloat16) steps; compiled equals eager,
    the loss falls, and the fp32 head's gradient stays fp32 under autocast."""
    torch = pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    T, h_in, h, v, k = 48, 12, 16, 257, 20
    teacher_x = torch.from_numpy(rng.standard_normal((T, 24)).astype(np.float32)).to(torch_device)
    teacher_w = torch.from_numpy((rng.standard_normal((v, 24)) * 0.6).astype(np.float32)).to(torch_device)
    ids, logprobs = jtorch.teacher_topk(teacher_x.reshape(4, 12, 24), teacher_w, k)
    x = torch.from_numpy(rng.standard_normal((4, 12, h_in)).astype(np.float32)).to(torch_device)
    labels = torch.from_numpy(rng.integers(0, v, (4, 12))).to(torch_device)
    loss_fn = jtorch.FusedLinearTopKJSDLoss(beta=0.5)

    def run(compiled, autocast):
        torch.manual_seed(0)
        body = torch.nn.Linear(h_in, h).to(torch_device)
        head = torch.nn.Linear(h, v, bias=False).to(torch_device)
        opt = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-2)
        step = lambda: loss_fn(body(x), head.weight, ids, logprobs, labels)  # noqa: E731
        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, fullgraph=True)
        losses = []
        for _ in range(4):
            with torch.autocast(torch_device, dtype=torch.bfloat16, enabled=autocast):
                loss = step()
            loss.backward()
            assert head.weight.grad.dtype == torch.float32
            losses.append(float(loss.detach()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses

    eager, compiled = run(False, False), run(True, False)
    assert np.allclose(eager, compiled, rtol=1e-5), (eager, compiled)
    assert eager[-1] < eager[0]
    mixed = run(False, True)
    assert abs(mixed[0] - eager[0]) <= 2.0**-6 * eager[0] and mixed[-1] < mixed[0]


@pytest.mark.gpu
def test_torch_training_step_in_a_cuda_graph(rng):
    """The top-k loss's forward + backward captured by torch.cuda.graph (capturable by itself),
    replayed on new hidden states and labels: the loss and gradients of an eager step on them."""
    torch = pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    T, h_in, h, v, k = 64, 12, 16, 1031, 24
    ids, logprobs = teacher_logprobs(rng, T, v, k, 2.0, unused=0.1)
    ids, logprobs = torch.from_numpy(ids).cuda(), torch.from_numpy(logprobs).cuda()
    torch.manual_seed(0)
    body, head = torch.nn.Linear(h_in, h).cuda(), torch.nn.Linear(h, v, bias=False).cuda()
    params = [*body.parameters(), head.weight]
    loss_fn = jtorch.FusedLinearTopKJSDLoss(beta=0.3, temperature=2.0)
    draw = lambda: (torch.from_numpy(rng.standard_normal((T, h_in)).astype(np.float32)).cuda(),  # noqa: E731
                    torch.from_numpy(rng.integers(0, v, T)).cuda())
    step = lambda x, labels: loss_fn(body(x), head.weight, ids, logprobs, labels)  # noqa: E731
    static_x, static_labels = draw()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, products' algorithms chosen
        for _ in range(2):
            torch.autograd.grad(step(static_x, static_labels), params)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(static_x, static_labels)
        static_grads = torch.autograd.grad(static_loss, params)
    for _ in range(2):
        x, labels = draw()
        static_x.copy_(x)
        static_labels.copy_(labels)
        graph.replay()
        loss = step(x, labels)
        grads = torch.autograd.grad(loss, params)
        assert abs(float(static_loss) - float(loss)) <= 1e-5 * abs(float(loss))
        for a, b in zip(static_grads, grads):
            assert rel_err(a.cpu().numpy(), b.cpu().numpy()) <= 1e-4


def test_torch_opcheck(rng, torch_device):
    torch = pytest.importorskip("torch")
    pytest.importorskip("jsdgpu.torch")
    case = make_topk_case(rng, T=5)
    t = _torch_case(case, torch_device)
    for name in ("student_input", "student_weight", "student_bias"):
        t[name].requires_grad_(True)
    args = (t["student_input"], t["student_weight"], t["teacher_indices"], t["teacher_logprobs"], t["target"],
            t["student_bias"])
    weights = torch.from_numpy(rng.uniform(0.0, 2.0, 5).astype(np.float32)).to(t["target"].device)
    for compute_grad, token_weights, reduction in ((True, None, "mean"), (False, None, "mean"),
                                                    (True, weights, "sum"), (False, weights, "none")):
        torch.library.opcheck(torch.ops.jsdgpu.fused_linear_topk_jsd.default,
                              (*args, "bucket", 0.5, 0.5, 0.3, 2.0, -100, None, None, compute_grad, None,
                               token_weights, reduction, None, 1.0, 1.0, None, None))
    # with no student bias, "none" traced carries its gradients (jsdgpu.torch_rows)
    for token_weights, missing_mass, caps in ((None, "bucket", [0.0, 0.0]), (weights, "renormalize", [5.0, 0.0])):
        torch.library.opcheck(torch.ops.jsdgpu.fused_linear_topk_jsd_rows.default,
                              (*args[:5], missing_mass, [0.5, 0.5, 0.3, 2.0, 0.5, 1.0], -100, None, None, None,
                               token_weights, caps))


@pytest.mark.parametrize("missing_mass", MODES)
def test_jax_jit_equals_eager_and_the_reference(rng, jax_device, missing_mass):
    import jax
    import jax.numpy as jnp

    from jsdgpu.jax import fused_linear_topk_jsd_loss
    case = make_topk_case(rng)
    a = {k: None if v is None else jax.device_put(jnp.asarray(v), jax_device) for k, v in case.items()}
    opts = dict(beta=0.3, temperature=1.5, missing_mass=missing_mass, chunk_size=4)

    def f(xs, ws, bs):
        return 2.0 * fused_linear_topk_jsd_loss(xs, ws, a["teacher_indices"], a["teacher_logprobs"], a["target"],
                                                bs, **opts)
    eager = jax.value_and_grad(f, argnums=(0, 1, 2))(a["student_input"], a["student_weight"], a["student_bias"])
    jitted = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(a["student_input"], a["student_weight"],
                                                               a["student_bias"])
    ref = reference_topk(**case, beta=0.3, temperature=1.5, missing_mass=missing_mass)
    assert abs(float(jitted[0]) - 2.0 * ref[0]) <= 1e-5 * 2.0 * ref[0]
    for x, y, want in zip(jitted[1], eager[1], ref[3:]):
        assert rel_err(np.asarray(x), np.asarray(y)) <= 1e-6
        assert rel_err(np.asarray(x), 2.0 * want) <= 1e-4


def test_jax_jitted_optax_step_trains(rng, jax_device):
    """A jitted optax training step whose loss is the top-k loss, its top-k made by teacher_topk."""
    import jax
    import jax.numpy as jnp
    optax = pytest.importorskip("optax")

    from jsdgpu.jax import fused_linear_topk_jsd_loss, teacher_topk as jax_teacher_topk
    T, h_in, h, v = 40, 12, 16, 211
    put = lambda x: jax.device_put(jnp.asarray(x), jax_device)  # noqa: E731
    ids, logprobs = jax_teacher_topk(put(rng.standard_normal((T, 24)).astype(np.float32)),
                                     put((rng.standard_normal((v, 24)) * 0.6).astype(np.float32)), 16)
    x, labels = put(rng.standard_normal((T, h_in)).astype(np.float32)), put(rng.integers(0, v, T))
    params = dict(body=put(rng.standard_normal((h_in, h)).astype(np.float32) * 0.3),
                  head=put(rng.standard_normal((v, h)).astype(np.float32) * 0.1))
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, state):
        def loss_of(p):
            return fused_linear_topk_jsd_loss(jnp.tanh(x @ p["body"]), p["head"], ids, logprobs, labels, beta=0.5)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    state = opt.init(params)
    losses = []
    for _ in range(10):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0], losses
