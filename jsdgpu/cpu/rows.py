"""The CPU backend's row kernels (Numba, parallel over rows): the fused kernel, which does a
row's whole work while the row is in the core's cache (statistics, KL sums, results and gradient
row), and the three phases of the same work that vocab parallelism combines across ranks between
(row statistics; KL sums; results and gradient). The fused kernel's columns are float32 (the
GPU kernel's second-order terms), its sums and logsumexps float64; the phases' math is float64
throughout; each with an exp and a log of its own (fastmath.py). Each divergence's terms are
divergences.py's.

Non-finite inputs give non-finite results, as the contract says: the kernels are compiled without
the no-NaN and no-infinity assumptions of fast math, keeping only reassociation (the vectorized
sums) and contraction, and `exp64` and `exp32` keep a NaN."""

import hashlib
import math
import pathlib

import numba
import numpy as np

from .. import options
from . import divergences, fastmath
from .divergences import (SMALL_B_BELOW, FORWARD_KL, JSD, REVERSE_KL, column, column32, grad_dz, soft,
                          soft_of_sums)
from .fastmath import F32, FAST, LINE, exp32, exp64, max32, prefetch
from .threads import rows_in_parallel


@numba.njit(fastmath=FAST, inline="always")
def _row_stats(s, t, y, inv_temp, vs, vt):
    """(max s, max z, max t / T, sum exp(s - max), sum exp(z - max z), sum exp(t / T - max), the
    target logit) of one row: z = s / temperature padded with zeros to vt."""
    ms = np.float64(max32(s[:vs]))
    mt = np.float64(max32(t[:vt]))
    mz = ms * inv_temp
    if vt > vs:
        mz = max(mz, 0.0)
    mt = mt * inv_temp
    sum_s = 0.0
    for j in range(vs):
        sum_s += exp64(np.float64(s[j]) - ms)
    if inv_temp == 1.0 and vt == vs:
        sum_z = sum_s
    else:
        sum_z = (vt - vs) * exp64(-mz)
        for j in range(vs):
            sum_z += exp64(np.float64(s[j]) * inv_temp - mz)
    sum_t = 0.0
    for j in range(vt):  # (vt >= vs: the student is padded, never the teacher)
        sum_t += exp64(t[j] * inv_temp - mt)
    return ms, mz, mt, sum_s, sum_z, sum_t, (np.float64(s[y]) if y >= 0 else 0.0)


@numba.njit(fastmath=FAST, inline="always")
def _kl_columns(s, t, inv_temp, mode, beta, lse_z, lse_t, inv_z, inv_t, p, h):
    """(a, b) of one row's columns for one divergence (mode: a constant where _row_kl calls it)."""
    vs, vt = len(s), len(t)
    keep = len(p) >= vs
    a = 0.0
    b = 0.0
    for j in range(vs):
        lp = np.float64(s[j]) * inv_temp - lse_z
        lq = t[j] * inv_temp - lse_t
        pj = p[j] * inv_z if keep else exp64(lp)
        qj = h[j] * inv_t if keep else exp64(lq)
        da, db, hj = column(lp, lq, pj, qj, mode, 1.0 - beta, beta)
        a += da
        b += db
        if keep:
            p[j] = pj
            h[j] = hj
    for j in range(vs, vt):  # the teacher's pad: z = 0
        lp, lq = -lse_z, t[j] * inv_temp - lse_t
        da, db, _ = column(lp, lq, exp64(lp), exp64(lq), mode, 1.0 - beta, beta)
        a += da
        b += db
    return a, b


@numba.njit(fastmath=FAST, inline="always")
def _row_kl(s, t, inv_temp, mode, beta, stats, p, h):
    """(a, b) of one row with its statistics (_row_stats'). Where p and h have room (the finish
    kernel's, with the gradient), they hold the student columns' exp(z - max z) and exp(t / T -
    max), and their p and h are written over them (the gradient reads them there). One loop a
    divergence, each with its mode a constant: with the mode a variable, LLVM if-converts
    column's branch on it in the vectorized loop, and every divergence paid for the JSD's log."""
    mz, mt, sum_z, sum_t = stats[1], stats[2], stats[4], stats[5]
    lse_z, lse_t = mz + math.log(sum_z), mt + math.log(sum_t)
    inv_z, inv_t = 1.0 / sum_z, 1.0 / sum_t
    if mode == FORWARD_KL:
        return _kl_columns(s, t, inv_temp, FORWARD_KL, beta, lse_z, lse_t, inv_z, inv_t, p, h)
    if mode == JSD:
        return _kl_columns(s, t, inv_temp, JSD, beta, lse_z, lse_t, inv_z, inv_t, p, h)
    return _kl_columns(s, t, inv_temp, REVERSE_KL, beta, lse_z, lse_t, inv_z, inv_t, p, h)


@numba.njit(fastmath=FAST, inline="always")
def _label_apart(y, target_logit, lse_s):
    """Whether the label's one-hot term is kept out of G (as the fused GPU kernel does, where G is
    16-bit): where softmax(s)[label] < 1/2."""
    return y >= 0 and math.exp(target_logit - lse_s) < 0.5


def model_derivative(z, model_scale, model_inv_cap):
    """dz / dx of a model's logit z = c tanh(scale x / c), from z: scale (1 - (z / c)^2); scale
    alone where there is no cap (inv_cap 0), 1 for the plain logits. Of a number or an array (the
    phases' pass over G: CpuSteps.model_gradient); compiled for the kernels below (z float32 and
    inv_cap float64: in float64)."""
    zc = z * model_inv_cap
    return model_scale * (1.0 - zc * zc)


_model_derivative = numba.njit(fastmath=FAST, inline="always")(model_derivative)


@numba.njit(fastmath=FAST, inline="always")
def _gradient_row(s, y, lse_s, softmax_is_p, mode, beta, a, w_hard, w_soft_over_t, label_apart, p, h, model_scale,
                  model_inv_cap, label_derivative, G):
    """G's row from the columns' p and h: w_hard (softmax(s) - onehot) + (w_soft / T) dz
    (softmax_is_p: no temperature and no pad, so that softmax(s) is p), times the student model's
    derivative where its logits are the model's (label_derivative: the derivative at the label).
    G may be s's own memory: a column's s is read before its G is written."""
    c = 1.0 - beta if mode == JSD else 1.0  # grad_dz's
    for j in range(len(G)):
        x = np.float64(s[j])
        dz = grad_dz(p[j], h[j], a, mode, c)
        softmax = p[j] if softmax_is_p else exp64(x - lse_s)
        G[j] = (w_hard * softmax + w_soft_over_t * dz) * _model_derivative(x, model_scale, model_inv_cap)
    if y >= 0 and not label_apart:
        G[y] -= w_hard * label_derivative


@numba.njit(fastmath=FAST, inline="always")
def _results(s, i, y, stats, a, b, inv_temp, mode, beta, w_hard, w_soft_over_t, ce, jsd, G, label_terms, write_grad,
             p, h, model_scale, model_inv_cap):
    """Row i's CE and soft part from its statistics and KL sums a, b, and with write_grad its
    gradient row and label term from its columns' p and h, in the raw logits where the student's
    are its model's (model_scale, model_inv_cap: _model_derivative's)."""
    lse_s, lse_z = stats[0] + math.log(stats[3]), stats[1] + math.log(stats[4])
    ce[i] = lse_s - stats[6]
    jsd[i] = soft(a, b, mode, beta)
    if write_grad:
        apart = _label_apart(y, stats[6], lse_s)
        label_derivative = _model_derivative(s[y], model_scale, model_inv_cap) if y >= 0 else 1.0
        label_terms[i] = -w_hard * label_derivative if apart else 0.0
        # softmax(s) is p where z is s (no temperature) and no pad widens z's sum (here or on
        # another rank)
        _gradient_row(s, y, lse_s, inv_temp == 1.0 and lse_z == lse_s, mode, beta, a, w_hard, w_soft_over_t, apart,
                      p, h, model_scale, model_inv_cap, label_derivative, G[i])


@numba.njit(fastmath=FAST, inline="always")
def _stats_of(stats, i):
    return stats[0, i], stats[1, i], stats[2, i], stats[3, i], stats[4, i], stats[5, i], stats[6, i]


# ---- the fused kernel: float32 columns, float64 rows (docs/design.md, "The CPU backend") ----

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
def _exp_sum(x, scale, shift, e):
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
def _shifted_exp_sum(x, scale, pad, e):
    """(shift, sum of exp(z - shift)) of the row z = x scale padded with `pad` zeros (float32 shift,
    float64 sum), the exps kept in e where it has room (its pad columns' too)."""
    for first in (True, False):  # a second time only with the row's maximum: _SUM_ABOVE
        shift = max32(x[:_SHIFT_COLUMNS] if first else x) * scale
        if pad:
            shift = max(shift, F32(0.0))
        total = _exp_sum(x, scale, shift, e)
        if pad:
            e_pad = exp32(-shift)
            total += pad * np.float64(e_pad)
            if len(e) > len(x):
                e[len(x):] = e_pad
        if total < _SUM_ABOVE:
            break
    return shift, total


@numba.njit(fastmath=FAST, inline="always")
def _reference_column(s, t):
    """(t - s, s, t) of reverse KL's reference column (row_math.cuh, "A sharp row"): the first
    that holds the student's largest logit; (0, 0, NaN) where none does (a row with a NaN above
    its numbers). Any such column will do: the largest t of those columns, the GPU's choice, took
    2-2.5 ms more at 512 rows of 32000 (docs/record.md). Found by the vectorized max32 of blocks,
    then a scan of the block that holds it: a scan of the row, or a vectorized reduction to the
    first index, took 2 ms more. (Where a teacher's pad holds the largest z, no column of G is
    near one-hot and any reference will do.)"""
    s_max = max32(s)
    for lo in range(0, len(s), _BLOCK):
        block = s[lo:lo + _BLOCK]
        if max32(block) == s_max:
            for j in range(len(block)):
                if block[j] == s_max:
                    return t[lo + j] - s_max, s_max, t[lo + j]
    return F32(0.0), F32(0.0), F32(np.nan)


@numba.njit(fastmath=FAST)
def _padded(s, vt):
    """The student's row with the teacher's pad (zeros: z = 0 there) where the teacher has one, else
    itself. (A function of its own: in the kernel's body Numba's array analysis took the two for
    arrays of one size, and asserted it.)"""
    if vt == len(s):
        return s
    z = np.zeros(vt, np.float32)
    z[:len(s)] = s
    return z


@numba.njit(fastmath=FAST, inline="always")
def _column_block(s, t, p, h, inv_z, inv_t, mode, small_b, row, poly, w_p, k_dz):
    """A block's float32 sums of column32's a, b, precise and w; written over the exps, p and the
    gradient's column part, w_p p + k_dz grad_dz(p, h) with the row's a taken as 0 and c as 1
    (_gradient_columns has the rest)."""
    a = b = precise = weights = F32(0.0)
    for j in range(len(s)):
        pj, qj = p[j] * inv_z, h[j] * inv_t
        da, db, dp, dw, hj = column32(s[j], t[j], pj, qj, mode, small_b, row, poly)
        a += da
        b += db
        precise += dp
        weights += dw
        p[j] = pj
        h[j] = w_p * pj + k_dz * grad_dz(pj, hj, F32(0.0), mode, F32(1.0))
    return a, b, precise, weights


# The column pass's blocks: a block's float32 partial sums are added into the row's float64 ones,
# and before each block the cache lines of the next row's logits at the block's columns are
# prefetched (_column_sums). Blocks of 128 columns, 16 lines of each row: of 64, 128 and 256, 128
# took the least time; bursts of 128 lines before blocks of 1024 took longer than no prefetch
# (docs/record.md).
_PREFETCH_BLOCK = 128


@numba.njit(fastmath=FAST, inline="always")
def _column_sums(s, t, p, h, inv_z, inv_t, mode, small_b, row, poly, w_p, k_dz, s_next, t_next):
    """The row's sums (float64) of column32's terms, a block at a time, each block's columns of
    the next row's logits s_next, t_next prefetched first (_next_row's), so that they are in the
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
        da, db, dp, dw = _column_block(s[lo:end], t[lo:end], p[lo:end], h[lo:end], inv_z, inv_t, mode, small_b, row,
                                       poly, w_p, k_dz)
        a += da
        b += db
        precise += dp
        weights += dw
    return a, b, precise, weights


@numba.njit(fastmath=FAST, inline="always")
def _row_sums(s, t, p, h, inv_z, inv_t, mode, small_b, row, poly, w_p, k_dz, s_next, t_next):
    """_column_sums with the mode and small_b constants: a loop of its own for each (column32's
    branches on them would be if-converted in one loop, and every divergence pay for all)."""
    if mode == FORWARD_KL:
        return _column_sums(s, t, p, h, inv_z, inv_t, FORWARD_KL, False, row, poly, w_p, k_dz, s_next, t_next)
    if mode == REVERSE_KL:
        return _column_sums(s, t, p, h, inv_z, inv_t, REVERSE_KL, False, row, poly, w_p, k_dz, s_next, t_next)
    if small_b:
        return _column_sums(s, t, p, h, inv_z, inv_t, JSD, True, row, poly, w_p, k_dz, s_next, t_next)
    return _column_sums(s, t, p, h, inv_z, inv_t, JSD, False, row, poly, w_p, k_dz, s_next, t_next)


@numba.njit(fastmath=FAST)
def _next_row(s, t, i, z_cols, t_i):
    """The logits the column pass of row i prefetches (_column_sums): row i + 1's, where there is
    one and the student's row is as long as the teacher's; else row i's own (z_cols, t_i), in the
    cache. (A function of its own, as _padded.)"""
    if i + 1 < s.shape[0] and s.shape[1] == t.shape[1]:
        return s[i + 1], t[i + 1]
    return z_cols, t_i


@numba.njit(fastmath=FAST, inline="always")
def _gradient_block(s, p, h, k_a, w_hard, softmax_is_p, shift_s, inv_sum_s, model_scale, model_inv_cap):
    """A block of G's row (float32), written over h: the column part less k_a p, plus w_hard
    softmax(s) where the column pass did not take it as p (softmax_is_p, a constant here), times
    the student model's derivative. softmax(s) = exp(s - shift_s) / sum_s, as the statistics made
    it (where exp(s - lse_s) would take lse_s in one float32, off by up to 1e-5 at a logsumexp of
    160). (The derivative is model_derivative's written in float32: its float64 1.0 would widen
    the loop's lanes.)"""
    for j in range(len(s)):
        x = s[j]
        g = h[j] - k_a * p[j]
        if not softmax_is_p:
            g += w_hard * exp32(x - shift_s) * inv_sum_s
        zc = x * model_inv_cap
        h[j] = g * (model_scale * (F32(1.0) - zc * zc))


@numba.njit(fastmath=FAST, inline="always")
def _gradient_columns(s, p, h, k_a, w_hard, softmax_is_p, shift_s, inv_sum_s, model_scale, model_inv_cap, G):
    """G's row (float32): (w_hard softmax(s) + k_soft dz) times the student model's derivative. dz
    is linear in the row's a (grad_dz's h - a p, or c p (h - a)): the column pass wrote the rest
    over h (_column_block, with the hard term where softmax(s) is p), so that here G is that less
    k_a p (k_a = k_soft c a). G may be s's memory. Where softmax(s) is p and the logits are no
    model's, the loop reads neither; else it runs a block at a time over h, then copies the block to
    G (written straight to G, a loop over s and G in one memory was scalar: LLVM's check that a
    store does not overlap a later load finds them overlapping, and takes its scalar loop; the row
    then took 5.5 ms more at 512 rows of 32000)."""
    if softmax_is_p and model_scale == F32(1.0) and model_inv_cap == F32(0.0):
        for j in range(len(G)):
            G[j] = h[j] - k_a * p[j]
        return
    for lo in range(0, len(G), _BLOCK):
        end = lo + _BLOCK
        h_block = h[lo:end]
        if softmax_is_p:
            _gradient_block(s[lo:end], p[lo:end], h_block, k_a, w_hard, True, shift_s, inv_sum_s, model_scale,
                            model_inv_cap)
        else:
            _gradient_block(s[lo:end], p[lo:end], h_block, k_a, w_hard, False, shift_s, inv_sum_s, model_scale,
                            model_inv_cap)
        G[lo:end] = h_block[:len(G[lo:end])]


# ---- the kernels, their cache keyed by what they take in ----

def _sources_digest():
    """The digest of the modules whose code or constants the kernels below take in at compilation
    (inlined functions, frozen globals): divergences.py, fastmath.py and options.py."""
    digest = hashlib.sha256()
    for module in (divergences, fastmath, options):
        digest.update(pathlib.Path(module.__file__).read_bytes())
    return digest.hexdigest()


def _kernels(sources):
    """The four kernels, each a closure over `sources` (_sources_digest's). Numba keys a kernel's
    cache by its own file's time and size, its own bytecode and its closure's contents: without
    the digest, a change to a module it inlines, with rows.py unchanged (a pull, a checkout),
    left the old kernel running from the cache (docs/design.md, "The CPU backend")."""

    @rows_in_parallel
    @numba.njit(parallel=True, fastmath=FAST, cache=True)
    def fused_kernel(s, t, target, inv_temp, mode, beta, one_minus_beta, soft_b, poly, w_hard, w_soft_over_t, ce, jsd,
                     G, label_terms, write_grad, model_scale, model_inv_cap):
        """Each row's CE and soft part, and with write_grad its gradient row (without the 1/N of the
        mean; in the raw logits where s is the student model's: _model_derivative) and label term:
        the three phases' work on one row at a time, read from memory once, its columns in float32
        (divergences.column32) and its sums and logsumexps in float64. soft_b and poly: the JSD's b
        and column32's twenty-seven coefficients (divergences.precise_terms). G may be s's
        memory."""
        sources  # (its cache key: _kernels)
        n, vs = s.shape
        vt = t.shape[1]
        scale = F32(inv_temp)
        same_z = scale == F32(1.0) and vt == vs  # z is s
        row_poly = (poly[0], poly[1], poly[2], poly[3], poly[4], poly[5], poly[6], poly[7], poly[8], poly[9], poly[10],
                    poly[11], poly[12], poly[13], poly[14], poly[15], poly[16], poly[17], poly[18], poly[19],
                    poly[20], poly[21], poly[22], poly[23], poly[24], poly[25], poly[26])
        b, beta32, one_minus_beta32 = F32(soft_b), F32(beta), F32(one_minus_beta)
        k_soft, m_scale, m_inv_cap = F32(w_soft_over_t), F32(model_scale), F32(model_inv_cap)
        c_dz = one_minus_beta32 if mode == JSD else F32(1.0)  # grad_dz's
        # the gradient's column part (_column_block): softmax(s) is p where z is s, and its hard term
        # then goes in with the column's
        w_p = F32(w_hard) if same_z else F32(0.0)
        none = np.empty(0, np.float32)
        for i in numba.prange(n):
            s_i, t_i, y = s[i], t[i], target[i]
            p = np.empty(vt, np.float32)  # exp(z - shift), then p
            h = np.empty(vt, np.float32)  # exp(t / T - shift), then h
            shift_s, sum_s = _shifted_exp_sum(s_i, F32(1.0), 0, p if same_z else none)
            shift_z, sum_z = (shift_s, sum_s) if same_z else _shifted_exp_sum(s_i, scale, vt - vs, p)
            shift_t, sum_t = _shifted_exp_sum(t_i, scale, 0, h)
            lse_s, lse_z, lse_t = shift_s + math.log(sum_s), shift_z + math.log(sum_z), shift_t + math.log(sum_t)
            c = lse_z - lse_t
            z_cols = _padded(s_i, vt)
            diff_ref, h_ref = F32(0.0), 0.0  # (h_ref: reverse KL's alone)
            if mode == REVERSE_KL:
                diff_ref, s_ref, t_ref = _reference_column(s_i, t_i)
                h_ref = (np.float64(s_ref) - np.float64(t_ref)) * np.float64(scale) - c
                if not math.isfinite(h_ref):  # (a teacher logit of -inf there: the divergence is inf)
                    diff_ref, h_ref = F32(0.0), -c
            row = (F32(c), scale, diff_ref, beta > 0.5, beta32, one_minus_beta32, b)
            s_next, t_next = _next_row(s, t, i, z_cols, t_i)
            a, b_sum, precise, weights = _row_sums(z_cols, t_i, p, h, F32(1.0 / sum_z), F32(1.0 / sum_t), mode,
                                                   b < SMALL_B_BELOW, row, row_poly, w_p, k_soft * c_dz, s_next, t_next)
            target_logit = np.float64(s_i[y]) if y >= 0 else 0.0
            ce[i] = lse_s - target_logit
            jsd[i] = soft_of_sums(a, b_sum, precise, weights, mode, beta, h_ref)
            if write_grad:
                apart = _label_apart(y, target_logit, lse_s)
                label_derivative = _model_derivative(s_i[y], model_scale, model_inv_cap) if y >= 0 else 1.0
                label_terms[i] = -w_hard * label_derivative if apart else 0.0
                k_a = k_soft * c_dz * F32(a)
                inv_sum_s = F32(1.0 / sum_s)
                _gradient_columns(s_i, p, h, k_a, F32(w_hard), same_z, shift_s, inv_sum_s, m_scale, m_inv_cap, G[i])
                if y >= 0 and not apart:
                    G[i, y] -= w_hard * label_derivative

    # ---- the three phases (vocab parallelism: each rank's shard, combined between them) ----

    @rows_in_parallel
    @numba.njit(parallel=True, fastmath=FAST, cache=True)
    def stats_kernel(s, t, target, inv_temp, stats):
        """stats [7, n]: the maxima of s, z = s / temperature (padded with zeros to vt) and
        t / temperature; the sums of exp(x - max) of each; the target logit (0 where target < 0)."""
        sources  # (its cache key: _kernels)
        n, vs = s.shape
        vt = t.shape[1]
        for i in numba.prange(n):
            (stats[0, i], stats[1, i], stats[2, i], stats[3, i], stats[4, i], stats[5, i],
             stats[6, i]) = _row_stats(s[i], t[i], target[i], inv_temp, vs, vt)

    @rows_in_parallel
    @numba.njit(parallel=True, fastmath=FAST, cache=True)
    def kl_kernel(s, t, inv_temp, mode, beta, stats, kl):
        """kl [2, n]: a and b of each row."""
        sources  # (its cache key: _kernels)
        n = s.shape[0]
        none = np.empty(0)
        for i in numba.prange(n):
            kl[0, i], kl[1, i] = _row_kl(s[i], t[i], inv_temp, mode, beta, _stats_of(stats, i), none, none)

    @rows_in_parallel
    @numba.njit(parallel=True, fastmath=FAST, cache=True)
    def finish_kernel(s, t, target, inv_temp, mode, beta, w_hard, w_soft_over_t, stats, kl, ce, jsd, G,
                      label_terms, write_grad):
        """The row's CE and JSD values, and with write_grad its gradient row without the 1/N of
        the mean; the label's one-hot term kept apart where it dominates (as the fused GPU kernel does,
        where G is 16-bit)."""
        sources  # (its cache key: _kernels)
        n, vs = s.shape
        for i in numba.prange(n):
            row = _stats_of(stats, i)
            p = np.empty(vs if write_grad else 0)
            h = np.empty(vs if write_grad else 0)
            for j in range(len(p)):  # what _row_kl takes p and h from (the rows' statistics, all ranks')
                p[j] = exp64(np.float64(s[i, j]) * inv_temp - row[1])
                h[j] = exp64(t[i, j] * inv_temp - row[2])
            if write_grad:
                _row_kl(s[i], t[i], inv_temp, mode, beta, row, p, h)  # (this rank's sums: not needed)
            _results(s[i], i, target[i], row, kl[0, i], kl[1, i], inv_temp, mode, beta, w_hard, w_soft_over_t, ce, jsd,
                      G, label_terms, write_grad, p, h, 1.0, 0.0)  # (the models' passes are around the phases)

    return fused_kernel, stats_kernel, kl_kernel, finish_kernel


fused_kernel, stats_kernel, kl_kernel, finish_kernel = _kernels(_sources_digest())
