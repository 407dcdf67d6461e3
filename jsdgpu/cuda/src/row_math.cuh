// The per-column math of a row, shared by the fused kernel and the three-phase kernels.
//
// In log2 units ("bits"): a logit x at temperature T is x * scale2 bits, scale2 = log2(e) / T,
// so that each exp is one ex2 of one FFMA and each log one lg2. The log-ratio h and the KL sums
// a and b are in bits; they turn into natural units (times ln 2) once per row.
//
// MODE (FORWARD_KL, JSD, JSD_MIRRORED, REVERSE_KL) is a template parameter: the kernels' inner
// loops hold no branch on it. Each kernel switches on its mode argument once (mode_dispatch).
// What differs between the divergences is Divergence<MODE>'s (divergences.cuh); what they share
// is here.
#pragma once

#include "common.cuh"
#include "reduce.cuh"

// What a row's sums and gradient need once its statistics are known.
struct RowMath {
  float scale2;          // log2(e) / temperature
  float lse_s;           // logsumexp of s, natural units (the CE)
  float lse_z2, lse_t2;  // logsumexp of s / T and of t / T, in bits
  float c_h;             // the shift of the gradient's h to the reference column (RELATIVE_H:
                         // "A sharp row", below; reverse KL's h is (s - t) scale2 + c_h, the
                         // JSD's lp - lm - c_h); 0 elsewhere
  float beta, one_minus_beta;  // both from the host's float64: 1 - beta in float32 from a beta
                               // near 1 would be a few percent off
  float w_hard, w_soft_over_t;
};

// ---- one column's terms ----
//
// Every soft part here is a sum over the columns of w F(d) >= 0: w the probability of a weight
// distribution (p; q where the divergence is mirrored: reverse KL, and the JSD with beta > 1/2),
// d = ln(o / w) the log-ratio of the other distribution's, formed from the logits' difference
// t - s (never from two logs near log(1/V), whose roundings are more than a small divergence),
// and F second order in d, so that no column's term cancels against another's:
//   KL(q || p) = sum p Phi(d), Phi(d) = 1 + e^d (d - 1); KL(p || q) is the same, mirrored;
//   the JSD = sum w H_b(d), H_b(d) = b Phi(d) - G(b (e^d - 1)), G(y) = (1 + y) ln(1 + y) - y,
//   with b the mixture's weight of the other distribution (beta, or 1 - beta mirrored: b <= 1/2,
//   so that H_b = b (1 - b) d^2 / 2 + ... loses at most a factor 2 to cancellation).
// (Each is the generalized KL form sum w (e^x - 1 - x): the sums of p and of q are 1, so the
// terms that are linear in them add up to 0; the rows' normalization errors then change the sum
// at second order only. docs/design.md, "Small divergences".)
// Where |d| < 1, F(d) = d^2 P(d) with P the host's polynomial for the mode and b
// (sources.soft_terms: a fit in float64, to float32's rounding). Elsewhere, in the JSD with
// b >= 1/6, the column's shares of the fast sums (below: they are w H_b(d) there, to float32);
// else F by its formula, written in w and o so that nothing overflows: w Phi(d) = w + o (d - 1), and
// w G(y) = m ln(m / w) - (m - w) with m = w + b (o - w) the mixture (G by its series where
// |y| < 1/10: only where b < 1/6). o is w times the smaller's ratio to the larger where o <= w,
// its own exp where o > w; the mixture's log is taken relative to the larger of the two.
//
// The fast sums a = sum p (lp - lm), b = sum q (lq - lm) (in bits; m the mixture, q in forward
// KL's b where m = p, and p in reverse KL's a where m = q) are the ones the gradient takes (its
// kl is a) and the soft part from 0.1 nats (PRECISE_BELOW_BITS, below): they are first order in d
// and cancel where the divergence is small, but correct to float32 where a divergence of
// hundreds of bits is off by the rounding of the row's logsumexps (unrounded_sums, below).

constexpr int SOFT_POLY_TERMS = 9;  // P's coefficients, of d^0 .. d^8, and Q's
// P, and the gradient's Q: where |d| < 1 the part of a column's gradient that is first order in
// d, forward KL's 2^d2 - 1 (its p - q is -p times it) and the JSD's log2(m / w), is d2 Q(d2)
// (sources.soft_terms; jsdgpu/soft_poly.py, grad_poly), not a difference of two rounded numbers
// near each other: from the rounded p and q, a small divergence's gradient lost to their
// roundings what it is smaller than 1 (at beta 1e-6, the whole gradient: docs/design.md, "Small
// divergences")
struct SoftPoly {
  float c[SOFT_POLY_TERMS], g[SOFT_POLY_TERMS];
};
// their coefficients as kernel parameters (by value: they stay in the constant bank), and gathered
#define SOFT_POLY_PARAMS                                                                                   \
  float poly0, float poly1, float poly2, float poly3, float poly4, float poly5, float poly6, float poly7,  \
      float poly8, float grad0, float grad1, float grad2, float grad3, float grad4, float grad5, float grad6, \
      float grad7, float grad8
#define SOFT_POLY_OF_PARAMS                                              \
  {{poly0, poly1, poly2, poly3, poly4, poly5, poly6, poly7, poly8},       \
   {grad0, grad1, grad2, grad3, grad4, grad5, grad6, grad7, grad8}}

// One column's shares of the fast sums (a, b) and of the precise one (soft, over the weights' sum
// w; natural units), p and q, and the gradient's h (lp - lm in bits, relative to the reference
// column in reverse KL and the JSD; p - q in forward KL). s: the student logit (0 in a pad
// column, -inf with t past the row's end), t: the teacher's. soft_b: the JSD's b (above).
struct ColumnTerms {
  float a, b, soft, w, p, q, h;
};

// SMALL_B: soft_b < SMALL_B_BELOW, where G(y) may need its series; a variant of its own, so that
// the common one (b >= 1/6, where the series is never taken) holds no check of it in each column
constexpr float SMALL_B_BELOW = 1.0f / 6.0f;

// STRAIGHT: the polynomials and the far formulas are taken for every column, and its own chosen by
// selects: no branch, so that the unrolled columns of a thread's registers interleave (with a branch
// per column, the JSD's common variant took 79 instructions a column; straight, 58:
// experiments/column_sass.py); else each only where the column needs it (the fused kernel's
// columns in shared memory: straight there, the shapes that hold such columns spilled)
template <int MODE, bool SMALL_B = false, bool STRAIGHT = true>
__device__ __forceinline__ ColumnTerms column_terms(float s, float t, const RowMath& r, float soft_b,
                                                    const SoftPoly& poly);

#include "divergences.cuh"

template <int MODE, bool SMALL_B, bool STRAIGHT>
__device__ __forceinline__ ColumnTerms column_terms(float s, float t, const RowMath& r, float soft_b,
                                                    const SoftPoly& poly) {
  using D = Divergence<MODE>;
  const bool mirrored = D::weight_is_q(r);
  const float lp = fmaf(s, r.scale2, -r.lse_z2), lq = fmaf(t, r.scale2, -r.lse_t2);
  Column c;
  c.p = ex2(lp);
  c.q = ex2(lq);
  // t - s is 0 where both are -inf (past the row's end: p = q = 0, and every term 0)
  c.diff = s == t ? 0.0f : t - s;
  c.dq2 = fmaf(c.diff, r.scale2, r.lse_z2 - r.lse_t2);  // log2(q / p)
  c.d2 = mirrored ? -c.dq2 : c.dq2;                      // log2(o / w)
  c.w = mirrored ? c.q : c.p;
  // the smaller of w and o over the larger: at most 1, so nothing here overflows
  c.ratio = ex2(fminf(c.d2, -c.d2));  // 2^-|d2| (fminf: one instruction, -fabsf took two)
  c.o = c.d2 <= 0.0f ? c.w * c.ratio : (mirrored ? c.p : c.q);
  c.near = fabsf(c.d2) < LOG2E;  // |d| < 1: P and Q take d in bits (sources.soft_terms)
  float cq = poly.g[SOFT_POLY_TERMS - 1], cp = poly.c[SOFT_POLY_TERMS - 1];  // Q and P at d2
  if (STRAIGHT || c.near) {
#pragma unroll
    for (int j = SOFT_POLY_TERMS - 2; j >= 0; --j) {
      cq = fmaf(cq, c.d2, poly.g[j]);
      cp = fmaf(cp, c.d2, poly.c[j]);
    }
  }
  c.qd = c.near ? c.d2 * cq : 0.0f;
  ColumnTerms k;
  k.w = c.w;
  k.p = c.p;
  k.q = c.q;
  const float far = D::template column<SMALL_B, STRAIGHT>(c, r, soft_b, k);
  const float far_soft = D::template far_soft<SMALL_B>(c, k, r, soft_b, far);
  k.soft = c.near ? c.w * (c.d2 * c.d2) * cp : far_soft;
  return k;
}

// A sharp or saturated row's gradient (reverse KL, the JSD: RELATIVE_H): where p is near one-hot
// the gradient's h - kl (below) at p's large column is a small difference of two numbers near
// each other: kl = sum p h is that column's h less a small part, and the difference is what the
// other columns hold, 1 - p of it. In reverse KL at a low temperature and large logits h = lp - lq
// is hundreds of bits there (lq far below 0 where the teacher disagrees); in the JSD with the
// teacher near one-hot elsewhere it is -log2(1 - beta) there, and the gradient 1e-11 of it (T = 3,
// V = 17, beta 0.0044: the gradient 90 times off, docs/design.md, "Numerics"). kl in float32
// would carry their rounding into it, 1e-3 of G and more. So the kernels take every column's h
// relative to the h of a reference column (the student's largest logit, where p is largest:
// h_ref, take_reference): h of the reference column comes out 0 (near 0 in reverse KL: its h is
// formed from the logits' difference), the other columns' h - h_ref as before, and the sum a as
// a_rel = sum p (h - h_ref), a sum of small terms (kl_rel once unrounded_sums has scaled it).
// h - kl = (h - h_ref) - kl_rel, and the fast soft part takes a_n = h_ref + kl_rel
// (docs/design.md, "Numerics"). Forward KL's gradient is h - kl p, h = p - q, which holds no such
// difference.

// h_ref of a RELATIVE_H divergence from its reference column's logits s_ref and t_ref, 0 where
// it is not finite (a teacher logit of -inf there in reverse KL: the divergence is inf; a row
// with no student column), and r.c_h set to take each column's h relative to it (0 and r as
// they are elsewhere). SMALL_B: the variant of column_terms that the row's columns take.
template <int MODE, bool SMALL_B>
__device__ __forceinline__ float take_reference(float s_ref, float t_ref, RowMath& r, float soft_b,
                                                const SoftPoly& poly) {
  using D = Divergence<MODE>;
  r.c_h = 0.0f;
  if (!D::RELATIVE_H) return 0.0f;
  const float h = D::template ref_h<SMALL_B>(s_ref, t_ref, r, soft_b, poly);
  const float h_ref = isfinite(h) ? h : 0.0f;
  r.c_h = D::h_shift(h_ref, r);
  return h_ref;
}

// (m, t_at_m) taken on over the four columns of s and t: the largest s, and the t of its column
// (the first of several that hold it)
__device__ __forceinline__ void argmax4(float4 s, float4 t, float& m, float& t_at_m) {
  const float sv[4] = {s.x, s.y, s.z, s.w}, tv[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (sv[j] > m) {
      m = sv[j];
      t_at_m = tv[j];
    }
  }
}

// The largest s over the lanes of a warp (v.x), and the largest t (v.y) of the lanes that hold it:
// every lane gets the same, whatever the order
__device__ __forceinline__ float2 ref_lanes(float2 v) {
  const float m = warp_max(v.x);
  return make_float2(m, warp_max(v.x == m ? v.y : NEG_INF));
}

// One gradient value: w_hard (softmax(s) - onehot) + (w_soft / temperature) dz, with
// dz = p - q (forward KL), else c p (h - kl) ln 2 with c = 1 - beta (JSD) or 1 (reverse KL) and kl
// the row's a in bits (the KL(p || m) of SPEC.md), or h and kl both relative to h_ref (above);
// softmax: the column's softmax(s), which is p where SOFTMAX_IS_P. There, except at the label and
// in forward KL, it takes two instructions as p (w_hard + k (h - kl)); that rounds w_hard - k kl
// where the general form rounds k (h - kl), which differs only where h - kl is near 0, and G with
// it. onehot: the label's one-hot term, 0 in every other column (1; the fused kernel, where it
// folds the student model's derivative into p and q, passes the derivative at the label).
template <int MODE, bool SOFTMAX_IS_P>
__device__ __forceinline__ float grad_value(float softmax, float p, float h, float onehot, float kl,
                                            const RowMath& r) {
  using D = Divergence<MODE>;
  const float k = D::grad_factor(r);
  if (SOFTMAX_IS_P && D::GRAD_OF_P && onehot == 0.0f) return p * fmaf(k, h, fmaf(-k, kl, r.w_hard));
  const float soft = D::grad_soft(k, p, h, kl);
  return fmaf(r.w_hard, softmax - onehot, soft);
}

// softmax(s) of a student logit s (at temperature 1): 2 instructions, where __expf(s - lse_s)
// took 7 (its range checks)
__device__ __forceinline__ float softmax_of(float s, const RowMath& r) { return ex2(fmaf(s, LOG2E, -r.lse_s * LOG2E)); }

// Whether the label's one-hot term is kept out of the 16-bit G row (and added exactly later):
// where softmax(s)[label] < 1/2 it would dominate G[label] and be rounded with it.
__device__ __forceinline__ bool label_dominates(float target_logit, float lse_s) {
  return target_logit - lse_s < -LN2;  // softmax(s)[label] < 1/2, without the exp
}

// The fused kernel's sums a and b come from p and q as computed from the row's logsumexps rounded
// to float32: at a low temperature those are hundreds of bits, off by up to 3e-5 bits (eps_z,
// eps_t: the roundings' errors, found where they are made), so p and q as computed are the exact
// ones times 2^-eps, and their logs are off by -eps. That would reach a divergence of hundreds of
// bits by as much, and the gradient's h - kl where p is near one-hot (kl is the h of that column
// less a small part) by far more. The sums for the exact distributions, in their first order:
// a_n = a 2^eps_z, b_n = b 2^eps_t (the gradient's kl is a_n: h's own offset cancels in h - a_n;
// where h is relative (RELATIVE_H), a is a_rel and a_n kl_rel: "A sharp row", above); the soft
// part, in bits: a KL also takes its logs' offsets.
template <int MODE>
__device__ __forceinline__ float2 unrounded_sums(float a, float b, float eps_z, float eps_t) {
  return make_float2(fmaf(a, eps_z * LN2, a), fmaf(b, eps_t * LN2, b));
}

// The precise sum's terms take d from the row's logsumexps as rounded, so every column's d is off
// by the same delta = (eps_z - eps_t) ln 2 (for d = ln(q / p); -delta mirrored). The generalized
// terms keep that out of a small divergence (second order there), but where a row's divergence is
// large and its soft part still small (a tiny b, or a sharp row's KL times it) it reaches the sum
// at first order, as delta sum w F'(d); and sum w F'(d) is ln 2 times a fast sum: b B for the JSD
// (w = p; b A mirrored), B for forward KL, A for reverse KL (A, B: the unrounded a and b, in
// bits). The precise sum less that.
template <int MODE>
__device__ __forceinline__ float unrounded_precise(float precise, float2 a_b, float eps_z, float eps_t, float soft_b,
                                                   const RowMath& r) {
  const bool mirrored = Divergence<MODE>::weight_is_q(r);
  const float slope = Divergence<MODE>::precise_slope(a_b, soft_b, r);
  const float delta = (eps_z - eps_t) * (LN2 * LN2);
  return fmaf(mirrored ? delta : -delta, slope, precise);
}

// The soft part, in bits, from which a row takes the fast sums' value rather than the precise
// sum's: there the fast sums' error (about 1e-6 bits: the logs of the row's logsumexps and of
// lg2.approx) is below 1e-5 of the divergence, and they are right to float32 where a divergence
// of hundreds of bits is off by the rounding of the logsumexps, which only reaches the precise
// sum's terms at first order there (unrounded_sums)
constexpr float PRECISE_BELOW_BITS = 0.1f * LOG2E;  // 0.1 nats

// The row's soft part in nats: fast_bits, the fast sums' (corrected as above), where it is at
// least PRECISE_BELOW_BITS; else the precise sum over the weights' (the rows' normalization
// errors common to both cancel in the quotient). A NaN of either reaches the loss.
__device__ __forceinline__ float row_soft(float fast_bits, float precise, float weights) {
  return fast_bits >= PRECISE_BELOW_BITS || isnan(precise) ? LN2 * fast_bits : precise / weights;
}

// The row's CE and soft part (soft: in nats), and the label term kept out of G (with G only).
__device__ __forceinline__ void write_row_results(long long row, float target_logit, float soft, bool label_apart,
                                                  const RowMath& r, bool with_grad, float* ce_out, float* jsd_out,
                                                  float* label_terms) {
  if (with_grad) label_terms[row] = label_apart ? -r.w_hard : 0.0f;
  const float ce = r.lse_s - target_logit;
  ce_out[row] = ce < 0.0f ? 0.0f : ce;  // a CE is >= 0: below by rounding alone (NaN passes)
  jsd_out[row] = soft;
}

// bits = m + lg2(s) rounded to float32 (a logsumexp in bits): its rounding's error, exact where
// |lg2(s)| <= |m| (the error of a sum of two floats, recovered), and of the order of 1e-6 bits
// elsewhere (then the sum is small)
__device__ __forceinline__ float rounding_error(float bits, float m, float log_s) { return (bits - m) - log_s; }

// sum over the four values of 2^(v * scale2 - m2)
__device__ __forceinline__ float sum_ex2_4(float4 v, float scale2, float m2) {
  return (ex2(fmaf(v.x, scale2, -m2)) + ex2(fmaf(v.y, scale2, -m2))) +
         (ex2(fmaf(v.z, scale2, -m2)) + ex2(fmaf(v.w, scale2, -m2)));
}
