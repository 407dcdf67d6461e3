"""The CPU's fused row kernel's row in one thread (rows._fused_row's parts, as the GPU's
fused_row.cuh is fused_rows.cu's): the row's shifted exps and their sums, its reference column,
the column pass over column32's terms a block at a time with the next row's logits prefetched,
and the gradient row. Each function is inlined into the row's function (rows.py's
_sources_digest holds this file)."""

import numba
import numpy as np

from .divergences import (FORWARD_KL, JSD, MIXTURE_BY_LOG, MIXTURE_BY_RATIO, MIXTURE_BY_SHORT_LOG, REVERSE_KL, column32,
                          grad_dz)
from .fastmath import F32, FAST, LINE, exp32, max32, prefetch


# Columns a float32 partial sum takes before it is added to the row's float64 sum (the column
# pass's: _PREFETCH_BLOCK): a float64 sum inside the column loop would take the loop to eight
# float32 lanes from sixteen (it took 18.5 ms where float32 sums took 12.3, 512 rows of 32000)
_BLOCK = 1024
# The first columns whose largest logit shifts a row's exps: the exps and their sum then take one
# pass over the row, where the row's maximum first would take two reads of it from memory; a sum
# past _SUM_ABOVE (a logit far above the first columns', beyond where float32 p keeps its
# precision; or inf or NaN) is made again with the row's maximum
_SHIFT_COLUMNS = 256
_SUM_ABOVE = 1e17


@numba.njit(fastmath=FAST, inline="always")
def exp_sum(x, scale, shift, e):
    """sum over x of exp32(x scale - shift) (float64, of float32 sums a block), the exps kept in e
    where it has room."""
    keep = len(e) >= len(x)
    total = 0.0
    for lo in range(0, len(x), _BLOCK):
        x_block = x[lo:lo + _BLOCK]
        e_block = e[lo:lo + _BLOCK]
        part = F32(0.0)
        for j in range(len(x_block)):  # (over a view: indices from a block's start kept it scalar)
            v = exp32(x_block[j] * scale - shift)
            part += v
            if keep:
                e_block[j] = v
        total += part
    return total


@numba.njit(fastmath=FAST, inline="always")
def shifted_exp_sum(x, scale, pad, e):
    """(shift, sum of exp(z - shift)) of the row z = x scale padded with `pad` zeros (float32 shift,
    float64 sum), the exps kept in e where it has room (its pad columns' too)."""
    for first in (True, False):  # a second time only with the row's maximum: _SUM_ABOVE
        shift = max32(x[:_SHIFT_COLUMNS] if first else x) * scale
        if pad:
            shift = max(shift, F32(0.0))
        total = exp_sum(x, scale, shift, e)
        if pad:
            e_pad = exp32(-shift)
            total += pad * np.float64(e_pad)
            if len(e) > len(x):
                e[len(x):] = e_pad
        if total < _SUM_ABOVE:
            break
    return shift, total


@numba.njit(fastmath=FAST, inline="always")
def reference_column(s, s_max):
    """The reference column of reverse KL and the JSD (row_math.cuh, "A sharp row"): the first
    that holds the student's largest logit, s_max (max32(s)); -1 where none does (a row with a NaN
    above its numbers). Any such column will do: the largest t of those columns, the GPU's
    choice, took 2-2.5 ms more at 512 rows of 32000 (docs/record.md). Found by the vectorized
    max32 of blocks, then a scan of the block that holds it: a scan of the row, or a vectorized
    reduction to the first index, took 2 ms more. (Where a teacher's pad holds the largest z, no
    column of G is near one-hot and any reference will do.)"""
    for lo in range(0, len(s), _BLOCK):
        block = s[lo:lo + _BLOCK]
        if max32(block) == s_max:
            for j in range(len(block)):
                if block[j] == s_max:
                    return lo + j
    return -1


@numba.njit(fastmath=FAST)
def padded(s, z):
    """The student's row with the teacher's pad (zeros: z = 0 there) in z, a buffer of the
    teacher's width, where the teacher has one (z longer than s), else itself. (A function of its
    own: in the kernel's body Numba's array analysis took the two for arrays of one size, and
    asserted it.)"""
    if len(z) <= len(s):
        return s
    z[:len(s)] = s
    z[len(s):] = 0.0
    return z


@numba.njit(fastmath=FAST, inline="always")
def column_block(s, t, e, h, inv_z, inv_t, mode, form, row, poly, w_p, k_dz):
    """A block's float32 sums of column32's a, b, precise and w; written over the teacher's exps,
    the gradient's column part, w_p p + k_dz grad_dz(p, h) with the row's a taken as 0 and c as 1
    (gradient_columns has the rest). e: the student's exps, whose p is e / sum (inv_z); they stay,
    and the gradient takes them, where writing p over them took a store a column."""
    a = b = precise = weights = F32(0.0)
    for j in range(len(s)):
        pj, qj = e[j] * inv_z, h[j] * inv_t
        da, db, dp, dw, hj = column32(s[j], t[j], pj, qj, mode, form, row, poly)
        a += da
        b += db
        precise += dp
        weights += dw
        h[j] = w_p * pj + k_dz * grad_dz(pj, hj, F32(0.0), mode, F32(1.0))
    return a, b, precise, weights


# The column pass's blocks: a block's float32 partial sums are added into the row's float64 ones,
# and before each block the cache lines of the next row's logits at the block's columns are
# prefetched (column_sums). Blocks of 128 columns, 16 lines of each row: of 64, 128 and 256, 128
# took the least time; bursts of 128 lines before blocks of 1024 took longer than no prefetch
# (docs/record.md).
_PREFETCH_BLOCK = 128


@numba.njit(fastmath=FAST, inline="always")
def column_sums(s, t, e, h, inv_z, inv_t, mode, form, row, poly, w_p, k_dz, s_next, t_next):
    """The row's sums (float64) of column32's terms, a block at a time, each block's columns of
    the next row's logits s_next, t_next prefetched first (next_row's), so that they are in the
    cache when that row's statistics take them: the row's own column math hides their way from
    memory, where a load of them (for a sum of them that the results never take) held each loop
    back until the line came (docs/design.md, "The CPU backend")."""
    a = b = precise = weights = 0.0
    ahead = min(len(s_next), len(t_next))
    for lo in range(0, len(s), _PREFETCH_BLOCK):
        end = lo + _PREFETCH_BLOCK
        for k in range(lo, min(end, ahead), LINE):
            prefetch(s_next, k)
            prefetch(t_next, k)
        da, db, dp, dw = column_block(s[lo:end], t[lo:end], e[lo:end], h[lo:end], inv_z, inv_t, mode, form, row,
                                      poly, w_p, k_dz)
        a += da
        b += db
        precise += dp
        weights += dw
    return a, b, precise, weights


@numba.njit(fastmath=FAST, inline="always")
def row_sums(s, t, e, h, inv_z, inv_t, mode, form, row, poly, w_p, k_dz, s_next, t_next):
    """column_sums with the mode and the JSD's mixture form as constants: a loop of its own for each
    (column32's branches on them would be if-converted in one loop, and every divergence pay for
    all)."""
    if mode == FORWARD_KL:
        return column_sums(s, t, e, h, inv_z, inv_t, FORWARD_KL, MIXTURE_BY_LOG, row, poly, w_p, k_dz, s_next, t_next)
    if mode == REVERSE_KL:
        return column_sums(s, t, e, h, inv_z, inv_t, REVERSE_KL, MIXTURE_BY_LOG, row, poly, w_p, k_dz, s_next, t_next)
    if form == MIXTURE_BY_RATIO:
        return column_sums(s, t, e, h, inv_z, inv_t, JSD, MIXTURE_BY_RATIO, row, poly, w_p, k_dz, s_next, t_next)
    if form == MIXTURE_BY_SHORT_LOG:
        return column_sums(s, t, e, h, inv_z, inv_t, JSD, MIXTURE_BY_SHORT_LOG, row, poly, w_p, k_dz, s_next, t_next)
    return column_sums(s, t, e, h, inv_z, inv_t, JSD, MIXTURE_BY_LOG, row, poly, w_p, k_dz, s_next, t_next)


@numba.njit(fastmath=FAST)
def next_row(s, t, i, z_cols, t_i):
    """The logits the column pass of row i prefetches (column_sums): row i + 1's, where there is
    one and the student's row is as long as the teacher's; else row i's own (z_cols, t_i), in the
    cache. (A function of its own, as padded.)"""
    if i + 1 < s.shape[0] and s.shape[1] == t.shape[1]:
        return s[i + 1], t[i + 1]
    return z_cols, t_i


@numba.njit(fastmath=FAST, inline="always")
def gradient_block(s, e, h, k_a, w_hard, softmax_is_p, shift_s, inv_sum_s, model_scale, model_inv_cap):
    """A block of G's row (float32), written over h: the column part less k_a e (gradient_columns'),
    plus w_hard softmax(s) where the column pass did not take it as p (softmax_is_p, a constant
    here), times the student model's derivative. softmax(s) = exp(s - shift_s) / sum_s, as the
    statistics made it (where exp(s - lse_s) would take lse_s in one float32, off by up to 1e-5 at a
    logsumexp of 160). (The derivative is model_derivative's written in float32: its float64 1.0
    would widen the loop's lanes.)"""
    for j in range(len(s)):
        x = s[j]
        g = h[j] - k_a * e[j]
        if not softmax_is_p:
            g += w_hard * exp32(x - shift_s) * inv_sum_s
        zc = x * model_inv_cap
        h[j] = g * (model_scale * (F32(1.0) - zc * zc))


@numba.njit(fastmath=FAST, inline="always")
def gradient_columns(s, e, h, k_a, w_hard, softmax_is_p, shift_s, inv_sum_s, model_scale, model_inv_cap, G):
    """G's row (float32): (w_hard softmax(s) + k_soft dz) times the student model's derivative. dz
    is linear in the row's a (grad_dz's h - a p, or c p (h - a)): the column pass wrote the rest
    over h (column_block, with the hard term where softmax(s) is p), so that here G is that less k_a
    e (e: the student's exps, which column_block left; k_a = k_soft c a / their sum). G may be s's
    memory. Where softmax(s) is p and the logits are no model's, the loop reads neither; else it
    runs a block at a time over h, then copies the block to G (written straight to G, a loop over s
    and G in one memory was scalar: LLVM's check that a store does not overlap a later load finds
    them overlapping, and takes its scalar loop; the row then took 5.5 ms more at 512 rows of
    32000). The copy is a loop of its own: a slice's assignment tests its two arrays for overlap,
    and outside a parallel loop's body it took the kernel at temperature 2 from 15.6 to 17-21 ms at
    512 rows of 32000."""
    if softmax_is_p and model_scale == F32(1.0) and model_inv_cap == F32(0.0):
        for j in range(len(G)):
            G[j] = h[j] - k_a * e[j]
        return
    for lo in range(0, len(G), _BLOCK):
        end = lo + _BLOCK
        h_block = h[lo:end]
        if softmax_is_p:
            gradient_block(s[lo:end], e[lo:end], h_block, k_a, w_hard, True, shift_s, inv_sum_s, model_scale,
                            model_inv_cap)
        else:
            gradient_block(s[lo:end], e[lo:end], h_block, k_a, w_hard, False, shift_s, inv_sum_s, model_scale,
                            model_inv_cap)
        g_block = G[lo:end]
        for j in range(len(g_block)):
            g_block[j] = h_block[j]
