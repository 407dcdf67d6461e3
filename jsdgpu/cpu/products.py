"""The CPU backend's matrix products, in one place: NumPy's matmul (its BLAS, OpenBLAS in NumPy's
wheels), or, inside `through(fn)`, fn's; and a product added into its output (`add_product`: a
chunk's part of grad_weight), by OpenBLAS's sgemm where NumPy's products are the call's, which also
runs a chunk's logits product of few rows transposed where that is faster. The torch front end's
calls on CPU tensors take the faster of torch's BLAS (MKL in PyTorch's x86 wheels) and NumPy's, by a
trial product once a process (`faster_of`, from jsdgpu.torch_bridge.current_stream): which one is
faster depends on the machine (docs/design.md, "The CPU backend").

Inside `own_threads()` (every call of the backend: CpuSteps.on_device), a call whose row kernels
run on Numba's threads (its first product's arrays past cpu/threads.py's PARALLEL_FROM values)
splits each product over threads of our own, one piece a thread, with NumPy's OpenBLAS on one
thread meanwhile. OpenBLAS's own threads keep spinning for a while after each product (2^28
cycles unless OPENBLAS_THREAD_TIMEOUT was set before NumPy loaded it), on the cores the row
kernel runs on next, where ours wait on a queue: steps took 13-15% less on two cores
(docs/design.md, "The CPU backend"). A smaller call, whose kernels run on one thread, keeps
OpenBLAS's threads, which split a product at less cost. OpenBLAS's thread count is the
process's: it is set back when the last product that set it ends."""

import concurrent.futures
import contextlib
import contextvars
import ctypes
import functools
import os
import pathlib
import re
import threading
import time

import numpy as np
from numba import get_num_threads

from .threads import PARALLEL_FROM

_MATMUL = contextvars.ContextVar("jsdgpu_cpu_matmul", default=None)


def matmul(a, b, out):
    """out = a @ b, float32 2-D arrays (a view of either transposed is fine); out is returned."""
    fn = _MATMUL.get()
    if fn is None:
        return np.matmul(a, b, out=out)
    return fn(a, b, out)


@contextlib.contextmanager
def through(fn):
    """For the block (in this thread or task), matmul is fn(a, b, out)."""
    token = _MATMUL.set(fn)
    try:
        yield
    finally:
        _MATMUL.reset(token)


def split_matmul(a, b, out):
    """out = a @ b in as many pieces as Numba has threads (its larger dimension cut into
    near-equal parts), each by NumPy's matmul with OpenBLAS on one thread, one piece on this
    thread and the others on our pool's."""
    return _split(lambda x, y, z: np.matmul(x, y, out=z), a, b, out)


def _split(product, a, b, out):
    """product(x, y, z) over the pieces of out = a @ b (split_matmul's), one piece on this thread
    and the others on our pool's, with OpenBLAS on one thread; out is returned."""
    m, n = out.shape
    pieces = get_num_threads()
    if pieces < 2:
        product(a, b, out)
        return out
    edges = np.linspace(0, max(m, n), pieces + 1).astype(int)
    if m >= n:
        parts = [(a[i:j], b, out[i:j]) for i, j in zip(edges[:-1], edges[1:])]
    else:
        parts = [(a, b[:, i:j], out[:, i:j]) for i, j in zip(edges[:-1], edges[1:])]
    pool = _pool(pieces - 1, os.getpid())
    with _openblas_on_one_thread():
        futures = [pool.submit(product, *part) for part in parts[1:]]
        product(*parts[0])
        for f in futures:
            f.result()
    return out


def add_product(a, b, out):
    """out += a @ b (float32 2-D arrays, a view of either transposed; out's rows contiguous) by
    the sgemm of NumPy's OpenBLAS with beta 1, where NumPy's products are the call's (split as
    its others are): no product of its own to add, and no pass over out to add it (a chunk's part
    of grad_weight, formed a block at a time and added, took 19.2 ms against 12.3 at 32 rows of
    V = 128256, H = 256; docs/design.md, "The CPU backend"). False, with nothing done, where
    another BLAS runs the call's products or NumPy's sgemm is not reached."""
    sgemm, out_layout = numpys_sgemm(), _layout(out)
    if sgemm is None or _layout(a) is None or _layout(b) is None or out_layout is None or out_layout[0]:
        return False
    fn = _MATMUL.get()
    if fn is None:  # outside a call: OpenBLAS's own threads
        sgemm(a, b, out, beta=1.0)
        return True
    call = getattr(fn, "__self__", None)
    return isinstance(call, _CallProducts) and call.add(a, b, out)


def _layout(x):
    """(transposed, leading dimension) of a float32 2-D array as BLAS takes it (a row-major
    matrix or its transposed view), or None."""
    rows, cols = x.shape
    if x.strides[1] == 4 and x.strides[0] >= 4 * max(1, cols):
        return False, x.strides[0] // 4
    if x.strides[0] == 4 and x.strides[1] >= 4 * max(1, rows):
        return True, x.strides[1] // 4
    return None


@functools.lru_cache(maxsize=4)
def _pool(workers, pid):
    """A pool of the process pid (a child forked from a process with a pool makes its own: the
    parent's threads are not in it)."""
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jsdgpu-product")


@functools.lru_cache(maxsize=1)
def _numpys_openblas_library():
    """(the OpenBLAS NumPy loaded, its symbols' prefix and suffix) (found among the process's
    mapped libraries, in NumPy's folders: Linux), or None (another BLAS, or another system)."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        return None
    numpy_folder = str(pathlib.Path(np.__file__).parent)  # numpy/ and the wheel's numpy.libs/
    for path in sorted({p for p in re.findall(r"(/\S*openblas\S*\.so\S*)", maps) if p.startswith(numpy_folder)}):
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"), ("openblas", "")):
            if all(hasattr(lib, f"{prefix}_{name}_num_threads{suffix}") for name in ("set", "get")):
                return lib, prefix, suffix
    return None


@functools.lru_cache(maxsize=1)
def numpys_openblas():
    """(set_num_threads, get_num_threads) of the OpenBLAS NumPy loaded, or None."""
    found = _numpys_openblas_library()
    if found is None:
        return None
    lib, prefix, suffix = found
    set_threads, get_threads = (getattr(lib, f"{prefix}_{name}_num_threads{suffix}") for name in ("set", "get"))
    set_threads.argtypes, set_threads.restype = [ctypes.c_int], None
    get_threads.restype = ctypes.c_int
    return set_threads, get_threads


@functools.lru_cache(maxsize=1)
def numpys_sgemm():
    """sgemm(a, b, out, beta): out = a @ b + beta out by the cblas_sgemm of the OpenBLAS NumPy
    loaded (its integers 64-bit where its symbols end in 64_), a and b as _layout takes them; or
    None."""
    found = _numpys_openblas_library()
    if found is None:
        return None
    lib, prefix, suffix = found
    fn = getattr(lib, f"{'scipy_' if prefix.startswith('scipy') else ''}cblas_sgemm{suffix}", None)
    if fn is None:
        return None
    index = ctypes.c_int64 if suffix == "64_" else ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, index, index, index, ctypes.c_float, ctypes.c_void_p,
                   index, ctypes.c_void_p, index, ctypes.c_float, ctypes.c_void_p, index]
    fn.restype = None
    row_major, no_trans, trans = 101, 111, 112

    def sgemm(a, b, out, beta):
        (ta, lda), (tb, ldb), (_, ldc) = _layout(a), _layout(b), _layout(out)
        m, n = out.shape
        if m and n:
            fn(row_major, trans if ta else no_trans, trans if tb else no_trans, m, n, a.shape[1], 1.0, a.ctypes.data,
               lda, b.ctypes.data, ldb, beta, out.ctypes.data, ldc)
    return sgemm


class _OneThreadBlas:
    """How many products in this process are inside _openblas_on_one_thread, and OpenBLAS's
    thread count before the first of them."""
    lock = threading.Lock()
    inside = 0
    before = None


@contextlib.contextmanager
def _openblas_on_one_thread():
    """For the block, NumPy's OpenBLAS on one thread (where numpys_openblas finds it), set back
    when the last of several threads' blocks at once ends."""
    openblas = numpys_openblas()
    if openblas is None:
        yield
        return
    set_threads, get_threads = openblas
    state = _OneThreadBlas
    with state.lock:
        if state.inside == 0:
            state.before = get_threads()
            set_threads(1)
        state.inside += 1
    try:
        yield
    finally:
        with state.lock:
            state.inside -= 1
            if state.inside == 0:
                set_threads(state.before)


class _CallProducts:
    """A call's products, as its first product says: all split (split_matmul) or none, split
    where one of its arrays holds PARALLEL_FROM values or more, as the chunk's logits do where
    the row kernels run on Numba's threads (smaller, the kernels run on one thread, beside which
    OpenBLAS's spinning threads take no core they need; and a call whose products mixed both
    ways would leave OpenBLAS's threads spinning beside ours). With other (another BLAS's
    matmul, faster_of's), all by other unless NumPy's ran the trial faster (numpy_is_faster).
    Split products of few rows run transposed (_transposed_product) where transposed says so, by
    default where the trial finds that faster (transposed_is_faster)."""

    def __init__(self, other=None, transposed=None):
        self.split = None
        self.other = other
        self.transposed = transposed

    def matmul(self, a, b, out):
        if self.split is None:
            if self.other is not None and not numpy_is_faster(self.other):
                self.split = False
            else:
                self.other = None
                self.split = (get_num_threads() > 1 and numpys_openblas() is not None
                              and max(a.size, b.size, out.size) >= PARALLEL_FROM)
        if self.other is not None:
            return self.other(a, b, out)
        if not self.split:
            return np.matmul(a, b, out=out)
        if _transposable(a, b, out):
            if self.transposed is None:
                self.transposed = transposed_is_faster()
            if self.transposed:
                return _split(_transposed_product, a, b, out)
        return split_matmul(a, b, out)

    def add(self, a, b, out):
        """out += a @ b (add_product's) where NumPy's products are the call's, split as they are;
        False where another BLAS's are (or none ran yet: nothing decided)."""
        if self.split is None or self.other is not None:
            return False
        sgemm_add = functools.partial(numpys_sgemm(), beta=1.0)
        if self.split:
            _split(sgemm_add, a, b, out)
        else:
            sgemm_add(a, b, out)
        return True


# A split logits product of at most this many rows (a chunk's, where the default budget's chunks
# are short: V = 128256 and T up to about 1000) runs transposed where the trial finds that faster
# (transposed_is_faster), TRANSPOSED_PIECE of the vocabulary's rows at a time, whose [piece, rows]
# buffer (1 MiB at 64 rows) stays in the core's cache
TRANSPOSED_UP_TO = 64
TRANSPOSED_PIECE = 4096


def _transposable(a, b, out):
    """Whether out = a @ b is a product of few rows that _transposed_product takes: out's rows
    contiguous, b a row-major matrix's transposed view (the LM head's W.T), and a as BLAS takes
    it."""
    rows, cols = out.shape
    b_layout, out_layout = _layout(b), _layout(out)
    return (rows <= TRANSPOSED_UP_TO < cols and numpys_sgemm() is not None and _layout(a) is not None
            and b_layout is not None and b_layout[0] and out_layout is not None and not out_layout[0])


def _transposed_product(a, b, out):
    """out = a @ b as (b.T @ a.T).T: TRANSPOSED_PIECE of out's columns at a time into a buffer by
    OpenBLAS's sgemm, then copied into out's columns. On two cores of the Zen 4 EPYC OpenBLAS ran
    [32, 256] @ [256, 128256] in 20.0 ms so against 25.1 as NumPy calls it, 31.5 against 33.4 at
    64 rows, and lost from about 96 rows, the same bits (docs/design.md, "The CPU backend")."""
    rows, cols = out.shape
    sgemm, w = numpys_sgemm(), b.T
    buffer = np.empty((min(cols, TRANSPOSED_PIECE), rows), np.float32)
    for start in range(0, cols, TRANSPOSED_PIECE):
        part = buffer[:min(TRANSPOSED_PIECE, cols - start)]
        sgemm(w[start:start + len(part)], a.T, part, beta=0.0)
        out[:, start:start + len(part)] = part.T  # (NumPy's copy lets go of the GIL: the threads' copies overlap)
    return out


def _best_time(fn, *args):
    """The best of three calls of fn(*args), after one, in seconds."""
    fn(*args)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


@functools.lru_cache(maxsize=1)
def transposed_is_faster():
    """Whether the trial's logits product of TRANSPOSED_UP_TO rows ([64, 256] @ [256, 8192], split
    as a large call's are) ran faster transposed (_transposed_product) than as NumPy calls it, in
    this process: OpenBLAS's speed at either form is its loop order's, measured on one kind of
    machine only (about 0.03 s and 10 MB, once)."""
    rng = np.random.default_rng(0)
    a = rng.random((TRANSPOSED_UP_TO, 256), np.float32)
    w = rng.random((8192, 256), np.float32)
    out = np.empty((len(a), len(w)), np.float32)
    return _best_time(_split, _transposed_product, a, w.T, out) < _best_time(split_matmul, a, w.T, out)


# the trial product of numpy_is_faster: [rows, H] @ [H, V], its output PARALLEL_FROM values (as a
# chunk's logits product where NumPy's would be split), about 0.02 s
TRIAL_SHAPE = (512, 256, PARALLEL_FROM // 512)


@functools.lru_cache(maxsize=None)
def numpy_is_faster(other):
    """Whether NumPy's products (as a large call takes them: _CallProducts) ran the trial product
    faster than other(a, b, out), in this process: the best of three each, after one. On two
    cores of an AMD EPYC NumPy's OpenBLAS took 0.64-0.85 times MKL's time on the three products'
    shapes at T = 512, V = 128256, where on a Xeon MKL's steps were faster (docs/design.md, "The
    CPU backend"); about 0.2 s, once. Small products are taken as large ones are: the trial's
    answer is the machine's."""
    m, k, n = TRIAL_SHAPE
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    out = np.empty((m, n), np.float32)
    return _best_time(_CallProducts().matmul, a, b, out) < _best_time(other, a, b, out)


def faster_of(other):
    """For the block (a call), matmul is a _CallProducts' with other (another BLAS's matmul)."""
    return through(_CallProducts(other).matmul)


def own_threads():
    """For the block (a call), matmul is a _CallProducts', unless `through` named another or
    NumPy's BLAS is not an OpenBLAS we can reach (its threads are then left as they are)."""
    if numpys_openblas() is None or _MATMUL.get() is not None:
        return contextlib.nullcontext()
    return through(_CallProducts().matmul)
