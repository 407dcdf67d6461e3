"""jsdgpu.jax: value and gradients through jax.custom_vjp, on the CPU (and the GPU where JAX
has one)."""

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, assert_upstream_sum_near, make_case, rel_err, weight_sums_spied
from test_topk import make_topk_case

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


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_jit_equals_eager_and_the_reference(rng, jdevice, dtype):
    """jax.jit(jax.value_and_grad(loss)): what the eager call gives, bit for bit on the CPU (the
    same callback runs), and the reference's answer."""
    case = make_case(rng, T=13, dtype=dtype, bias=True, ignored=0.3, vt=1040)
    args = [jax.device_put(jnp.asarray(case[k]), jdevice) for k in
            ("student_input", "student_weight", "teacher_input", "teacher_weight", "target",
             "student_bias", "teacher_bias")]
    f = lambda xs, ws, bs: jjax.fused_linear_jsd_loss(xs, ws, args[2], args[3], args[4], bs, args[6],  # noqa: E731
                                                      beta=0.3, temperature=2.0, chunk_size=5)
    eager = jax.value_and_grad(f, argnums=(0, 1, 2))(args[0], args[1], args[5])
    jitted = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(args[0], args[1], args[5])
    ref = jsdgpu.reference(**case, beta=0.3, temperature=2.0)
    assert abs(float(jitted[0]) - ref[0]) <= 1e-5 * ref[0]
    tol = 1e-4 if dtype == np.float32 else 2.0**-7
    for a, b, want in zip(jitted[1], eager[1], ref[3:]):
        assert rel_err(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))) <= 1e-6
        assert rel_err(np.asarray(a.astype(jnp.float32)), want) <= tol


@pytest.mark.parametrize("held", [True, False])
def test_float32_weight_gradient_in_its_output(rng, jdevice, monkeypatch, held):
    """Jitted, a float32 weight's gradient is formed in the callback's output buffer: where G is
    not held for all rows, its float32 sum over the chunks is kept there (no copy into it after);
    where G is held, the core does not ask for it, and its one product writes there. The
    reference's gradients either way."""
    given = weight_sums_spied(monkeypatch, held)
    case = make_case(rng, T=13, bias=True, ignored=0.3)
    args = [jax.device_put(jnp.asarray(case[k]), jdevice) for k in
            ("student_input", "student_weight", "teacher_input", "teacher_weight", "target",
             "student_bias", "teacher_bias")]
    f = lambda xs, ws, bs: 3.0 * jjax.fused_linear_jsd_loss(xs, ws, args[2], args[3], args[4], bs,  # noqa: E731
                                                             args[6], beta=0.4, chunk_size=4)
    loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(args[0], args[1], args[5])
    # (hold_g, weight_memory given, asked for that often, the sum kept there): G held, not made
    assert given == [(held, True, int(not held), not held)]
    ref = jsdgpu.reference(**case, beta=0.4)
    for got, want in zip(grads, ref[3:]):
        assert got.dtype == np.float32 and rel_err(np.asarray(got), 3.0 * want) <= 1e-4


def counted(monkeypatch, module, name):
    """A list that grows by one at each call of module.name (a loss's call of the core) from now."""
    calls, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


@pytest.fixture
def loss_calls(monkeypatch):
    """The online loss's calls of the core (jsdgpu.api.forward_with) so far."""
    return counted(monkeypatch, jsdgpu.api, "forward_with")


def _rows_own_step(case, device, upstream, jit=True, **opts):
    """(step, student): jax.jit(jax.value_and_grad) (eager where not jit) of the rows' losses
    times upstream, summed, with respect to the student's input and head (and bias, where the
    case has one), and those arrays on device (the bias None where the case has none)."""
    names = ["student_input", "student_weight", "teacher_input", "teacher_weight", "target", "student_bias",
             "teacher_bias"]
    args = [None if case[k] is None else jax.device_put(jnp.asarray(case[k]), device) for k in names]
    weights = opts.pop("token_weights", None)
    weights = None if weights is None else jax.device_put(jnp.asarray(weights), device)
    up = jax.device_put(jnp.asarray(upstream), device)

    def f(xs, ws, bs=None):
        rows = jjax.fused_linear_jsd_loss(xs, ws, args[2], args[3], args[4], bs, args[6], token_weights=weights,
                                          reduction="none", **opts)
        return (rows * up).sum()
    student = (args[0], args[1], args[5])
    step = jax.value_and_grad(f, argnums=(0, 1) if args[5] is None else (0, 1, 2))
    return jax.jit(step) if jit else step, student


def _check_rows_own(value, grads, ref, upstream, dtype=np.float32):
    """A step of the rows' losses times upstream, summed (its value and the student's gradients,
    in dtype), against the float64 reference's results ref for that upstream gradient."""
    assert_upstream_sum_near(value, ref[0], upstream)
    tol = 1e-4 if dtype == np.float32 else 2.0**-7
    for got, want in zip(grads, ref[3:]):
        assert got.dtype == dtype
        assert rel_err(np.asarray(got.astype(jnp.float32)), want) <= tol


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("T,ignored,weighted", [(1, 0.0, False), (13, 0.3, True), (37, 0.0, False),
                                                (300, 0.5, True), (7, 1.0, False)])
def test_rows_own_losses_carry_their_gradients(rng, jdevice, loss_calls, dtype, T, ignored, weighted):
    """reduction "none" without a student bias: forward computes the gradients and hands backward
    G and the rows' parts, so the jitted step calls the loss once (with a bias, whose gradient
    is a sum over the rows, backward computes the call again: twice); both the reference's
    gradients for a random upstream gradient. Only where JAX's default platform is the arrays'
    (else test_rows_own_losses_on_another_platform_than_the_default)."""
    if jdevice.platform != jax.default_backend():
        pytest.skip("the arrays' platform is not JAX's default")
    opts = dict(beta=0.7, temperature=2.0, weight_hard_loss=0.4, weight_soft_loss=0.6)
    for bias, calls in ((False, 1), (True, 2)):
        case = make_case(rng, T=T, dtype=dtype, bias=bias, ignored=ignored, vt=1035)
        upstream = rng.standard_normal(T).astype(np.float32)
        weights = (rng.random(T) * 2).astype(np.float32) if weighted else None
        step, student = _rows_own_step(case, jdevice, upstream, token_weights=weights, **opts)
        loss_calls.clear()
        value, grads = step(*(a for a in student if a is not None))
        jax.block_until_ready(grads)
        assert len(loss_calls) == calls
        _check_rows_own(value, grads, jsdgpu.reference(**case, token_weights=weights, reduction="none",
                                                       grad_output=upstream, **opts), upstream, dtype)


@pytest.mark.parametrize("jit", [True, False])
def test_rows_own_losses_carried_with_soft_caps_and_chunks(rng, jdevice, loss_calls, jit):
    """The carry with the models' scales and soft caps (G in the raw logits) and chunks of 5 rows
    (G held across them), jitted and eagerly: one call, the reference's gradients."""
    if jdevice.platform != jax.default_backend():
        pytest.skip("the arrays' platform is not JAX's default")
    case = make_case(rng, T=17, ignored=0.3, vt=1040, logit_std=8.0)
    upstream = rng.standard_normal(17).astype(np.float32)
    opts = dict(beta=0.5, student_logit_scale=2.0, student_logit_softcap=5.0, teacher_logit_softcap=30.0)
    step, student = _rows_own_step(case, jdevice, upstream, jit, chunk_size=5, **opts)
    value, grads = step(*student[:2])
    jax.block_until_ready(grads)
    assert len(loss_calls) == 1
    _check_rows_own(value, grads, jsdgpu.reference(**case, reduction="none", grad_output=upstream, **opts), upstream)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("T,ignored,opts", [(1, 0.0, dict(beta=0.3)), (13, 0.3, dict(beta=0.0)),
                                            (300, 0.5, dict(missing_mass="renormalize", temperature=2.0))])
def test_topk_rows_own_losses_carry_their_gradients(rng, jdevice, monkeypatch, dtype, T, ignored, opts):
    """The top-k loss's rows' own losses likewise: one call of the core in the jitted step (two
    with a student bias), the reference's gradients for a random upstream gradient."""
    if jdevice.platform != jax.default_backend():
        pytest.skip("the arrays' platform is not JAX's default")
    calls = counted(monkeypatch, jsdgpu.topk, "forward_topk_with")
    for bias, n_calls in ((False, 1), (True, 2)):
        case = make_topk_case(rng, T=T, dtype=dtype, bias=bias, ignored=ignored)
        upstream = rng.standard_normal(T).astype(np.float32)
        put = lambda name: jax.device_put(jnp.asarray(case[name]), jdevice)  # noqa: E731
        student = [put("student_input"), put("student_weight")] + ([put("student_bias")] if bias else [])
        ids, lq, target, up = put("teacher_indices"), put("teacher_logprobs"), put("target"), jnp.asarray(upstream)

        def f(xs, ws, bs=None):
            rows = jjax.fused_linear_topk_jsd_loss(xs, ws, ids, lq, target, bs, reduction="none", **opts)
            return (rows * jax.device_put(up, jdevice)).sum()
        calls.clear()
        value, grads = jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(student)))))(*student)
        jax.block_until_ready(grads)
        assert len(calls) == n_calls
        _check_rows_own(value, grads, jsdgpu.reference_topk(**case, reduction="none", grad_output=upstream, **opts),
                        upstream, dtype)


@pytest.mark.gpu
def test_rows_own_losses_on_another_platform_than_the_default(rng, loss_calls):
    """Arrays committed to the CPU where JAX's default platform is the GPU: the call was planned
    for the GPU's G, so the CPU runs the other branch (the rows' values, then the call again in
    backward: two calls), with the reference's gradients."""
    if jax.default_backend() != "gpu":
        pytest.skip("JAX's default platform is not a GPU here")
    cpu = jax.devices("cpu")[0]
    case = make_case(rng, T=11, ignored=0.3)
    upstream = rng.standard_normal(11).astype(np.float32)
    step, student = _rows_own_step(case, cpu, upstream, beta=0.3)
    value, grads = step(*student[:2])
    jax.block_until_ready(grads)
    assert len(loss_calls) == 2
    _check_rows_own(value, grads, jsdgpu.reference(**case, reduction="none", grad_output=upstream, beta=0.3), upstream)
    assert all(next(iter(g.devices())) == cpu for g in grads)


def test_jitted_training_step_with_optax(rng, jdevice):
    """A jitted optax step over a small model (a linear body and an LM head, the teacher's
    hidden state fixed) whose last hidden state feeds the loss: the loss falls."""
    optax = pytest.importorskip("optax")
    x = jax.device_put(jnp.asarray(rng.standard_normal((32, 12)).astype(np.float32)), jdevice)
    teacher_hidden = jax.device_put(jnp.asarray(rng.standard_normal((32, 24)).astype(np.float32)), jdevice)
    teacher_head = jax.device_put(jnp.asarray((rng.standard_normal((515, 24)) / 3).astype(np.float32)), jdevice)
    labels = jax.device_put(jnp.asarray(rng.integers(0, 515, 32)), jdevice)
    params = {"body": jnp.asarray((rng.standard_normal((12, 16)) / 3).astype(np.float32)),
              "head": jnp.asarray((rng.standard_normal((515, 16)) / 3).astype(np.float32))}
    params = jax.device_put(params, jdevice)
    opt = optax.adamw(1e-2)
    state = opt.init(params)

    def loss_of(p):
        hidden = jnp.tanh(x @ p["body"])
        return jjax.fused_linear_jsd_loss(hidden, p["head"], teacher_hidden, teacher_head, labels, beta=0.5)

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_of)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for _ in range(6):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0], losses


def test_num_valid_tokens(rng):
    case = make_case(rng, T=6, ignored=0.3)
    n = max(1, int((case["target"] != -100).sum()))
    args = [jnp.asarray(case[k]) for k in ("student_input", "student_weight", "teacher_input",
                                           "teacher_weight", "target")]
    loss, g = jax.value_and_grad(jjax.fused_linear_jsd_loss, argnums=1)(*args, num_valid_tokens=4.0 * n)
    ref = jsdgpu.reference(**case)
    assert abs(float(loss) - ref[0] / 4.0) <= 1e-5 * ref[0]
    assert rel_err(np.asarray(g), ref[4] / 4.0) <= 1e-4


def test_options_are_static_numbers(rng):
    """An option passed as a JAX array (a schedule's value traced through jax.jit) raises TypeError
    naming it; static, each value traces once and gives the reference's loss."""
    case = make_case(rng, T=6)
    args = [jnp.asarray(case[k]) for k in ("student_input", "student_weight", "teacher_input",
                                           "teacher_weight", "target")]
    traced = jax.jit(lambda temperature: jjax.fused_linear_jsd_loss(*args, temperature=temperature))
    with pytest.raises(TypeError, match="temperature: the options are Python numbers, static"):
        traced(2.0)
    static = jax.jit(lambda temperature: jjax.fused_linear_jsd_loss(*args, temperature=temperature),
                     static_argnames="temperature")
    for temperature in (1.0, 2.0):
        ref = jsdgpu.reference(**case, temperature=temperature)[0]
        assert abs(float(static(temperature=temperature)) - ref) <= 1e-5 * ref
