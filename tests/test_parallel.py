"""Vocab parallelism (jsdgpu.parallel): the sharded loss equals the single-shard one.

P ranks are simulated by threads of this process (on the CPU, and on one GPU, where they run
the vocab-parallel phase kernels); on a machine with two GPUs, two processes talk over NCCL,
through CuPy's bindings and through a torch.distributed process group.
"""

import threading

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, DTYPES, assert_near_float64, make_case, rel_err, run_processes, to_numpy, to_xp
from jsdgpu import parallel
from test_topk import make_topk_case


class ThreadRanks:
    """P ranks as threads that take turns: a rank runs until it reaches a collective, where it
    waits for the others (one rank computes at a time, so Numba's parallel kernels are never
    entered by two threads at once). All-reduces combine the ranks' arrays in rank order."""

    def __init__(self, size):
        self.size = size
        self.turn = threading.Lock()
        # a rank that fails before a collective leaves the others waiting: they time out
        self.barrier = threading.Barrier(size, timeout=60)
        self.buffers = [None] * size

    def run(self, fn):
        """[fn(rank communicator) for each rank], each in its own thread; an exception is
        returned in place of the result."""
        results = [None] * self.size

        def target(r):
            with self.turn:
                try:
                    results[r] = fn(_Rank(self, r))
                except Exception as e:  # noqa: BLE001 - handed to the test
                    results[r] = e

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


class _Rank:
    def __init__(self, world, rank):
        self.world, self.rank, self.size = world, rank, world.size

    def _wait(self):
        self.world.turn.release()
        try:
            self.world.barrier.wait()
        finally:
            self.world.turn.acquire()

    def allreduce(self, a, op):
        world = self.world
        world.buffers[self.rank] = a.copy()
        self._wait()
        combine = {"sum": np.add, "max": np.maximum}[op]  # NumPy or CuPy, by the arrays
        total = world.buffers[0].copy()
        for b in world.buffers[1:]:
            total = combine(total, b)
        self._wait()  # every rank has read the buffers before any writes them again
        a[...] = total


def split(case, bounds):
    """Each rank's inputs: teacher rows [bounds[r], bounds[r + 1]), the student's rows of it."""
    vs = case["student_weight"].shape[0]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        s = slice(min(lo, vs), min(hi, vs))
        part = dict(case, teacher_weight=case["teacher_weight"][lo:hi],
                    student_weight=case["student_weight"][s])
        if case["student_bias"] is not None:
            part.update(student_bias=case["student_bias"][s], teacher_bias=case["teacher_bias"][lo:hi])
        out.append(part)
    return out


def split_student(case, bounds):
    """Each rank's inputs of the top-k loss: the student's rows [bounds[r], bounds[r + 1])."""
    return [dict(case, student_weight=case["student_weight"][lo:hi],
                 student_bias=None if case["student_bias"] is None else case["student_bias"][lo:hi])
            for lo, hi in zip(bounds[:-1], bounds[1:])]


def sharded(parts, xp, forward=jsdgpu.forward, **options):
    """forward and backward on every rank: [(loss, hard, soft, gi, gw, gb)] as NumPy."""
    def step(comm):
        loss, ctx = forward(**to_xp(parts[comm.rank], xp), vocab_parallel=comm, **options)
        out = (loss, ctx.hard_loss, ctx.soft_loss)
        if options.get("compute_grad", True):
            out += jsdgpu.backward(ctx)
        return tuple(to_numpy(a) for a in out)

    results = ThreadRanks(len(parts)).run(step)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def assert_matches_single(case, xp, bounds, tol, forward=jsdgpu.forward, **options):
    loss, ctx = forward(**to_xp(case, xp), **options)
    single = tuple(to_numpy(a) for a in (loss, ctx.hard_loss, ctx.soft_loss) + jsdgpu.backward(ctx))
    parts = split(case, bounds) if forward is jsdgpu.forward else split_student(case, bounds)
    ranks = sharded(parts, xp, forward, **options)
    for r in ranks:  # every rank holds the same loss, bit for bit
        assert all(np.array_equal(a, b) for a, b in zip(r[:3], ranks[0][:3]))
    for got, want in zip(ranks[0][:3], single[:3]):
        assert abs(float(got) - float(want)) <= tol * max(1.0, abs(float(want))), (got, want)
    assert rel_err(ranks[0][3], single[3].astype(np.float64)) <= tol  # grad_input, summed
    for k in (4, 5):  # grad_weight and grad_bias: the ranks' shards side by side
        if single[k] is None:
            assert all(r[k] is None for r in ranks)
            continue
        whole = np.concatenate([r[k].astype(np.float64) for r in ranks])
        assert whole.shape == single[k].shape and rel_err(whole, single[k].astype(np.float64)) <= tol


OPTIONS = [dict(beta=0.5), dict(beta=0.0, temperature=2.0), dict(beta=1.0, temperature=0.5),
           dict(beta=0.3, weight_hard_loss=1.0, weight_soft_loss=0.0),
           dict(beta=0.7, weight_hard_loss=0.0, weight_soft_loss=1.0, temperature=2.0)]


@pytest.mark.parametrize("index", range(len(OPTIONS)))
@pytest.mark.parametrize("n_ranks", [2, 3])
def test_sharded_equals_single_float32(xp, rng, index, n_ranks):
    # Vt > Vs (the pad ends inside the last rank's range), odd and uneven shards, biases on
    # alternate cases, ignored rows, T not a multiple of the chunk
    vs, vt = 401, 437
    case = make_case(rng, T=11, vs=vs, vt=vt, bias=index % 2 == 0, ignored=0.3)
    bounds = [0, 131, 260, vt] if n_ranks == 3 else [0, 203, vt]
    assert_matches_single(case, xp, bounds, 2e-5, chunk_size=4, grad_weight_float32=True,
                          **OPTIONS[index])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sharded_token_weights(xp, rng, reduction):
    """Token weights (each rank the whole call's) and the sum, as on one rank."""
    case = make_case(rng, T=11, vs=401, vt=437, bias=True, ignored=0.3)
    case["token_weights"] = rng.uniform(0.0, 3.0, 11).astype(np.float32)
    assert_matches_single(case, xp, [0, 131, 260, 437], 2e-5, chunk_size=4, grad_weight_float32=True,
                          reduction=reduction)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_sharded_equals_single_16bit(xp, rng, dtype):
    case = make_case(rng, T=9, vs=515, vt=515, dtype=dtype, bias=True, ignored=0.2)
    # 16-bit gradients: reduction-order differences may flip a rounding of G or of the output
    eps = 2.0**-8 if dtype == BF16 else 2.0**-11
    assert_matches_single(case, xp, [0, 258, 515], 2 * eps, beta=0.5, temperature=2.0)


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_sharded_sharp_rows_against_float64(xp, rng, beta):
    """Sharp rows (temperature 0.05, logits of std 40: a KL of hundreds of bits) split over
    three ranks: reverse KL's reference column is the largest student logit of all the ranks',
    and the gradients stay as close to float64 as the single-shard call's (conftest's bound)."""
    case = make_case(rng, T=7, vs=401, vt=437, bias=True, ignored=0.2, logit_std=40.0)
    opts = dict(beta=beta, temperature=0.05, weight_hard_loss=0.3, weight_soft_loss=0.7)
    ranks = sharded(split(case, [0, 131, 260, 437]), xp, chunk_size=4, grad_weight_float32=True, **opts)
    loss, hard, soft, grad_input = ranks[0][:4]
    grad_weight, grad_bias = (np.concatenate([r[k] for r in ranks]) for k in (4, 5))
    assert_near_float64(case, "float32", opts, loss, hard, soft, (grad_input, grad_weight, grad_bias))


@pytest.mark.parametrize("beta", [0.0044, 0.9956])
def test_sharded_saturated_jsd_gradients(xp, rng, beta):
    """test_numerics' saturated JSD (the soft part's gradient alone, p near one-hot on column i,
    q on column j) split over three ranks, i and j on different ones: the reference column is
    the largest student logit of all the ranks', and the gradients as close to float64 as every
    gradient (assert_near_float64). The CPU's phases, float64, were up to 61 times off, their
    two kernels' h of the reference column differing in the last bits."""
    case = make_case(rng, T=3, vs=401, vt=437, bias=True, logit_std=1.0)
    case["student_bias"][[20, 300]] += [20.0, 10.0]
    case["teacher_bias"][300] += 20.0
    opts = dict(beta=beta, temperature=0.3, weight_hard_loss=0.0, weight_soft_loss=1.0)
    ranks = sharded(split(case, [0, 131, 260, 437]), xp, grad_weight_float32=True, **opts)
    loss, hard, soft, grad_input = ranks[0][:4]
    grad_weight, grad_bias = (np.concatenate([r[k] for r in ranks]) for k in (4, 5))
    assert_near_float64(case, "float32", opts, loss, hard, soft, (grad_input, grad_weight, grad_bias))


def test_a_rank_without_labels(xp, rng):
    case = make_case(rng, T=6, vs=300, vt=300, bias=True)
    case["target"] = rng.integers(0, 100, 6)  # every label on rank 0
    assert_matches_single(case, xp, [0, 150, 300], 2e-5, grad_weight_float32=True)


def test_loss_only(xp, rng):
    case = make_case(rng, T=5, vs=200, vt=211)
    ranks = sharded(split(case, [0, 100, 211]), xp, compute_grad=False)
    ref = jsdgpu.reference(**case)
    for r in ranks:
        assert len(r) == 3 and abs(float(r[0]) - ref[0]) <= 1e-5 * max(1.0, abs(ref[0]))


def test_all_rows_ignored(xp, rng):
    case = make_case(rng, T=4, vs=64, vt=64, ignored=1.0)
    for loss, _, _, gi, gw, _ in sharded(split(case, [0, 32, 64]), xp):
        assert float(loss) == 0.0 and not gi.any() and not gw.any()


def test_a_bad_layout_raises_on_every_rank(rng):
    case = make_case(rng, T=3, vs=100, vt=120)
    parts = split(case, [0, 60, 120])
    # rank 0 short of a student row while rank 1 holds some: a gap in the student vocabulary
    # (the last rank short of one would just be a smaller Vs)
    parts[0]["student_weight"] = parts[0]["student_weight"][:-1]
    results = ThreadRanks(2).run(lambda comm: jsdgpu.forward(**parts[comm.rank], vocab_parallel=comm))
    assert all(isinstance(r, ValueError) and "vocab_parallel" in str(r) for r in results), results


def test_a_target_outside_the_whole_vocabulary_raises(rng):
    case = make_case(rng, T=3, vs=100, vt=100)
    case["target"][1] = 100  # inside no shard: the check uses the whole Vs, after the sizes cross
    results = ThreadRanks(2).run(
        lambda comm: jsdgpu.forward(**split(case, [0, 50, 100])[comm.rank], vocab_parallel=comm))
    assert all(isinstance(r, ValueError) and "target[1]" in str(r) for r in results), results


def test_communicator_kinds():
    assert parallel.communicator(None) is None
    one = ThreadRanks(1)
    assert one.run(lambda comm: parallel.communicator(comm))[0] is None  # one rank: not sharded
    with pytest.raises(TypeError, match="vocab_parallel"):
        parallel.communicator(object())


# ---- two GPUs, two processes ----

def _two_gpus():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() >= 2
    except Exception:  # noqa: BLE001 - no CuPy or no driver
        return False


def _compare_cases(rank, world, rendezvous, how, seeds, results):
    """One rank: the one-GPU loss of each case on this GPU, and the sharded one; puts the
    relative differences (grad_input, grad_weight shard, grad_bias shard) in results."""
    import cupy
    cupy.cuda.Device(rank).use()
    if how == "nccl":
        from cupy.cuda import nccl
        comm = nccl.NcclCommunicator(world, rendezvous, rank)
    else:
        import torch
        import torch.distributed as dist
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=rendezvous, rank=rank, world_size=world)
        comm = dist.group.WORLD
    try:
        for seed, dtype in seeds:
            dtype = DTYPES[dtype]
            rng = np.random.default_rng(seed)
            vs = 1000 + int(rng.integers(0, 24))
            vt = vs + int(rng.integers(0, 40))
            case = make_case(rng, T=int(rng.integers(1, 300)), hs=64, ht=96, vs=vs, vt=vt,
                             dtype=dtype, bias=bool(rng.integers(2)), ignored=0.25, logit_std=4.0)
            options = dict(beta=float(rng.choice([0.0, 0.5, 1.0])), temperature=float(rng.choice([1.0, 2.0])),
                           chunk_size=int(rng.choice([64, 1000])), grad_weight_float32=True)
            bounds = [0, vt // 2, vt]
            single = _step(case, None, how, **options)
            got = _step(split(case, bounds)[rank], comm, how, **options)
            lo, hi = min(bounds[rank], vs), min(bounds[rank + 1], vs)
            pairs = [(got[1], single[1]), (got[2], single[2][lo:hi])]
            if single[3] is not None:
                pairs.append((got[3], single[3][lo:hi]))
            results.put((rank, seed, dtype.name, float(got[0]), float(single[0]),
                         [rel_err(g, w.astype(np.float64)) for g, w in pairs]))
    finally:
        if how == "torch":
            dist.destroy_process_group()


def _step(case, comm, how, **options):
    """loss, grad_input, grad_weight, grad_bias as NumPy, through CuPy or the torch module."""
    if how == "nccl":
        import cupy
        loss, ctx = jsdgpu.forward(**to_xp(case, cupy), vocab_parallel=comm, **options)
        return (to_numpy(loss),) + tuple(to_numpy(a) for a in jsdgpu.backward(ctx))
    import torch
    from jsdgpu.torch import FusedLinearJSDLoss
    dtype = {np.dtype(np.float32): torch.float32, BF16: torch.bfloat16}[case["student_input"].dtype]
    t = {k: None if v is None else torch.from_numpy(np.asarray(v, np.float32)).to("cuda", dtype)
         for k, v in case.items() if k != "target"}  # bf16 values: exact through float32
    t["target"] = torch.from_numpy(case["target"]).cuda()
    xs, ws = t["student_input"].requires_grad_(), t["student_weight"].requires_grad_()
    bs = t["student_bias"].requires_grad_() if t["student_bias"] is not None else None
    options.pop("grad_weight_float32")
    loss = FusedLinearJSDLoss(**options, vocab_parallel=comm)(xs, ws, t["teacher_input"], t["teacher_weight"],
                                                              t["target"], bs, t["teacher_bias"])
    loss.backward()
    as_np = lambda a: None if a is None else a.detach().float().cpu().numpy()
    return as_np(loss), as_np(xs.grad), as_np(ws.grad), as_np(bs.grad if bs is not None else None)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
@pytest.mark.parametrize("how", ["nccl", "torch"])
def test_two_gpus_equal_one(how, tmp_path, rng):
    if how == "nccl":
        from cupy.cuda import nccl
        rendezvous = nccl.get_unique_id()
    else:
        rendezvous = f"file://{tmp_path / 'rendezvous'}"
    seeds = [(int(rng.integers(2**31)), dtype) for dtype in ("float32", "float32", "bfloat16")]
    out = run_processes(_compare_cases, 2, rendezvous, how, seeds, count=2 * len(seeds))
    assert len(out) == 2 * len(seeds)
    losses = {}
    for rank, seed, dtype, loss, single_loss, errors in out:
        losses.setdefault(seed, set()).add(loss)
        assert abs(loss - single_loss) <= 1e-5 * max(1.0, abs(single_loss)), (seed, loss, single_loss)
        # float32: reduction-order error; bf16 gradients: a flipped rounding here and there
        tol = 2e-5 if dtype == "float32" else 2.0**-7
        assert max(errors) <= tol, (rank, seed, dtype, errors)
    assert all(len(v) == 1 for v in losses.values())  # both ranks hold the same loss


TOPK_OPTIONS = [dict(beta=0.5), dict(beta=0.0, temperature=2.0), dict(beta=1.0, temperature=0.5),
                dict(beta=0.3, missing_mass="renormalize"),
                dict(beta=0.0, missing_mass="renormalize", weight_hard_loss=0.0, weight_soft_loss=1.0),
                dict(beta=0.0, temperature=0.05, student_logit_scale=2.0, student_logit_softcap=30.0)]


@pytest.mark.parametrize("index", range(len(TOPK_OPTIONS)))
@pytest.mark.parametrize("n_ranks", [2, 3])
def test_sharded_topk_equals_single(xp, rng, index, n_ranks):
    """The top-k loss under vocab parallelism (jsdgpu.topk_shards): each rank the student's rows of
    its range, the stored top-k's ids over the whole vocabulary, odd and uneven shards, biases on
    alternate cases, ignored rows, unused slots, T not a multiple of the chunk; as one rank."""
    case = make_topk_case(rng, T=11, vs=401, k=17, bias=index % 2 == 0, ignored=0.3, logit_std=4.0)
    bounds = [0, 131, 260, 401] if n_ranks == 3 else [0, 203, 401]
    assert_matches_single(case, xp, bounds, 2e-5, forward=jsdgpu.forward_topk, chunk_size=4,
                          grad_weight_float32=True, **TOPK_OPTIONS[index])


@pytest.mark.parametrize("missing_mass", ["bucket", "renormalize"])
def test_sharded_topk_slots_hold_a_whole_shard(xp, rng, missing_mass):
    """k = Vs: every id is a slot's, so no rank holds a column of the rest (the bucket's rest is
    empty everywhere), and one rank holds no used slot in some rows."""
    case = make_topk_case(rng, T=6, vs=37, k=37, ignored=0.0, unused=0.3)
    assert_matches_single(case, xp, [0, 19, 37], 2e-5, forward=jsdgpu.forward_topk, grad_weight_float32=True,
                          missing_mass=missing_mass, beta=0.5)


def test_sharded_topk_rest_on_one_rank_alone(xp, rng):
    """The bucket's rest on the second rank alone: every id of the first rank's is a used slot's,
    and a few of the second rank's are not (their slots unused), so the first rank's part of the
    rest's sum is empty (its maximum -inf), and the whole rest is the second rank's."""
    case = make_topk_case(rng, T=6, vs=37, k=37, ignored=0.0, unused=0.0)
    ids, lq = case["teacher_indices"], case["teacher_logprobs"]
    for row in range(6):
        second = np.flatnonzero(ids[row] >= 19)
        lq[row, rng.choice(second, size=int(rng.integers(1, 4)), replace=False)] = -np.inf
    assert_matches_single(case, xp, [0, 19, 37], 2e-5, forward=jsdgpu.forward_topk, grad_weight_float32=True,
                          missing_mass="bucket", beta=0.5)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_sharded_topk_16bit(xp, rng, dtype):
    """16-bit heads: the label's one-hot term kept apart from G where it would dominate, as on one
    rank."""
    case = make_topk_case(rng, T=9, vs=515, k=33, dtype=dtype, bias=True, ignored=0.2)
    eps = 2.0**-8 if dtype == BF16 else 2.0**-11
    assert_matches_single(case, xp, [0, 258, 515], 2 * eps, forward=jsdgpu.forward_topk, beta=0.5, temperature=2.0)


@pytest.mark.parametrize("loss", ["online", "topk"])
def test_a_capturable_call_takes_no_vocab_parallel(rng, loss):
    """A capturable call (no host synchronization) cannot read the shard layout on the host."""
    class TwoRanks:
        rank, size = 0, 2

        def allreduce(self, a, op):
            raise AssertionError("no collective before the check")
    if loss == "online":
        case, call = make_case(rng, T=4), jsdgpu.forward
    else:
        case, call = make_topk_case(rng, T=4), jsdgpu.forward_topk
    with pytest.raises(NotImplementedError, match="capturable"):
        call(**case, vocab_parallel=TwoRanks(), capturable=True)
