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

// What a row's KL sums and gradient need once its statistics are known.
struct RowMath {
  float scale2;          // log2(e) / temperature
  float lse_s;           // logsumexp of s, natural units (the CE)
  float lse_z2, lse_t2;  // logsumexp of s / T and of t / T, in bits
  float beta, w_hard, w_soft_over_t;
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
    const float m = (1.0f - r.beta) * p + r.beta * q;
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

// One gradient value: w_hard (softmax(s) - onehot) + (w_soft / temperature) dz, with
// dz = p - q (forward KL), else c p (h - kl) ln 2 with c = 1 - beta (JSD) or 1 (reverse KL) and kl
// the row's a in bits (the KL(p || m) of SPEC.md); softmax: the column's softmax(s), which is p
// where SOFTMAX_IS_P. There, except at the label and in forward KL, it takes two instructions as
// p (w_hard + k (h - kl)); that rounds w_hard - k kl where the general form rounds k (h - kl),
// which differs only where h - kl is near 0, and G with it.
template <int MODE, bool SOFTMAX_IS_P>
__device__ __forceinline__ float grad_value(float softmax, float p, float h, bool onehot, float kl,
                                            const RowMath& r) {
  const float k = MODE == FORWARD_KL ? r.w_soft_over_t : r.w_soft_over_t * ((MODE == JSD ? 1.0f - r.beta : 1.0f) * LN2);
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

// The row's CE and JSD values from its sums (in bits), and the label term kept out of G (with G
// only).
template <int MODE>
__device__ __forceinline__ void write_row_results(long long row, float target_logit, float a, float b,
                                                  bool label_apart, const RowMath& r, bool with_grad,
                                                  float* ce_out, float* jsd_out, float* label_terms) {
  if (with_grad) label_terms[row] = label_apart ? -r.w_hard : 0.0f;
  ce_out[row] = r.lse_s - target_logit;
  jsd_out[row] = LN2 * (MODE == FORWARD_KL ? b : MODE == JSD ? r.beta * b + (1.0f - r.beta) * a : a);
}

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
