// The soft part's divergences, each in one place: Divergence<MODE> (MODE: a code of
// options.Divergence, defined by the loader) holds everything in which one differs from another:
// its column terms (a column's shares of the fast and the precise sums, and its gradient's h),
// its gradient's form, the row's value from its sums, and a top-k category's terms. The row
// kernels are templates on MODE (switched once a launch: mode_dispatch) and read their divergence
// through these alone; row_math.cuh forms what every divergence shares (a column's probabilities
// and log-ratios: Column), and the kernels do the rest. Included by row_math.cuh, after RowMath
// and ColumnTerms. Adding a divergence: docs/design.md, "Where a divergence's math lives".
#pragma once
#include "common.cuh"

// A column's operands as row_math.cuh's column_terms forms them for every divergence: p and q;
// diff = t - s (0 where both are -inf); dq2 = log2(q / p); w the weight distribution's
// probability and o the other's (w = q where the divergence is mirrored: weight_is_q); d2 =
// log2(o / w); ratio = 2^-|d2|, the smaller of w and o over the larger; near: |d| < 1, where qd
// is d2 Q(d2) (row_math.cuh, SoftPoly), else 0.
struct Column {
  float p, q, diff, dq2, d2, w, ratio, o, qd;
  bool near;
};

// One category's share of the divergence (d) and of u_bar (pu = P u), and u, for log P = lp,
// log q = lq (natural); u is dD/dP up to a constant (which cancels in the gradient), and in forward
// KL, where u = -q / P, the gradient takes P u = -q, so u is not formed. (topk_rows.cu)
struct Category {
  double d, pu, u;
};

__device__ __forceinline__ double log_add_exp(double a, double b) {
  if (isnan(a) || isnan(b)) return a + b;
  const double m = fmax(a, b);
  return m == -D_INF ? m : m + log1p(exp(-fabs(a - b)));
}

// w Phi(d) = w + o (d - 1), Phi(d) = 1 + e^d (d - 1): the KLs' precise term where |d| >= 1, and
// the JSD's Phi part in its small-b variant
__device__ __forceinline__ float w_phi(const Column& c) { return fmaf(c.o, fmaf(c.d2, LN2, -1.0f), c.w); }

// What each divergence supplies (row_math.cuh's comment, "one column's terms", has the math):
//   RELATIVE_H: whether the gradient's h is relative to a reference column (a sharp or saturated
//     row: row_math.cuh, "A sharp row"); the kernels then find that column, take its h with
//     ref_h<SMALL_B>(s_ref, t_ref, r, soft_b, poly) (r.c_h 0) and shift every column's h and the
//     row's kl by it (column's h less it: c_h = h_shift(h_ref, r)).
//   SMALL_B: whether it has a variant for a small mixture weight b (< SMALL_B_BELOW).
//   weight_is_q(r): whether its weight distribution is q (mirrored; a constant of each code).
//   column<SMALL_B, STRAIGHT>(c, r, soft_b, k): a column's h, a and b into k; returns what its
//     far_soft takes (the JSD's; 0 elsewhere). STRAIGHT: by selects, not branches (column_terms).
//   far_soft<SMALL_B>(c, k, r, soft_b, far): the column's precise term where |d| >= 1 (below 1,
//     the host's polynomial: sources.soft_terms).
//   grad_factor(r), GRAD_OF_P, grad_soft(k, p, h, kl): the soft part's gradient in a column,
//     (w_soft / T) dz = grad_soft(grad_factor, ...); GRAD_OF_P: dz = p (...), which grad_value
//     folds with the hard part's softmax where that is p.
//   soft_bits(a, b, r), unrounded_soft_bits(n, eps_z, eps_t, r), precise_slope(a_b, soft_b, r):
//     the row's soft part from its fast sums (in bits), corrected for the logsumexps' roundings
//     (row_math.cuh, unrounded_sums), and the slope of its precise sum in those roundings.
//   category(lp, lq, ...), slot_dz(P, u_bar, cat, lq), rest_a(u_bar, rest), rest_b(lq_rest): the
//     top-k's categories (float64), a slot's dz, and the rest's gradient coefficients A and B
//     (topk_math.cuh, RestGradient).
template <int MODE>
struct Divergence;

// KL(q || p) = sum p Phi(d): weight p, no reference column; dz = p - q, as h - kl p: h the
// column's p - q (where |d| < 1 -p (2^d2 - 1) by Q), kl their sum over the row (the fast sum a),
// which is 0 but for their roundings (the logsumexps' shift every column's d alike)
template <>
struct Divergence<FORWARD_KL> {
  enum : bool { RELATIVE_H = false, SMALL_B = false, GRAD_OF_P = false };
  __device__ static __forceinline__ bool weight_is_q(const RowMath&) { return false; }
  template <bool SMALL, bool STRAIGHT>
  __device__ static __forceinline__ float column(const Column& c, const RowMath&, float, ColumnTerms& k) {
    k.h = c.near ? -c.p * c.qd : c.p - c.q;
    k.a = k.h;
    k.b = c.q * c.dq2;
    return 0.0f;
  }
  template <bool SMALL>
  __device__ static __forceinline__ float far_soft(const Column& c, const ColumnTerms&, const RowMath&, float, float) {
    return w_phi(c);
  }
  template <bool SMALL>
  __device__ static __forceinline__ float ref_h(float, float, const RowMath&, float, const SoftPoly&) { return 0.0f; }
  __device__ static __forceinline__ float h_shift(float, const RowMath&) { return 0.0f; }
  __device__ static __forceinline__ float grad_factor(const RowMath& r) { return r.w_soft_over_t; }
  __device__ static __forceinline__ float grad_soft(float k, float p, float h, float kl) { return k * fmaf(-p, kl, h); }
  __device__ static __forceinline__ float soft_bits(float, float b, const RowMath&) { return b; }
  __device__ static __forceinline__ float unrounded_soft_bits(float2 n, float eps_z, float eps_t, const RowMath&) {
    return n.y + (eps_t - eps_z);
  }
  __device__ static __forceinline__ float precise_slope(float2 a_b, float, const RowMath&) { return a_b.y; }
  __device__ static __forceinline__ Category category(double lp, double lq, double, double, double, double) {
    const double q = exp(lq);
    return {q != 0.0 ? q * (lq - lp) : 0.0, -q, 0.0};
  }
  __device__ static __forceinline__ double slot_dz(double P, double u_bar, const Category&, double lq) {
    return P * -u_bar - exp(lq);
  }
  __device__ static __forceinline__ double rest_a(double u_bar, const Category&) { return -u_bar; }
  __device__ static __forceinline__ double rest_b(double lq_rest) { return -exp(lq_rest); }
};

// KL(p || q): forward KL mirrored (weight q), h relative to a reference column; dz = p (h - kl)
template <>
struct Divergence<REVERSE_KL> {
  enum : bool { RELATIVE_H = true, SMALL_B = false, GRAD_OF_P = true };
  __device__ static __forceinline__ bool weight_is_q(const RowMath&) { return true; }
  template <bool SMALL, bool STRAIGHT>
  __device__ static __forceinline__ float column(const Column& c, const RowMath& r, float, ColumnTerms& k) {
    k.h = fmaf(-c.diff, r.scale2, r.c_h);
    k.a = c.p * k.h;
    k.b = 0.0f;
    return 0.0f;
  }
  template <bool SMALL>
  __device__ static __forceinline__ float far_soft(const Column& c, const ColumnTerms&, const RowMath&, float, float) {
    return w_phi(c);
  }
  // h = lp - lq of the reference column, and the c_h of column's h relative to it
  template <bool SMALL>
  __device__ static __forceinline__ float ref_h(float s_ref, float t_ref, const RowMath& r, float, const SoftPoly&) {
    return fmaf(s_ref, r.scale2, -r.lse_z2) - fmaf(t_ref, r.scale2, -r.lse_t2);
  }
  __device__ static __forceinline__ float h_shift(float h_ref, const RowMath& r) {
    return (r.lse_t2 - h_ref) - r.lse_z2;
  }
  __device__ static __forceinline__ float grad_factor(const RowMath& r) { return r.w_soft_over_t * LN2; }
  __device__ static __forceinline__ float grad_soft(float k, float p, float h, float kl) { return k * p * (h - kl); }
  __device__ static __forceinline__ float soft_bits(float a, float, const RowMath&) { return a; }
  __device__ static __forceinline__ float unrounded_soft_bits(float2 n, float eps_z, float eps_t, const RowMath&) {
    return n.x + (eps_z - eps_t);
  }
  __device__ static __forceinline__ float precise_slope(float2 a_b, float, const RowMath&) { return a_b.x; }
  __device__ static __forceinline__ Category category(double lp, double lq, double, double, double, double) {
    const double P = exp(lp);
    const double u = P != 0.0 ? lp - lq : 0.0;
    return {P * u, P * u, u};
  }
  __device__ static __forceinline__ double slot_dz(double P, double u_bar, const Category& cat, double) {
    return P * (cat.u - u_bar);
  }
  __device__ static __forceinline__ double rest_a(double u_bar, const Category& rest) { return rest.u - u_bar; }
  __device__ static __forceinline__ double rest_b(double) { return 0.0; }
};

// The generalized JSD, beta KL(q || m) + (1 - beta) KL(p || m), m = (1 - beta) p + beta q: weight
// p (q where beta > 1/2: MIRRORED, the code JSD_MIRRORED), b its mixture weight of the other; dz =
// (1 - beta) p (h - kl), h = lp - lm relative to a reference column (a saturated row:
// row_math.cuh, "A sharp row"). Which distribution weighs is the kernel's constant, not a test of
// the row's beta: its selects took 4 of pass 2's 59 instructions a column, and the kernel 4-6% of
// its time (docs/design.md, "Where a divergence's math lives").
template <bool MIRRORED>
struct Jsd {
  enum : bool { RELATIVE_H = true, SMALL_B = true, GRAD_OF_P = true };
  static constexpr int CODE = MIRRORED ? JSD_MIRRORED : JSD;
  __device__ static __forceinline__ bool weight_is_q(const RowMath&) { return MIRRORED; }
  template <bool SMALL, bool STRAIGHT>
  __device__ static __forceinline__ float column(const Column& c, const RowMath& r, float soft_b, ColumnTerms& k) {
    const bool mirrored = weight_is_q(r);
    const float d2 = c.d2, ratio = c.ratio, w = c.w, o = c.o;
    float w_g = 0.0f;  // w G(y), where |d| >= 1 in the small-b variant
    // lw - lm and lo - lm: where |d| < 1 from log2(m / w) = d2 Q(d2) (row_math.cuh, SoftPoly);
    // beyond, from l2, the mixture's log2 over the larger of w and o (in [log2 b, 0]: never a
    // difference of two large logs, nor a sum with d2, hundreds of bits in a sharp row), and in the
    // small-b variant, where |y| < 1/10 (y = m / w - 1, whose log2 of a number within b of 1 lost
    // it), from ln(1 + y)'s series
    const float o_less_w = soft_b * (o - w);  // m - w
    const bool series = SMALL && !c.near && o_less_w < 0.1f * w && o_less_w > -0.1f * w;
    // (where b >= 1/6, |y| = b |e^d - 1| >= 1/10 past |d| < 1)
    float y = 0.0f, l2 = 0.0f, h_w, h_o;
    if (c.near && !STRAIGHT) {
      h_w = -c.qd;
      h_o = d2 - c.qd;
    } else if (series) {
      y = soft_b * (d2 <= 0.0f ? ratio - 1.0f : __frcp_rn(ratio) - 1.0f);
      float l1p = 1.0f / 7.0f;  // ln(1 + y) / y = sum of (-y)^j / (j + 1), to y^6 / 7
      l1p = fmaf(l1p, y, -1.0f / 6.0f);
      l1p = fmaf(l1p, y, 1.0f / 5.0f);
      l1p = fmaf(l1p, y, -1.0f / 4.0f);
      l1p = fmaf(l1p, y, 1.0f / 3.0f);
      l1p = fmaf(l1p, y, -0.5f);
      l1p = fmaf(l1p, y, 1.0f);
      h_w = -y * l1p * LOG2E;
      h_o = d2 + h_w;
    } else {
      l2 = lg2(d2 <= 0.0f ? fmaf(soft_b, ratio, 1.0f - soft_b) : fmaf(1.0f - soft_b, ratio, soft_b));
      h_w = c.near ? -c.qd : -l2 - fmaxf(d2, 0.0f);  // (near only where STRAIGHT)
      h_o = c.near ? d2 - c.qd : fminf(d2, 0.0f) - l2;
    }
    const float h_p = mirrored ? h_o : h_w;  // lp - lm
    k.h = h_p - r.c_h;
    k.a = c.p * k.h;
    k.b = c.q * (mirrored ? h_w : h_o);
    // |d| >= 1 and b >= 1/6: the column's shares of the fast sums (not relative), (1 - beta) a +
    // beta b, are w H_b(d) itself (their linear parts, (1 - b) (w - m) + b (o - m), are 0), and
    // there they cancel by a factor of a few at most, the mixture's log is of a number at least
    // 1/10 from 1 (lg2's absolute error is small beside it) and the term is at least w H_b(+-1):
    // right to a few 1e-6 of the term (each >= 0, so the sum likewise), in 3 instructions where
    // the formula took 10 (it stays in the small-b variant, whose G may need its series)
    if (!SMALL) return LN2 * fmaf(r.beta, k.b, r.one_minus_beta * (c.p * h_p));
    if (!c.near) {
      if (series) {
        // |y| < 1/10: G(y) / y^2 = sum of (-y)^j / ((j + 1)(j + 2))
        float g = 1.0f / 56.0f;
        g = fmaf(g, y, -1.0f / 42.0f);
        g = fmaf(g, y, 1.0f / 30.0f);
        g = fmaf(g, y, -1.0f / 20.0f);
        g = fmaf(g, y, 1.0f / 12.0f);
        g = fmaf(g, y, -1.0f / 6.0f);
        g = fmaf(g, y, 0.5f);
        w_g = w * (y * y) * g;
      } else {  // m ln(m / w) - (m - w)
        w_g = fmaf(w + o_less_w, (l2 + fmaxf(d2, 0.0f)) * LN2, -o_less_w);
      }
    }
    return w_g;
  }
  // far: column's return, the fast sums' share where b >= 1/6, w G(y) in the small-b variant
  template <bool SMALL>
  __device__ static __forceinline__ float far_soft(const Column& c, const ColumnTerms&, const RowMath&, float soft_b,
                                                    float far) {
    return SMALL ? fmaf(soft_b, w_phi(c), -far) : far;  // H_b(d) = b Phi(d) - G(b (e^d - 1))
  }
  // lp - lm of the reference column (r.c_h 0), by column's own math; c_h is it
  template <bool SMALL>
  __device__ static __forceinline__ float ref_h(float s_ref, float t_ref, const RowMath& r, float soft_b,
                                                const SoftPoly& poly) {
    return column_terms<CODE, SMALL>(s_ref, t_ref, r, soft_b, poly).h;
  }
  __device__ static __forceinline__ float h_shift(float h_ref, const RowMath&) { return h_ref; }
  __device__ static __forceinline__ float grad_factor(const RowMath& r) {
    return r.w_soft_over_t * (r.one_minus_beta * LN2);
  }
  __device__ static __forceinline__ float grad_soft(float k, float p, float h, float kl) { return k * p * (h - kl); }
  __device__ static __forceinline__ float soft_bits(float a, float b, const RowMath& r) {
    return r.beta * b + r.one_minus_beta * a;
  }
  __device__ static __forceinline__ float unrounded_soft_bits(float2 n, float, float, const RowMath& r) {
    return soft_bits(n.x, n.y, r);
  }
  __device__ static __forceinline__ float precise_slope(float2 a_b, float soft_b, const RowMath& r) {
    return soft_b * (weight_is_q(r) ? a_b.x : a_b.y);
  }
  __device__ static __forceinline__ Category category(double lp, double lq, double beta, double one_minus_beta,
                                                      double log_beta, double log_one_minus_beta) {
    const double P = exp(lp), q = exp(lq);
    const double lm = log_add_exp(log_one_minus_beta + lp, log_beta + lq);
    const double u = P != 0.0 ? one_minus_beta * (lp - lm) : 0.0;
    return {beta * (q != 0.0 ? q * (lq - lm) : 0.0) + P * u, P * u, u};
  }
  __device__ static __forceinline__ double slot_dz(double P, double u_bar, const Category& cat, double) {
    return P * (cat.u - u_bar);
  }
  __device__ static __forceinline__ double rest_a(double u_bar, const Category& rest) { return rest.u - u_bar; }
  __device__ static __forceinline__ double rest_b(double) { return 0.0; }
};

template <>
struct Divergence<JSD> : Jsd<false> {};
template <>
struct Divergence<JSD_MIRRORED> : Jsd<true> {};

template <int M>
struct Mode {
  static constexpr int value = M;
};

// f(Mode<MODE>()) for the runtime mode: every divergence's code. MIRRORED_JSD: whether the kernel
// takes JSD_MIRRORED (the online loss's row kernels); the top-k's categories weigh by neither
// distribution, and its kernels take the JSD's code for every beta
template <bool MIRRORED_JSD = true, typename F>
__device__ __forceinline__ void mode_dispatch(int mode, F&& f) {
  if (mode == FORWARD_KL) {
    f(Mode<FORWARD_KL>());
    return;
  }
  if (mode == JSD) {
    f(Mode<JSD>());
    return;
  }
  if constexpr (MIRRORED_JSD) {
    if (mode == JSD_MIRRORED) {
      f(Mode<JSD_MIRRORED>());
      return;
    }
  }
  f(Mode<REVERSE_KL>());
}
