"""The CPU kernels' own exp and log (jsdgpu/cpu/fastmath.py), elementwise against NumPy's in
float64 on the same arguments: float64's to a few 1e-16 relative, float32's to 2e-7 (each exp's
error grows with |x|, up to 2.4e-14 and 3e-7 at the ends of its range), with their limits (0
below the smallest normal's exponent, NaN for a NaN)."""

import numba
import numpy as np
import pytest

from jsdgpu.cpu import fastmath


def _elementwise(fn):
    @numba.njit(fastmath=fastmath.FAST)
    def apply(x):
        out = np.empty_like(x)
        for j in range(len(x)):
            out[j] = fn(x[j])
        return out
    return apply


def _rel_err(got, want, floor=0.0):
    return np.max(np.abs(got - want) / np.maximum(np.abs(want), floor))


def test_exp_and_log_of_float64(rng):
    exp = _elementwise(fastmath.exp64)
    x = rng.uniform(-40, 40, 100000)
    assert _rel_err(exp(x), np.exp(x)) <= 2e-15
    x = rng.uniform(-708, 709, 100000)
    assert _rel_err(exp(x), np.exp(x)) <= 3e-14
    log = _elementwise(fastmath.log64)
    y = np.exp(rng.uniform(-700, 700, 100000))
    assert _rel_err(log(y), np.log(y), 1.0) <= 1e-15
    near_one = 1 + rng.uniform(-1e-3, 1e-3, 10000)
    assert _rel_err(log(near_one), np.log(near_one), 1e-30) <= 1e-15


def test_exp_and_log_of_float32(rng):
    exp = _elementwise(fastmath.exp32)
    for top, bound in ((40, 2e-7), (87, 4e-7)):
        x = rng.uniform(-top, top, 100000).astype(np.float32)
        got = exp(x)
        assert got.dtype == np.float32
        assert _rel_err(got, np.exp(x.astype(np.float64))) <= bound
    log = _elementwise(fastmath.log32)
    y = np.exp(rng.uniform(-87, 88, 100000)).astype(np.float32)
    got = log(y)
    assert got.dtype == np.float32
    assert _rel_err(got, np.log(y.astype(np.float64)), 1.0) <= 2e-7
    near_one = (1 + rng.uniform(-1e-3, 1e-3, 10000)).astype(np.float32)
    assert _rel_err(log(near_one), np.log(near_one.astype(np.float64)), 1e-30) <= 2e-7


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_limits(dtype):
    exp = _elementwise(fastmath.exp32 if dtype == np.float32 else fastmath.exp64)
    got = exp(np.array([-np.inf, -1e4, np.nan, 0.0], dtype))
    assert got[0] == 0.0 and got[1] == 0.0 and np.isnan(got[2]) and got[3] == 1.0


def test_max32(rng):
    """max32 (by its bits' integer order) against NumPy's max: of every sign, of one value, at the
    infinities, of -0.0 against 0.0, -inf where empty; a NaN with the sign bit clear above all."""
    max32 = numba.njit(fastmath=fastmath.FAST)(lambda x: fastmath.max32(x))
    for n in (1, 15, 16, 17, 1000, 32001):
        x = (rng.standard_normal(n) * 10 - rng.uniform(0, 50)).astype(np.float32)
        assert max32(x) == np.max(x) and max32(-x) == np.max(-x)
    for values, want in (([-np.inf, -3.0], -3.0), ([np.inf, 1.0], np.inf), ([-np.inf], -np.inf), ([], -np.inf),
                         ([-0.0, -1.0], -0.0), ([-0.0, 0.0], 0.0), ([-5.0, -1e-45, -7.0], -1e-45)):
        got, want = max32(np.array(values, np.float32)), np.float32(want)
        assert got == want and np.signbit(got) == np.signbit(want), values
    assert np.isnan(max32(np.array([1.0, np.nan, 2.0], np.float32)))


@pytest.mark.parametrize("b", [1.0 / 6.0, 0.25, 0.3333, 1.0 / 3.0, 0.4, 0.5])
def test_mixture_log_polynomial_is_good_to_float32(b):
    """The JSD column's mixture log, 2 atanh(u) by L (divergences.mixture_log_poly) on the u that a
    column of mixture weight b meets, u in [(b - 1) / (b + 1), 0], evaluated as the fused kernel
    does (mixture_log_of in b's form, nine terms or from b = 1/3 six; float32): within a few
    float32 roundings of float64's, relative."""
    from jsdgpu.cpu import divergences
    _, coefficients = divergences.precise_terms(divergences.JSD, b)
    form = divergences.mixture_form(np.float32(b))
    assert form == (divergences.MIXTURE_BY_SHORT_LOG if b >= 1.0 / 3.0 else divergences.MIXTURE_BY_LOG)
    log_of = numba.njit(fastmath=fastmath.FAST)(lambda poly, u: divergences.mixture_log_of(poly, u, form))
    u = np.linspace((b - 1) / (b + 1), 0.0, 20001)[:-1].astype(np.float32)
    got = np.array([log_of(coefficients, x) for x in u], np.float64)
    want = 2 * np.arctanh(u.astype(np.float64))
    assert _rel_err(got, want) <= 3e-7


def test_wide_vectors_marks_its_function_alone():
    """wide_vectors() puts LLVM's 512-bit preference on the function that calls it, and on no other:
    where the host has AVX-512 its loop takes 512-bit registers (zmm), whatever LLVM's tuning of the
    CPU prefers; a function without it carries no such attribute."""
    def summed(wide):
        @numba.njit(fastmath=fastmath.FAST)
        def total(x):
            if wide:
                fastmath.wide_vectors()
            acc = np.float32(0.0)
            for j in range(len(x)):
                acc += fastmath.exp32(x[j])
            return acc
        x = np.linspace(-1, 1, 1000, dtype=np.float32)
        assert total(x) == pytest.approx(np.exp(x.astype(np.float64)).sum(), rel=1e-6)
        (ir,), (asm,) = total.inspect_llvm().values(), total.inspect_asm().values()
        return ir, asm
    wide_ir, wide_asm = summed(True)
    plain_ir, _ = summed(False)
    assert '"prefer-vector-width"="512"' in wide_ir
    assert '"prefer-vector-width"' not in plain_ir
    if "+avx512f" in numba.core.codegen.get_host_cpu_features():
        assert "zmm" in wide_asm
