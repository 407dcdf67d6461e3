// The row work in three streaming kernels: the row statistics, the KL sums, then the row's
// results and its gradient columns. They run where the fused kernel cannot: under vocab
// parallelism (each rank holds columns [v0, v0 + vt) of every row, student columns
// [v0, v0 + vs), and the driver combines the ranks' statistics and KL sums over NCCL between the
// phases), and on one GPU where the teacher's vocabulary is wider than a cluster holds. One CTA
// of THREADS per row, 16-byte loads, partial sums merged in a fixed order. Instantiated by
// jsdgpu/cuda/kernels.py (THREADS stated there).
//
// stats [8, rows]: the maxima of s, z and t; the sums of exp(x - max) of s, z (with this
// rank's pad columns) and t; the target logit where this rank owns the label (else 0); the t of
// the column of the largest s (the reference column of a sharp or saturated row where
// RELATIVE_H: row_math.cuh, "A sharp row"; combined over the ranks, the t of the rank that holds
// the largest s).
// kl [6, rows]: the fast sums a (relative to the reference column where RELATIVE_H) and b, the
// precise sum and its weights' sum (column_terms), the sums of p and of q.
// Both kernels take the columns' small-b variant (column_terms<MODE, true>: phase_column_terms):
// its check of the series in every column costs little here, where they are not the common path.
// target: the label's column in this rank's shard, -1 where not owned (or none).
#include "reduce.cuh"
#include "row_math.cuh"

// Columns i..i+3 of the row: the biased student (NEG_INF past ns) and teacher logits. i < n and
// i is a multiple of 4; the rows and biases are padded to a multiple of 4, so a float4 at i < ns
// (i < n) stays inside the student (teacher) row.
__device__ __forceinline__ void load_columns(const float* srow, const float* trow, const float* bias_s,
                                             const float* bias_t, int i, int ns, float s[4], float t[4]) {
  float4 t4 = *reinterpret_cast<const float4*>(trow + i);
  if (bias_t) {
    t4 = add4(t4, *reinterpret_cast<const float4*>(bias_t + i));
  }
  t[0] = t4.x; t[1] = t4.y; t[2] = t4.z; t[3] = t4.w;
  float4 s4 = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
  if (i < ns) {
    s4 = *reinterpret_cast<const float4*>(srow + i);
    if (bias_s) {
      s4 = add4(s4, *reinterpret_cast<const float4*>(bias_s + i));
    }
  }
  s[0] = s4.x; s[1] = s4.y; s[2] = s4.z; s[3] = s4.w;
}

// The logsumexp parts of x[k] * scale over the first count of four values
__device__ __forceinline__ Lse lse_of4(const float x[4], float scale, int count) {
  float m = NEG_INF;
  for (int k = 0; k < 4; ++k)
    if (k < count) m = fmaxf(m, x[k] * scale);
  float s = 0.0f;
  for (int k = 0; k < 4; ++k)
    if (k < count) s += __expf(x[k] * scale - m);
  Lse r = {m, s};
  return r;
}

#define PHASE_ROW_ARGS                                                                                    \
  const float *S, long long lds, const float *Tl, long long ldt, const float *bias_s, const float *bias_t, \
      const int *target, int vs, int vt, float inv_temp, int rows

// Phase 1: this rank's part of the row statistics.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) phase_stats(PHASE_ROW_ARGS, float* stats) {
  const long long row = blockIdx.x;
  const float *srow = S + row * lds, *trow = Tl + row * ldt;
  const int y = target[row];
  const bool tempered = inv_temp != 1.0f;
  Stats st = stats_empty();
  for (int i = 4 * threadIdx.x; i < vt; i += 4 * THREADS) {
    float s[4], t[4];
    load_columns(srow, trow, bias_s, bias_t, i, vs, s, t);
    const int cs = max(0, min(4, vs - i)), ct = min(4, vt - i);
    st.s = lse_merge(st.s, lse_of4(s, 1.0f, cs));
    if (tempered) st.z = lse_merge(st.z, lse_of4(s, inv_temp, cs));
    st.t = lse_merge(st.t, lse_of4(t, inv_temp, ct));
    if (y >= i && y < i + cs) st.target_logit = s[y - i];
    for (int k = 0; k < cs; ++k) ref_take(st, s[k], t[k]);
  }
  Stats r = block_merge<THREADS>(st, stats_empty(), stats_warp_merge, stats_warp_merge);
  if (threadIdx.x == 0) {
    if (!tempered) r.z = r.s;
    if (vt > vs) {  // this rank's pad columns: z = 0, vt - vs of them
      Lse pad = {0.0f, (float)(vt - vs)};
      r.z = lse_merge(r.z, pad);
    }
    const float v[8] = {r.s.m, r.z.m, r.t.m, r.s.s, r.z.s, r.t.s, r.target_logit, r.ref_t};
    for (int k = 0; k < 8; ++k) stats[k * (long long)rows + row] = v[k];
  }
}

// A column's terms (column_terms, the small-b variant), with h and a exactly 0 where RELATIVE_H in
// a column whose logits are the reference column's s_ref, t_ref (its h is h_ref itself): a row's
// a (phase_kl) and its columns' h (phase_finish) are made in two kernels, whose h of one column
// may differ in their last bits, and a saturated row's gradient at that column is h less kl, at
// first order (the fused kernel makes both in one pass)
template <int MODE>
__device__ __forceinline__ ColumnTerms phase_column_terms(float s, float t, const RowMath& rm, float soft_b,
                                                          const SoftPoly& poly, float s_ref, float t_ref) {
  ColumnTerms c = column_terms<MODE, true>(s, t, rm, soft_b, poly);
  if (Divergence<MODE>::RELATIVE_H && s == s_ref && t == t_ref) c.h = c.a = 0.0f;
  return c;
}

// The row's RowMath from the statistics combined over all ranks (its c_h: take_reference's, from
// the reference column, the largest s (stats[0]) and its t (stats[7]), in each kernel's mode)
__device__ __forceinline__ RowMath phase_row_math(const float* stats, long long row, int rows, float inv_temp,
                                                  float beta, float one_minus_beta, float w_hard,
                                                  float w_soft_over_t) {
  const float* st = stats + row;
  return {inv_temp * LOG2E,
          st[0] + logf(st[3 * (long long)rows]),
          (st[(long long)rows] + logf(st[4 * (long long)rows])) * LOG2E,
          (st[2 * (long long)rows] + logf(st[5 * (long long)rows])) * LOG2E,
          0.0f, beta, one_minus_beta, w_hard, w_soft_over_t};
}

// Phase 2: this thread's part of the row's sums (column_terms): the fast a and b, the precise
// sum and its weights' sum, and the sums of p and of q.
template <int THREADS>
struct RowSums {
  const float *srow, *trow, *bias_s, *bias_t;
  int vs, vt;
  RowMath rm;
  float soft_b, s_ref, t_ref;  // the reference column's logits
  SoftPoly poly;
  float4 sums;  // a, b, precise, weights
  float2 pq;    // the sums of p and of q

  template <int MODE>
  __device__ __forceinline__ void operator()(Mode<MODE>) {
    take_reference<MODE, true>(s_ref, t_ref, rm, soft_b, poly);
    for (int i = 4 * threadIdx.x; i < vt; i += 4 * THREADS) {
      float s[4], t[4];
      load_columns(srow, trow, bias_s, bias_t, i, vs, s, t);
      for (int k = 0; k < 4 && i + k < vt; ++k) {
        const ColumnTerms c = phase_column_terms<MODE>(i + k < vs ? s[k] : 0.0f, t[k], rm, soft_b, poly, s_ref, t_ref);
        sums = make_float4(sums.x + c.a, sums.y + c.b, sums.z + c.soft, sums.w + c.w);
        pq = make_float2(pq.x + c.p, pq.y + c.q);
      }
    }
  }
};

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
    phase_kl(PHASE_ROW_ARGS, int mode, float beta, float one_minus_beta, float soft_b, SOFT_POLY_PARAMS,
             const float* stats, float* kl) {
  const long long row = blockIdx.x;
  RowSums<THREADS> f = {S + row * lds, Tl + row * ldt, bias_s, bias_t, vs, vt,
                        phase_row_math(stats, row, rows, inv_temp, beta, one_minus_beta, 0.0f, 0.0f),
                        soft_b, stats[row], stats[7 * (long long)rows + row], SOFT_POLY_OF_PARAMS,
                        make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float2(0.0f, 0.0f)};
  mode_dispatch(mode, f);
  const float4 sums = block_merge<THREADS>(f.sums, make_float4(0.0f, 0.0f, 0.0f, 0.0f), sums_warp_merge<32, float4>,
                                           sums_warp_merge<tree_lanes(THREADS / 32), float4>);
  __syncthreads();  // block_merge's shared memory, used again
  const float2 pq = block_merge<THREADS>(f.pq, make_float2(0.0f, 0.0f), sums_warp_merge<32, float2>,
                                         sums_warp_merge<tree_lanes(THREADS / 32), float2>);
  if (threadIdx.x == 0) {
    const float v[6] = {sums.x, sums.y, sums.z, sums.w, pq.x, pq.y};
    for (int k = 0; k < 6; ++k) kl[k * (long long)rows + row] = v[k];
  }
}

// Phase 3: the row's CE and JSD values (every rank the same), and this rank's gradient columns.
template <int OUT, int THREADS>
struct Finish {
  const float *srow, *trow, *bias_s, *bias_t;
  int vs, y;
  long long row;
  RowMath rm;
  float soft_b, target_logit, s_ref, t_ref;  // the reference column's logits
  float sum_s;    // s's statistic's sum, over its largest logit s_ref
  SoftPoly poly;  // (its Q: the gradient's h where |d| < 1)
  float4 sums;  // phase_kl's, over every rank: a, b, precise, weights
  float2 pq;    // the sums of p and q
  float *ce_out, *jsd_out, *label_terms;
  void* G;
  long long ldg;

  template <int MODE>
  __device__ __forceinline__ void operator()(Mode<MODE>) {
    const float h_ref = take_reference<MODE, true>(s_ref, t_ref, rm, soft_b, poly);
    // the fast sums for the distributions as computed, normalized (where the fused kernel corrects
    // them by the logsumexps' recovered roundings): kl, the gradient's, is a_n (relative as h is)
    const float a_n = sums.x / pq.x, b_n = sums.y / pq.y;
    const float fast = Divergence<MODE>::soft_bits(h_ref + a_n, b_n, rm);
    const bool label_apart = G != nullptr && y >= 0 && label_dominates(target_logit, rm.lse_s);
    if (threadIdx.x == 0)
      write_row_results(row, target_logit, row_soft(fast, sums.z, sums.w), label_apart, rm, G != nullptr, ce_out,
                        jsd_out, label_terms);
    if (G == nullptr) return;
    for (int i = 4 * threadIdx.x; i < vs; i += 4 * THREADS) {
      float s[4], t[4], g[4];
      load_columns(srow, trow, bias_s, bias_t, i, vs, s, t);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const ColumnTerms c = phase_column_terms<MODE>(s[k], t[k], rm, soft_b, poly, s_ref, t_ref);
        // softmax(s) from its own logsumexp: the rank cannot see whether another has pad columns.
        // At the label, which may hold nearly all the row's mass, its term over the sum that
        // holds it (as the fused kernel's FusedRow::passes), so that p - 1 is right to the sum's
        // roundings, not off by the logsumexp's
        const bool label = i + k == y;
        const float softmax = label ? __expf(s[k] - s_ref) / sum_s : softmax_of(s[k], rm);
        g[k] = grad_value<MODE, false>(softmax, c.p, c.h, label && !label_apart ? 1.0f : 0.0f, a_n, rm);
      }
      const int count = min(4, vs - i);
      store4<OUT>(G, row * ldg + i, g, count);
    }
  }
};

template <int OUT, int THREADS>
__global__ void __launch_bounds__(THREADS)
    phase_finish(PHASE_ROW_ARGS, int mode, float beta, float one_minus_beta, float soft_b, SOFT_POLY_PARAMS,
                 float w_hard, float w_soft_over_t, const float* stats, const float* kl, float* ce_out, float* jsd_out,
                 void* G, long long ldg, float* label_terms) {
  const long long row = blockIdx.x;
  const RowMath rm = phase_row_math(stats, row, rows, inv_temp, beta, one_minus_beta, w_hard, w_soft_over_t);
  const long long n = rows;
  Finish<OUT, THREADS> f = {S + row * lds, Tl + row * ldt, bias_s, bias_t, vs, target[row], row, rm, soft_b,
                            stats[6 * n + row], stats[row], stats[7 * n + row], stats[3 * n + row], SOFT_POLY_OF_PARAMS,
                            make_float4(kl[row], kl[n + row], kl[2 * n + row], kl[3 * n + row]),
                            make_float2(kl[4 * n + row], kl[5 * n + row]),
                            ce_out, jsd_out, label_terms, G, ldg};
  mode_dispatch(mode, f);
}
