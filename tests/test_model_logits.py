"""Scaled and soft-capped logits (docs/contract.md, "Forward": each model's logits are
scale (x @ W.T + b), then c tanh(z / c) where a cap c is given), for the online loss, the top-k
loss and teacher_topk, on both backends, against the float64 reference: caps of 30 (Gemma's) and
of 5 (which bites at logit std 8), scales, biases, ignored rows, G held for all rows or per chunk,
vocab parallel; PyTorch against c * torch.tanh(z / c) on real logits; JAX under jit; bad options."""

import numpy as np
import pytest

import jsdgpu
from conftest import DTYPES, LABEL_P_ABS, float32_logits, head_logits, make_case, rel_err, to_numpy, to_xp
from jsdgpu.options import DEFAULTS
from jsdgpu.reference import model_logits, reference_logits
from test_api import check_against_reference
from test_parallel import assert_matches_single
from test_token_weights import check_topk
from test_topk import make_topk_case

MODELS = [dict(student_logit_softcap=30.0, teacher_logit_softcap=30.0),
          dict(student_logit_softcap=5.0, teacher_logit_softcap=5.0),
          dict(student_logit_scale=0.3, teacher_logit_scale=2.0),
          dict(student_logit_scale=2.0, student_logit_softcap=5.0, teacher_logit_softcap=7.0)]


@pytest.mark.parametrize("model", range(len(MODELS)))
@pytest.mark.parametrize("chunk_size,memory_budget", [(None, None), (4, 1)])  # G held; G per chunk
@pytest.mark.parametrize("same_vocab", [False, True])  # (the fused kernel keeps p or z by it)
def test_online_against_float64(xp, rng, model, chunk_size, memory_budget, same_vocab):
    vs = int(rng.integers(200, 1100))
    case = make_case(rng, T=int(rng.integers(1, 25)), vs=vs, vt=vs if same_vocab else 1103, bias=True,
                     ignored=0.3, logit_std=8.0)
    check_against_reference(case, xp, np.dtype(np.float32), chunk_size=chunk_size, memory_budget=memory_budget,
                            grad_output=0.7, beta=float(rng.choice([0.0, 0.4, 1.0])),
                            temperature=float(rng.choice([0.5, 1.0, 2.0])), **MODELS[model])


@pytest.mark.parametrize("model", [dict(student_logit_softcap=30.0, teacher_logit_softcap=30.0),
                                   dict(student_logit_scale=2.0)])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_label_dominant_rows(xp, rng, model, beta):
    """Rows whose label holds most of softmax(z), at temperature 1 with one vocabulary: the one-hot
    term goes into G there (where softmax(z) < 1/2 it is kept apart), and the fused kernel folds
    the model's derivative into p in pass 2, so the label's term takes the derivative at the label
    (FusedRow::passes, FOLD). Each row's label is its largest z; at least two rows are dominated.
    Where every row's label holds nearly all of its mass, and the JSD is at its ceiling (p and q on
    other columns: its gradient nearly 0), the gradients are the labels' p - 1 alone, right to the
    contract's LABEL_P_ABS absolutely (test_numerics.py, test_confident_rows_gradient_at_the_label)."""
    case = make_case(rng, T=int(rng.integers(5, 20)), vs=53, bias=True, logit_std=12.0)
    z, derivative = model_logits(head_logits(case, "student"), model.get("student_logit_scale", 1.0),
                                 model.get("student_logit_softcap"))
    rows = np.arange(len(z))
    case["target"] = target = z.argmax(axis=1)
    p_label = 1.0 / np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1)  # softmax(z) at the label
    assert (p_label >= 0.5).sum() >= 2, p_label
    # each dominated row's G at its label (the default weight_hard_loss, the mean over the rows),
    # along the label's weight row in grad_input, its input row in grad_weight
    at_label = np.broadcast_to(derivative, z.shape)[rows, target] * DEFAULTS.weight_hard_loss / len(z)
    off = np.where(p_label >= 0.5, LABEL_P_ABS * at_label, 0.0)
    floors = (off @ np.linalg.norm(case["student_weight"][target], axis=1),
              off @ np.linalg.norm(case["student_input"], axis=1), off.sum())
    check_against_reference(case, xp, np.dtype(np.float32), grad_floors=floors, beta=beta, **model)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("memory_budget", [None, 1])
@pytest.mark.parametrize("vt", [1031, 1040])
def test_online_16bit_gpu(rng, dtype, memory_budget, vt):
    import cupy
    case = make_case(rng, T=int(rng.integers(20, 300)), vs=1031, vt=vt, dtype=DTYPES[dtype], bias=True,
                     ignored=0.3, logit_std=8.0)
    check_against_reference(case, cupy, DTYPES[dtype], memory_budget=memory_budget, **MODELS[3])


@pytest.mark.gpu
def test_calls_like_the_last_queue_ahead(rng):
    """Three calls in a row, each like the last (the student's logits queued ahead of the checks,
    the head's products before the selection is read, with a third of the rows ignored at the
    second call), online and top-k: the models' logits taken once, as the reference's."""
    import cupy
    for ignored in (0.0, 0.3, 0.0):
        case = make_case(rng, T=300, vs=1031, vt=1040, dtype=DTYPES["bfloat16"], bias=True, ignored=ignored,
                         logit_std=8.0)
        check_against_reference(case, cupy, DTYPES["bfloat16"], **MODELS[3])
        topk_case = make_topk_case(rng, T=300, vs=5003, hs=256, k=40, dtype=DTYPES["bfloat16"], ignored=ignored)
        loss, ctx = jsdgpu.forward_topk(**to_xp(topk_case, cupy), student_logit_softcap=5.0)
        grads = jsdgpu.backward(ctx)
        ref = jsdgpu.reference_topk(**topk_case, student_logit_softcap=5.0)
        assert abs(float(loss) - ref[0]) <= 1e-4 * max(1.0, abs(ref[0]))
        for got, want in zip(grads, ref[3:]):
            assert rel_err(got, want) <= 2 * 2.0**-8


@pytest.mark.parametrize("n_ranks", [2, 3])
def test_vocab_parallel(xp, rng, n_ranks):
    """Each rank's shard of the logits scaled and capped: as one rank."""
    case = make_case(rng, T=11, vs=401, vt=437, bias=True, ignored=0.3, logit_std=8.0)
    bounds = [0, 131, 260, 437] if n_ranks == 3 else [0, 203, 437]
    assert_matches_single(case, xp, bounds, 2e-5, chunk_size=4, grad_weight_float32=True, **MODELS[3])


@pytest.mark.parametrize("missing_mass", ["bucket", "renormalize"])
@pytest.mark.parametrize("chunk_size,memory_budget", [(None, None), (4, 1)])
def test_topk_against_float64(xp, rng, missing_mass, chunk_size, memory_budget):
    case = make_topk_case(rng, T=int(rng.integers(1, 25)), vs=int(rng.integers(100, 600)),
                          k=int(rng.integers(1, 40)), logit_std=8.0)
    check_topk(xp, case, np.float32, missing_mass=missing_mass, chunk_size=chunk_size, memory_budget=memory_budget,
               student_logit_scale=float(rng.choice([0.5, 1.0, 2.0])), student_logit_softcap=5.0,
               temperature=float(rng.choice([1.0, 2.0])))


def test_topk_takes_no_teacher_model(rng):
    case = make_topk_case(rng, T=3)
    for option in (dict(teacher_logit_scale=2.0), dict(teacher_logit_softcap=30.0)):
        with pytest.raises(ValueError, match="teacher_logit"):
            jsdgpu.forward_topk(**case, **option)


def test_teacher_topk_of_the_model(xp, rng):
    """teacher_topk's logit_scale and logit_softcap: the top k and log-softmax of the model's
    logits, as NumPy forms them in float64."""
    T, h, v, k = 9, 24, 301, 7
    # logits of std about 3 before the scale: the cap bends them, and leaves no ties in float32
    x, w = rng.standard_normal((T, h)).astype(np.float32), (rng.standard_normal((v, h)) * 0.6).astype(np.float32)
    b = rng.standard_normal(v).astype(np.float32)
    ids, logprobs = jsdgpu.teacher_topk(xp.asarray(x), xp.asarray(w), k, 2.0, xp.asarray(b), logit_scale=1.5,
                                        logit_softcap=5.0)
    z = 5.0 * np.tanh(1.5 * (x.astype(np.float64) @ w.T.astype(np.float64) + b) / 5.0) / 2.0
    logq = z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) - z.max(1, keepdims=True)
    want = np.argsort(-z, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(to_numpy(ids), want)
    np.testing.assert_allclose(to_numpy(logprobs), np.take_along_axis(logq, want, axis=1), rtol=1e-5, atol=1e-5)


DEEP_SCALE, DEEP_CAP = 40.0, 0.5  # |scale x / c| in the hundreds at logit std 8


def deep_in_the_cap(case, with_one_rounding=True):
    """What test_deep_in_the_cap holds the student's gradients to, at DEEP_SCALE and DEEP_CAP on
    both models: (want, tol, gradients): the float64 (grad_input, grad_weight), their elementwise
    tolerances, and gradients(raw), the float64 math's from the student's raw logits raw.

    The tolerance: the cap's derivative 1 - (z / c)^2 (from the float32 z) makes the gradients
    tiny, so they are right absolutely, not relatively (docs/contract.md, "Numerics"): each raw
    logit's gradient to scale 2^-21 times its gradient in z (the derivative's error, 2 |z / c|
    times z's relative error of a few 2^-24), through the sums that make the student's gradients
    (G @ Ws, G.T @ Xs); on top of 4 times what the float32 raw logits cost, which the derivative
    magnifies (it moves by 2 scale / c = 160 times a raw logit's error, relatively): the floors
    of float32_logits' ways and (with_one_rounding) of the raw logits moved by one rounding of
    the products' partial sums, 2^-24 sum |x w|, each way. float32_logits' three orders are
    samples; cuBLAS's differs, and where a row's gradient comes from one or two columns out of the
    cap, all three can round such a column almost exactly (`python
    experiments/deep_cap_orders.py` counts the cases of other orders past the tolerance)."""
    f = lambda k: case[k].astype(np.float64)  # noqa: E731
    through = lambda g: (g @ f("student_weight"), g.T @ f("student_input"))  # noqa: E731
    z_t = model_logits(head_logits(case, "teacher"), DEEP_SCALE, DEEP_CAP)[0]

    def gradients(raw_s):  # (the student's gradients, the gradient in z) from its raw logits
        z_s, derivative = model_logits(raw_s.astype(np.float64), DEEP_SCALE, DEEP_CAP)
        g_z = reference_logits(z_s, z_t, case["target"], beta=0.5)[3]
        return through(derivative * g_z), g_z

    raw = head_logits(case, "student")
    want, g_z = gradients(raw)
    ways = float32_logits(case, "student")
    if with_one_rounding:
        one_rounding = 2.0**-24 * (np.abs(f("student_input")) @ np.abs(f("student_weight")).T)
        ways += [raw + one_rounding, raw - one_rounding]
    floors = [gradients(way)[0] for way in ways]
    g_raw = DEEP_SCALE * 2.0**-21 * np.abs(g_z)  # the derivative's error, per raw logit
    bounds = (g_raw @ np.abs(f("student_weight")), g_raw.T @ np.abs(f("student_input")))
    tol = [4 * np.max([np.abs(fl[k] - want[k]) for fl in floors], axis=0) + bounds[k] + 1e-5 * np.abs(want[k])
           + 1e-12 for k in range(2)]
    return want, tol, lambda raw_s: gradients(raw_s)[0]


def deep_case(rng):
    """test_deep_in_the_cap's inputs: 8 rows (about a fifth ignored) of 53 columns, logits of std 8."""
    return make_case(rng, T=8, vs=53, vt=53, ignored=0.2, logit_std=8.0)


def test_deep_in_the_cap(xp, rng):
    """Logits deep in the cap (scale 40, caps of 0.5, logits of std 8): the loss to float32, and
    the gradients to deep_in_the_cap's tolerance."""
    opts = dict(student_logit_scale=DEEP_SCALE, student_logit_softcap=DEEP_CAP, teacher_logit_scale=DEEP_SCALE,
                teacher_logit_softcap=DEEP_CAP, beta=0.5)
    case = deep_case(rng)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), **opts)
    grads = jsdgpu.backward(ctx)
    ref = jsdgpu.reference(**case, **opts)
    assert abs(float(loss) - ref[0]) <= 1e-5 * abs(ref[0])
    want, tol, _ = deep_in_the_cap(case)
    for name, got, w, t in zip(("grad_input", "grad_weight"), grads, want, tol):
        err = np.abs(to_numpy(got) - w)
        assert (err <= t).all(), (name, err.max(), (err / t).max())


# model_logits4 and model_logit of each float4 of x (common.cuh)
_TANH_KERNEL = r"""
extern "C" __global__ void both_ways(const float4* x, float4* by4, float4* by1, float scale, float cap, int n4) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  const float4 v = x[i];
  by4[i] = model_logits4(v, scale, cap, 1.0f / cap);
  by1[i] = make_float4(model_logit(v.x, scale, cap, 1.0f / cap), model_logit(v.y, scale, cap, 1.0f / cap),
                       model_logit(v.z, scale, cap, 1.0f / cap), model_logit(v.w, scale, cap, 1.0f / cap));
}
"""


@pytest.mark.gpu
def test_soft_tanh_on_the_gpu(rng):
    """common.cuh's soft_tanh against tanh in float64: within 2 ulp below TANH_POLY_BELOW (the
    polynomial) and 4 above (ex2 and rcp, each approximate in its last bit), +-1 at +-inf, NaN at
    NaN. And model_logits4, whose warps skip the exponential where all their columns are below
    TANH_POLY_BELOW, gives model_logit's bits whatever a warp's other columns are: warps all
    below, mixed, all above, and at caps and scales that round u."""
    import cupy
    from jsdgpu.cuda import sources
    module = cupy.RawModule(code=sources.prelude() + (sources.SRC / "common.cuh").read_text() + _TANH_KERNEL,
                            options=sources.NVRTC_OPTIONS)
    kernel = module.get_function("both_ways")

    def both_ways(x, scale, cap):  # (model_logits4's, model_logit's) of x, bits alike
        xd = cupy.asarray(x)
        by4, by1 = cupy.empty_like(xd), cupy.empty_like(xd)
        n4 = x.size // 4
        kernel(((n4 + 255) // 256,), (256,), (xd, by4, by1, np.float32(scale), np.float32(cap), np.int32(n4)))
        np.testing.assert_array_equal(by4.get().view(np.uint32), by1.get().view(np.uint32))
        return by1.get()

    below, warp, n = sources.TANH_POLY_BELOW, 32 * 4, 64 * 32 * 4  # a warp's columns
    small = rng.uniform(-below, below, n)
    large = np.sign(rng.standard_normal(n)) * np.exp(rng.uniform(np.log(below), np.log(20.0), n))
    mixed = np.where(rng.random(n) < 0.5, small, large)
    tiny = 2.0 ** -rng.uniform(1, 126, n) * np.sign(rng.standard_normal(n))
    edges = [0.0, np.inf, -np.inf, np.nan, below, -below, np.nextafter(np.float32(below), np.float32(0)), 9.5, 100.0]
    u = np.concatenate([small, tiny, mixed, large, edges, np.zeros((-len(edges)) % warp)]).astype(np.float32)
    for scale, cap in [(1.5, 30.0), (40.0, 0.5), (0.3, 5.0)]:
        both_ways(u * np.float32(cap / scale), scale, cap)
    got = both_ways(u, 1.0, 1.0)  # soft_tanh(u)
    want = np.tanh(u.astype(np.float64))
    err = np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    normal = np.isfinite(u) & (np.abs(u) >= np.finfo(np.float32).tiny)  # (-ftz: the kernels flush the others)
    assert err[normal & (np.abs(u) < below)].max() <= 2.0, err[normal & (np.abs(u) < below)].max()
    assert err[normal & (np.abs(u) >= below)].max() <= 4.0, err[normal & (np.abs(u) >= below)].max()
    assert (got[np.isinf(u)] == np.sign(u[np.isinf(u)])).all() and np.isnan(got[np.isnan(u)]).all()
    assert (got[u == 0] == 0).all()


@pytest.mark.parametrize("option,value", [("student_logit_scale", 0.0), ("teacher_logit_scale", -1.0),
                                          ("student_logit_softcap", 0.0), ("teacher_logit_softcap", float("nan")),
                                          ("student_logit_scale", float("inf"))])
def test_bad_options_raise(rng, option, value):
    with pytest.raises(ValueError, match=option):
        jsdgpu.forward(**make_case(rng, T=3), **{option: value})


# ---- the front ends ----

@pytest.mark.parametrize("compiled", [False, True])
def test_torch_softcap_against_tanh(rng, torch_device, compiled):
    """FusedLinearJSDLoss with soft caps and scales against the plain loss in PyTorch on logits
    c * torch.tanh(z / c) of real products, by autograd: the loss and the student's gradients,
    eager and under torch.compile(fullgraph=True)."""
    torch = pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    case = make_case(rng, T=12, bias=True, ignored=0.25, logit_std=8.0)
    names = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target", "student_bias",
             "teacher_bias")
    ts = [torch.from_numpy(case[n]).to(torch_device) for n in names]
    plain = [t.detach().double().requires_grad_(True) if t.is_floating_point() else t for t in ts]
    for i in (0, 1, 5):
        ts[i].requires_grad_(True)
    scale_s, cap_s, scale_t, cap_t = 2.0, 5.0, 0.5, 30.0
    loss_fn = jtorch.FusedLinearJSDLoss(beta=0.3, temperature=2.0, student_logit_scale=scale_s,
                                        student_logit_softcap=cap_s, teacher_logit_scale=scale_t,
                                        teacher_logit_softcap=cap_t)
    call = torch.compile(loss_fn, fullgraph=True) if compiled else loss_fn
    if compiled:
        torch._dynamo.reset()
    call(*ts).backward()

    xs, ws, xt, wt, y, bs, bt = plain
    s = cap_s * torch.tanh(scale_s * (xs @ ws.T + bs) / cap_s)
    t = cap_t * torch.tanh(scale_t * (xt @ wt.T + bt) / cap_t)
    valid = y != -100
    ce = torch.nn.functional.cross_entropy(s[valid], y[valid], reduction="sum") / valid.sum()
    logp, logq = torch.log_softmax(s / 2.0, -1)[valid], torch.log_softmax(t / 2.0, -1)[valid]
    logm = torch.logsumexp(torch.stack([logp + np.log(0.7), logq + np.log(0.3)]), 0)
    jsd = (0.3 * (logq.exp() * (logq - logm)).sum() + 0.7 * (logp.exp() * (logp - logm)).sum()) / valid.sum()
    want = 0.5 * ce + 0.5 * jsd
    want.backward()
    assert abs(float(loss_fn(*[t.detach() for t in ts])) - float(want)) <= 1e-5 * float(want)
    for got, ref in zip((ts[0], ts[1], ts[5]), (xs, ws, bs)):
        assert rel_err(got.grad.cpu().numpy(), ref.grad.cpu().numpy()) <= 1e-4


def test_jax_under_jit(rng):
    jax = pytest.importorskip("jax")
    jjax = pytest.importorskip("jsdgpu.jax")
    case = make_case(rng, T=9, bias=True, ignored=0.3, logit_std=8.0)
    args = [jax.numpy.asarray(case[k]) for k in ("student_input", "student_weight", "teacher_input",
                                                  "teacher_weight", "target", "student_bias", "teacher_bias")]
    f = lambda xs, ws, bs: jjax.fused_linear_jsd_loss(xs, ws, args[2], args[3], args[4], bs, args[6],  # noqa: E731
                                                      beta=0.3, **MODELS[3])
    loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(args[0], args[1], args[5])
    ref = jsdgpu.reference(**case, beta=0.3, **MODELS[3])
    assert abs(float(loss) - ref[0]) <= 1e-5 * max(1.0, ref[0])
    for got, want in zip(grads, ref[3:]):
        assert rel_err(np.asarray(got), want) <= 1e-4


@pytest.mark.parametrize("compiled", [False, True])
def test_torch_topk_module(rng, torch_device, compiled):
    """FusedLinearTopKJSDLoss(student_logit_scale=, student_logit_softcap=), eager and compiled:
    the loss and the student's gradients as the float64 reference's."""
    torch = pytest.importorskip("torch")
    jtorch = pytest.importorskip("jsdgpu.torch")
    case = make_topk_case(rng, T=10, logit_std=8.0)
    names = ("student_input", "student_weight", "teacher_indices", "teacher_logprobs", "target", "student_bias")
    ts = [torch.from_numpy(case[n]).to(torch_device) for n in names]
    for i in (0, 1, 5):
        ts[i].requires_grad_(True)
    loss_fn = jtorch.FusedLinearTopKJSDLoss(beta=0.3, student_logit_scale=1.5, student_logit_softcap=5.0)
    if compiled:
        torch._dynamo.reset()
    loss = (torch.compile(loss_fn, fullgraph=True) if compiled else loss_fn)(*ts)
    loss.backward()
    ref = jsdgpu.reference_topk(**case, beta=0.3, student_logit_scale=1.5, student_logit_softcap=5.0)
    assert abs(float(loss.detach()) - ref[0]) <= 1e-5 * max(1.0, abs(ref[0]))
    for t, want in zip((ts[0], ts[1], ts[5]), ref[3:]):
        assert rel_err(t.grad.cpu().numpy(), want) <= 1e-4
