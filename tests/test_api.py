"""forward / backward against the float64 reference, on every option, on both backends."""

import itertools

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, DTYPES, make_case, rel_err, round_to, to_numpy, to_xp

BETAS = (0.0, 0.3, 0.5, 1.0)
TEMPERATURES = (0.5, 1.0, 2.0)
WEIGHTS = ((0.5, 0.5), (1.0, 0.0), (0.0, 1.0))
CHUNKS = (1, 5, None)
# (T, Vs, Vt - Vs): T = 1, T not a multiple of 5, odd vocabularies, Vt > Vs
SHAPES = ((1, 1031, 0), (13, 1031, 9), (7, 257, 0), (23, 999, 33))
OPTION_CASES = list(itertools.product(BETAS, TEMPERATURES, WEIGHTS))


def case_for(index, rng, dtype):
    """The index-th option case's shape, biases, ignored rows, chunk size and memory budget (None:
    G held for all rows; 1 byte: G per chunk, grad_weight summed over chunks): all values of each,
    and every chunk size with each budget, come round as the index runs over the option product."""
    T, vs, pad = SHAPES[index % len(SHAPES)]
    bias = index % 2 == 1
    ignored = (0.0, 0.3, 0.6)[(index // 2) % 3]
    ignore_index = -100 if index % 5 else 7  # a non-default ignore_index inside [0, Vs) too
    case = make_case(rng, T=T, vs=vs, vt=vs + pad, dtype=dtype, bias=bias, ignored=ignored,
                     ignore_index=ignore_index)
    return case, ignore_index, CHUNKS[index % len(CHUNKS)], (None, 1)[(index // len(CHUNKS)) % 2]


def check_against_reference(case, xp, dtype, *, chunk_size=None, memory_budget=None,
                            grad_output=1.0, grad_floors=(0.0, 0.0, 0.0), **options):
    """The library's loss parts and gradients against the float64 reference's: float32 gradients
    within 1e-4 of its norms, plus grad_floors (grad_input's, grad_weight's, grad_bias's),
    absolute allowances on those norms where the contract's precision is absolute."""
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), chunk_size=chunk_size,
                               memory_budget=memory_budget, **options)
    gi, gw, gb = jsdgpu.backward(ctx, grad_output)
    ref = jsdgpu.reference(**case, **options)
    assert type(loss) is xp.ndarray and loss.shape == () and loss.dtype == np.float32
    assert ctx.hard_loss.shape == () and ctx.soft_loss.shape == ()
    for got, want in ((loss, ref[0]), (ctx.hard_loss, ref[1]), (ctx.soft_loss, ref[2])):
        assert abs(float(got) - want) <= 1e-5 * max(1.0, abs(want)), (float(got), want)
    assert (gb is None) == (case["student_bias"] is None)
    for got, want, floor in zip((gi, gw, gb), ref[3:], grad_floors):
        if want is None:
            continue
        want = want * grad_output
        assert type(got) is xp.ndarray and got.dtype == dtype and got.shape == want.shape
        assert np.isfinite(to_numpy(got).astype(np.float64)).all()
        if dtype == np.float32:
            floor = floor * abs(grad_output)
            assert rel_err(got, want) <= 1e-4 + floor / max(np.linalg.norm(want), 1e-30), (rel_err(got, want), floor)
        else:
            # 16-bit gradients: within 2 eps of the reference (a few hundred elements make a
            # noisy ratio; the strict bound, twice the rounding floor, is checked at the
            # benchmark shape in test_cuda_backend.py)
            eps = float(np.finfo(dtype).eps) if dtype != BF16 else 2.0**-8
            assert rel_err(got, want) <= 2 * eps, (rel_err(got, want),
                                                   rel_err(round_to(want, dtype), want))


@pytest.mark.parametrize("index", range(len(OPTION_CASES)))
def test_options_float32(xp, rng, index):
    beta, temperature, (w_hard, w_soft) = OPTION_CASES[index]
    case, ignore_index, chunk, budget = case_for(index, rng, np.float32)
    check_against_reference(case, xp, np.dtype(np.float32), chunk_size=chunk, memory_budget=budget,
                            beta=beta, temperature=temperature, weight_hard_loss=w_hard,
                            weight_soft_loss=w_soft, ignore_index=ignore_index)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("index", range(len(OPTION_CASES)))
def test_options_16bit_gpu(rng, index, dtype):
    import cupy
    beta, temperature, (w_hard, w_soft) = OPTION_CASES[index]
    case, ignore_index, chunk, budget = case_for(index, rng, DTYPES[dtype])
    check_against_reference(case, cupy, DTYPES[dtype], chunk_size=chunk, memory_budget=budget,
                            beta=beta, temperature=temperature, weight_hard_loss=w_hard,
                            weight_soft_loss=w_soft, ignore_index=ignore_index)


def test_bfloat16_cpu(rng):
    case = make_case(rng, T=9, dtype=BF16, bias=True, ignored=0.3, vt=1040)
    check_against_reference(case, np, BF16, chunk_size=4, beta=0.3, temperature=2.0)


# memory_budget None: grad_weight's product runs in backward, scaled there; 1: summed in forward
@pytest.mark.parametrize("memory_budget", [None, 1])
def test_grad_output_scales(xp, rng, memory_budget):
    case = make_case(rng, T=6, bias=True)
    check_against_reference(case, xp, np.dtype(np.float32), memory_budget=memory_budget,
                            grad_output=-2.5)


@pytest.mark.parametrize("memory_budget", [None, 1])
def test_grad_output_device_scalar(xp, rng, memory_budget):
    case = make_case(rng, T=4)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), memory_budget=memory_budget)
    gi, gw, _ = jsdgpu.backward(ctx, xp.asarray(3.0, dtype=np.float32))
    ref = jsdgpu.reference(**case)
    assert rel_err(gi, 3.0 * ref[3]) <= 1e-4 and rel_err(gw, 3.0 * ref[4]) <= 1e-4
    # the product read its scale on the device: the shared cuBLAS handle is back to host scalars
    a = xp.asarray(case["student_weight"][:8])
    assert rel_err(a @ a.T, case["student_weight"][:8] @ case["student_weight"][:8].T) <= 1e-5


@pytest.mark.parametrize("all_ignored", [False, True])
def test_no_valid_rows(xp, rng, all_ignored):
    """T == 0 or every row ignored: loss 0 and zero gradients of the right shapes."""
    case = make_case(rng, T=0 if not all_ignored else 5, bias=True)
    if all_ignored:
        case["target"][:] = -100
    loss, ctx = jsdgpu.forward(**to_xp(case, xp))
    gi, gw, gb = jsdgpu.backward(ctx)
    assert float(loss) == 0.0 and float(ctx.hard_loss) == 0.0 and float(ctx.soft_loss) == 0.0
    assert gi.shape == case["student_input"].shape and gw.shape == case["student_weight"].shape
    assert gb.shape == case["student_bias"].shape
    for g in (gi, gw, gb):
        assert not to_numpy(g).any()


def test_compute_grad_false(xp, rng):
    case = make_case(rng, T=8, ignored=0.3)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), compute_grad=False)
    assert abs(float(loss) - jsdgpu.reference(**case)[0]) <= 1e-5 * max(1.0, float(loss))
    with pytest.raises(ValueError, match="compute_grad"):
        jsdgpu.backward(ctx)


def test_backward_twice_raises(xp, rng):
    loss, ctx = jsdgpu.forward(**to_xp(make_case(rng, T=3), xp))
    jsdgpu.backward(ctx)
    with pytest.raises(RuntimeError, match="already"):
        jsdgpu.backward(ctx)


def test_bitwise_repeatable(xp, rng):
    case = to_xp(make_case(rng, T=37, bias=True, ignored=0.3, vt=1040), xp)
    runs = []
    for _ in range(2):
        loss, ctx = jsdgpu.forward(**case, chunk_size=8, beta=0.3, temperature=2.0)
        runs.append([to_numpy(a) for a in (loss, ctx.hard_loss, ctx.soft_loss,
                                           *jsdgpu.backward(ctx))])
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()


def test_chunk_from_memory_budget(xp, rng):
    """A budget of a few rows' buffers makes several chunks; the result does not change."""
    case = make_case(rng, T=21, bias=True)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), memory_budget=3 * 1031 * 12)
    gi, gw, gb = jsdgpu.backward(ctx)
    ref = jsdgpu.reference(**case)
    assert abs(float(loss) - ref[0]) <= 1e-5 * max(1.0, ref[0])
    assert rel_err(gi, ref[3]) <= 1e-4 and rel_err(gw, ref[4]) <= 1e-4
    assert rel_err(gb, ref[5]) <= 1e-4


def test_grad_weight_float32_option(xp, rng):
    case = make_case(rng, T=5, dtype=np.float16, bias=True) if xp is not np else \
        make_case(rng, T=5, dtype=BF16, bias=True)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), grad_weight_float32=True)
    gi, gw, gb = jsdgpu.backward(ctx)
    assert gi.dtype == case["student_input"].dtype
    assert gw.dtype == np.float32 and gb.dtype == np.float32
    ref = jsdgpu.reference(**case)
    assert rel_err(gw, ref[4]) <= 1e-3


def test_loss_object(xp, rng):
    case = make_case(rng, T=6, bias=True)
    loss_fn = jsdgpu.JSDDistillLoss(beta=0.3, temperature=2.0, weight_hard_loss=0.2)
    assert "beta=0.3" in repr(loss_fn)
    loss, ctx = loss_fn(**to_xp(case, xp))
    gi, gw, gb = loss_fn.backward(ctx)
    ref = jsdgpu.reference(**case, beta=0.3, temperature=2.0, weight_hard_loss=0.2)
    assert abs(float(loss) - ref[0]) <= 1e-5 * max(1.0, ref[0])
    assert rel_err(gw, ref[4]) <= 1e-4
    with pytest.raises(ValueError, match="beta"):
        jsdgpu.JSDDistillLoss(beta=2.0)


def test_outputs_do_not_alias_inputs(xp, rng):
    case = to_xp(make_case(rng, T=4, bias=True), xp)
    loss, ctx = jsdgpu.forward(**case)
    grads = jsdgpu.backward(ctx)
    for g in grads:
        for a in case.values():
            assert not np.shares_memory(to_numpy(g), to_numpy(a)) if xp is np else \
                g.data.ptr != a.data.ptr


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_confident_and_unsure_rows(rng, dtype):
    """Logits of std 8, half the rows labelled with the student's own top token (softmax near 1:
    the label stays in G) and half at random (the label term is added apart, exactly), with
    repeated labels so several rows add into one grad_weight row."""
    xp = np if dtype == "float32" else pytest.importorskip("cupy")
    case = make_case(rng, T=40, vs=257, dtype=DTYPES[dtype], bias=True, logit_std=8.0, ignored=0.1)
    logits = case["student_input"].astype(np.float64) @ case["student_weight"].astype(np.float64).T
    confident = rng.random(40) < 0.5
    case["target"] = np.where(confident, logits.argmax(1), rng.integers(0, 5, 40))
    check_against_reference(case, xp, DTYPES[dtype], chunk_size=7, beta=0.3)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_label_in_a_part_that_ends_inside_a_float4(rng, dtype, temperature):
    """The last column as the label of about half the rows, with the student's bias making its
    softmax about 0.9 (the label's one-hot term stays in G). At Vs = 257 the fused kernel's last
    CTA holds columns 240 to 256: its part of the row ends inside a float4, whose values, the
    label's among them, it writes after its loop of whole float4s."""
    xp = np if dtype == "float32" else pytest.importorskip("cupy")
    case = make_case(rng, T=24, vs=257, dtype=DTYPES[dtype], bias=True, ignored=0.1)
    case["student_bias"][-1] = 8.0
    case["target"][rng.random(24) < 0.5] = 256
    check_against_reference(case, xp, DTYPES[dtype], chunk_size=7, beta=0.3, temperature=temperature)


def test_num_valid_tokens_parts_add_up_to_the_whole(xp, rng):
    """Two parts of a batch, each divided by the whole batch's count of valid rows, add up to
    the loss and gradients of the whole batch in one call (data parallelism, accumulation)."""
    case = make_case(rng, T=20, bias=True, ignored=0.3)
    n = max(1, int((case["target"] != -100).sum()))
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), beta=0.3)
    whole = [to_numpy(a) for a in (loss, *jsdgpu.backward(ctx))]
    parts = []
    for rows in (slice(0, 8), slice(8, 20)):
        part = dict(case, student_input=case["student_input"][rows],
                    teacher_input=case["teacher_input"][rows], target=case["target"][rows])
        loss, ctx = jsdgpu.forward(**to_xp(part, xp), beta=0.3, num_valid_tokens=n)
        parts.append([to_numpy(a) for a in (loss, *jsdgpu.backward(ctx))])
    assert abs(float(parts[0][0]) + float(parts[1][0]) - float(whole[0])) <= 1e-5 * float(whole[0])
    assert rel_err(np.concatenate([parts[0][1], parts[1][1]]), whole[1]) <= 1e-5
    for k in (2, 3):  # grad_weight, grad_bias
        assert rel_err(parts[0][k] + parts[1][k], whole[k]) <= 1e-5


def test_num_valid_tokens_scales(xp, rng):
    case = make_case(rng, T=9, ignored=0.3)
    n = max(1, int((case["target"] != -100).sum()))
    ref = jsdgpu.reference(**case)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), num_valid_tokens=2.5 * n)
    gi, gw, _ = jsdgpu.backward(ctx)
    assert abs(float(loss) - ref[0] / 2.5) <= 1e-5 * ref[0]
    assert rel_err(gi, ref[3] / 2.5) <= 1e-4 and rel_err(gw, ref[4] / 2.5) <= 1e-4
