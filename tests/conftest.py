"""Shared test helpers: random cases, array kinds, the gpu marker.

Every case draws fresh random inputs; the seed is printed so a failure can be replayed
(JSDGPU_SEED=<seed> pytest ...).
"""

import contextlib
import os
import secrets
import sys

# JAX would take 75% of the GPU's memory when it starts, leaving CuPy and torch too little
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# the products tuned in the test's own process, not taken from the user's cache of earlier runs
# (a test that keeps them on disk names its own file)
os.environ.setdefault("JSDGPU_GEMM_CACHE", "0")

import ml_dtypes
import numpy as np
import pytest

from jsdgpu.checks import gpu_available

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    seed = int(os.environ.get("JSDGPU_SEED", secrets.randbits(32)))
    print(f"JSDGPU_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def queued_ahead(monkeypatch):
    """A list of (rows a chunk, head rows) of each student logits' product queued ahead of a call's
    checks (CudaBackend.logits_ahead, ahead.FirstProduct), for the test's duration."""
    from jsdgpu.cuda.backend import CudaBackend
    queued, queue_ahead = [], CudaBackend.logits_ahead
    monkeypatch.setattr(CudaBackend, "logits_ahead", staticmethod(
        lambda xs, ws, rows, head: queued.append((rows, head)) or queue_ahead(xs, ws, rows, head)))
    return queued


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module of the backend under test."""
    if request.param == "cupy":
        import cupy
        return cupy
    return np


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def torch_device(request):
    """The torch device of the front end under test."""
    return request.param


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def jax_device(request):
    """The JAX device of the front end under test (skipped where JAX, or its device, is not here)."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("jsdgpu.jax")
    try:
        return jax.devices(request.param)[0]
    except RuntimeError:
        pytest.skip(f"JAX has no {request.param} device here")


def make_case(rng, *, T=13, hs=16, ht=24, vs=1031, vt=None, dtype=np.float32, bias=False,
              ignored=0.0, ignore_index=-100, logit_std=1.0):
    """Random NumPy inputs (a dict of forward's arguments). Logits have about logit_std."""
    vt = vs if vt is None else vt
    dtype = np.dtype(dtype)

    def arr(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    target = rng.integers(0, vs, T)
    target[rng.random(T) < ignored] = ignore_index
    return dict(student_input=arr((T, hs)), student_weight=arr((vs, hs), logit_std / np.sqrt(hs)),
                teacher_input=arr((T, ht)), teacher_weight=arr((vt, ht), logit_std / np.sqrt(ht)),
                target=target,
                student_bias=arr(vs, 0.5) if bias else None,
                teacher_bias=arr(vt, 0.5) if bias else None)


def to_xp(case, xp):
    return {k: None if v is None else xp.asarray(v) for k, v in case.items()}


def to_numpy(a):
    if a is None or isinstance(a, np.ndarray):
        return a
    return a.get()


# How far softmax(z) may be off, absolutely, at a label that holds most of its row's mass, where
# p - 1 is the gradient (docs/contract.md, "Numerics")
LABEL_P_ABS = 1e-6


def rel_err(a, ref):
    a = np.asarray(to_numpy(a), dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30)


def assert_upstream_sum_near(value, rows, upstream):
    """value, a float32 step's sum of the rows' losses times a random upstream gradient, against
    the float64 reference's rows: the terms' signs cancel, so the sum's float32 error follows the
    size of its terms, not of the sum (a step of 150 valid rows: 1.3e-5 off a sum of 0.81, its terms'
    sizes summing to 446, JSDGPU_SEED=3847153300 in test_jax.py)."""
    terms = np.asarray(rows, np.float64) * np.asarray(upstream, np.float64)
    want = float(terms.sum())
    assert abs(float(value) - want) <= 1e-5 * max(1.0, abs(want)) + 1e-6 * float(np.abs(terms).sum())


def round_to(a, dtype):
    """a rounded to dtype and back to float64: the error of merely storing it in dtype."""
    return np.asarray(a, dtype=dtype).astype(np.float64)


def head_logits(case, who, dtype=np.float64, blocks=1):
    """who's ("student" or "teacher") logits of a case, by a product in dtype (with blocks > 1,
    the hidden dimension summed in that many blocks, one after another)."""
    x, w, b = (case[f"{who}_{k}"] for k in ("input", "weight", "bias"))
    x, w = x.astype(dtype), w.astype(dtype)
    if blocks == 1:
        out = x @ w.T
    else:
        out = np.zeros((x.shape[0], w.shape[0]), dtype)
        for part in np.array_split(np.arange(x.shape[1]), blocks):
            out += x[:, part] @ w[:, part].T
    return out if b is None else out + b.astype(dtype)


def float64_logits(case):
    """The student's and teacher's logits of a case, in float64."""
    return head_logits(case, "student"), head_logits(case, "teacher")


def float32_logits(case, who):
    """who's logits as the library may hold them, six ways: the float64 logits rounded to
    float32; those of a float32 product, in three accumulation orders (NumPy's, and the hidden
    dimension summed in 2 and in 4 blocks: the rounding depends on the order, and cuBLAS's
    differs with the shape and algorithm); and the rounded ones moved one ulp apart, each row's
    largest up and the others down, and the other way. The float64 math on each is a "floor":
    what making and holding the logits in float32 costs. Where the loss is ill-conditioned (two
    near-equal top logits, a KL of thousands of nats at temperature 0.05) it hangs on the gap
    between the largest logits, and one way's error can be a hundred times another's, so the
    bounds below take the largest. (With NumPy's order alone, another order's error passed 4
    times the floors' in 0.7% of the cases of reverse KL, renormalized, at temperature 0.05 with
    logits of std 8 and 40: the GPU's tests failed so, now and then.)"""
    rounded = head_logits(case, who).astype(np.float32)
    top = np.arange(rounded.shape[1]) == rounded.argmax(axis=1)[:, None]
    sharper = np.nextafter(rounded, np.where(top, np.inf, -np.inf).astype(np.float32))
    flatter = np.nextafter(rounded, np.where(top, -np.inf, np.inf).astype(np.float32))
    return [rounded, *(head_logits(case, who, np.float32, blocks) for blocks in (1, 2, 4)), sharper, flatter]


def assert_part_near(name, got, want, floors, open_by=0.0):
    """A loss part got about as close to float64's want as the float64 math itself is on float32
    logits (floors: its values on float32_logits' ways), plus float32 rounding of the result:
    1e-5 relative (1e-9 absolute), plus open_by (what float64 itself leaves undetermined)."""
    tol = 4 * max(abs(f - want) for f in floors) + max(1e-5 * abs(want), 1e-9) + open_by
    assert abs(got - want) <= tol, (name, got, want, abs(got - want), tol)


def assert_grads_near(case, G, G_floors, grads, dtype, slack=0.0):
    """The student's gradients (grad_input, grad_weight, grad_bias; None without a bias) as the
    reference's through its G (G @ Ws, G.T @ Xs, G.sum(0)), within 4 times the floors' largest
    relative error (the same through each of G_floors), plus 2 eps of the dtype (its name) and
    slack."""
    f = lambda k: case[k].astype(np.float64)  # noqa: E731
    through = lambda g: [g @ f("student_weight"), g.T @ f("student_input"), g.sum(0)]  # noqa: E731
    want = through(G)
    rounded = zip(*map(through, G_floors))
    eps = {"float32": 1e-5, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    for name, got, w, r in zip(("grad_input", "grad_weight", "grad_bias"), grads, want, rounded):
        if got is None:
            assert case["student_bias"] is None
            continue
        got = to_numpy(got).astype(np.float64)
        assert got.shape == w.shape
        floor = max(rel_err(x, w) for x in r)
        assert rel_err(got, w) <= 4 * floor + 2 * eps + slack, (name, rel_err(got, w), floor)


def assert_near_float64(case, dtype, opts, loss, hard, soft, grads):
    """The loss parts and the gradients (grad_input, grad_weight, grad_bias) about as close to
    the float64 reference as the float64 math itself is on float32 logits (float32_logits), plus
    float32 rounding of the result: 1e-5 relative (1e-9 absolute) for the loss parts; 2 eps of
    the dtype (float32: plus 1e-4) for the gradients. The soft part never negative; everything
    finite."""
    from jsdgpu.reference import reference_logits
    ref = reference_logits(*float64_logits(case), case["target"], **opts)
    floors = [reference_logits(s, t, case["target"], **opts)
              for s, t in zip(float32_logits(case, "student"), float32_logits(case, "teacher"))]
    for name, got, i in (("loss", loss, 0), ("soft", soft, 2), ("hard", hard, 1)):
        got = float(to_numpy(got))
        assert np.isfinite(got), (name, got, ref[i])
        assert_part_near(name, got, ref[i], [f[i] for f in floors])
    assert float(to_numpy(soft)) >= 0.0
    assert all(np.isfinite(to_numpy(g)).all() for g in grads if g is not None)
    # float32 G: its sums' rounding beside the float64 reference's. (A sharp row, whose KL is
    # hundreds of bits at temperature 0.05, needs its h and KL taken relative to a reference
    # column to stay within this: row_math.cuh, "A sharp row".)
    assert_grads_near(case, ref[3], [f[3] for f in floors], grads, dtype, slack=1e-4 * (dtype == "float32"))


def head_path_ignored(T):
    """The ignored rows of a run of default calls of T rows (T >= 16) that takes every path of
    ahead.queue_head, each call's head sized by the last HEAD_HISTORY calls (the first five
    calls leave none of the calls before the run among them): the whole first chunk as it is,
    kept; a prefix of it kept (the rest computed again); the first selected rows, fewer than the
    call has (the rest of the chunk queued after the read); none of the first chunk kept (row 0
    ignored); the first selected rows, as many as the call has, and more (the rows past its count
    computed for nothing)."""
    from jsdgpu.ahead import HEAD_HISTORY
    some = lambda first: [first, 12, 15]  # noqa: E731
    all_valid = [[]] * HEAD_HISTORY
    return all_valid + [[], some(2)] + all_valid + [some(0), some(9), list(range(1, T, 2)), []]


def _with_fault_handler(target, *args):
    """target(*args) in a rank whose fatal signals print every thread's Python stack to stderr (which
    the test's report shows), whose exception goes to the parent through results (the last of args)
    as ("error", rank, its traceback), and which ends without the interpreter's finalization once
    target has returned and its results are through the queue. Ranks over gloo aborted now and then
    in finalization, after delivering their results and destroying the process group (exit code -6,
    "terminate called without an active exception" from a thread without Python frames while the
    main thread had none: torch's C++ threads torn down with the interpreter, as
    pytorch/pytorch#179291 describes); what a rank does wrong before then still fails the test."""
    import faulthandler
    import traceback
    faulthandler.enable(all_threads=True)
    results = args[-1]
    try:
        target(*args)
    except BaseException:  # noqa: BLE001 - handed to the parent, which fails the test
        results.put(("error", args[0], traceback.format_exc()))
    results.close()
    results.join_thread()  # (the queue's feeder thread has written everything to the pipe)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def weight_sums_spied(monkeypatch, held):
    """A list of (hold_g, weight_memory given, how often the engine asked for it, grad_weight's
    float32 sum kept in the memory it got) for each call of the engine's row_outputs from now;
    held False: a budget of 1 byte (chunks of chunk_size, G per chunk, grad_weight summed over
    them), as memory_budget=1, for the front ends, which do not take one."""
    from jsdgpu import engine, options
    if not held:
        monkeypatch.setattr(options.RunOptions, "budget", lambda self, backend, call_bytes: 1)
    given, row_outputs = [], engine.row_outputs
    address = lambda a: a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr  # noqa: E731

    def spy(xp, n_rows, hs, vs, hold_g, has_bias, compute_grad, weight_memory=None):
        got = []
        asked = None if weight_memory is None else lambda: got.append(weight_memory()) or got[-1]
        out = row_outputs(xp, n_rows, hs, vs, hold_g, has_bias, compute_grad, asked)
        kept = len(got) == 1 and address(out[2].grad_weight) == address(got[0])
        given.append((hold_g, weight_memory is not None, len(got), kept))
        return out
    monkeypatch.setattr(engine, "row_outputs", spy)
    return given


@contextlib.contextmanager
def process_group(rendezvous, rank, world, backend="gloo"):
    """torch.distributed's default process group of a rank, for the block."""
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_processes(target, world, rendezvous, *args, count=None):
    """target(rank, world, rendezvous, *args, results) in `world` spawned processes: the `count`
    items they put in results (default: one each); fails the test with the traceback of what a rank
    raised, and kills a rank left waiting in a collective by its partner's end."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_with_fault_handler, args=(target, r, world, rendezvous, *args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = []
        for _ in range(world if count is None else count):
            out.append(results.get(timeout=240))
            if out[-1][0] == "error":
                pytest.fail(f"rank {out[-1][1]} failed:\n{out[-1][2]}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # a rank that delivered its results and then failed (a negative code: the signal; -9 may be
    # the kill above, after 30 s)
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}"
    return out
