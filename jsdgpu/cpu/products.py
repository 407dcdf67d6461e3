"""The CPU backend's matrix products, in one place: NumPy's matmul (its BLAS, OpenBLAS in NumPy's
wheels), or, inside `through(fn)`, fn's. The torch front end's calls on CPU tensors take torch's
(jsdgpu.torch_bridge.current_stream: MKL in PyTorch's x86 wheels; their steps took 0.72-0.83 of
the NumPy call's time, docs/design.md, "The CPU backend")."""

import contextlib
import contextvars

import numpy as np

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
