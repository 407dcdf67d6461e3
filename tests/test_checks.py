"""Every bad input of docs/contract.md raises ValueError or TypeError naming the argument, and leaves the
inputs as they were."""

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, make_case, to_numpy, to_xp


def _set(name, value):
    def mutate(case, xp):
        case[name] = value(case, xp) if callable(value) else value
    return mutate


def _retype(name, dtype):
    return _set(name, lambda c, xp: c[name].astype(dtype))


def _target_value(value):
    def mutate(case, xp):
        t = to_numpy(case["target"]).copy()
        t[len(t) // 2] = value
        case["target"] = xp.asarray(t)
    return mutate


# (id, mutation of the arrays, options, exception, words the message must hold)
BAD_INPUTS = [
    ("rank student_input", _set("student_input", lambda c, xp: c["student_input"][None]), {},
     ValueError, "student_input"),
    ("rank teacher_weight", _set("teacher_weight", lambda c, xp: c["teacher_weight"][0]), {},
     ValueError, "teacher_weight"),
    ("rank target", _set("target", lambda c, xp: c["target"][:, None]), {}, ValueError, "target"),
    ("rank student_bias", _set("student_bias", lambda c, xp: xp.zeros((2, 3), np.float32)), {},
     ValueError, "student_bias"),
    ("T teacher_input", _set("teacher_input", lambda c, xp: c["teacher_input"][1:]), {},
     ValueError, "teacher_input"),
    ("T target", _set("target", lambda c, xp: c["target"][1:]), {}, ValueError, "target"),
    ("hidden student", _set("student_weight", lambda c, xp: c["student_weight"][:, 1:]), {},
     ValueError, "student_weight"),
    ("hidden teacher", _set("teacher_input", lambda c, xp: c["teacher_input"][:, 1:]), {},
     ValueError, "teacher_weight"),
    ("Vt < Vs", _set("teacher_weight", lambda c, xp: c["teacher_weight"][:-3]), {},
     ValueError, "teacher_weight"),
    ("bias length", _set("student_bias", lambda c, xp: c["student_bias"][1:]), {},
     ValueError, "student_bias"),
    ("teacher bias length", _set("teacher_bias", lambda c, xp: c["teacher_bias"][1:]), {},
     ValueError, "teacher_bias"),
    ("dtype pair student", _retype("student_weight", np.float16), {}, TypeError,
     "student_input"),
    ("dtype pair teacher", _retype("teacher_input", BF16), {}, TypeError, "teacher_input"),
    ("float64", lambda c, xp: (_retype("student_input", np.float64)(c, xp),
                               _retype("student_weight", np.float64)(c, xp)), {},
     TypeError, "student_input"),
    ("int input", lambda c, xp: (_retype("teacher_input", np.int32)(c, xp),
                                 _retype("teacher_weight", np.int32)(c, xp)), {},
     TypeError, "teacher_input"),
    ("float target", _retype("target", np.float32), {}, TypeError, "target"),
    ("target too large", _target_value(1031), {}, ValueError, "target"),
    ("target negative", _target_value(-1), {}, ValueError, "target"),
    ("target other ignore", _target_value(-100), {"ignore_index": -1}, ValueError, "target"),
    ("beta < 0", None, {"beta": -0.1}, ValueError, "beta"),
    ("beta > 1", None, {"beta": 1.5}, ValueError, "beta"),
    ("beta nan", None, {"beta": float("nan")}, ValueError, "beta"),
    ("temperature 0", None, {"temperature": 0.0}, ValueError, "temperature"),
    ("temperature < 0", None, {"temperature": -1.0}, ValueError, "temperature"),
    ("temperature inf", None, {"temperature": float("inf")}, ValueError, "temperature"),
    ("weight_hard nan", None, {"weight_hard_loss": float("nan")}, ValueError, "weight_hard_loss"),
    ("weight_soft inf", None, {"weight_soft_loss": float("-inf")}, ValueError, "weight_soft_loss"),
    ("weight string", None, {"weight_soft_loss": "0.5"}, TypeError, "weight_soft_loss"),
    ("ignore_index float", None, {"ignore_index": 1.5}, TypeError, "ignore_index"),
    ("chunk_size 0", None, {"chunk_size": 0}, ValueError, "chunk_size"),
    ("num_valid_tokens 0", None, {"num_valid_tokens": 0}, ValueError, "num_valid_tokens"),
    ("num_valid_tokens nan", None, {"num_valid_tokens": float("nan")}, ValueError,
     "num_valid_tokens"),
    ("num_valid_tokens text", None, {"num_valid_tokens": "8"}, TypeError, "num_valid_tokens"),
    ("not an array", _set("student_weight", lambda c, xp: [[1.0]]), {}, TypeError,
     "student_weight"),
    # a function too (api.forward_with's weight_memory is the one argument that may be one)
    ("a function", _set("student_input", lambda c, xp: lambda: c["student_input"]), {}, TypeError,
     "student_input"),
]


@pytest.mark.parametrize("name,mutate,options,error,words", BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(xp, rng, name, mutate, options, error, words):
    case = to_xp(make_case(rng, T=6, bias=True), xp)
    if mutate is not None:
        mutate(case, xp)
    before = {k: to_numpy(v).copy() for k, v in case.items() if hasattr(v, "shape")}
    with pytest.raises(error, match=words):
        jsdgpu.forward(**case, **options)
    for k, v in before.items():
        assert np.array_equal(to_numpy(case[k]), v, equal_nan=True), k


def test_checked_once_per_signature_but_bad_input_raises_every_time(xp, rng):
    """The checks are skipped for arrays whose names, kinds, shapes, dtypes and devices passed
    before (checks.once_per_signature), never for a signature that failed; and a signature of
    arrays that passed is still checked where one of them changes."""
    case = to_xp(make_case(rng, T=5), xp)
    bad = dict(case, target=case["target"].astype(np.float32))
    other_device_kind = dict(case, target=to_numpy(case["target"])) if xp is not np else None
    for _ in range(2):
        with pytest.raises(TypeError, match="target"):
            jsdgpu.forward(**bad)
        jsdgpu.forward(**case)  # passes, and its signature is kept
        with pytest.raises(ValueError, match="student_input"):
            jsdgpu.forward(**dict(case, student_input=case["student_input"][:, :-1]))
        if other_device_kind is not None:
            with pytest.raises(ValueError, match="host and device"):
                jsdgpu.forward(**other_device_kind)


def test_inputs_unchanged_after_a_good_call(xp, rng):
    case = to_xp(make_case(rng, T=9, bias=True, ignored=0.4, vt=1040), xp)
    before = {k: to_numpy(v).copy() for k, v in case.items()}
    loss, ctx = jsdgpu.forward(**case, chunk_size=4)
    jsdgpu.backward(ctx)
    for k, v in before.items():
        assert to_numpy(case[k]).tobytes() == v.tobytes(), k


@pytest.mark.gpu
def test_mixed_host_and_device():
    import cupy
    case = make_case(np.random.default_rng(), T=4)
    mixed = to_xp(case, cupy)
    mixed["target"] = case["target"]
    with pytest.raises(ValueError, match="host and device.*target"):
        jsdgpu.forward(**mixed)


@pytest.mark.gpu
def test_different_devices():
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    case = to_xp(make_case(np.random.default_rng(), T=4), cupy)
    with cupy.cuda.Device(1):
        case["teacher_weight"] = cupy.asarray(case["teacher_weight"].get())
    with pytest.raises(ValueError, match="different devices"):
        jsdgpu.forward(**case)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("where", ["teacher_input", "student_weight"])
def test_non_finite_inputs_give_non_finite_loss(xp, rng, beta, where):
    """Not masked: a NaN in either model's inputs reaches the loss, whatever the JSD variant."""
    case = make_case(rng, T=5)
    case[where][2, 3] = np.nan
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), beta=beta, weight_hard_loss=0.0)
    assert np.isnan(float(loss)) and np.isnan(float(ctx.soft_loss))
    assert np.isnan(jsdgpu.reference(**case, beta=beta, weight_hard_loss=0.0)[0])
