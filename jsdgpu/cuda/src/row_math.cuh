// The per-column math of a row, shared by the fused kernel and the three-phase kernels.
//
// In log2 units ("bits"): a logit x at temperature T is x * scale2 bits, scale2 = log2(e) / T,
// so that each exp is one ex2 of one FFMA and each log one lg2. The log-ratio h and the KL sums
// a and b are in bits; they turn into natural units (times ln 2) once per row.
//
// MODE (FORWARD_KL, JSD, REVERSE_KL) is a template parameter: the kernels' inner loops hold no
// branch on it. Each kernel switches on its mode argument once (mode_dispatch).
#pragma once

#include "common.cuh"
#include "reduce.cuh"

// What a row's KL sums and gradient need once its statistics are known.
struct RowMath {
  float scale2;          // log2(e) / temperature
  float lse_s;           // logsumexp of s, natural units (the CE)
  float lse_z2, lse_t2;  // logsumexp of s / T and of t / T, in bits
  float beta, one_minus_beta;  // both from the host's float64: 1 - beta in float32 from a beta
                               // near 1 would be a few percent off
  float w_hard, w_soft_over_t;
};

// One column's share of a = sum p (log p - log m) and b = sum q (log q - log m), in bits, with m
// the mixture (JSD), p (forward KL) or q (reverse KL); the sum a KL does not use is 0 (a in
// forward KL, b in reverse KL). p, and h, what the gradient needs of the teacher (bits but in
// forward KL, where h = q). s: the student logit (0 in a pad column), t: the teacher logit.
struct KlTerms {
  float a, b, p, h;
};


template <int MODE>
__device__ __forceinline__ KlTerms kl_terms(float s, float t, const RowMath& r) {
  const float lp = fmaf(s, r.scale2, -r.lse_z2), lq = fmaf(t, r.scale2, -r.lse_t2);
  const float p = ex2(lp), q = ex2(lq);
  if (MODE == JSD) {
    // m clamped to the smallest normal float so that its log stays finite (the terms it touches
    // are below 1e-36); max_nan, not fmaxf, so that a NaN passes
    const float m = r.one_minus_beta * p + r.beta * q;
    const float lm = lg2(max_nan(m, FLT_MIN_NORMAL)), h = lp - lm;
    // 0 log 0 = 0: lm is finite, so where p = 0 (lp = -inf at worst) p max(lp - lm, -FLT_MAX) is
    // 0, and elsewhere it is p (lp - lm); likewise for q. A NaN reaches the loss. (One max and an
    // FMA where "p != 0 ? p (lp - lm) : 0" took four instructions.)
    KlTerms k = {p * max_nan(h, -FLT_MAX_FINITE), q * max_nan(lq - lm, -FLT_MAX_FINITE), p, h};
    return k;
  }
  // the KLs: only one sum is used (a for reverse KL, b for forward KL), and its log-ratio can be
  // -inf - -inf where both logits are -inf: its 0 log 0 is the explicit 0 of "p != 0", which
  // (rather than "p > 0") lets a NaN reach the loss
  const float h = MODE == FORWARD_KL ? q : lp - lq;
  KlTerms k = {MODE == REVERSE_KL && p != 0.0f ? p * h : 0.0f,
               MODE == FORWARD_KL && q != 0.0f ? q * (lq - lp) : 0.0f, p, h};
  return k;
}

// ---- the KL sums without cancellation, where the fast ones above cannot be trusted ----
//
// Where p and q nearly agree (a high temperature, or beta near 0 or 1 in the JSD), the fast sums
// add first-order terms of about 1e-4 that cancel to a divergence of 1e-8, and the logs of
// probabilities near 1/V carry 1e-6 bits of rounding each: their sum is off by far more than the
// divergence. Here each column's term is the generalized KL term w (e^x - 1 - x) >= 0 of w
// against w e^x, with x a log-ratio formed from the logits' difference t - s (never from two
// logs near log(1/V)): second order in x, so no term cancels against another, and an error in
// the rows' normalizations (the logsumexps) changes the sum only at second order. In natural
// units.

// e^x - 1 - x, to float32 rounding at every x: by its series where it cancels
__device__ __forceinline__ float expm1_minus_x(float x) {
  if (fabsf(x) < 0.5f) {  // sum of x^k / k! for k = 2..10; the rest is below 1e-9 of it
    float c = 1.0f / 3628800.0f;
    c = fmaf(c, x, 1.0f / 362880.0f);
    c = fmaf(c, x, 1.0f / 40320.0f);
    c = fmaf(c, x, 1.0f / 5040.0f);
    c = fmaf(c, x, 1.0f / 720.0f);
    c = fmaf(c, x, 1.0f / 120.0f);
    c = fmaf(c, x, 1.0f / 24.0f);
    c = fmaf(c, x, 1.0f / 6.0f);
    c = fmaf(c, x, 0.5f);
    return x * x * c;
  }
  return expm1f(x) - x;
}

// w (e^x - 1 - x) where w e^x = w_other: w's term of the generalized KL(w || w_other)
__device__ __forceinline__ float kl_term(float w, float w_other, float x) {
  if (x >= 0.5f) return w == 0.0f ? w_other : w_other - fmaf(w, x, w);  // w_other > 1.6 w: no cancellation
  return w * expm1_minus_x(x);
}

// ln((1 - c) + c e^d) for c in [0, 1], omc = 1 - c: log1p(c expm1(d)), but from its sum of two
// positive terms where that is below 1/2 (log1p's argument near -1 would have cancelled); NaN
// passes. d <= 80 (no overflow).
__device__ __forceinline__ float log_mix(float c, float omc, float d) {
  const float y = c * expm1f(d);
  return y < -0.5f ? logf(fmaf(c, expf(d), omc)) : log1pf(y);
}

// A column's share of the KL sums (a, b), in bits, as kl_terms' a and b; its p and q; and its share
// of kl_terms' a as the gradient takes it (fast_a: its logs' offsets cancel there against h's).
// s: the student logit, 0 in a pad column; t: the teacher's.
struct PreciseTerms {
  float a, b, p, q, fast_a;
};

template <int MODE>
__device__ __forceinline__ PreciseTerms precise_kl_terms(float s, float t, const RowMath& r) {
  const float lp = fmaf(s, r.scale2, -r.lse_z2), lq = fmaf(t, r.scale2, -r.lse_t2);
  const float p = ex2(lp), q = ex2(lq);
  const float delta = LN2 * fmaf(t - s, r.scale2, r.lse_z2 - r.lse_t2);  // ln(q / p)
  if (MODE == FORWARD_KL) return {0.0f, LOG2E * kl_term(q, p, -delta), p, q, 0.0f};
  if (MODE == REVERSE_KL) return {LOG2E * kl_term(p, q, delta), 0.0f, p, q, p != 0.0f ? p * (lp - lq) : 0.0f};
  // JSD: lambda = ln(m / p), mu = ln(m / q) = lambda - delta, each from its own mixture where
  // that does not overflow
  const float m = r.one_minus_beta * p + r.beta * q;
  float lambda, mu;
  if (delta > 80.0f) {
    mu = log_mix(r.one_minus_beta, r.beta, -delta);
    lambda = mu + delta;
  } else {
    lambda = log_mix(r.beta, r.one_minus_beta, delta);
    mu = delta < -80.0f ? lambda - delta : log_mix(r.one_minus_beta, r.beta, -delta);
  }
  const float lm = lg2(max_nan(m, FLT_MIN_NORMAL));
  return {LOG2E * kl_term(p, m, lambda), LOG2E * kl_term(q, m, mu), p, q, p * max_nan(lp - lm, -FLT_MAX_FINITE)};
}


// A sharp row's gradient in reverse KL: at a low temperature and large logits p is near
// one-hot, and the gradient's h - kl (below) at p's large column is a small difference of two
// numbers of hundreds of bits (h = lp - lq, with lq far below 0 where the teacher disagrees):
// kl = sum p h in float32 would carry their rounding into it, 1e-3 of G and more. So the fused
// kernel takes every column's h relative to the h of a reference column (the student's largest
// logit, where p is largest: h_ref), by shifting lse_t2 by h_ref (shifted_lse_t2): lq and h of
// the reference column come out near 0 and exact, the other columns' h - h_ref as before, and
// the sum a as a_rel = sum p (h - h_ref), a sum of small terms (kl_rel once unrounded_sums has
// scaled it). h - kl = (h - h_ref) - kl_rel, and the soft part takes a_n = h_ref + kl_rel
// (docs/design.md, "Numerics"). In the JSD, h = lp - lm is never
// far from 0 where p is large (lm >= lg2((1 - beta) p)), and forward KL's gradient is p - q.

// reverse KL's lse_t2 less h_ref (above), from the reference column's logits s_ref and t_ref;
// lse_t2 itself where h_ref is not finite (a teacher logit of -inf there: the divergence is inf)
__device__ __forceinline__ float shifted_lse_t2(float s_ref, float t_ref, float scale2, float lse_z2, float lse_t2) {
  const float h_ref = fmaf(s_ref, scale2, -lse_z2) - fmaf(t_ref, scale2, -lse_t2);  // as kl_terms forms h
  return isfinite(h_ref) ? lse_t2 - h_ref : lse_t2;
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
// it.
template <int MODE, bool SOFTMAX_IS_P>
__device__ __forceinline__ float grad_value(float softmax, float p, float h, bool onehot, float kl,
                                            const RowMath& r) {
  const float k = MODE == FORWARD_KL ? r.w_soft_over_t : r.w_soft_over_t * ((MODE == JSD ? r.one_minus_beta : 1.0f) * LN2);
  if (SOFTMAX_IS_P && MODE != FORWARD_KL && !onehot) return p * fmaf(k, h, fmaf(-k, kl, r.w_hard));
  const float soft = MODE == FORWARD_KL ? k * (p - h) : k * p * (h - kl);
  return fmaf(r.w_hard, softmax - (onehot ? 1.0f : 0.0f), soft);
}

// softmax(s) of a student logit s (at temperature 1): 2 instructions, where __expf(s - lse_s)
// took 7 (its range checks)
__device__ __forceinline__ float softmax_of(float s, const RowMath& r) { return ex2(fmaf(s, LOG2E, -r.lse_s * LOG2E)); }

// Whether the label's one-hot term is kept out of the 16-bit G row (and added exactly later):
// where softmax(s)[label] < 1/2 it would dominate G[label] and be rounded with it.
__device__ __forceinline__ bool label_dominates(float target_logit, float lse_s) {
  return target_logit - lse_s < -LN2;  // softmax(s)[label] < 1/2, without the exp
}

// The row's soft part in bits from its KL sums a and b (in bits)
template <int MODE>
__device__ __forceinline__ float soft_bits(float a, float b, const RowMath& r) {
  return MODE == FORWARD_KL ? b : MODE == JSD ? r.beta * b + r.one_minus_beta * a : a;
}

// The fused kernel's sums a and b come from p and q as computed from the row's logsumexps rounded
// to float32: at a low temperature those are hundreds of bits, off by up to 3e-5 bits (eps_z,
// eps_t: the roundings' errors, found where they are made), so p and q as computed are the exact
// ones times 2^-eps, and their logs are off by -eps. That would reach a divergence of hundreds of
// bits by as much, and the gradient's h - kl where p is near one-hot (kl is the h of that column
// less a small part) by far more. The sums for the exact distributions, in their first order:
// a_n = a 2^eps_z, b_n = b 2^eps_t (the gradient's kl is a_n: h's own offset cancels in h - a_n;
// in the fused kernel's reverse KL, a is a_rel and a_n kl_rel: "A sharp row", above); the soft
// part, in bits: a KL also takes its logs' offsets.
template <int MODE>
__device__ __forceinline__ float2 unrounded_sums(float a, float b, float eps_z, float eps_t) {
  return make_float2(fmaf(a, eps_z * LN2, a), fmaf(b, eps_t * LN2, b));
}

template <int MODE>
__device__ __forceinline__ float unrounded_soft_bits(float2 n, float eps_z, float eps_t, const RowMath& r) {
  if (MODE == REVERSE_KL) return n.x + (eps_z - eps_t);
  if (MODE == FORWARD_KL) return n.y + (eps_t - eps_z);
  return soft_bits<MODE>(n.x, n.y, r);
}

// The row's CE and soft part (soft: in bits), and the label term kept out of G (with G only).
__device__ __forceinline__ void write_row_results(long long row, float target_logit, float soft, bool label_apart,
                                                  const RowMath& r, bool with_grad, float* ce_out, float* jsd_out,
                                                  float* label_terms) {
  if (with_grad) label_terms[row] = label_apart ? -r.w_hard : 0.0f;
  ce_out[row] = r.lse_s - target_logit;
  jsd_out[row] = LN2 * soft;
}

// bits = m + lg2(s) rounded to float32 (a logsumexp in bits): its rounding's error, exact where
// |lg2(s)| <= |m| (the error of a sum of two floats, recovered), and of the order of 1e-6 bits
// elsewhere (then the sum is small)
__device__ __forceinline__ float rounding_error(float bits, float m, float log_s) { return (bits - m) - log_s; }

template <int M>
struct Mode {
  static constexpr int value = M;
};

// f(Mode<MODE>()) for the runtime mode
template <typename F>
__device__ __forceinline__ void mode_dispatch(int mode, F&& f) {
  if (mode == FORWARD_KL)
    f(Mode<FORWARD_KL>());
  else if (mode == JSD)
    f(Mode<JSD>());
  else
    f(Mode<REVERSE_KL>());
}


// sum over the four values of 2^(v * scale2 - m2)
__device__ __forceinline__ float sum_ex2_4(float4 v, float scale2, float m2) {
  return (ex2(fmaf(v.x, scale2, -m2)) + ex2(fmaf(v.y, scale2, -m2))) +
         (ex2(fmaf(v.z, scale2, -m2)) + ex2(fmaf(v.w, scale2, -m2)));
}
