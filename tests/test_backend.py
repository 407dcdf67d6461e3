"""The steps both backends implement (jsdgpu.backend.Backend), tested alike on each: the
contract's methods, and the selection of the valid rows."""

import inspect
import pathlib

import numpy as np
import pytest

from conftest import to_numpy
from jsdgpu.call import backend_for


def _parameters(method, skip_self):
    return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()
            if not (skip_self and p.name == "self")]


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_backends_implement_the_contract(kind):
    """Each backend is its three parts (the call's steps, the online loss's row work, the top-k
    loss's), and each part has every method of its protocol in jsdgpu.backend, with its
    parameters (names, kinds, defaults), and no public method beyond it. (The CUDA backend's
    modules import without a GPU, where CuPy is installed.)"""
    from jsdgpu import backend
    if kind == "cpu":
        from jsdgpu.cpu.backend import CpuBackend as B
    else:
        pytest.importorskip("cupy")
        from jsdgpu.cuda.backend import CudaBackend as B
    protocols = (backend.CallSteps, backend.OnlineRowWork, backend.TopKRowWork)
    assert backend.Backend.__bases__[:3] == protocols and len(B.__bases__) == 3
    assert {name for name, f in vars(B).items() if not name.startswith("_")} == set()  # nothing of its own
    for part, protocol in zip(B.__bases__, protocols):
        contract = {name: f for name, f in vars(protocol).items() if inspect.isfunction(f) and not name.startswith("_")}
        public = {name for name, f in vars(part).items() if not name.startswith("_") and callable(getattr(part, name))}
        assert public == set(contract), (part.__name__, sorted(public - set(contract)), sorted(set(contract) - public))
        for name, f in contract.items():
            assert _parameters(getattr(part, name), False) == _parameters(f, True), name
    for name in ("xp", "queues_ahead"):
        assert hasattr(B.__bases__[0], name), name


def _select_rows(xp, target, vocab, ignore_index):
    rows = backend_for("numpy" if xp is np else "cupy").select_rows(xp.asarray(target), vocab,
                                                                     ignore_index).wait(lambda count: 1.0)
    return rows.valid_rows, rows.target, rows.count


# T: one tile of the GPU's select_rows kernel (8192 rows), a row past it, several tiles
@pytest.mark.parametrize("T", [1, 7, 8192, 8193, 20000])
@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.int64, np.uint64])
def test_select_rows(xp, rng, T, dtype):
    """The valid rows, in order, their targets as int32 and their count, for every integer
    dtype of the targets; None for the rows where every row is valid."""
    vocab, ignore_index = 100, 7  # an ignore_index inside [0, vocab)
    target = rng.integers(0, vocab, T).astype(dtype)
    target[rng.random(T) < rng.choice([0.0, 0.5])] = ignore_index
    rows, row_target, count = _select_rows(xp, target, vocab, ignore_index)
    want = np.flatnonzero(target != ignore_index)
    assert count == len(want)
    if len(want) == T:
        assert rows is None
    else:
        assert np.array_equal(to_numpy(rows), want)
    assert row_target.dtype == np.int32 and np.array_equal(to_numpy(row_target), target[want])


@pytest.mark.gpu
def test_select_rows_labels_past_the_count_and_of_bad_rows_are_none():
    """Before the host's wait the GPU may read any prefix of the selection's targets as labels
    (the top-k loss's first row kernel, queued ahead): -1 (no label) past the count and where a
    target is out of range, never an id outside the vocabulary."""
    import cupy

    from jsdgpu.cuda.backend import CudaBackend
    target = cupy.asarray([3, -100, 12, 4, -100, -100])  # 12: out of [0, 10)
    selection = CudaBackend.select_rows(target, 10, -100)
    with pytest.raises(ValueError):
        selection.wait(lambda count: 1.0)
    assert to_numpy(selection.row_target).tolist() == [3, -1, 4, -1, -1, -1]


@pytest.mark.parametrize("T", [7, 8193, 20000])
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.uint64])
def test_select_rows_names_the_first_bad_target(xp, rng, T, dtype):
    vocab = 100
    target = rng.integers(0, vocab, T).astype(dtype)
    first, second = np.sort(rng.choice(T, 2, replace=False))
    bad = [np.iinfo(dtype).max, vocab] if np.iinfo(dtype).min == 0 else [-1, vocab]
    rng.shuffle(bad)
    target[first], target[second] = bad
    with pytest.raises(ValueError, match=rf"target\[{first}\] = {target[first]} is outside"):
        _select_rows(xp, target, vocab, -100)


def test_ignore_index_beyond_int64(xp):
    """An ignore_index that no int64 target can equal: every row is valid, and -100 is bad."""
    rows, _, count = _select_rows(xp, np.arange(5), 10, 2**70)
    assert rows is None and count == 5
    with pytest.raises(ValueError, match=r"target\[1\] = -100"):
        _select_rows(xp, np.array([3, -100, 4]), 10, 2**70)


@pytest.mark.parametrize("T", [1, 7, 1500])
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.uint64])
def test_mark_rows(xp, rng, T, dtype):
    """A capturable call's rows: every row's target, -1 where ignored or bad; the valid rows'
    count and the first bad row; 1/N, NaN where a target is bad."""
    vocab, ignore_index = 100, 7
    target = rng.integers(0, vocab, T).astype(dtype)
    target[rng.random(T) < 0.4] = ignore_index
    valid = target != ignore_index
    rows = backend_for("numpy" if xp is np else "cupy").mark_rows(xp.asarray(target), vocab, ignore_index, None)
    assert rows.masked and rows.valid_rows is None and rows.count is None
    assert np.array_equal(to_numpy(rows.target), np.where(valid, target.astype(np.int64), -1))
    assert to_numpy(rows.status).tolist() == [int(valid.sum()), T]
    # (1/N to float32's precision, the GPU's: np.float32 of both sides, where a Python float
    # compared with a float32 is widened under NumPy 1's promotion and rounded under NumPy 2's)
    assert np.float32(float(rows.inv_n)) == np.float32(1.0 / max(1, valid.sum()))
    if T > 1:
        first = int(rng.integers(0, T))
        target[first:] = np.iinfo(dtype).max if np.iinfo(dtype).min == 0 else -1
        bad = backend_for("numpy" if xp is np else "cupy").mark_rows(xp.asarray(target), vocab, ignore_index, 5.0)
        assert to_numpy(bad.status)[1] == first and np.isnan(float(bad.inv_n))
        assert (to_numpy(bad.target)[first:] == -1).all()


def test_cpu_fused_kernel_writes_g_over_the_student_logits():
    """As on the GPU: with the fused row kernel a chunk's G is the student logits' memory, which
    the budget then does not count; G held for all rows, or without the fused kernel, is apart."""
    from jsdgpu.cpu.backend import CpuBackend as B
    assert B.bytes_per_row(100, 120, np.float32, True, True) == (880, 400, 0)
    assert B.bytes_per_row(100, 120, np.float32, True, False) == (880, 400, 400)
    w = np.zeros((100, 8), np.float32)
    for fused, own_g, shared in ((True, False, True), (True, True, False), (False, False, False)):
        work = B.prepare(w, np.zeros((120, 8), np.float32), None, None, 16, fused)
        assert np.shares_memory(B.gradient_rows(work, 16, own_g), work.s) == shared


@pytest.mark.parametrize("rows,vs,vt", [(1, 1, 1), (3, 17, 33), (64, 32000, 32003), (5, 128256, 151936)])
def test_cpu_logits_buffers_start_on_a_cache_line(rows, vs, vt):
    """The chunks' logits buffers (both losses') start at a multiple of 64 bytes, where NumPy's
    large arrays start 16 bytes past one: the row kernels' 512-bit loads and stores would cross
    two lines (jsdgpu.cpu.steps.row_buffer); they are what an empty array would be otherwise."""
    from jsdgpu.cpu.backend import CpuBackend as B
    ws, wt = np.zeros((vs, 4), np.float32), np.zeros((vt, 4), np.float32)
    work = B.prepare(ws, wt, None, None, rows, True)
    topk = B.topk_prepare(ws, None, rows)
    for logits, shape in ((work.s, (rows, vs)), (work.t, (rows, vt)), (topk.s, (rows, vs))):
        assert logits.shape == shape and logits.dtype == np.float32 and logits.flags.c_contiguous
        assert logits.ctypes.data % 64 == 0


def test_cpu_kernels_cache_keys_hold_the_modules_they_take_in(tmp_path, monkeypatch):
    """Numba keys a cached kernel by its own file, its bytecode and its closure's contents: each
    CPU row kernel is a closure over the digest of the modules it inlines (rows._sources_digest),
    so that a change to one of them alone compiles the kernels again rather than running the old
    ones from the cache; the digest moves with any of those modules' bytes."""
    from jsdgpu import options
    from jsdgpu.cpu import divergences, fastmath, fused_row, rows
    digest = rows._sources_digest()
    for kernel in (rows.fused_kernel, rows.stats_kernel, rows.kl_kernel, rows.finish_kernel):
        assert [cell.cell_contents for cell in kernel.__wrapped__.py_func.__closure__] == [digest]
    for module in (divergences, fastmath, fused_row, options):
        changed = tmp_path / f"{module.__name__}.py"
        changed.write_bytes(pathlib.Path(module.__file__).read_bytes() + b"\n")
        with monkeypatch.context() as patch:
            patch.setattr(module, "__file__", str(changed))
            assert rows._sources_digest() != digest
    assert rows._sources_digest() == digest


@pytest.mark.parametrize("row_options", [True, False], ids=["row_function", "njit_defaults"])
def test_cpu_row_functions_divide_on_vectors(rng, row_options):
    """Each CPU row kernel calls its row's function, compiled with rows._row_function's options:
    under njit's own error model each float division tests its divisor for zero so as to raise,
    and LLVM kept the JSD's column loops scalar, eight times slower (docs/design.md, "The CPU
    backend"). The JSD's column loops (fused_row.row_sums) compiled with those options divide on
    vectors; with njit's defaults on scalars only, which shows what the check tells apart."""
    import re

    import numba
    from jsdgpu.cpu import fused_row, rows
    from jsdgpu.cpu.divergences import JSD, mixture_form, precise_terms
    from jsdgpu.options import Divergence
    f32 = np.float32
    s, t = rng.standard_normal(40, dtype=f32), rng.standard_normal(40, dtype=f32)
    p, h = np.exp(s), np.exp(t)
    b, poly = precise_terms(Divergence.JSD, 0.5)
    row = (f32(0.0), f32(1.0), f32(0.0), f32(0.0), False, f32(0.5), f32(0.5), f32(b))
    compile_ = rows._row_function if row_options else numba.njit(fastmath=rows.FAST)
    row_sums = compile_(fused_row.row_sums.py_func)
    row_sums(s, t, p, h, f32(1 / p.sum()), f32(1 / h.sum()), JSD, mixture_form(f32(b)), row, tuple(poly), f32(0.5),
             f32(0.5), s, t)
    ir = "".join(row_sums.inspect_llvm().values())
    vector_divisions = re.findall(r"fdiv[^\n]*<\d+ x float>", ir)
    assert (len(vector_divisions) > 0) == row_options


def test_cpu_kernels_on_one_thread_below_parallel_from(monkeypatch):
    """A CPU row kernel runs on one thread where its first array holds fewer than PARALLEL_FROM
    values, on Numba's threads from there (cpu/threads.py), and the thread count is Numba's
    again after it, when the kernel raises too."""
    import numba
    from jsdgpu.cpu import threads
    monkeypatch.setattr(threads, "PARALLEL_FROM", 100)
    seen = []

    @threads.rows_in_parallel
    def kernel(x, fail):
        seen.append(numba.get_num_threads())
        if fail:
            raise RuntimeError("in the kernel")
    numba_threads = numba.get_num_threads()
    kernel(np.zeros(99), False)
    kernel(np.zeros((10, 10)), False)
    with pytest.raises(RuntimeError, match="in the kernel"):
        kernel(np.zeros(5), True)
    assert seen == [1, numba_threads, 1] and numba.get_num_threads() == numba_threads


@pytest.mark.parametrize("loss", ["online", "online_phases", "teacher_topk"])
def test_cpu_kernels_give_the_same_bits_on_one_thread_and_in_parallel(rng, monkeypatch, loss):
    """Each row is one thread's whole work, so the row kernels give the same bits on one thread
    (the tests' small calls) and on Numba's threads (PARALLEL_FROM 0): the fused kernel, the three
    phases (vocab parallelism's, here on two simulated ranks) and the teacher top-k's logsumexp."""
    import jsdgpu
    from jsdgpu.cpu import threads
    from conftest import make_case
    case = make_case(rng, T=37, bias=True, ignored=0.2, vt=1100)
    runs = []
    for parallel_from in (threads.PARALLEL_FROM, 0):
        monkeypatch.setattr(threads, "PARALLEL_FROM", parallel_from)
        if loss == "online_phases":  # two ranks, as threads
            from test_parallel import sharded, split
            runs.append([a for rank in sharded(split(case, [0, 500, 1100]), np, beta=0.3, temperature=1.7)
                         for a in rank])
            continue
        if loss == "teacher_topk":
            runs.append(list(jsdgpu.teacher_topk(case["teacher_input"], case["teacher_weight"], 9, 1.7,
                                                 case["teacher_bias"])))
            continue
        loss_value, ctx = jsdgpu.forward(**case, beta=0.3, temperature=1.7)
        runs.append([np.asarray(loss_value), *jsdgpu.backward(ctx)])
    for one, parallel in zip(*runs):
        np.testing.assert_array_equal(one, parallel)


@pytest.mark.parametrize("shape", [(37, 1031, 19), (1031, 37, 19), (5, 2, 3)])
def test_cpu_products_split_over_our_threads(rng, monkeypatch, shape):
    """split_matmul cuts the product's larger dimension into one piece a thread (three here,
    whatever the machine has; more than the dimension has: some empty), of transposed views too,
    and gives the product."""
    from jsdgpu.cpu import products
    monkeypatch.setattr(products, "get_num_threads", lambda: 3)
    m, n, k = shape
    a = rng.standard_normal((k, m)).astype(np.float32).T  # a transposed view, as G.T is
    b = rng.standard_normal((n, k)).astype(np.float32).T  # as the weights' W.T
    out = np.full((m, n), np.nan, np.float32)
    assert products.split_matmul(a, b, out) is out
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()


def test_cpu_split_products_run_openblas_on_one_thread_and_set_it_back(rng, monkeypatch):
    """A call's matmul is its _CallProducts' (own_threads), unless `through` names another
    (torch's products). While a split product runs, NumPy's OpenBLAS is on one thread; its
    count is set back when the last of two threads' products at once ends, after one that
    raises, and after a split product."""
    import contextlib
    import threading
    from jsdgpu.cpu import products
    openblas = products.numpys_openblas()
    if openblas is None:
        pytest.skip("NumPy's BLAS here is not an OpenBLAS that jsdgpu reaches")
    set_threads, get_threads = openblas
    before = get_threads()
    set_threads(2)
    try:
        with products.own_threads():
            assert isinstance(products._MATMUL.get().__self__, products._CallProducts)
        mine = lambda a, b, out: np.matmul(a, b, out=out)  # noqa: E731
        with products.through(mine), products.own_threads():
            assert products._MATMUL.get() is mine
        first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
        seen = {}

        def product(name, entered, wait_for, then):
            with products._openblas_on_one_thread():
                seen[name, "inside"] = get_threads()
                entered.set()
                wait_for.wait(10)
            seen[name, "after"] = get_threads()
            if then is not None:
                then.set()
        first = threading.Thread(target=product, args=("first", first_in, second_in, first_out))
        second = threading.Thread(target=product, args=("second", second_in, first_out, None))
        first.start()
        first_in.wait(10)
        second.start()
        first.join(10)
        second.join(10)
        assert seen == {("first", "inside"): 1, ("second", "inside"): 1, ("first", "after"): 1,
                        ("second", "after"): 2}
        with pytest.raises(RuntimeError, match="in the product"):
            with products._openblas_on_one_thread():
                raise RuntimeError("in the product")
        assert get_threads() == 2
        monkeypatch.setattr(products, "get_num_threads", lambda: 2)
        during, one_thread = [], products._openblas_on_one_thread

        @contextlib.contextmanager
        def watched():
            with one_thread():
                during.append(get_threads())
                yield
        monkeypatch.setattr(products, "_openblas_on_one_thread", watched)
        a, b = rng.standard_normal((9, 4)).astype(np.float32), rng.standard_normal((4, 7)).astype(np.float32)
        products.split_matmul(a, b, np.empty((9, 7), np.float32))
        assert during == [1] and get_threads() == 2
    finally:
        set_threads(before)


def test_cpu_add_product_adds_by_sgemm_where_numpys_products_are_the_calls(rng, monkeypatch):
    """add_product: out += a @ b for a padded G's transposed view and a chunk's inputs, as
    grad_products takes them, within float32 rounding of float64: outside a call, and in a call
    whose products are split (three threads) or not. False, out untouched, where another BLAS
    runs the call's products (through), or where the call has run no product yet."""
    from jsdgpu.cpu import products
    if products.numpys_sgemm() is None:
        pytest.skip("NumPy's BLAS here is not an OpenBLAS that jsdgpu reaches")
    G = np.zeros((5, 40), np.float32)[:, :37]  # [rows, V] in a buffer of padded rows
    G[...] = rng.standard_normal(G.shape)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    start = rng.standard_normal((37, 3)).astype(np.float32)
    want = start.astype(np.float64) + G.T.astype(np.float64) @ x

    def added():
        out = start.copy()
        done = products.add_product(G.T, x, out)
        if done:
            assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max()
        else:
            assert (out == start).all()
        return done
    assert added()
    monkeypatch.setattr(products, "PARALLEL_FROM", 100)
    for threads, first_rows, split in ((3, 40, True), (3, 2, False), (1, 40, False)):
        monkeypatch.setattr(products, "get_num_threads", lambda: threads)
        with products.own_threads():
            assert not added()  # (nothing decided yet)
            call = products._MATMUL.get().__self__
            call.matmul(np.ones((first_rows, 4), np.float32), np.ones((4, 3), np.float32),
                        np.empty((first_rows, 3), np.float32))
            assert call.split == split and added()
    with products.through(lambda a, b, out: np.matmul(a, b, out=out)):
        assert not added()


def test_cpu_call_splits_all_its_products_or_none(monkeypatch):
    """A call's first product decides for all of its products: split where one of its arrays
    holds PARALLEL_FROM values or more (where the row kernels run on Numba's threads), else
    none (after it, whatever their size); on one thread, none."""
    from jsdgpu.cpu import products
    monkeypatch.setattr(products, "PARALLEL_FROM", 100)
    monkeypatch.setattr(products, "numpys_openblas", lambda: (None, None))  # (reached or not here)
    split = []
    monkeypatch.setattr(products, "split_matmul", lambda a, b, out: split.append(out.shape))
    small, large = np.ones((3, 4), np.float32), np.ones((30, 4), np.float32)
    for threads, first, then, want in ((2, small, large, []), (2, large, small, [(30, 3), (3, 3)]),
                                       (1, large, large, [])):
        monkeypatch.setattr(products, "get_num_threads", lambda: threads)
        split.clear()
        call = products._CallProducts()
        for a in (first, then):
            call.matmul(a, np.ones((4, 3), np.float32), np.empty((len(a), 3), np.float32))
        assert split == want, (threads, len(first), len(then))


def test_cpu_call_through_another_blas_takes_the_faster(monkeypatch):
    """A call of faster_of(other) (the torch front end's, other torch's matmul) takes other for
    all of its products unless NumPy's ran the trial faster; then NumPy's, split as an own
    call's are (where its first product is large). The trial finds a slow other slower and one
    that does nothing faster."""
    import time

    from jsdgpu.cpu import products
    monkeypatch.setattr(products, "PARALLEL_FROM", 100)
    monkeypatch.setattr(products, "numpys_openblas", lambda: (None, None))
    monkeypatch.setattr(products, "get_num_threads", lambda: 2)
    took = []
    monkeypatch.setattr(products, "split_matmul", lambda a, b, out: took.append(("split", len(a))))
    monkeypatch.setattr(products.np, "matmul", lambda a, b, out: took.append(("numpy", len(a))))
    other = lambda a, b, out: took.append(("other", len(a)))  # noqa: E731
    small, large = np.ones((3, 4), np.float32), np.ones((30, 4), np.float32)
    for faster, first, want in ((True, large, ["split", "split"]), (True, small, ["numpy", "numpy"]),
                                (False, large, ["other", "other"]), (False, small, ["other", "other"])):
        monkeypatch.setattr(products, "numpy_is_faster", lambda fn: faster)
        took.clear()
        with products.faster_of(other):
            for a in (first, large):
                products.matmul(a, np.ones((4, 3), np.float32), np.empty((len(a), 3), np.float32))
        assert [name for name, _ in took] == want, (faster, len(first))
    monkeypatch.undo()
    monkeypatch.setattr(products, "TRIAL_SHAPE", (64, 32, 256))

    def slow(a, b, out):
        time.sleep(0.01)
        return np.matmul(a, b, out=out)
    try:
        assert products.numpy_is_faster(slow)
        assert not products.numpy_is_faster(lambda a, b, out: out)
    finally:
        products.numpy_is_faster.cache_clear()


@pytest.mark.parametrize("transposed", [True, False])
def test_cpu_loss_with_every_product_split(rng, monkeypatch, transposed):
    """A call whose products are all split (PARALLEL_FROM 0 for the products, three pieces),
    with a bias, ignored rows and two chunks, against the float64 reference: its logits products
    (chunks of few rows) transposed where the trial finds that faster, else as NumPy calls them."""
    import jsdgpu
    from conftest import assert_near_float64, make_case
    from jsdgpu.cpu import products
    if products.numpys_sgemm() is None:
        pytest.skip("NumPy's BLAS here is not an OpenBLAS that jsdgpu reaches: its calls split nothing")
    monkeypatch.setattr(products, "get_num_threads", lambda: 3)
    monkeypatch.setattr(products, "PARALLEL_FROM", 0)
    monkeypatch.setattr(products, "TRANSPOSED_PIECE", 100)
    monkeypatch.setattr(products, "transposed_is_faster", lambda: transposed)
    split, by_pieces = [], []
    split_matmul, transposed_product = products.split_matmul, products._transposed_product
    monkeypatch.setattr(products, "split_matmul", lambda a, b, out: split.append(1) or split_matmul(a, b, out))
    monkeypatch.setattr(products, "_transposed_product",
                        lambda a, b, out: by_pieces.append(1) or transposed_product(a, b, out))
    case = make_case(rng, T=29, hs=16, ht=24, vs=1031, vt=1033, bias=True)
    # 23 valid rows, two chunks of 16 (a random share of ignored rows left one chunk at
    # JSDGPU_SEED=498102570)
    case["target"][rng.choice(29, 6, replace=False)] = -100
    opts = dict(beta=0.3, temperature=1.7)
    loss, ctx = jsdgpu.forward(**case, chunk_size=16, **opts)
    assert_near_float64(case, "float32", opts, loss, ctx.hard_loss, ctx.soft_loss, jsdgpu.backward(ctx))
    # both chunks' two logits products (three pieces each where transposed), grad_input's and
    # grad_weight's
    assert len(by_pieces) == (12 if transposed else 0) and len(split) + len(by_pieces) // 3 >= 6


@pytest.mark.parametrize("rows, cols, piece", [(1, 1031, 100), (29, 1031, 100), (64, 250, 1000), (7, 300, 300),
                                              (65, 300, 128)])
def test_cpu_transposed_product(rng, monkeypatch, rows, cols, piece):
    """_transposed_product: out = a @ W.T, a piece of W's rows at a time (pieces that end short
    of the columns, or one piece), within float32 rounding of float64; transposable only for few
    rows, W.T a transposed view and out's rows contiguous. The trial answers a bool."""
    from jsdgpu.cpu import products
    if products.numpys_sgemm() is None:
        pytest.skip("NumPy's BLAS here is not an OpenBLAS that jsdgpu reaches")
    monkeypatch.setattr(products, "TRANSPOSED_PIECE", piece)
    a = rng.standard_normal((rows, 19)).astype(np.float32)
    w = rng.standard_normal((cols, 19)).astype(np.float32)
    out = np.zeros((rows, cols + 5), np.float32)[:, :cols]  # (rows in a buffer of padded rows)
    assert products._transposable(a, w.T, out) == (rows <= 64 < cols)
    assert not products._transposable(a, np.ascontiguousarray(w.T), out)
    assert not products._transposable(a, w.T, np.empty((cols, rows), np.float32).T)
    assert products._transposed_product(a, w.T, out) is out
    want = a.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    assert products.transposed_is_faster() in (True, False)
