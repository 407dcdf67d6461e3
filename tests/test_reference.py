"""The float64 reference checked against itself: its gradient against finite differences of its
loss, and the JSD's known values."""

import numpy as np
import pytest

import jsdgpu
from conftest import make_case


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_gradient_matches_finite_differences(rng, beta, temperature):
    case = {k: None if v is None else v.astype(np.float64) if v.dtype.kind == "f" else v
            for k, v in make_case(rng, T=4, hs=3, ht=5, vs=7, vt=9, bias=True,
                                  ignored=0.3).items()}
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.3, weight_soft_loss=0.7)
    _, _, _, gi, gw, gb = jsdgpu.reference(**case, **opts)
    for name, grad in (("student_input", gi), ("student_weight", gw), ("student_bias", gb)):
        x = case[name]
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            h = 1e-6
            x[idx] += h
            up = jsdgpu.reference(**case, **opts)[0]
            x[idx] -= 2 * h
            down = jsdgpu.reference(**case, **opts)[0]
            x[idx] += h
            numeric[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8, err_msg=name)


def test_identical_student_and_teacher_have_zero_jsd(rng):
    case = make_case(rng, T=5, hs=8, ht=8, vs=50)
    case["teacher_input"], case["teacher_weight"] = case["student_input"], case["student_weight"]
    for beta in (0.0, 0.5, 1.0):
        loss, hard, soft, *_ = jsdgpu.reference(**case, beta=beta)
        assert abs(soft) < 1e-12


def test_jsd_of_disjoint_distributions_is_log2():
    """Student and teacher each certain of a different token: JSD(beta=0.5) = log 2."""
    xs = np.array([[1.0, 0.0]])
    ws = np.array([[0.0, 0.0], [400.0, 0.0]])  # student logits [0, 400]
    wt = np.array([[400.0, 0.0], [0.0, 0.0]])  # teacher logits [400, 0]
    loss, hard, soft, *_ = jsdgpu.reference(xs, ws, xs, wt, np.array([1]), weight_hard_loss=0.0,
                                            weight_soft_loss=1.0)
    assert abs(soft - np.log(2)) < 1e-12 and abs(loss - np.log(2)) < 1e-12
