"""float64 exp and log of our own for the CPU's Numba kernels: branch-free polynomials that LLVM
vectorizes, where libm's are a call per column (docs/design.md, "The CPU backend"); and the fast
math the kernels compile with."""

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

# fast math without nnan and ninf (a NaN or an infinity must reach the loss)
FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.6931471803691238, 1.9082149292705877e-10  # ln 2 in two parts (Cody and Waite)
_SQRT_HALF_BITS = 0x3FE6A09E667F3BCD  # the bits of sqrt(1/2)
SMALLEST_NORMAL = 2.2250738585072014e-308


@intrinsic
def _double_of_bits(typingctx, bits):
    """The float64 whose bits are the int64 `bits`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@intrinsic
def _bits_of_double(typingctx, x):
    """The int64 whose bits are the float64 `x`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


@numba.njit(fastmath=FAST, inline="always")
def exp64(x):
    """e^x to a few 1e-16 relative (0 below -708, where a float64 would be subnormal; NaN for a
    NaN): x = n ln 2 + r, |r| <= ln(2) / 2, e^r by its Taylor series to r^13, 2^n from its bits."""
    c = min(max(x, -708.0), 709.0)
    n = math.floor(c * _LOG2E + 0.5)
    r = (c - n * _LN2_HI) - n * _LN2_LO
    e = (((((1.0 / 6227020800.0 * r + 1.0 / 479001600.0) * r + 1.0 / 39916800.0) * r + 1.0 / 3628800.0) * r
          + 1.0 / 362880.0) * r + 1.0 / 40320.0) * r + 1.0 / 5040.0
    e = ((((((e * r + 1.0 / 720.0) * r + 1.0 / 120.0) * r + 1.0 / 24.0) * r + 1.0 / 6.0) * r + 0.5) * r + 1.0) * r + 1.0
    e *= _double_of_bits((np.int64(n) + 1023) << 52)
    return x if x != x else (0.0 if x < -708.0 else e)


@numba.njit(fastmath=FAST, inline="always")
def log64(x):
    """ln x for a normal x > 0, to a few 1e-16 relative: x = 2^k f, f in [sqrt(1/2), sqrt 2) (k
    from the bits of x over those of sqrt(1/2)), and ln f = 2 atanh(u), u = (f - 1) / (f + 1)
    (|u| <= 0.172), by its series to u^23."""
    bits = _bits_of_double(x)
    k = (bits - _SQRT_HALF_BITS) >> 52
    f = _double_of_bits(bits - (k << 52))
    u = (f - 1.0) / (f + 1.0)
    u2 = u * u
    s = ((((1.0 / 23.0 * u2 + 1.0 / 21.0) * u2 + 1.0 / 19.0) * u2 + 1.0 / 17.0) * u2 + 1.0 / 15.0) * u2 + 1.0 / 13.0
    s = (((((s * u2 + 1.0 / 11.0) * u2 + 1.0 / 9.0) * u2 + 1.0 / 7.0) * u2 + 1.0 / 5.0) * u2 + 1.0 / 3.0) * u2 + 1.0
    n = np.float64(k)
    return (n * _LN2_HI + 2.0 * u * s) + n * _LN2_LO
