"""The loss at every temperature and logit scale, against float64 (docs/contract.md: finite
inputs give a finite loss wherever float64 is finite, the soft part is never negative, and a
small soft part keeps float32's relative precision).

Three-way: the library's result must be about as close to the float64 reference as the float64
math itself is on the same logits rounded to float32 (the "floor": what merely holding the
logits in float32, as the library does, costs), plus float32 rounding of the result: 1e-5
relative, or 1e-9 absolute for soft parts below 1e-4.
"""

import itertools

import numpy as np
import pytest

import jsdgpu
from conftest import DTYPES, make_case, rel_err, to_numpy, to_xp
from jsdgpu.reference import reference_logits

SCALES = (1.0, 8.0, 40.0)  # logits' std
TEMPERATURES = (0.05, 0.25, 1.0, 50.0)
BETAS = (0.0, 1e-6, 0.3, 0.5, 1.0 - 1e-6, 1.0)
GRID = list(itertools.product(SCALES, TEMPERATURES, BETAS))


def logits(case):
    f = lambda k: case[k].astype(np.float64)  # noqa: E731
    s = f("student_input") @ f("student_weight").T + f("student_bias")
    t = f("teacher_input") @ f("teacher_weight").T + f("teacher_bias")
    return s, t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("scale,temperature,beta", GRID)
def test_grid_against_float64(xp, rng, dtype, scale, temperature, beta):
    if xp is np and dtype == "float16":
        pytest.skip("float16 on the CPU: as float32 there (its products are float32)")
    case = make_case(rng, T=7, hs=16, ht=24, vs=515, vt=523, dtype=DTYPES[dtype], bias=True, ignored=0.2,
                     logit_std=scale)
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.3, weight_soft_loss=0.7)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), chunk_size=3, **opts)
    gi, gw, gb = jsdgpu.backward(ctx)
    s, t = logits(case)
    ref = reference_logits(s, t, case["target"], **opts)
    floor = reference_logits(s.astype(np.float32), t.astype(np.float32), case["target"], **opts)
    for name, got, want, rounded in (("loss", loss, ref[0], floor[0]), ("soft", ctx.soft_loss, ref[2], floor[2]),
                                     ("hard", ctx.hard_loss, ref[1], floor[1])):
        got = float(got)
        assert np.isfinite(got), (name, got, want)
        tol = 4 * abs(rounded - want) + max(1e-5 * abs(want), 1e-9)
        assert abs(got - want) <= tol, (name, got, want, abs(got - want), tol)
    assert float(ctx.soft_loss) >= 0.0
    grads = [to_numpy(g).astype(np.float64) for g in (gi, gw, gb)]
    assert all(np.isfinite(g).all() for g in grads)
    # the gradients through G: G @ Ws, G.T @ Xs, G.sum(0), from the reference's G and the floor's
    f = lambda k: case[k].astype(np.float64)  # noqa: E731
    want = [ref[3] @ f("student_weight"), ref[3].T @ f("student_input"), ref[3].sum(0)]
    rounded = [floor[3] @ f("student_weight"), floor[3].T @ f("student_input"), floor[3].sum(0)]
    eps = {"float32": 1e-5, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    # float32 G: its sums' rounding beside the float64 reference's. (A sharp row, whose KL is
    # hundreds of bits at temperature 0.05, needs its h and KL taken relative to a reference
    # column to stay within this: row_math.cuh, "A sharp row".)
    slack = 1e-4 * (dtype == "float32")
    for got, w, r in zip(grads, want, rounded):
        assert rel_err(got, w) <= 4 * rel_err(r, w) + 2 * eps + slack, (rel_err(got, w), rel_err(r, w))


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
    s, t = logits(case)
    want = reference_logits(s.astype(np.float32), t.astype(np.float32), case["target"], **opts)[2]
    got = float(ctx.soft_loss)
    print(f"soft part {want:.3e}: got {got:.6e}, error {abs(got - want):.1e}")
    assert 0.0 <= got and abs(got - want) <= max(1e-5 * want, 1e-9), (got, want)


@pytest.mark.parametrize("memory_budget", [None, 1])  # G held apart; G over the chunk's logits
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_rows_near_and_far_in_one_chunk(xp, rng, dtype, beta, memory_budget):
    """Half of the rows with a teacher that nearly agrees with the student (soft parts of about
    1e-7: on the GPU the fused kernel leaves those rows to the phase kernels, which write their
    G over their own logits where G is not held apart) and half with an unrelated teacher, in
    one chunk: every row's loss and gradient as the reference's."""
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
