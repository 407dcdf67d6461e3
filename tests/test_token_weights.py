"""Per-token weights (token_weights) and the "sum" reduction (docs/contract.md, "Token weights and
reductions"), for the online loss and the top-k loss, on both backends, against the float64
reference: weights zero, large and mixed, ignored rows, G held for all rows or per chunk, chunks
that end inside a call, the capturable mode, and the bad inputs."""

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, DTYPES, assert_upstream_sum_near, make_case, rel_err, to_numpy, to_xp
from test_api import check_against_reference
from test_topk import make_topk_case

WEIGHTS = ("mixed", "zeros", "large")


def token_weights(rng, T, kind):
    """[T] float32 weights: uniform in [0, 3) with some exact zeros (mixed), all zero but one
    (zeros), or up to 1e4 (large)."""
    w = rng.uniform(0.0, 3.0, T)
    if kind == "zeros":
        w = np.zeros(T)
        w[rng.integers(T)] = 1.5
    elif kind == "large":
        w = 10.0 ** rng.uniform(0, 4, T)
    w[rng.random(T) < 0.2] = 0.0
    return w.astype(np.float32)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size,memory_budget", [(None, None), (5, None), (4, 1)])  # G held; per chunk
def test_online_against_float64(xp, rng, weights, reduction, chunk_size, memory_budget):
    T = int(rng.integers(1, 30))
    case = make_case(rng, T=T, vs=int(rng.integers(200, 1100)), vt=1103, bias=bool(rng.integers(2)), ignored=0.3)
    case["token_weights"] = token_weights(rng, T, weights)
    check_against_reference(case, xp, np.dtype(np.float32), chunk_size=chunk_size, memory_budget=memory_budget,
                            grad_output=0.7, reduction=reduction, beta=float(rng.choice([0.0, 0.4, 1.0])),
                            temperature=float(rng.choice([0.5, 1.0, 3.0])))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("memory_budget", [None, 1])
def test_online_16bit_gpu(rng, dtype, reduction, memory_budget):
    import cupy
    T = int(rng.integers(20, 300))
    case = make_case(rng, T=T, vs=1031, vt=1040, dtype=DTYPES[dtype], bias=True, ignored=0.3)
    case["token_weights"] = token_weights(rng, T, "mixed")
    check_against_reference(case, cupy, DTYPES[dtype], memory_budget=memory_budget, reduction=reduction)


def check_topk(xp, case, dtype, chunk_size=None, memory_budget=None, **options):
    loss, ctx = jsdgpu.forward_topk(**to_xp(case, xp), chunk_size=chunk_size, memory_budget=memory_budget,
                                    **options)
    grads = jsdgpu.backward(ctx, 0.7)
    ref = jsdgpu.reference_topk(**case, grad_output=0.7, **options)
    for got, want in ((loss, ref[0]), (ctx.hard_loss, ref[1]), (ctx.soft_loss, ref[2])):
        assert abs(float(got) - want) <= 2e-5 * max(1.0, abs(want)), (float(got), want)
    eps = 1e-4 if dtype == np.float32 else 2 * 2.0**-8
    for got, want in zip(grads, ref[3:]):
        if want is not None:
            assert np.isfinite(to_numpy(got).astype(np.float64)).all()
            assert rel_err(got, want) <= eps, rel_err(got, want)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("missing_mass", ["bucket", "renormalize"])
@pytest.mark.parametrize("chunk_size,memory_budget", [(None, None), (4, 1)])
def test_topk_against_float64(xp, rng, weights, reduction, missing_mass, chunk_size, memory_budget):
    T = int(rng.integers(1, 30))
    case = make_topk_case(rng, T=T, vs=int(rng.integers(100, 600)), k=int(rng.integers(1, 40)))
    case["token_weights"] = token_weights(rng, T, weights)
    check_topk(xp, case, np.float32, missing_mass=missing_mass, reduction=reduction, chunk_size=chunk_size,
               memory_budget=memory_budget, temperature=float(rng.choice([1.0, 2.0])))


@pytest.mark.gpu
@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_bf16_queued_ahead(rng, monkeypatch, own, temperature):
    """bf16: G stored with row scales (at temperature 1), the logits product of our own, and the
    first chunk's row work queued before the wait (the second and third calls, like the first):
    the weights times G's own row scales."""
    import cupy

    from jsdgpu.cuda import topk_work
    monkeypatch.setattr(topk_work, "OWN_TOPK_PRODUCT", own)
    T = 300
    case = make_topk_case(rng, T=T, vs=5003, hs=256, k=40, dtype=BF16, ignored=0.0)
    for _ in range(3):
        case["token_weights"] = token_weights(rng, T, "mixed")
        check_topk(cupy, case, BF16, temperature=temperature, reduction="sum")


@pytest.mark.parametrize("loss", ["online", "topk"])
def test_capturable_weights_and_a_bad_weight(xp, rng, loss):
    """The capturable mode gives the default mode's results; a bad weight there (no host wait:
    nothing can raise) makes the loss NaN."""
    T = 9
    if loss == "online":
        case, call = make_case(rng, T=T, bias=True, ignored=0.3), jsdgpu.forward
    else:
        case, call = make_topk_case(rng, T=T), jsdgpu.forward_topk
    case["token_weights"] = token_weights(rng, T, "mixed")
    default, _ = call(**to_xp(case, xp))
    captured, ctx = call(**to_xp(case, xp), capturable=True)
    np.testing.assert_allclose(float(captured), float(default), rtol=1e-6)
    case["token_weights"][4] = np.nan
    bad, _ = call(**to_xp(case, xp), capturable=True)
    assert np.isnan(float(bad))


@pytest.mark.parametrize("bad,error", [("nan", ValueError), ("negative", ValueError), ("inf", ValueError),
                                       ("shape", ValueError), ("rank", ValueError), ("int", TypeError)])
@pytest.mark.parametrize("loss", ["online", "topk"])
def test_bad_weights_raise(xp, rng, bad, error, loss):
    T = 7
    case = make_case(rng, T=T) if loss == "online" else make_topk_case(rng, T=T)
    w = np.ones(T, np.float32)
    w = {"nan": np.where(np.arange(T) == 3, np.nan, w), "negative": -w, "inf": w * np.inf,
         "shape": w[:5], "rank": w[:, None], "int": w.astype(np.int32)}[bad]
    call = jsdgpu.forward if loss == "online" else jsdgpu.forward_topk
    with pytest.raises(error, match=r"token_weights\[3\]" if bad == "nan" else "token_weights"):
        call(**to_xp(case, xp), token_weights=xp.asarray(w))


def test_the_first_bad_weight_is_named(xp, rng):
    """Past the checking kernel's first block of rows (256), among ignored rows too: the first
    bad weight's row and value."""
    T = 1500
    case = make_case(rng, T=T, ignored=0.3)
    w = rng.random(T).astype(np.float32)
    w[[1234, 1400]] = -0.5, np.nan
    with pytest.raises(ValueError, match=r"token_weights\[1234\] = -0\.5"):
        jsdgpu.forward(**to_xp(case, xp), token_weights=xp.asarray(w))


def test_reductions_checked(rng):
    case = make_case(rng, T=3)
    with pytest.raises(ValueError, match="reduction"):
        jsdgpu.forward(**case, reduction="average")
    for reduction in ("sum", "none"):
        with pytest.raises(ValueError, match="num_valid_tokens"):
            jsdgpu.forward(**case, reduction=reduction, num_valid_tokens=4)


@pytest.mark.parametrize("loss", ["online", "topk"])
@pytest.mark.parametrize("T", [1, 5])
def test_rows_own_losses_of_ignored_rows_alone(xp, rng, loss, T):
    """reduction "none" where every row is ignored: zero losses, and zero gradients for any
    grad_output (forward keeps its gradients, of no row: a JSDGPU_SEED=17306165 draw of the test
    below had T = 1, its one row ignored)."""
    case = make_case(rng, T=T) if loss == "online" else make_topk_case(rng, T=T)
    case["target"] = np.full(T, -100)
    call = jsdgpu.forward if loss == "online" else jsdgpu.forward_topk
    out, ctx = call(**to_xp(case, xp), reduction="none")
    assert out.shape == (T,) and not to_numpy(out).any()
    for g in jsdgpu.backward(ctx, xp.asarray(rng.standard_normal(T), dtype=np.float32)):
        assert g is None or not to_numpy(g).any()


@pytest.mark.parametrize("loss", ["online", "topk"])
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("chunk_size,memory_budget", [(None, None), (4, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_own_losses_against_float64(xp, rng, loss, capturable, chunk_size, memory_budget, bias):
    """reduction "none": the loss, hard and soft parts per row ([T], 0 where ignored) and the
    gradients of backward(grad_output [T]) (a random upstream gradient, negative entries too) as
    the float64 reference's; a scalar grad_output is each row's; a grad_output of another shape
    raises. Both ways: the gradients kept from forward (G held, no bias) and the call run again
    (a bias, or a budget that holds no G)."""
    T = int(rng.integers(1, 25))
    if loss == "online":
        case, call, reference = make_case(rng, T=T, bias=bias, ignored=0.3), jsdgpu.forward, jsdgpu.reference
    else:
        case, call, reference = make_topk_case(rng, T=T, bias=bias), jsdgpu.forward_topk, jsdgpu.reference_topk
    case["token_weights"] = token_weights(rng, T, "mixed")
    upstream = rng.standard_normal(T)
    out, ctx = call(**to_xp(case, xp), reduction="none", capturable=capturable, chunk_size=chunk_size,
                    memory_budget=memory_budget, beta=0.3)
    assert (ctx._recompute is None) == (not bias and memory_budget is None)  # which way backward goes
    grads = jsdgpu.backward(ctx, xp.asarray(upstream, dtype=np.float32))
    ref = reference(**case, reduction="none", grad_output=upstream, beta=0.3)
    for got, want in ((out, ref[0]), (ctx.hard_loss, ref[1]), (ctx.soft_loss, ref[2])):
        assert got.shape == (T,)
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref[3:]):
        if want is not None:
            assert rel_err(got, want) <= 1e-4, rel_err(got, want)
    _, ctx = call(**to_xp(case, xp), reduction="none", beta=0.3)
    whole = jsdgpu.backward(ctx, 2.0)
    ref = reference(**case, reduction="none", grad_output=np.full(T, 2.0), beta=0.3)
    assert rel_err(whole[1], ref[4]) <= 1e-4
    _, ctx = call(**to_xp(case, xp), reduction="none", beta=0.3)
    with pytest.raises(ValueError, match="grad_output"):
        jsdgpu.backward(ctx, xp.ones(T + 1, np.float32))


def test_a_weighted_mean_by_num_valid_tokens(xp, rng):
    """The weighted mean of the rows' losses: num_valid_tokens = the weights' sum."""
    T = 11
    case = make_case(rng, T=T, ignored=0.3)
    w = token_weights(rng, T, "mixed")
    total, _ = jsdgpu.forward(**to_xp(case, xp), token_weights=xp.asarray(w), reduction="sum")
    valid_sum = float(w[case["target"] != -100].sum())
    mean, _ = jsdgpu.forward(**to_xp(case, xp), token_weights=xp.asarray(w), num_valid_tokens=valid_sum)
    np.testing.assert_allclose(float(mean), float(total) / valid_sum, rtol=1e-6)


# ---- the front ends: per-call token weights (the labels' leading shape) and the module's reduction ----

@pytest.mark.parametrize("loss", ["online", "topk"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_modules_take_weights_per_call(rng, torch_device, loss, compiled, reduction):
    """FusedLinearJSDLoss(reduction=...)(..., token_weights=w) and the top-k module, inputs of
    leading shape [2, 5], eager and under torch.compile(fullgraph=True): the loss (with "none",
    [2, 5], backpropagated with a random upstream gradient) and the student's gradients as the
    float64 reference's."""
    torch = pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    T = 10
    if loss == "online":
        case = make_case(rng, T=T, bias=True, ignored=0.3)
        names = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target", "student_bias",
                 "teacher_bias")
        module, reference = jtorch.FusedLinearJSDLoss(beta=0.3, reduction=reduction), jsdgpu.reference
    else:
        case = make_topk_case(rng, T=T)
        names = ("student_input", "student_weight", "teacher_indices", "teacher_logprobs", "target", "student_bias")
        module, reference = jtorch.FusedLinearTopKJSDLoss(beta=0.3, reduction=reduction), jsdgpu.reference_topk
    w = token_weights(rng, T, "mixed")
    ts = [torch.from_numpy(case[n]).to(torch_device) for n in names]
    for i in (0, 1, len(ts) - 1 if loss == "topk" else 5):  # the student's input, weight and bias
        ts[i].requires_grad_(True)
    lead = lambda t: t.reshape(2, 5, *t.shape[1:])  # noqa: E731
    args = [lead(t) if n in ("student_input", "teacher_input", "teacher_indices", "teacher_logprobs", "target")
            else t for n, t in zip(names, ts)]
    call = lambda *a, token_weights: module(*a, token_weights=token_weights)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True)
    out = call(*args, token_weights=torch.from_numpy(w).to(torch_device).reshape(2, 5))
    upstream = rng.standard_normal(T) if reduction == "none" else None
    if upstream is None:
        out.backward()
    else:
        assert out.shape == (2, 5)
        (out * torch.from_numpy(upstream).float().to(torch_device).reshape(2, 5)).sum().backward()
    ref = reference(**case, token_weights=w, reduction=reduction, beta=0.3, grad_output=upstream)
    np.testing.assert_allclose(out.detach().cpu().numpy().ravel(), np.ravel(ref[0]), rtol=1e-5, atol=1e-6)
    for t, want in zip((ts[0], ts[1], ts[len(ts) - 1 if loss == "topk" else 5]), ref[3:]):
        assert rel_err(t.grad.cpu().numpy(), want) <= 1e-4


@pytest.mark.parametrize("loss", ["online", "topk"])
def test_torch_weights_that_want_a_gradient_raise(rng, torch_device, loss):
    """token_weights that require a gradient raise ValueError naming them, where autograd is on (the
    loss gives them none, as PyTorch's own losses give their `weight` none); under torch.no_grad
    the same tensor is taken, and gives the loss of its detached values."""
    torch = pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    T = 7
    if loss == "online":
        case = make_case(rng, T=T, bias=False)
        names = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target")
        module = jtorch.FusedLinearJSDLoss(beta=0.3)
    else:
        case = make_topk_case(rng, T=T, bias=False)
        names = ("student_input", "student_weight", "teacher_indices", "teacher_logprobs", "target")
        module = jtorch.FusedLinearTopKJSDLoss(beta=0.3)
    ts = [torch.from_numpy(case[n]).to(torch_device) for n in names]
    ts[0].requires_grad_(True)
    w = torch.from_numpy(token_weights(rng, T, "mixed")).to(torch_device).requires_grad_(True)
    with pytest.raises(ValueError, match="token_weights"):
        module(*ts, token_weights=w)
    with torch.no_grad():
        wanted = module(*ts, token_weights=w)
    assert module(*ts, token_weights=w.detach()).item() == pytest.approx(wanted.item(), rel=1e-6)


# what the student's gradients of compiled_rows_step may differ from the float64 reference's by,
# relative: bf16 tensors, 2^-7; under autocast G is 16-bit on the GPU, and its rounding, 2^-9 a
# value, bounds it (1.01e-4 once on the H200 for the top-k loss, 1.12e-4 for the online one; the
# CPU's float32 G gives 1e-7); float32, 1e-4
GRAD_TOLERANCE = {"bf16": 2.0**-7, "autocast": 2.0**-9, None: 1e-4}


def compiled_rows_step(module, ts, w, form, torch_device, rng):
    """One step of torch.compile(fullgraph=True) of module (reduction "none") on the tensors ts
    (the student's input and weight first, given gradients here) with token weights w, under
    autocast(bfloat16) where form is "autocast", backward through a random upstream gradient:
    (the rows' losses, the upstream gradient, the jsdgpu operators the step ran)."""
    import torch
    ts[0].requires_grad_(True), ts[1].requires_grad_(True)
    torch._dynamo.reset()
    step = torch.compile(lambda *a, token_weights: module(*a, token_weights=token_weights), fullgraph=True)
    upstream = rng.standard_normal(ts[0].shape[0])
    with torch.profiler.profile() as prof:
        with torch.autocast(torch_device, dtype=torch.bfloat16, enabled=form == "autocast"):
            out = step(*ts, token_weights=None if w is None else torch.from_numpy(w).to(torch_device))
        (out * torch.from_numpy(upstream).float().to(torch_device)).sum().backward()
    return out, upstream, [e.name for e in prof.events() if e.name.startswith("jsdgpu::")]


@pytest.mark.parametrize("T,ignored,weights,caps,form", [
    (10, 0.0, None, None, None), (10, 0.3, "mixed", None, None), (1, 0.0, None, 5.0, None), (7, 1.0, None, None, None),
    (9, 0.4, "zeros", 5.0, None), (12, 0.25, "mixed", None, "bf16"), (12, 0.25, None, 5.0, "autocast")])
def test_compiled_rows_own_losses_carry_their_gradients(rng, torch_device, T, ignored, weights, caps, form):
    """reduction "none" under torch.compile(fullgraph=True), no student bias: forward keeps the
    gradients and carries G to backward as tensors (jsdgpu.torch_rows), so backward runs no
    second call of the loss (no jsdgpu::fused_linear_jsd in the step); the per-row losses and the
    gradients under a random upstream gradient as the float64 reference's, with rows ignored
    (all of them too), token weights, T = 1, soft caps, bf16 tensors, and fp32 ones under
    autocast(bfloat16) (against the reference of the bf16-rounded operands)."""
    pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    case = make_case(rng, T=T, ignored=ignored, logit_std=4.0, dtype=BF16 if form == "bf16" else np.float32)
    names = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target")
    ts = [jtorch.from_native(case[n]).to(torch_device) for n in names]
    w = None if weights is None else token_weights(rng, T, weights)
    opts = dict(beta=0.3, temperature=2.0, student_logit_softcap=caps, teacher_logit_softcap=caps)
    out, upstream, ops = compiled_rows_step(jtorch.FusedLinearJSDLoss(reduction="none", **opts), ts, w, form,
                                            torch_device, rng)
    assert "jsdgpu::fused_linear_jsd_rows" in ops and "jsdgpu::fused_linear_jsd" not in ops, sorted(set(ops))
    if form == "autocast":
        case = {k: v if k == "target" or v is None else v.astype(BF16) for k, v in case.items()}
    ref = jsdgpu.reference(**case, token_weights=w, reduction="none", grad_output=upstream, **opts)
    np.testing.assert_allclose(out.detach().float().cpu().numpy(), ref[0], rtol=1e-5, atol=1e-6)
    for t, want in zip(ts[:2], ref[3:5]):
        assert t.grad.dtype == t.dtype  # (autocast: the fp32 tensors' gradients in fp32)
        assert rel_err(t.grad.float().cpu().numpy(), want) <= GRAD_TOLERANCE[form]


@pytest.mark.parametrize("T,ignored,weights,missing_mass,form", [
    (10, 0.0, None, "bucket", None), (1, 0.0, "mixed", "renormalize", None), (7, 1.0, None, "bucket", None),
    (13, 0.3, "zeros", "renormalize", "bf16"), (12, 0.25, "mixed", "bucket", "autocast")])
def test_compiled_topk_rows_own_losses_carry_their_gradients(rng, torch_device, T, ignored, weights, missing_mass,
                                                             form):
    """The top-k loss's reduction "none" under torch.compile(fullgraph=True), no student bias, as
    the online loss's above: one call (jsdgpu::fused_linear_topk_jsd_rows, no
    jsdgpu::fused_linear_topk_jsd in the step), and the rows' losses and the student's gradients
    under a random upstream gradient as the float64 reference's."""
    pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    case = make_topk_case(rng, T=T, bias=False, ignored=ignored, logit_std=4.0,
                          dtype=BF16 if form == "bf16" else np.float32)
    names = ("student_input", "student_weight", "teacher_indices", "teacher_logprobs", "target")
    ts = [jtorch.from_native(case[n]).to(torch_device) for n in names]
    w = None if weights is None else token_weights(rng, T, weights)
    opts = dict(beta=0.3, temperature=2.0, student_logit_softcap=5.0)
    out, upstream, ops = compiled_rows_step(
        jtorch.FusedLinearTopKJSDLoss(reduction="none", missing_mass=missing_mass, **opts), ts, w, form, torch_device,
        rng)
    assert "jsdgpu::fused_linear_topk_jsd_rows" in ops and "jsdgpu::fused_linear_topk_jsd" not in ops, \
        sorted(set(ops))
    if form == "autocast":
        case = {k: v.astype(BF16) if k.startswith("student") and v is not None else v for k, v in case.items()}
    ref = jsdgpu.reference_topk(**case, token_weights=w, reduction="none", grad_output=upstream,
                                missing_mass=missing_mass, **opts)
    np.testing.assert_allclose(out.detach().float().cpu().numpy(), ref[0], rtol=1e-5, atol=1e-6)
    for t, want in zip(ts[:2], ref[3:5]):
        assert t.grad.dtype == t.dtype
        assert rel_err(t.grad.float().cpu().numpy(), want) <= GRAD_TOLERANCE[form]


@pytest.mark.parametrize("loss", ["online", "topk"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_jax_weights_under_jit(rng, jax_device, loss, reduction):
    """jax.jit(jax.value_and_grad(...)) with the token weights a traced argument: the loss and the
    student's gradients as the float64 reference's, new weights at the second call (no retrace
    needed for them) too; "none" through a random upstream gradient (the rows' losses times it,
    summed)."""
    jax = pytest.importorskip("jax")
    jjax = pytest.importorskip("jsdgpu.jax")
    T = 9
    if loss == "online":
        case = make_case(rng, T=T, bias=True, ignored=0.3)
        others, fn, reference = ("teacher_input", "teacher_weight"), jjax.fused_linear_jsd_loss, jsdgpu.reference
    else:
        case = make_topk_case(rng, T=T)
        others, fn, reference = (("teacher_indices", "teacher_logprobs"), jjax.fused_linear_topk_jsd_loss,
                                 jsdgpu.reference_topk)
    put = lambda name: jax.device_put(jax.numpy.asarray(case[name]), jax_device)  # noqa: E731
    teacher, target = [put(n) for n in others], put("target")

    upstream = rng.standard_normal(T).astype(np.float32)

    def f(xs, ws, bs, w):
        teacher_bias = (put("teacher_bias"),) if loss == "online" else ()
        out = fn(xs, ws, *teacher, target, bs, *teacher_bias, token_weights=w, beta=0.3, reduction=reduction)
        return (out * jax.numpy.asarray(upstream)).sum() if reduction == "none" else out
    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
    for _ in range(2):
        w = token_weights(rng, T, "mixed")
        value, grads = step(put("student_input"), put("student_weight"), put("student_bias"),
                            jax.device_put(jax.numpy.asarray(w), jax_device))
        ref = reference(**case, token_weights=w, reduction=reduction, beta=0.3,
                        grad_output=upstream.astype(np.float64) if reduction == "none" else None)
        if reduction == "none":
            assert_upstream_sum_near(value, ref[0], upstream)
        else:
            assert abs(float(value) - ref[0]) <= 1e-5 * max(1.0, abs(ref[0]))
        for got, want in zip(grads, ref[3:]):
            assert rel_err(np.asarray(got), want) <= 1e-4
