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


# ---- the model features (soft caps and scales, token weights, reductions): the reference first ----

def _torch_loss(torch, case, opts, caps, token_weights, reduction):
    """The loss of the model features in float64 PyTorch autograd, written independently of the
    reference: each model's logits scale * (x @ W.T + b), soft-capped as c * torch.tanh(z / c);
    per row w_hard CE + w_soft JSD_beta at the temperature, times its token weight; reduced."""
    t = {k: None if v is None else torch.from_numpy(np.asarray(v, np.float64)) for k, v in case.items()
         if k != "target"}
    for name in ("student_input", "student_weight", "student_bias"):
        t[name].requires_grad_(True)
    target = torch.from_numpy(case["target"])

    def logits(side):
        z = t[f"{side}_input"] @ t[f"{side}_weight"].T + t[f"{side}_bias"]
        z = caps[f"{side}_logit_scale"] * z
        c = caps[f"{side}_logit_softcap"]
        return z if c is None else c * torch.tanh(z / c)
    s, u = logits("student"), logits("teacher")
    valid = target != -100
    ce = torch.nn.functional.cross_entropy(s, torch.where(valid, target, 0), reduction="none")
    beta, temp = opts["beta"], opts["temperature"]
    logp, logq = torch.log_softmax(s / temp, -1), torch.log_softmax(u / temp, -1)
    logm = torch.logsumexp(torch.stack([logp + np.log(1 - beta), logq + np.log(beta)]), 0)
    jsd = beta * (logq.exp() * (logq - logm)).sum(-1) + (1 - beta) * (logp.exp() * (logp - logm)).sum(-1)
    w = torch.from_numpy(token_weights) * valid
    rows = w * (opts["weight_hard_loss"] * ce + opts["weight_soft_loss"] * jsd)
    return rows if reduction == "none" else rows.sum() / (max(1, int(valid.sum())) if reduction == "mean" else 1), t


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("caps", [dict(student_logit_scale=1.0, teacher_logit_scale=1.0, student_logit_softcap=None,
                                       teacher_logit_softcap=None),
                                  dict(student_logit_scale=0.5, teacher_logit_scale=2.0, student_logit_softcap=30.0,
                                       teacher_logit_softcap=30.0),
                                  dict(student_logit_scale=1.0, teacher_logit_scale=1.0, student_logit_softcap=5.0,
                                       teacher_logit_softcap=5.0)])  # a cap that bites at logit std 8
def test_model_features_against_torch_autograd(rng, caps, reduction):
    """The reference's soft caps, scales, token weights (zero, large, mixed) and reductions:
    its loss and gradients equal float64 PyTorch autograd's on the same logits, with a random
    upstream gradient for "none"."""
    torch = pytest.importorskip("torch")
    case = make_case(rng, T=9, hs=6, ht=7, vs=37, bias=True, ignored=0.3, logit_std=8.0)
    weights = rng.choice([0.0, 0.3, 1.0, 7.5], 9)
    opts = dict(beta=0.3, temperature=1.7, weight_hard_loss=0.4, weight_soft_loss=0.6)
    upstream = rng.standard_normal(9) if reduction == "none" else 1.3
    ref = jsdgpu.reference(**case, **caps, token_weights=weights, reduction=reduction, grad_output=upstream, **opts)
    want, t = _torch_loss(torch, case, opts, caps, weights, reduction)
    want_grads = torch.autograd.grad(want, [t["student_input"], t["student_weight"], t["student_bias"]],
                                     torch.as_tensor(upstream, dtype=torch.float64))
    np.testing.assert_allclose(ref[0], want.detach().numpy(), rtol=1e-12, atol=1e-12)
    for got, w in zip(ref[3:], want_grads):
        np.testing.assert_allclose(got, w.numpy(), rtol=1e-10, atol=1e-12)
    if caps["student_logit_softcap"] == 5.0:  # the cap bites: the capped logits differ from the raw ones
        raw = case["student_input"].astype(np.float64) @ case["student_weight"].T.astype(np.float64)
        assert np.abs(raw).max() > 10.0


@pytest.mark.parametrize("bad", [np.ones(8), -np.ones(9), np.full(9, np.nan)])
def test_bad_token_weights_and_reduction_raise(rng, bad):
    case = make_case(rng, T=9, hs=4, ht=4, vs=11)
    with pytest.raises(ValueError, match="token_weights"):
        jsdgpu.reference(**case, token_weights=bad)
    with pytest.raises(ValueError, match="reduction"):
        jsdgpu.reference(**case, reduction="average")


def test_topk_model_features_match_finite_differences(rng):
    """The top-k reference with the student's scale and soft cap, token weights and reduction
    "none" under a random upstream gradient: its gradient against finite differences."""
    from jsdgpu.reference import reference_topk
    T, hs, vs, k = 5, 3, 13, 4
    xs, ws = rng.standard_normal((T, hs)), rng.standard_normal((vs, hs)) * 3.0
    ids = np.stack([rng.choice(vs, k, replace=False) for _ in range(T)])
    lq = np.log(rng.dirichlet(np.ones(k), T) * 0.9)
    target = rng.integers(0, vs, T)
    target[1] = -100
    upstream, weights = rng.standard_normal(T), rng.choice([0.0, 0.5, 2.0], T)
    opts = dict(student_logit_scale=0.7, student_logit_softcap=4.0, token_weights=weights, reduction="none",
                beta=0.4, temperature=1.3)
    _, _, _, gi, gw, _ = reference_topk(xs, ws, ids, lq, target, **opts, grad_output=upstream)
    for x, grad in ((xs, gi), (ws, gw)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            x[idx] += 1e-6
            up = reference_topk(xs, ws, ids, lq, target, **opts)[0] @ upstream
            x[idx] -= 2e-6
            down = reference_topk(xs, ws, ids, lq, target, **opts)[0] @ upstream
            x[idx] += 1e-6
            numeric[idx] = (up - down) / 2e-6
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)
