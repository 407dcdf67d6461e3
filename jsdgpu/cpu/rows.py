"""The CPU backend's row kernels (Numba, parallel over rows): the fused kernel, which does a
row's whole work while the row is in the core's cache (statistics, KL sums, results and gradient
row), and the three phases of the same work that vocab parallelism combines across ranks between
(row statistics; KL sums; results and gradient). The fused kernel's columns are float32 (the
GPU kernel's second-order terms), its sums and logsumexps float64; the phases' math is float64
throughout; each with an exp and a log of its own (fastmath.py). Each divergence's terms are
divergences.py's; the fused kernel's row in a thread is fused_row.py's.

Non-finite inputs give non-finite results, as the contract says: the kernels are compiled without
the no-NaN and no-infinity assumptions of fast math, keeping only reassociation (the vectorized
sums) and contraction, and `exp64` and `exp32` keep a NaN."""

import hashlib
import math
import pathlib

import numba
import numpy as np

from .. import options
from . import divergences, fastmath, fused_row
from .divergences import (FORWARD_KL, JSD, REVERSE_KL, column, column32, grad_dz, mixture_form, soft,
                          soft_of_sums)
from .fastmath import F32, FAST, exp64, max32, wide_vectors
from .fused_row import gradient_columns, next_row, padded, reference_column, row_sums, shifted_exp_sum
from .threads import rows_in_parallel


@numba.njit(fastmath=FAST, inline="always")
def _row_stats(s, t, y, inv_temp, vs, vt):
    """(max s, max z, max t / T, sum exp(s - max), sum exp(z - max z), sum exp(t / T - max), the
    target logit, the reference column's t) of one row: z = s / temperature padded with zeros to
    vt; the reference column is reference_column's (its t NaN where there is none)."""
    s_max = max32(s[:vs])
    ms = np.float64(s_max)
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
    ref = reference_column(s[:vs], s_max)
    return (ms, mz, mt, sum_s, sum_z, sum_t, (np.float64(s[y]) if y >= 0 else 0.0),
            np.float64(t[ref]) if ref >= 0 else np.nan)


@numba.njit(fastmath=FAST, inline="always")
def _kl_columns(s, t, inv_temp, mode, beta, stats, h_ref, p, h):
    """(a, b) of one row's columns for one divergence (mode: a constant where _row_kl calls it), a
    and h relative to h_ref (column's)."""
    vs, vt = len(s), len(t)
    keep = len(p) >= vs
    lse_z, lse_t = stats[1] + math.log(stats[4]), stats[2] + math.log(stats[5])
    inv_z, inv_t, s_ref, t_ref = 1.0 / stats[4], 1.0 / stats[5], stats[0], stats[7]  # (the reference: _reference_h)
    a = 0.0
    b = 0.0
    for j in range(vs):
        lp = np.float64(s[j]) * inv_temp - lse_z
        lq = t[j] * inv_temp - lse_t
        pj = p[j] * inv_z if keep else exp64(lp)
        qj = h[j] * inv_t if keep else exp64(lq)
        da, db, hj = column(lp, lq, pj, qj, mode, 1.0 - beta, beta, h_ref)
        if mode != FORWARD_KL and np.float64(s[j]) == s_ref and np.float64(t[j]) == t_ref:
            da, hj = 0.0, 0.0  # the reference column's h less h_ref: 0 (_reference_h)
        a += da
        b += db
        if keep:
            p[j] = pj
            h[j] = hj
    for j in range(vs, vt):  # the teacher's pad: z = 0
        lp, lq = -lse_z, t[j] * inv_temp - lse_t
        da, db, _ = column(lp, lq, exp64(lp), exp64(lq), mode, 1.0 - beta, beta, h_ref)
        a += da
        b += db
    return a, b


@numba.njit(fastmath=FAST, inline="always")
def _reference_h(stats, inv_temp, mode, beta):
    """h of the row's reference column (its largest s and, in the statistics, its t: row_math.cuh,
    "A sharp row") in reverse KL and the JSD, else 0 (and where not finite). The phases take h and
    a relative to it, and 0 in a column of its logits (_kl_columns): the kl kernel's a and the
    finish kernel's h, two compilations of column, differed in that h's last bits, above a
    saturated row's gradient there."""
    lp = stats[0] * inv_temp - (stats[1] + math.log(stats[4]))
    lq = stats[7] * inv_temp - (stats[2] + math.log(stats[5]))
    h = column(lp, lq, exp64(lp), exp64(lq), mode, 1.0 - beta, beta, 0.0)[2]
    return h if mode != FORWARD_KL and math.isfinite(h) else 0.0


@numba.njit(fastmath=FAST, inline="always")
def _row_kl(s, t, inv_temp, mode, beta, stats, h_ref, p, h):
    """(a, b) of one row with its statistics (_row_stats'), a relative to h_ref (_reference_h's).
    Where p and h have room (the finish kernel's, with the gradient), they hold the student columns' exp(z -
    max z) and exp(t / T - max), and their p and h are written over them. One loop a divergence,
    its mode a constant: with it a variable, LLVM if-converted column's branch on it in the
    vectorized loop, and every divergence paid for the JSD's log."""
    if mode == FORWARD_KL:
        return _kl_columns(s, t, inv_temp, FORWARD_KL, beta, stats, h_ref, p, h)
    if mode == JSD:
        return _kl_columns(s, t, inv_temp, JSD, beta, stats, h_ref, p, h)
    return _kl_columns(s, t, inv_temp, REVERSE_KL, beta, stats, h_ref, p, h)


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
def _cross_entropy(lse_s, target_logit):
    """A row's CE, lse_s - target_logit: 0 where the logsumexp's rounding takes it below (a
    confident row's CE under the rounding of its largest logit; NaN passes)."""
    ce = lse_s - target_logit
    return 0.0 if ce < 0.0 else ce


@numba.njit(fastmath=FAST, inline="always")
def _results(s, i, y, stats, a, b, h_ref, inv_temp, mode, beta, w_hard, w_soft_over_t, ce, jsd, G, label_terms,
             write_grad, p, h, model_scale, model_inv_cap):
    """Row i's CE and soft part from its statistics and KL sums a (relative to h_ref), b, and
    with write_grad its gradient row and label term from its columns' p and h, in the raw logits
    where the student's are its model's (model_scale, model_inv_cap: _model_derivative's)."""
    lse_s, lse_z = stats[0] + math.log(stats[3]), stats[1] + math.log(stats[4])
    ce[i] = _cross_entropy(lse_s, stats[6])
    jsd[i] = soft(a + h_ref, b, mode, beta)
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
    return stats[0, i], stats[1, i], stats[2, i], stats[3, i], stats[4, i], stats[5, i], stats[6, i], stats[7, i]


# ---- each kernel's row: a function of its own ----
#
# Each kernel is a loop over its rows in parallel (numba.prange) that calls its row's function.
# With the row's code inlined into that loop, Numba's passes for the parallel loop took most of
# a kernel's first compilation (the fused kernel's 76-80 s, where the loop and its row's function
# take 25-28: docs/design.md, "The CPU backend"). The row's functions compile with the parallel
# loop's error model, NumPy's: under Python's, njit's default, each float division tests its
# divisor for zero so as to raise, and LLVM kept such a loop scalar (the JSD's column pass, eight
# times slower). Each row's function calls fastmath.wide_vectors() first: its loops are its own
# LLVM function's, which that marks for 512-bit vectors (a decorator's options cannot).
_row_function = numba.njit(fastmath=FAST, error_model="numpy")


@_row_function
def _fused_row(i, s, t, target, inv_temp, mode, beta, one_minus_beta, soft_b, poly, w_hard, w_soft_over_t, ce, jsd, G,
               label_terms, write_grad, model_scale, model_inv_cap, e, h, z):
    """Row i of fused_kernel (_kernels'), in its part's row buffers e, h and z (the teacher's
    width; z empty where the student's width is the teacher's)."""
    wide_vectors()
    vs, vt = s.shape[1], t.shape[1]
    scale = F32(inv_temp)
    same_z = scale == F32(1.0) and vt == vs  # z is s
    row_poly = (poly[0], poly[1], poly[2], poly[3], poly[4], poly[5], poly[6], poly[7], poly[8], poly[9], poly[10],
                poly[11], poly[12], poly[13], poly[14], poly[15], poly[16], poly[17], poly[18], poly[19], poly[20],
                poly[21], poly[22])  # (precise_terms': P's seven, L's nine, Q's seven)
    b, beta32, one_minus_beta32 = F32(soft_b), F32(beta), F32(one_minus_beta)
    form = mixture_form(b)
    k_soft, m_scale, m_inv_cap = F32(w_soft_over_t), F32(model_scale), F32(model_inv_cap)
    c_dz = one_minus_beta32 if mode == JSD else F32(1.0)  # grad_dz's
    # the gradient's column part (column_block): softmax(s) is p where z is s, and its hard term
    # then goes in with the column's
    w_p = F32(w_hard) if same_z else F32(0.0)
    s_i, t_i, y = s[i], t[i], target[i]
    # e: exp(z - shift), whose p is e / sum_z; h: exp(t / T - shift), then h (column_block)
    shift_s, sum_s = shifted_exp_sum(s_i, F32(1.0), 0, e if same_z else np.empty(0, np.float32))
    shift_z, sum_z = (shift_s, sum_s) if same_z else shifted_exp_sum(s_i, scale, vt - vs, e)
    shift_t, sum_t = shifted_exp_sum(t_i, scale, 0, h)
    lse_s, lse_z, lse_t = shift_s + math.log(sum_s), shift_z + math.log(sum_z), shift_t + math.log(sum_t)
    c = lse_z - lse_t
    z_cols = padded(s_i, z)
    # h relative to the reference column's h_ref (row_math.cuh, "A sharp row"): reverse KL's from
    # the logits' difference, the JSD's by column32 itself (so that it comes out 0 there)
    diff_ref, h_ref32, h_ref = F32(0.0), F32(0.0), 0.0
    inv_z, inv_t = F32(1.0 / sum_z), F32(1.0 / sum_t)
    ref = reference_column(s_i, max32(s_i)) if mode != FORWARD_KL else -1
    if mode == REVERSE_KL:
        diff_ref, s_ref, t_ref = (t_i[ref] - s_i[ref], s_i[ref], t_i[ref]) if ref >= 0 else (
            F32(0.0), F32(0.0), F32(np.nan))
        h_ref = (np.float64(s_ref) - np.float64(t_ref)) * np.float64(scale) - c
        if not math.isfinite(h_ref):  # (a teacher logit of -inf there: the divergence is inf)
            diff_ref, h_ref = F32(0.0), -c
    elif mode == JSD and ref >= 0:
        h_ref32 = column32(z_cols[ref], t_i[ref], e[ref] * inv_z, h[ref] * inv_t, JSD, form,
                           (F32(c), scale, diff_ref, F32(0.0), beta > 0.5, beta32, one_minus_beta32, b),
                           row_poly)[4]
        h_ref32 = h_ref32 if math.isfinite(h_ref32) else F32(0.0)
        h_ref = np.float64(h_ref32)
    row = (F32(c), scale, diff_ref, h_ref32, beta > 0.5, beta32, one_minus_beta32, b)
    s_next, t_next = next_row(s, t, i, z_cols, t_i)
    a, b_sum, precise, weights = row_sums(z_cols, t_i, e, h, inv_z, inv_t, mode, form, row, row_poly,
                                          w_p, k_soft * c_dz, s_next, t_next)
    target_logit = np.float64(s_i[y]) if y >= 0 else 0.0
    ce[i] = _cross_entropy(lse_s, target_logit)
    jsd[i] = soft_of_sums(a, b_sum, precise, weights, mode, beta, h_ref)
    if write_grad:
        apart = _label_apart(y, target_logit, lse_s)
        label_derivative = _model_derivative(s_i[y], model_scale, model_inv_cap) if y >= 0 else 1.0
        label_terms[i] = -w_hard * label_derivative if apart else 0.0
        k_a = k_soft * c_dz * F32(a) * inv_z  # (p = e inv_z: column_block)
        inv_sum_s = F32(1.0 / sum_s)
        gradient_columns(s_i, e, h, k_a, F32(w_hard), same_z, shift_s, inv_sum_s, m_scale, m_inv_cap, G[i])
        if y >= 0 and not apart:
            G[i, y] -= w_hard * label_derivative


@_row_function
def _stats_row(i, s, t, target, inv_temp, stats):
    """Row i of stats_kernel."""
    wide_vectors()
    (stats[0, i], stats[1, i], stats[2, i], stats[3, i], stats[4, i], stats[5, i], stats[6, i],
     stats[7, i]) = _row_stats(s[i], t[i], target[i], inv_temp, s.shape[1], t.shape[1])


@_row_function
def _kl_row(i, s, t, inv_temp, mode, beta, stats, kl):
    """Row i of kl_kernel."""
    wide_vectors()
    none = np.empty(0)
    row = _stats_of(stats, i)
    kl[0, i], kl[1, i] = _row_kl(s[i], t[i], inv_temp, mode, beta, row, _reference_h(row, inv_temp, mode, beta), none,
                                 none)


@_row_function
def _finish_row(i, s, t, target, inv_temp, mode, beta, w_hard, w_soft_over_t, stats, kl, ce, jsd, G, label_terms,
                write_grad):
    """Row i of finish_kernel."""
    wide_vectors()
    vs = s.shape[1]
    row = _stats_of(stats, i)
    h_ref = _reference_h(row, inv_temp, mode, beta)  # (one for its columns' h and its value)
    p = np.empty(vs if write_grad else 0)
    h = np.empty(vs if write_grad else 0)
    for j in range(len(p)):  # what _row_kl takes p and h from (the rows' statistics, all ranks')
        p[j] = exp64(np.float64(s[i, j]) * inv_temp - row[1])
        h[j] = exp64(t[i, j] * inv_temp - row[2])
    if write_grad:
        _row_kl(s[i], t[i], inv_temp, mode, beta, row, h_ref, p, h)  # (this rank's sums: not needed)
    _results(s[i], i, target[i], row, kl[0, i], kl[1, i], h_ref, inv_temp, mode, beta, w_hard, w_soft_over_t, ce, jsd,
             G, label_terms, write_grad, p, h, 1.0, 0.0)  # (the models' passes are around the phases)


# ---- the kernels, their cache keyed by what they take in ----

def _sources_digest():
    """The digest of the modules whose code or constants the kernels below take in at compilation
    (inlined functions, frozen globals): divergences.py, fastmath.py, fused_row.py and
    options.py."""
    digest = hashlib.sha256()
    for module in (divergences, fastmath, fused_row, options):
        digest.update(pathlib.Path(module.__file__).read_bytes())
    return digest.hexdigest()


def _kernels(sources):
    """The four kernels, each a closure over `sources` (_sources_digest's). Numba keys a kernel's
    cache by its own file's time and size, its own bytecode and its closure's contents: without
    the digest, a change to a module it inlines, with rows.py unchanged (a pull, a checkout),
    left the old kernel running from the cache (docs/design.md, "The CPU backend"). Each passes
    its row's function the row's index as an int64: the parallel loop's index is unsigned in the
    loop's body and signed where Numba first types it, and each compiled the function again."""

    @rows_in_parallel
    @numba.njit(parallel=True, fastmath=FAST, cache=True)
    def fused_kernel(s, t, target, inv_temp, mode, beta, one_minus_beta, soft_b, poly, w_hard, w_soft_over_t, ce, jsd,
                     G, label_terms, write_grad, model_scale, model_inv_cap, parts):
        """Each row's CE and soft part, and with write_grad its gradient row (without the 1/N of the
        mean; in the raw logits where s is the student model's: _model_derivative) and label term:
        the three phases' work on one row at a time, read from memory once, its columns in float32
        (divergences.column32) and its sums and logsumexps in float64. soft_b and poly: the JSD's b
        and column32's twenty-three coefficients (divergences.precise_terms). G may be s's
        memory. The rows in `parts` runs of consecutive rows (one a thread: Numba's own split of a
        loop over the rows), each with its row buffers made once: made for each row, at V =
        128256 glibc at times grew and shrank its heap around each row, whose buffers' pages were
        faulted in anew, the kernel three times as long (docs/design.md, "The CPU backend").
        (Numba's thread count or index read inside a kernel would keep it from its cache.)"""
        sources  # (its cache key: _kernels)
        for part in numba.prange(parts):
            vt = t.shape[1]
            e, h = np.empty(vt, np.float32), np.empty(vt, np.float32)
            z = np.empty(vt if vt > s.shape[1] else 0, np.float32)  # the student's row and the teacher's pad
            k, n = np.int64(part), s.shape[0]  # (the loop's index is unsigned in its body: _kernels)
            for i in range(k * n // parts, (k + 1) * n // parts):
                _fused_row(i, s, t, target, inv_temp, mode, beta, one_minus_beta, soft_b, poly, w_hard, w_soft_over_t,
                           ce, jsd, G, label_terms, write_grad, model_scale, model_inv_cap, e, h, z)

    # ---- the three phases (vocab parallelism: each rank's shard, combined between them) ----

    @rows_in_parallel
    @numba.njit(parallel=True, fastmath=FAST, cache=True)
    def stats_kernel(s, t, target, inv_temp, stats):
        """stats [8, n]: the maxima of s, z = s / temperature (padded with zeros to vt) and
        t / temperature; the sums of exp(x - max) of each; the target logit (0 where target < 0);
        the reference column's t (_row_stats')."""
        sources  # (its cache key: _kernels)
        for i in numba.prange(s.shape[0]):
            _stats_row(np.int64(i), s, t, target, inv_temp, stats)

    @rows_in_parallel
    @numba.njit(parallel=True, fastmath=FAST, cache=True)
    def kl_kernel(s, t, inv_temp, mode, beta, stats, kl):
        """kl [2, n]: a and b of each row."""
        sources  # (its cache key: _kernels)
        for i in numba.prange(s.shape[0]):
            _kl_row(np.int64(i), s, t, inv_temp, mode, beta, stats, kl)

    @rows_in_parallel
    @numba.njit(parallel=True, fastmath=FAST, cache=True)
    def finish_kernel(s, t, target, inv_temp, mode, beta, w_hard, w_soft_over_t, stats, kl, ce, jsd, G,
                      label_terms, write_grad):
        """The row's CE and JSD values, and with write_grad its gradient row without the 1/N of
        the mean; the label's one-hot term kept apart where it dominates (as the fused GPU kernel does,
        where G is 16-bit)."""
        sources  # (its cache key: _kernels)
        for i in numba.prange(s.shape[0]):
            _finish_row(np.int64(i), s, t, target, inv_temp, mode, beta, w_hard, w_soft_over_t, stats, kl, ce, jsd, G,
                        label_terms, write_grad)

    return fused_kernel, stats_kernel, kl_kernel, finish_kernel


fused_kernel, stats_kernel, kl_kernel, finish_kernel = _kernels(_sources_digest())
