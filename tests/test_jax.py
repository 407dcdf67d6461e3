"""jsdgpu.jax: value and gradients through jax.custom_vjp, on the CPU (and the GPU where JAX
has one)."""

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, make_case, rel_err

jax = pytest.importorskip("jax")
jjax = pytest.importorskip("jsdgpu.jax")
jnp = jax.numpy


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def jdevice(request):
    try:
        return jax.devices(request.param)[0]
    except RuntimeError:
        pytest.skip(f"JAX has no {request.param} device here")


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("beta,temperature", [(0.0, 2.0), (0.5, 1.0), (1.0, 0.5)])
def test_value_and_grad_against_reference(rng, jdevice, dtype, beta, temperature):
    case = make_case(rng, T=9, dtype=dtype, bias=True, ignored=0.3, vt=1035)
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.4, weight_soft_loss=0.6)
    args = [jax.device_put(jnp.asarray(case[k]), jdevice) for k in
            ("student_input", "student_weight", "teacher_input", "teacher_weight", "target",
             "student_bias", "teacher_bias")]
    f = lambda xs, ws, bs: 3.0 * jjax.fused_linear_jsd_loss(xs, ws, args[2], args[3], args[4], bs,
                                                             args[6], chunk_size=4, **opts)
    loss, (gi, gw, gb) = jax.value_and_grad(f, argnums=(0, 1, 2))(args[0], args[1], args[5])
    ref = jsdgpu.reference(**case, **opts)
    assert abs(float(loss) - 3.0 * ref[0]) <= 1e-5 * max(1.0, 3.0 * ref[0])
    tol = 1e-4 if dtype == np.float32 else 2.0**-7
    for got, want in zip((gi, gw, gb), ref[3:]):
        assert got.dtype == dtype
        assert rel_err(np.asarray(got.astype(jnp.float32)), 3.0 * want) <= tol


def test_under_jit_raises_a_clear_error(rng):
    case = make_case(rng, T=3)
    args = [jnp.asarray(case[k]) for k in ("student_input", "student_weight", "teacher_input",
                                           "teacher_weight", "target")]
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(jjax.fused_linear_jsd_loss)(*args)


def test_num_valid_tokens(rng):
    case = make_case(rng, T=6, ignored=0.3)
    n = max(1, int((case["target"] != -100).sum()))
    args = [jnp.asarray(case[k]) for k in ("student_input", "student_weight", "teacher_input",
                                           "teacher_weight", "target")]
    loss, g = jax.value_and_grad(jjax.fused_linear_jsd_loss, argnums=1)(*args, num_valid_tokens=4.0 * n)
    ref = jsdgpu.reference(**case)
    assert abs(float(loss) - ref[0] / 4.0) <= 1e-5 * ref[0]
    assert rel_err(np.asarray(g), ref[4] / 4.0) <= 1e-4
