"""The loss at every temperature and logit scale, against float64 (docs/contract.md: finite
inputs give a finite loss wherever float64 is finite, the soft part is never negative, and a
small soft part keeps float32's relative precision).

Three-way: the library's result must be about as close to the float64 reference as the float64
math itself is on the logits of float32 products (the "floor": what making and holding the
logits in float32, as the library does, costs), plus float32 rounding of the result: 1e-5
relative, or 1e-9 absolute for soft parts below 1e-4.
"""

import itertools

import numpy as np
import pytest

import jsdgpu
from conftest import DTYPES, LABEL_P_ABS, assert_near_float64, float64_logits, make_case, rel_err, to_numpy, to_xp
from jsdgpu.reference import reference_logits

SCALES = (1.0, 8.0, 40.0)  # logits' std
TEMPERATURES = (0.05, 0.25, 1.0, 50.0)
BETAS = (0.0, 1e-6, 0.3, 0.5, 1.0 - 1e-6, 1.0)
GRID = list(itertools.product(SCALES, TEMPERATURES, BETAS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("scale,temperature,beta", GRID)
def test_grid_against_float64(xp, rng, dtype, scale, temperature, beta):
    if xp is np and dtype == "float16":
        pytest.skip("float16 on the CPU: as float32 there (its products are float32)")
    case = make_case(rng, T=7, hs=16, ht=24, vs=515, vt=523, dtype=DTYPES[dtype], bias=True, ignored=0.2,
                     logit_std=scale)
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.3, weight_soft_loss=0.7)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), chunk_size=3, **opts)
    assert_near_float64(case, dtype, opts, loss, ctx.hard_loss, ctx.soft_loss, jsdgpu.backward(ctx))


@pytest.mark.parametrize("vt", [131072 + 9, 163840 + 9, 262144 + 9])
@pytest.mark.parametrize("scale", [8.0, 40.0])
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_sharp_rows_of_wide_teachers(xp, rng, scale, beta, vt):
    """Sharp rows (temperature 0.05, a KL of hundreds of bits) with teacher vocabularies wider
    than each of the fused kernel's shapes takes (on the GPU: past 131072 its shape with a group
    in shared memory, past 163840 its wide shape, past 262144 the three phase kernels, which take
    reverse KL's gradient relative to the reference column too)."""
    case = make_case(rng, T=5, hs=16, ht=16, vs=515, vt=vt, bias=True, logit_std=scale)
    opts = dict(beta=beta, temperature=0.05, weight_hard_loss=0.3, weight_soft_loss=0.7)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), chunk_size=2, **opts)
    assert_near_float64(case, "float32", opts, loss, ctx.hard_loss, ctx.soft_loss, jsdgpu.backward(ctx))


@pytest.mark.parametrize("temperature,beta,scale", [(50.0, 0.5, 1.0), (1.0, 0.9999, 1.0), (1.0, 1e-6, 1.0),
                                                    (50.0, 1e-6, 8.0), (20.0, 1.0, 1.0), (20.0, 0.0, 1.0)])
def test_small_soft_parts_keep_their_precision(xp, rng, temperature, beta, scale):
    """Soft parts of 1e-9 to 1e-4, where the student and teacher nearly agree: within 1e-5
    relative of float64 on the same float32 logits, or 1e-9 absolute below 1e-4, and never
    negative. The teacher is the student with a small perturbation, as in a well-trained
    student."""
    case = make_case(rng, T=9, hs=16, ht=16, vs=1031, vt=1031, dtype=np.float32, bias=True, logit_std=scale)
    case["teacher_input"] = case["student_input"]
    case["teacher_weight"] = (case["student_weight"] * (1 + 0.05 * rng.standard_normal(
        case["student_weight"].shape))).astype(np.float32)
    case["teacher_bias"] = case["student_bias"]
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.0, weight_soft_loss=1.0)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), **opts)
    s, t = float64_logits(case)
    want = reference_logits(s.astype(np.float32), t.astype(np.float32), case["target"], **opts)[2]
    got = float(ctx.soft_loss)
    print(f"soft part {want:.3e}: got {got:.6e}, error {abs(got - want):.1e}")
    assert 0.0 <= got and abs(got - want) <= max(1e-5 * want, 1e-9), (got, want)


@pytest.mark.parametrize("noise", [1e-3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 20.0])
@pytest.mark.parametrize("beta", [0.0, 1e-6, 1e-3, 0.25, 0.5, 0.7, 1.0 - 1e-6, 1.0])
def test_small_soft_parts_gradients(xp, rng, beta, temperature, noise):
    """The soft part's gradient alone (weight_hard_loss 0; with the hard part's beside it, a
    small soft part's gradient hides in its rounding), the teacher the student plus noise (1e-3:
    log-ratios of 1e-4 and less at temperature 20), beta next to 0 and 1, and in each of the CPU
    JSD's forms of its mixture log (b = 0.25 and 0.3 with nine terms, 1/2 with six): as close to the
    float64 reference as every gradient (assert_near_float64). Formed from the rounded p and q,
    forward KL's p - q and the JSD's ln(p / m) were up to 38 times off at beta 1e-6 and 1e-3
    off where the log-ratios were 1e-4."""
    case = make_case(rng, T=6, hs=16, ht=16, vs=1031, vt=1031, bias=True, logit_std=2.0)
    case["teacher_input"] = case["student_input"]
    case["teacher_weight"] = (case["student_weight"] + noise / 4 * rng.standard_normal(
        case["student_weight"].shape)).astype(np.float32)
    case["teacher_bias"] = case["student_bias"]
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.0, weight_soft_loss=1.0)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), **opts)
    assert_near_float64(case, "float32", opts, loss, ctx.hard_loss, ctx.soft_loss, jsdgpu.backward(ctx))


@pytest.mark.parametrize("vs", [17, 1031])
@pytest.mark.parametrize("beta", [0.0044, 0.5, 0.9956])
def test_saturated_jsd_gradients(xp, rng, beta, vs):
    """The JSD's soft part's gradient alone where the JSD saturates: p near one-hot on column i,
    q on column j, p's next largest at j (e^-33 of p_i), so that the gradient, 1e-11 of its usual
    size and less, is what j holds: as close to the float64 reference as every gradient
    (assert_near_float64). With h = ln(p / m) taken as it is, kl = sum p h cancelled against the
    h of column i to that h's rounding, and the gradient was 0.1 to 0.9 off, relatively; h
    relative to the reference column (row_math.cuh, "A sharp row") keeps it right. (Where p's
    mass is on several such columns, the gradient is right to the rounding of their h,
    absolutely: the contract's "Numerics".)"""
    case = make_case(rng, T=3, hs=16, ht=16, vs=vs, vt=vs, bias=True, logit_std=1.0)
    i, j = rng.choice(vs, 2, replace=False)
    case["student_bias"][[i, j]] += [20.0, 10.0]
    case["teacher_bias"][j] += 20.0
    opts = dict(beta=beta, temperature=0.3, weight_hard_loss=0.0, weight_soft_loss=1.0)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), **opts)
    assert_near_float64(case, "float32", opts, loss, ctx.hard_loss, ctx.soft_loss, jsdgpu.backward(ctx))


@pytest.mark.parametrize("memory_budget", [None, 1])  # G held apart; G over the chunk's logits
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_rows_near_and_far_in_one_chunk(xp, rng, dtype, beta, memory_budget):
    """Half of the rows with a teacher that nearly agrees with the student (soft parts of about
    1e-7, which the fused kernel's precise sum forms in the pass that forms the others') and half
    with an unrelated teacher, in one chunk, G held apart or written over the logits: every row's
    loss and gradient as the reference's."""
    case = make_case(rng, T=40, hs=16, ht=16, vs=1031, vt=1031, dtype=DTYPES[dtype], bias=True, logit_std=2.0,
                     ignored=0.1)
    near = rng.random(40) < 0.5
    case["teacher_input"][near] = case["student_input"][near]
    case["teacher_weight"] = case["student_weight"] + (0.001 * rng.standard_normal(
        case["student_weight"].shape)).astype(DTYPES[dtype])
    case["teacher_bias"] = case["student_bias"]
    opts = dict(beta=beta, temperature=2.0)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), chunk_size=40, memory_budget=memory_budget, **opts)
    gi, gw, gb = jsdgpu.backward(ctx)
    ref = jsdgpu.reference(**case, **opts)
    assert abs(float(ctx.soft_loss) - ref[2]) <= 1e-5 * ref[2]
    tol = 1e-4 if dtype == "float32" else 2.0**-7
    for got, want in zip((gi, gw, gb), ref[3:]):
        assert rel_err(got, want) <= tol


@pytest.mark.parametrize("temperature", [0.25, 1.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_largest_logit_far_past_the_first_columns(xp, rng, temperature, beta):
    """Rows whose largest logit is 150 above every other, past the first 256 columns (the CPU's
    fused kernel shifts a row's exps by its first columns' largest logit, and makes them again
    with the row's largest where that overflowed): as the float64 reference."""
    case = make_case(rng, T=5, hs=16, ht=16, vs=1031, vt=1031, bias=True, logit_std=2.0)
    case["student_bias"][600] += 150.0
    case["teacher_bias"][700] += 150.0
    opts = dict(beta=beta, temperature=temperature)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), **opts)
    assert_near_float64(case, "float32", opts, loss, ctx.hard_loss, ctx.soft_loss, jsdgpu.backward(ctx))


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_sharp_rows_whose_student_mass_is_in_the_pad(xp, rng, beta):
    """A teacher vocabulary wider than the student's, whose pad columns (z = 0) hold nearly all of
    the student's tempered mass (every student logit below 0), at temperature 0.05: the pad's
    share of the statistics and sums, and the real columns' gradients beside it."""
    case = make_case(rng, T=5, hs=16, ht=16, vs=515, vt=523, bias=True, logit_std=8.0)
    case["student_bias"] -= 40.0
    opts = dict(beta=beta, temperature=0.05)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), **opts)
    assert_near_float64(case, "float32", opts, loss, ctx.hard_loss, ctx.soft_loss, jsdgpu.backward(ctx))


@pytest.mark.parametrize("loss,vt", [("online", 1031), ("online", 327680 + 9), ("topk", None)])
def test_confident_rows_cross_entropy(xp, rng, loss, vt):
    """Rows whose label is their largest logit, 10-40, by margins of 7-27 nats (a CE from 5e-2 down
    to 1e-11, as a trained model's easy tokens): each row's CE is never negative (where the
    rounding of its logsumexp takes lse - s[label] below 0, as it did on such rows before), and
    within 4 ulps of its largest logit of the float64 reference (docs/contract.md, "Numerics");
    the fused kernel, the phase kernels (a teacher past 327680) and the top-k loss."""
    T, H, vs = 48, 16, 1031
    labels = rng.choice(np.arange(300, vs), H, replace=False)  # past the CPU's first 256 columns
    weight = (rng.standard_normal((vs, H)) * 0.1).astype(np.float32)
    weight[labels] = np.eye(H, dtype=np.float32)  # label column i's logit: the row's size along axis i
    axis = rng.integers(0, H, T)
    x = (np.eye(H)[axis] * rng.uniform(10.0, 40.0, (T, 1))).astype(np.float32)
    target = labels[axis]
    s = x.astype(np.float64) @ weight.T.astype(np.float64)
    assert (s.argmax(1) == target).all()
    opts = dict(weight_hard_loss=1.0, weight_soft_loss=0.5, reduction="none")
    if loss == "topk":
        ids = np.argsort(-s, axis=1)[:, :8]
        lq = (s - np.logaddexp.reduce(s, axis=1, keepdims=True))[np.arange(T)[:, None], ids].astype(np.float32)
        arrays = dict(student_input=x, student_weight=weight, teacher_indices=ids, teacher_logprobs=lq, target=target)
        _, ctx = jsdgpu.forward_topk(**to_xp(arrays, xp), **opts)
    else:
        teacher_weight = np.concatenate([weight, rng.standard_normal((vt - vs, H)).astype(np.float32) * 0.1])
        arrays = dict(student_input=x, student_weight=weight, teacher_input=x, teacher_weight=teacher_weight,
                      target=target)
        _, ctx = jsdgpu.forward(**to_xp(arrays, xp), **opts)
    ce = to_numpy(ctx.hard_loss).astype(np.float64)
    want = np.logaddexp.reduce(s, axis=1) - s[np.arange(T), target]
    assert (ce >= 0).all(), ce.min()
    assert (np.abs(ce - want) <= 4 * 2.0**-23 * s.max(1) + 1e-7).all(), np.abs(ce - want).max()


# (options, teacher vocabulary) of test_confident_rows_gradient_at_the_label, also measured by
# experiments/label_softmax.py; vt None: the top-k loss
CONFIDENT_ROWS_CASES = [({}, 1031), (dict(temperature=2.0), 1031), (dict(student_logit_scale=1.5), 1031),
                        ({}, 1040), ({}, 327680 + 9), ({}, None), (dict(temperature=2.0), None),
                        (dict(student_logit_scale=1.5, missing_mass="renormalize"), None)]


@pytest.mark.parametrize("options,vt", CONFIDENT_ROWS_CASES)
def test_confident_rows_gradient_at_the_label(xp, rng, options, vt):
    """Rows whose label holds all but 4e-9 to 5e-3 of the mass, at logits of 30-120 (logsumexps of
    up to 173 bits, whose float32 rounding is up to 8e-6 bits): the gradient at the label, p - 1,
    is right to LABEL_P_ABS absolutely (docs/contract.md, "Numerics"), as the label's own term over
    the row's sum; from the logsumexp rounded to float32, p was up to 5e-6 off. The fused kernel
    with softmax(s) p, with a temperature, with the model's derivative folded into p, with pad
    columns, and the phase kernels (a teacher past 327680); the top-k loss (vt None), whose GPU
    kernel takes p against the logsumexp in the bits it was summed in, where its round trip through
    nats put p - 1 off by 1.06e-8 of the logit (1.3e-6 at 120)."""
    error, rest = confident_rows_label_error(xp, rng, options, vt)
    assert error.max() <= LABEL_P_ABS, (error.max(), rest[error.argmax()])


def confident_rows_label_error(xp, rng, options, vt):
    """(each row's error in p - 1 at its label, the rows' 1 - p) of a call of 32 such rows: the
    hard part alone, each row on an axis of the hidden space of its own, so that
    grad_weight[label, axis] / size is the row's G at its label (the model's derivative times p - 1).
    vt None: the top-k loss, four slots a row, the label among them in half the rows (the slots'
    pass) and not in the others (the rest's)."""
    T = H = 32
    vs = 1031
    labels = rng.choice(np.arange(300, vs), T, replace=False)  # past the CPU's first 256 columns
    axis = rng.permutation(H)
    size = rng.uniform(30.0, 120.0, T)
    margin = rng.uniform(11.0, 25.0, T)  # 1 - p of about 250 e^-margin
    weight = np.empty((vs, H))
    weight[:, axis] = 1.0 - (margin + 3.0 * np.abs(rng.standard_normal((vs, T)))) / size
    weight[labels, axis] = 1.0
    weight = weight.astype(np.float32)
    x = (np.eye(H)[axis] * size[:, None]).astype(np.float32)
    opts = dict(weight_hard_loss=1.0, weight_soft_loss=0.0, reduction="sum", **options)
    if vt is None:
        ids = np.array([rng.choice(np.setdiff1d(np.arange(vs), [y]), 4, replace=False) for y in labels])
        ids[::2, 0] = labels[::2]
        lq = np.log(np.tile(np.float32([0.4, 0.3, 0.2, 0.05]), (T, 1)))
        arrays = dict(student_input=x, student_weight=weight, teacher_indices=ids, teacher_logprobs=lq,
                      target=labels)
        _, ctx = jsdgpu.forward_topk(**to_xp(arrays, xp), **opts)
    else:
        teacher_weight = np.concatenate([weight, rng.standard_normal((vt - vs, H)).astype(np.float32)])
        arrays = dict(student_input=x, student_weight=weight, teacher_input=x, teacher_weight=teacher_weight,
                      target=labels)
        _, ctx = jsdgpu.forward(**to_xp(arrays, xp), **opts)
    _, grad_weight, _ = jsdgpu.backward(ctx)
    scale = options.get("student_logit_scale", 1.0)
    z = scale * (x.astype(np.float64) @ weight.T.astype(np.float64))
    others = np.exp(z - z[np.arange(T), labels][:, None])
    others[np.arange(T), labels] = 0.0
    rest = others.sum(axis=1) / (1.0 + others.sum(axis=1))  # 1 - p, with no cancellation
    assert rest.max() < 1e-2, rest
    got = to_numpy(grad_weight)[labels, axis].astype(np.float64) / size.astype(np.float32)
    return np.abs(got / scale + rest), rest
