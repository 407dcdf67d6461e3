// One row of the fused kernel (fused_rows.cu) in one thread: its columns (in registers, and
// past GROUPS in shared memory), the row's statistics, and passes 2 and 3 over them.
#pragma once

#include "ptx.cuh"
#include "reduce.cuh"
#include "row_math.cuh"

template <int OUT, int CLUSTER, int THREADS, int GROUPS, int EXTRA>
struct FusedRow {
  static constexpr int WARPS = THREADS / 32;
  static constexpr int ALL = GROUPS + EXTRA;  // the thread's float4 groups: GROUPS in registers, EXTRA in shared memory
  float4 s[GROUPS], t[GROUPS];  // student logits (later p where softmax(s) == p), teacher (later h;
                                // relative to h_ref where RELATIVE_H: row_math.cuh, "A sharp row");
                                // with the student's model, p and forward KL's h (p - q) times the
                                // model's derivative (passes)
  float soft_b;                 // the JSD's b (row_math.cuh, column_terms)
  int n, ns, lo, label_column;  // label_column: the label's column in the slice if its one-hot
                                // term goes into G, else -1
  long long row;
  unsigned rank;
  RowMath rm;
  bool label_apart, softmax_is_p;
  // the student's model (LossOptions.models): the gradient in its raw logits is the gradient in z
  // times model_derivative (common.cuh), applied where with_model: folded into p (and forward KL's
  // q) in pass 2 where softmax(s) == p (passes' FOLD), so that pass 3 needs neither z nor an exp;
  // else in pass 3
  float model_scale, model_inv_cap;
  bool with_model;
  float *ce_out, *jsd_out, *label_terms;
  void* G;
  long long ldg;
  float4* inbox_sums;  // the cluster's CTAs' sums (a, b, precise, weights), by rank (pushed
                       // there); then this row's eps_z, eps_t
  unsigned sums_bar, parity;  // their mbarrier, and the parity of this row's phase

  __device__ __forceinline__ int column(int k) const { return 4 * (threadIdx.x + k * THREADS); }

  // Group k of s (m 0) or t (m 1): a register's below GROUPS; past them the thread's own slot of
  // shared memory (after the next row's copy), which no other thread touches. k is a constant in
  // every (unrolled) use, so each access is one or the other (the register index is clamped only
  // so that the branch not taken stays in bounds).
  __device__ __forceinline__ static float4& extra_slot(int k, int m) {
    extern __shared__ float4 dynamic_smem[];
    return dynamic_smem[(2 * ALL + 2 * (k - GROUPS) + m) * THREADS + threadIdx.x];
  }
  __device__ __forceinline__ static float& extra_value(int k, int m, int j) {
    return reinterpret_cast<float*>(&extra_slot(k, m))[j];
  }
  __device__ __forceinline__ float4 S(int k) const { return k < GROUPS ? s[k < GROUPS ? k : 0] : extra_slot(k, 0); }
  __device__ __forceinline__ float4 T(int k) const { return k < GROUPS ? t[k < GROUPS ? k : 0] : extra_slot(k, 1); }
  __device__ __forceinline__ void set_s(int k, float4 v) {
    if (k < GROUPS) s[k < GROUPS ? k : 0] = v; else extra_slot(k, 0) = v;
  }
  __device__ __forceinline__ void set_t(int k, float4 v) {
    if (k < GROUPS) t[k < GROUPS ? k : 0] = v; else extra_slot(k, 1) = v;
  }

  // stats: the row's statistics in shared memory (row_values). What only the results and pass 3
  // need of them (lse_s, the label's logit, h_ref) is read once the sums are in:
  // held in registers through pass 2, they left the kernel closer to spilling (it has 64 a
  // thread). poly: the precise sum's polynomial (row_math.cuh), from kernel parameters.
  // FOLD (only where SOFTMAX_IS_P and with_model): the model's derivative folded into p and q in
  // pass 2; a variant of its own, so that the other rows' pass 2 holds no multiply by it
  template <int MODE, bool SOFTMAX_IS_P, bool FOLD>
  __device__ __forceinline__ void passes(const float* stats, const SoftPoly& poly) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // 2. the fast sums a and b (a_rel where RELATIVE_H), the precise sum and its weights' sum; t
    //    becomes h, and s becomes p where softmax(s) == p (no temperature, no pad), so that pass 3
    //    needs no exp (with the student's model, p and q times its derivative at z, which pass 3
    //    then no longer needs)
    const float4 sums4 = Divergence<MODE>::SMALL_B && soft_b < SMALL_B_BELOW
                             ? column_sums<MODE, SOFTMAX_IS_P, FOLD, true>(poly)
                             : column_sums<MODE, SOFTMAX_IS_P, FOLD, false>(poly);
    const float4 mine = block_merge<THREADS>(sums4, make_float4(0.0f, 0.0f, 0.0f, 0.0f), sums_warp_merge<32, float4>,
                                             sums_warp_merge<tree_lanes(WARPS > CLUSTER ? WARPS : CLUSTER), float4>);
    // this CTA's sums, pushed to every CTA (lane r to rank r)
    if (warp == 0 && lane < CLUSTER) push4(smem_addr(inbox_sums + rank), mine, sums_bar, lane);
    // The cluster's sums: every warp that needs them waits for them and merges them itself (the
    // same tree, so the same bits), with no block barrier behind one warp's merge. Without G only
    // warp 0 needs them (for the row's results); the others go on to the next row.
    if (G == nullptr && warp != 0) return;
    mbar_wait(sums_bar, parity);
    float4 sums = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (lane < CLUSTER) sums = ld_shared4(smem_addr(inbox_sums) + 16 * lane_id());
    sums = sums_warp_merge<32>(sums);  // the other lanes hold zeros: every lane gets the CLUSTER lanes' tree's bits
    const float4 eps = inbox_sums[CLUSTER];  // the logsumexps' roundings (row_math.cuh, unrounded_sums)
    // r.x: a_n (where RELATIVE_H kl_rel, and a_n = h_ref + kl_rel)
    const float2 r = unrounded_sums<MODE>(sums.x, sums.y, eps.x, eps.y);
    rm.lse_s = stats[0];
    if (warp == 0 && lane == 0 && rank == 0) {
      const float2 n = make_float2(Divergence<MODE>::RELATIVE_H ? stats[6] + r.x : r.x, r.y);  // a_n (not relative), b_n
      const float fast = Divergence<MODE>::unrounded_soft_bits(n, eps.x, eps.y, rm);
      const float precise = unrounded_precise<MODE>(sums.z, n, eps.x, eps.y, soft_b, rm);
      write_row_results(row, stats[3], row_soft(fast, precise, sums.w), label_apart, rm, G != nullptr, ce_out,
                        jsd_out, label_terms);
      if (label_apart && with_model) label_terms[row] *= model_derivative(stats[3], model_scale, model_inv_cap);
    }
    // 3. the gradient row: the loop writes the groups of 4 student columns, without the
    //    label's one-hot term; after it, the thread that holds them writes the group that ends
    //    inside a float4 (where ns % 4 != 0) and, where the one-hot term goes into G, the label's
    //    value over its group's. So the loop holds one check per group. Group k's values go to
    //    g0 + 4 k THREADS: offsets the stores take as immediates.
    if (G != nullptr) {
      const float kl = r.x;  // a_n; kl_rel where h is relative
      const long long g0 = row * ldg + lo + column(0);
      const int ns4 = ns & ~3;
#pragma unroll
      for (int k = 0; k < ALL; ++k) {
        if (column(k) >= ns4) continue;
        float out[4];
        gradient<MODE, SOFTMAX_IS_P>(k, kl, -1, out);
        store4<OUT>(G, g0 + 4 * k * THREADS, out, 4);
      }
      if (label_column >= 0 || ns4 != ns) {
        // the label's one-hot term, times the model's derivative there where it is folded into p
        const float one = FOLD ? model_derivative(stats[3], model_scale, model_inv_cap) : 1.0f;
#pragma unroll
        for (int k = 0; k < ALL; ++k) {
          const int c = column(k);
          const bool tail = c == ns4 && ns4 != ns, label = (label_column & ~3) == c;
          if (!tail && !label) continue;
          // softmax(s) at the label, which holds most of the row's mass here, from s's statistic:
          // its own term over the sum that holds that very term, so that p - 1 is right to the
          // sum's roundings (a few 1e-7). From the logsumexp rounded to float32 it was off by
          // that rounding, relatively: 2^-24 of a logsumexp of a hundred bits, 4e-6 in p - 1
          const float label_softmax =
              label ? one * (ex2(fmaf(stats[3], LOG2E, -stats[7])) * __frcp_rn(stats[8])) : 0.0f;
          float out[4];
          gradient<MODE, SOFTMAX_IS_P>(k, kl, label ? label_column - c : -1, out, one, label_softmax);
          if (tail) {
            store4<OUT>(G, g0 + 4 * k * THREADS, out, ns & 3);  // the columns c + [0, ns - c)
          } else {
            const float value = component(make_float4(out[0], out[1], out[2], out[3]), label_column - c);
            store4<OUT>(G, g0 + 4 * k * THREADS + (label_column - c), &value, 1);
          }
        }
      }
    }
  }

  // One column of pass 2: its terms added to sums; returns what pass 3 reads in its place, (p, h)
  // (with FOLD, p and forward KL's h, q, times the model's derivative at z)
  template <int MODE, bool FOLD, bool SMALL_B, bool STRAIGHT>
  __device__ __forceinline__ float2 column_sum(float z, float t, float4& sums, const SoftPoly& poly) const {
    const ColumnTerms c = column_terms<MODE, SMALL_B, STRAIGHT>(z, t, rm, soft_b, poly);
    sums = make_float4(sums.x + c.a, sums.y + c.b, sums.z + c.soft, sums.w + c.w);
    const float derivative = FOLD ? model_derivative(z, model_scale, model_inv_cap) : 1.0f;
    return make_float2(FOLD ? c.p * derivative : c.p, FOLD && !Divergence<MODE>::GRAD_OF_P ? c.h * derivative : c.h);
  }

  // Pass 2 over the thread's columns: their sums (column_terms); t becomes h, and s p where
  // SOFTMAX_IS_P (with FOLD, p and forward KL's h, q, times the model's derivative at z)
  template <int MODE, bool SOFTMAX_IS_P, bool FOLD, bool SMALL_B>
  __device__ __forceinline__ float4 column_sums(const SoftPoly& poly) {
    float4 sums = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k < ALL; ++k) {
      if (column(k) >= n) continue;
      if (k >= GROUPS) {  // column by column from and to shared memory: a float4 of s and t and their
                          // results held at once took 16 registers more, and the JSD spilled.
                          // With branches (column_terms' STRAIGHT false), and in the KLs one column
                          // at a time: each other way some mode spilled (here or under NVRTC 13.5:
                          // tests/test_cuda_sources.py)
#pragma unroll((MODE == JSD || MODE == JSD_MIRRORED) ? 4 : 1)
        for (int j = 0; j < 4; ++j) {
          const float2 ph = column_sum<MODE, FOLD, SMALL_B, false>(extra_value(k, 0, j), extra_value(k, 1, j), sums, poly);
          extra_value(k, 1, j) = ph.y;
          if (SOFTMAX_IS_P) extra_value(k, 0, j) = ph.x;
        }
        continue;
      }
      const float4 s4 = S(k), t4 = T(k);
      const float sv[4] = {s4.x, s4.y, s4.z, s4.w}, tv[4] = {t4.x, t4.y, t4.z, t4.w};
      float pv[4], hv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 ph = column_sum<MODE, FOLD, SMALL_B, true>(sv[j], tv[j], sums, poly);
        pv[j] = ph.x;
        hv[j] = ph.y;
      }
      set_t(k, make_float4(hv[0], hv[1], hv[2], hv[3]));
      if (SOFTMAX_IS_P) set_s(k, make_float4(pv[0], pv[1], pv[2], pv[3]));
    }
    return sums;
  }

  // The gradient values of group k; its value j_label (if 0..3) with the label's one-hot term
  // (one: its value, 1 or the model's derivative there; label_softmax: softmax(s) there, times
  // one: passes).
  template <int MODE, bool SOFTMAX_IS_P>
  __device__ __forceinline__ void gradient(int k, float kl, int j_label, float out[4], float one = 1.0f,
                                           float label_softmax = 0.0f) const {
    const float4 s4 = S(k), h4 = T(k);
    const float sv[4] = {s4.x, s4.y, s4.z, s4.w}, hv[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p = SOFTMAX_IS_P ? sv[j] : ex2(fmaf(sv[j], rm.scale2, -rm.lse_z2));
      const float softmax = j == j_label ? label_softmax : SOFTMAX_IS_P ? p : softmax_of(sv[j], rm);
      out[j] = grad_value<MODE, SOFTMAX_IS_P>(softmax, p, hv[j], j == j_label ? one : 0.0f, kl, rm);
    }
    if (!SOFTMAX_IS_P && with_model) {  // sv: z (where SOFTMAX_IS_P, pass 2 folded it into p)
#pragma unroll
      for (int j = 0; j < 4; ++j) out[j] *= model_derivative(sv[j], model_scale, model_inv_cap);
    }
  }
};
