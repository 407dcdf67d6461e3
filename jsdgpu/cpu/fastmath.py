"""float64 and float32 exp and log of our own for the CPU's Numba kernels: branch-free
polynomials that LLVM vectorizes, where libm's are a call per column (docs/design.md, "The CPU
backend"); and the fast math the kernels compile with."""

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

# fast math without nnan and ninf (a NaN or an infinity must reach the loss)
FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.6931471803691238, 1.9082149292705877e-10  # ln 2 in two parts (Cody and Waite)
_SQRT_HALF_BITS = 0x3FE6A09E667F3BCD  # the bits of sqrt(1/2)
SMALLEST_NORMAL = 2.2250738585072014e-308
F32 = np.float32
_LN2_HI32, _LN2_LO32 = F32(0.693359375), F32(-2.12194440e-4)  # ln 2 in two float32 parts
_SQRT_HALF_BITS32 = 0x3F3504F3  # the bits of float32 sqrt(1/2)
LINE = 16  # float32 values in a 64-byte cache line (the row kernels' prefetches and buffers)


def _bitcast(source, target):
    """An intrinsic: the `target` (a Numba type) whose bits are those of its `source` argument."""
    @intrinsic
    def cast(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(target))
        return target(source), codegen
    return cast


_double_of_bits, _bits_of_double = _bitcast(types.int64, types.float64), _bitcast(types.float64, types.int64)
_float_of_bits, _bits_of_float = _bitcast(types.int32, types.float32), _bitcast(types.float32, types.int32)


def _int32_op(name):
    """An intrinsic: the int32 result of IRBuilder's `name` (sub, shl, ashr) on two int32s, wrapping
    like C's. Numba's own int32 arithmetic is int64's, and a vectorized loop then takes eight
    lanes, or converts each half of sixteen (log32's took 12 instructions for 3 this way)."""
    @intrinsic
    def op(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return getattr(builder, name)(*args)
        return types.int32(types.int32, types.int32), codegen
    return op


_sub32, _shl32, _ashr32 = _int32_op("sub"), _int32_op("shl"), _int32_op("ashr")


@intrinsic
def prefetch(typingctx, array, index):
    """Ask the core for the cache line that holds array[index] (a C-contiguous array, an index in
    it), into its first-level cache, without waiting for it: LLVM's llvm.prefetch (a read, the
    highest locality, data). A load would hold the loop back until the line came from memory."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, signature.args[0], data, [args[1]], wraparound=False)
        byte_pointer, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer] + [i32] * 3),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.none(array, types.intp), codegen


@intrinsic
def wide_vectors(typingctx):
    """Mark the function that calls it (its LLVM function: a row's function, whose loops its
    inlined helpers hold) to be vectorized at 512 bits where the CPU has them: LLVM's tuning of
    Intel's AVX-512 cores (CI's Xeon kind among them, which LLVM takes for rocketlake) prefers
    256-bit vectors, and there the row kernels took 1.16-1.47 times as long (docs/design.md, "The
    CPU backend"). An LLVM function attribute, so the process's other Numba code keeps its own
    width (NUMBA_CPU_FEATURES would change all of it); without AVX-512 it changes nothing.
    (llvmlite's attribute set knows no string attributes, so it is added past its check.)"""
    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()
    return types.none(), codegen


@numba.njit(fastmath=FAST, inline="always")
def exp64(x):
    """e^x to 2e-15 relative for |x| <= 40, 3e-14 at the ends of its range
    (tests/test_cpu_fastmath.py; 0 below -708, where a float64 would be subnormal; NaN for a NaN):
    x = n ln 2 + r, |r| <= ln(2) / 2, e^r by its Taylor series to r^13, 2^n from its bits."""
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


def _exp32_poly():
    """E's six float32 coefficients, of r^0 .. r^5, with 1 + r E(r) = e^r on |r| <= ln(2) / 2: a
    Chebyshev fit of (e^r - 1) / r at 64 nodes. Evaluated as exp32 does (Horner in float32, the
    last step an FMA with 1), within 6.4e-8 relative of e^r there (in float32 arithmetic, each
    FMA rounded once), where the Taylor series to r^7 took two operations more for 7.3e-8
    (docs/record.md)."""
    half = math.log(2.0) / 2
    nodes = half * np.cos(np.pi * (np.arange(64) + 0.5) / 64)
    fit = np.polynomial.Chebyshev.fit(nodes, np.expm1(nodes) / nodes, 5, domain=[-half, half])
    return tuple(F32(c) for c in fit.convert(kind=np.polynomial.Polynomial).coef)


_E0, _E1, _E2, _E3, _E4, _E5 = _exp32_poly()


@numba.njit(fastmath=FAST, inline="always")
def exp32(x):
    """e^x of a float32 to 2e-7 relative for |x| <= 40, 4e-7 at the ends of its range
    (tests/test_cpu_fastmath.py; 0 below -87, near where a float32 becomes subnormal, inf from
    about 88.4, where 2^n is, NaN for a NaN): x = n ln 2 + r, |r| <= ln(2) / 2, e^r = 1 + r E(r)
    (_exp32_poly), 2^n from its bits. (np.floor: math.floor would make n an int64, and the lanes
    float64.)"""
    c = min(max(x, F32(-87.0)), F32(88.7))
    n = np.floor(c * F32(_LOG2E) + F32(0.5))
    r = (c - n * _LN2_HI32) - n * _LN2_LO32
    e = (((((_E5 * r + _E4) * r + _E3) * r + _E2) * r + _E1) * r + _E0) * r + F32(1.0)
    e *= _float_of_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    return x if x != x else (F32(0.0) if x < F32(-87.0) else e)


@numba.njit(fastmath=FAST, inline="always")
def log32(x):
    """ln x of a normal float32 x > 0 to 2e-7 relative (absolute past e; tests/test_cpu_fastmath.py),
    as log64 in float32: ln f = 2 atanh(u) by its series to u^11."""
    bits = _bits_of_float(x)
    k = _ashr32(_sub32(bits, np.int32(_SQRT_HALF_BITS32)), np.int32(23))
    f = _float_of_bits(_sub32(bits, _shl32(k, np.int32(23))))
    u = (f - F32(1.0)) / (f + F32(1.0))
    u2 = u * u
    s = ((((F32(2 / 11) * u2 + F32(2 / 9)) * u2 + F32(2 / 7)) * u2 + F32(2 / 5)) * u2 + F32(2 / 3)) * u2
    return F32(k) * F32(0.6931471805599453) + (F32(2.0) * u + u * s)


@numba.njit(fastmath=FAST, inline="always")
def _order_key(bits):
    """The int32 whose order is that of the float32 with these bits (a float's bits with the
    magnitude's flipped where the sign is set); its own inverse."""
    return bits ^ ((bits >> np.int32(31)) & np.int32(0x7FFFFFFF))


@numba.njit(fastmath=FAST, inline="always")
def max32(x):
    """The largest of a float32 array (-inf where it is empty), by the integer order of its bits:
    LLVM vectorizes an integer max, not a float one that may meet a NaN. A NaN with its sign bit
    clear is above every number, one with it set below -inf."""
    key = _order_key(_bits_of_float(F32(-np.inf)))
    for j in range(len(x)):
        key = max(key, _order_key(_bits_of_float(x[j])))
    return _float_of_bits(np.int32(_order_key(key)))
