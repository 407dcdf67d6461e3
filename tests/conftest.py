"""Shared test helpers: random cases, array kinds, the gpu marker.

Every case draws fresh random inputs; the seed is printed so a failure can be replayed
(JSDGPU_SEED=<seed> pytest ...).
"""

import os
import secrets

# JAX would take 75% of the GPU's memory when it starts, leaving CuPy and torch too little
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

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


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module of the backend under test."""
    if request.param == "cupy":
        import cupy
        return cupy
    return np


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


def rel_err(a, ref):
    a = np.asarray(to_numpy(a), dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30)


def round_to(a, dtype):
    """a rounded to dtype and back to float64: the error of merely storing it in dtype."""
    return np.asarray(a, dtype=dtype).astype(np.float64)
