"""The products (jsdgpu/cuda/products.py) through cuBLASLt, tuned and untuned, against float64: for
the row count a class was tuned on and for others of its class, and for products that add to
their output (not timed) with the scale on the host or on the device."""

import numpy as np
import pytest

from conftest import DTYPES, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture
def fresh_tuning(monkeypatch):
    """products with tuning on or off (the test's choice) and nothing tuned yet."""
    from jsdgpu.cuda import products
    monkeypatch.setattr(products, "_tuned", {})
    monkeypatch.setattr(products, "_references", {})
    products._product.cache_clear()

    def with_tuning(on):
        monkeypatch.setattr(products, "TUNING", on)
        return products
    return with_tuning


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("tuning", [True, False])
@pytest.mark.parametrize("workspace_mib", [0, 32])
def test_logits_against_float64(rng, fresh_tuning, dtype, tuning, workspace_mib):
    import cupy

    from jsdgpu.cuda.steps import leading_dim
    lt = fresh_tuning(tuning)
    h = int(rng.integers(8, 200))
    v = int(rng.integers(900, 1100))  # odd vocabularies too: the row pitch has padding
    w = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(DTYPES[dtype])
    # 37 tunes the class of 37..40 rows (products._bucket), 39 and 40 take its choice; 1 and 65 are
    # classes of their own
    for c in (37, 39, 40, 1, 65):
        x = rng.standard_normal((c, h)).astype(DTYPES[dtype])
        out = cupy.full((c, leading_dim(v)), np.nan, np.float32)  # poisoned: every logit must be written
        # out^T [v, c] = w [h, v]^T @ x [h, c], as products.logits forms it
        lt.gemm(lt.T, lt.N, v, c, h, 1.0, cupy.asarray(w), h, cupy.asarray(x), h, 0.0, out, out.shape[1],
                workspace_bytes=workspace_mib << 20)
        want = x.astype(np.float64) @ w.astype(np.float64).T
        assert rel_err(out[:, :v], want) <= 1e-5, (c, rel_err(out[:, :v], want))
    assert len(lt._tuned) == 3  # the classes, timed or (untuned) at their first candidate


@pytest.mark.parametrize("tuning", [True, False])
def test_a_rows_logits_are_the_same_bits_whatever_rows_they_are_computed_with(rng, fresh_tuning, tuning):
    """products.logits chooses, in each class, among the algorithms that give the bits of one
    reference algorithm (at these shapes, cuBLASLt's candidates give up to three different bits:
    experiments/logits_bits.py): a row's logits are the same bits in a rest of 44 rows after a
    head of 256 (ahead.queue_head's split of a first chunk), alone, or in one product of 300 or
    1000 rows, whichever the process met first; untuned, every class takes the reference."""
    import cupy

    from jsdgpu.cuda.steps import leading_dim
    lt = fresh_tuning(tuning)
    bf16 = DTYPES["bfloat16"]
    h, v = int(rng.integers(16, 300)), int(rng.integers(900, 1100))
    w = cupy.asarray((rng.standard_normal((v, h)) / np.sqrt(h)).astype(bf16))
    x = cupy.asarray(rng.standard_normal((1000, h)).astype(bf16))
    results = []
    for products in ([(256, 300), (0, 256)], [(299, 300)], [(0, 300)], [(0, 1000)]):  # 44 rows first
        out = cupy.full((1000, leading_dim(v)), np.nan, np.float32)
        for start, stop in products:
            lt.logits(x[start:stop], w, out[start:stop])
        results.append(out[:, :v].get())
    whole = results[-1]
    want = x.get().astype(np.float64) @ w.get().astype(np.float64).T
    assert rel_err(whole, want) <= 1e-5
    for products, out in zip(([(0, 300)], [(299, 300)], [(0, 300)]), results):
        rows = slice(products[0][0], 300)
        assert np.array_equal(out[rows], whole[rows]), products
    if not tuning:
        assert len({bytes(algo) for algo in lt._tuned.values()}) == 1


@pytest.mark.parametrize("device_alpha", [False, True])
def test_accumulating_products(rng, fresh_tuning, device_alpha):
    """grad_weight's form, out [V, Hs] = alpha G^T @ Xs + beta out: the first product (beta 0)
    tunes its class, the second adds to out by the class's choice, the third, of another class,
    adds by the heuristic's first candidate (it is not timed), which stays its class's choice when
    a product of the class that is timed comes (the fourth): a call's bits do not change."""
    import cupy

    lt = fresh_tuning(True)
    bf16 = DTYPES["bfloat16"]
    v, hs = int(rng.integers(900, 1100)), int(rng.integers(8, 100))
    out = cupy.full((v, hs), np.nan, np.float32)
    want = np.zeros((v, hs))
    choices = []
    for c, beta in ((37, 0.0), (40, 1.0), (100, 1.0), (103, 0.0)):  # classes of 40 and 104 rows
        G, xs = rng.standard_normal((c, v)).astype(bf16), rng.standard_normal((c, hs)).astype(bf16)
        alpha = float(rng.uniform(0.5, 2.0))
        scale = cupy.asarray(np.float32(alpha)) if device_alpha else alpha
        # column-major: out^T [Hs, V] = alpha Xs^T [Hs, c] @ G [c, V] + beta out^T
        lt.gemm(lt.N, lt.T, hs, v, c, scale, cupy.asarray(xs), hs, cupy.asarray(G), v, beta, out, hs)
        want = np.float32(alpha) * (G.astype(np.float64).T @ xs.astype(np.float64)) + beta * want
        assert rel_err(out, want) <= 1e-5, (c, rel_err(out, want))
        choices.append({key: bytes(algo) for key, algo in lt._tuned.items()})
    assert [len(c) for c in choices] == [1, 1, 2, 2]
    assert choices[3] == choices[2]


def test_long_sums_against_float64(rng, fresh_tuning):
    """grad_input's form, few outputs over a long sum (k the vocabulary): the shape whose fastest
    algorithms split k over CTAs, which takes the workspace."""
    import cupy

    lt = fresh_tuning(True)
    bf16 = DTYPES["bfloat16"]
    c, hs, v = int(rng.integers(1, 40)), int(rng.integers(8, 100)), int(rng.integers(40000, 60000))
    G, ws = rng.standard_normal((c, v)).astype(bf16), rng.standard_normal((v, hs)).astype(bf16)
    out = cupy.full((c, hs), np.nan, np.float32)
    lt.input_gradient(cupy.asarray(G), cupy.asarray(ws), 0.5, out)
    want = 0.5 * G.astype(np.float64) @ ws.astype(np.float64)
    # float32 sums of 40000-60000 terms: about 1e-5 from their rounding; a split's sums lost or
    # added twice are O(1)
    assert rel_err(out, want) <= 1e-4, rel_err(out, want)


_PRODUCTS_IN_A_PROCESS = """
import hashlib, json, sys
import cupy, numpy as np, ml_dtypes
from jsdgpu.cuda import products
timed = []
fastest = products._fastest
products._fastest = lambda runs: timed.append(len(runs)) or fastest(runs)
rng = np.random.default_rng(int(sys.argv[1]))
x, w = (cupy.asarray(rng.standard_normal(s).astype(ml_dtypes.bfloat16)) for s in ((300, 64), (5003, 64)))
out = cupy.empty((300, 5003), np.float32)
products.logits(x, w, out)
products.logits(x[:37], w, out[:37])
grad = cupy.empty((300, 64), np.float32)
products.input_gradient(out.astype(ml_dtypes.bfloat16), w, 0.5, grad)
print(json.dumps({"timed": len(timed), "tuned": {repr(k[1:]): bytes(a).hex() for k, a in products._tuned.items()},
                  "bits": hashlib.sha256(out.get().tobytes() + grad.get().tobytes()).hexdigest()}))
"""


def test_a_new_process_takes_the_choices_kept_on_disk(tmp_path):
    """A process times its classes and keeps each choice in JSDGPU_GEMM_CACHE's file; the next
    process, on the same inputs, times none, takes the same choices and gives the same bits."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, JSDGPU_GEMM_CACHE=str(tmp_path / "gemm.jsonl"), JSDGPU_GEMM_TUNING="1")
    seed = str(np.random.default_rng().integers(2**31))
    first, second = (json.loads(subprocess.run([sys.executable, "-c", _PRODUCTS_IN_A_PROCESS, seed], env=env,
                                               capture_output=True, text=True, check=True).stdout)
                     for _ in range(2))
    assert first["timed"] == len(first["tuned"]) == 3  # the two logits classes and grad_input's
    assert len((tmp_path / "gemm.jsonl").read_text().splitlines()) == 3
    assert second["timed"] == 0
    assert second["tuned"] == first["tuned"]
    assert second["bits"] == first["bits"]
