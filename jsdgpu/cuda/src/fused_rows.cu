// The fused row kernel: one thread-block cluster per token row, the row held in registers, all
// of a row's work done with one read of its logits. Instantiated by jsdgpu/cuda/kernels.py as
// fused_rows<MODE, OUT, CLUSTER, THREADS, GROUPS, EXTRA, MIN_CTAS> (the shape stated in sources.py,
// once); the row in a thread is fused_row.cuh's FusedRow.
#include "fused_row.cuh"

// ---- the fused kernel ----
//
// A thread-block cluster of CLUSTER CTAs works on one token row at a time. CTA r holds the row's
// columns r * slice + [0, slice) (slice: a multiple of 4), and its thread i holds GROUPS float4
// groups of them in registers and EXTRA more in its own slots of shared memory (a shape for
// vocabularies a little wider than the registers hold): group k is the CTA's columns
// 4 (i + k THREADS) + [0, 4). The passes, (1) the row statistics, (2) the soft part's sums
// (row_math.cuh, column_terms: the fast ones and the precise one at once, so that every row's
// divergence, small or large, is right after this one pass), (3) the gradient row, work on those
// only; each logit crosses HBM once (8 bytes in, 2 or 4 bytes of gradient out).
//
// The grid holds only as many clusters as fit the GPU at once, and each takes rows until none
// is left: while it works on one row, the next one's columns are on their way into shared memory
// (one bulk copy per matrix and CTA). Rows are handed out as they are asked for, not in a
// fixed stride (a cluster that runs slower, such as one whose CTAs share SMs with one another,
// takes fewer rows; with a fixed stride the slowest cluster set the kernel's time): cluster c
// takes rows c and c + clusters first; from then on, at the start of each row, rank 0 takes the
// row after the next one from *row_counter (zero at launch) and pushes it with its statistics,
// so every CTA knows the next row a whole row ahead, when its copy must start.
// The CTAs exchange partial results by pushing them into one another's shared memory
// (st.async, counted by an mbarrier), not through cluster barriers: in the profile of that
// version a fifth of the stall samples were at those barriers.
// Partial results are merged in a fixed order: lanes by xor trees (every lane gets the same
// bits), warps by one warp (a warp per statistic, warp 0 for the KL sums), then the cluster's
// CTAs by rank (the statistics by those warps, the KL sums by every warp that needs them). So
// every CTA holds the same bits, on every run.
//
// S [rows, lds], Tl [rows, ldt]: float32 logits without bias (lds, ldt multiples of 4: a row's
// float4 at a column below round4(v) is inside its padded row). bias_s, bias_t: float32 biases
// padded with zeros to a multiple of 4, or null. scale_s, cap_s, inv_cap_s (the student's) and
// scale_t, cap_t, inv_cap_t (the teacher's): the models' logits (LossOptions.models; common.cuh,
// model_logit; a cap of 0: none), made from the biased logits as a row is loaded; the passes work
// on them, and G is the gradient in the student's raw logits (times model_derivative). G [rows,
// ldg] in OUT's format, or null for the loss alone: the gradient with respect to the student
// logits, without the 1/N of the mean. Where
// softmax(s)[y] < 1/2 the label's one-hot term -w_hard dominates G[y] and would be rounded with
// it to 16 bits: it is left out of G and written to label_terms[row] instead (else 0), for the
// caller to add exactly (label_scatter). CLUSTER * slice >= vt, slice <= 4 * THREADS * (GROUPS + EXTRA).
// G may be S's own memory (so S and G are not __restrict__): a row's gradient goes over its
// student logits, which every CTA of the cluster has read by then (each pushed its KL sums after
// reading its part of the row, and pass 3 comes after every CTA's sums are in).
//
// Columns past the CTA's part of the row hold -inf in s and t (2^-inf = 0: no bounds checks in
// the passes); student columns past vs (the teacher's pad) hold -inf for the statistics, then 0
// (z = 0) for the JSD sums.


template <int MODE, int OUT, int CLUSTER, int THREADS, int GROUPS, int EXTRA>
__device__ __forceinline__ void fused_rows_body(const float* S, long long lds, const float* __restrict__ Tl,
                                         long long ldt, const float* __restrict__ bias_s,
                                         const float* __restrict__ bias_t, const int* __restrict__ target, int vs,
                                         int vt, int slice, int rows, float inv_temp, float beta,
                                         float one_minus_beta,
                                         float w_hard, float w_soft_over_t, float* __restrict__ ce_out,
                                         float* __restrict__ jsd_out, void* G, long long ldg,
                                         float* __restrict__ label_terms, int* __restrict__ row_counter,
                                         float scale_s, float cap_s, float inv_cap_s, float scale_t, float cap_t,
                                         float inv_cap_t, float soft_b, const SoftPoly& poly) {
  static_assert(CLUSTER < 32, "lane CLUSTER of warp 2 holds the pad columns' part of z");
  static_assert(THREADS >= 128, "warps 0, 1 and 2 merge one statistic each; a thread of warp 3 copies");
  constexpr int WARPS = THREADS / 32;
  constexpr int COPIER = 96;  // the thread that starts the copies: in warp 3, which merges nothing
  // The next row's part of this CTA, copied ahead while this row is worked on: the student's
  // (GROUPS + EXTRA) * THREADS float4s, then the teacher's, each in the order of its columns, so
  // that float4 k * THREADS + i is thread i's group k; after them this row's extra groups
  // (FusedRow::extra_slot).
  extern __shared__ float4 next_row[];
  __shared__ Lse warp_lse[3][WARPS];
  __shared__ float2 warp_ref[WARPS];  // each warp's largest student logit, and the teacher's there
  __shared__ float target_logit;  // in the CTA that holds the label's column
  // The cluster's CTAs push their partial results here: the statistics by statistic (s, t with
  // the label's logit, z where it is apart, then where RELATIVE_H each CTA's largest student logit
  // and the teacher's there), then rank; then the KL sums, by rank. Row i + 1's
  // pushes cannot come before this CTA has read row i's: a CTA pushes its statistics of row i + 1
  // only after it has all sums of row i, this CTA's among them, pushed after it read the
  // statistics of row i; likewise for the sums.
  // inbox_sums[CLUSTER]: this CTA's own slot, of the row's logsumexps' rounding errors (eps_z, eps_t),
  // written before the barrier after the statistics' merge, read after the sums' exchange: the
  // next row's comes after that row's first barrier, which every warp reaches after this row
  __shared__ float4 inbox_stats[4 * CLUSTER], inbox_sums[CLUSTER + 1];
  __shared__ unsigned long long bars[3];  // their mbarriers, and the copies': one phase per row
  // the cluster's statistics, for every thread: lse_s (nats), lse_z2, lse_t2, the label's logit,
  // the reference column's s and t, h_ref (RELATIVE_H: row_math.cuh, "A sharp row"), and the
  // max (in bits) and sum of s's statistic (FusedRow::passes: softmax(s) at the label)
  __shared__ float row_values[9];
  // The row after this one (rows_queued[parity ^ 1]) and the one after that (rows_queued[parity],
  // from rank 0 with the statistics), for every thread: read from here where they are needed
  // rather than held in registers through the passes (ptxas spilled them)
  __shared__ int rows_queued[2];
  // vt - vs, read from here by the one lane that needs it: held in a register through the loop,
  // it was spilled in jsd_rows_f32
  __shared__ float pad_columns;

  FusedRow<OUT, CLUSTER, THREADS, GROUPS, EXTRA> f;
  constexpr int ALL = GROUPS + EXTRA;
  const unsigned rank = cluster_ctarank();
  const int lo = rank * slice;
  const int n = max(0, min(slice, vt - lo));  // this CTA's columns: lo + [0, n)
  const int ns = max(0, min(n, vs - lo));     // of which student columns: lo + [0, ns)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool tempered = inv_temp != 1.0f;
  const bool z_apart = tempered || vt > vs;  // z = s / T is not s: it has a temperature or pad columns
  const float scale2 = inv_temp * LOG2E;
  // shared-memory addresses of this thread's group 0 there; group k is k * THREADS float4s on
  const unsigned next_s = smem_addr(next_row + threadIdx.x), next_t = next_s + 16 * ALL * THREADS;
  f.n = n;
  f.ns = ns;
  f.lo = lo;
  f.rank = rank;
  // softmax(z) is p: pass 3 takes p (with the model's derivative folded in) where pass 2 leaves it
  f.softmax_is_p = !tempered && vt == vs;
  f.with_model = scale_s != 1.0f || cap_s != 0.0f;
  f.model_scale = scale_s;
  f.model_inv_cap = inv_cap_s;
  f.ce_out = ce_out;
  f.jsd_out = jsd_out;
  f.label_terms = label_terms;
  f.soft_b = soft_b;
  f.G = G;
  f.ldg = ldg;
  f.inbox_sums = inbox_sums;
  f.sums_bar = smem_addr(bars + 1);
  const unsigned stats_bar = smem_addr(bars), copy_bar = smem_addr(bars + 2);
  if (threadIdx.x == 0) {
    mbar_init(stats_bar, 1);
    mbar_init(f.sums_bar, 1);
    mbar_init(copy_bar, 1);
    pad_columns = vt - vs;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The copies fill only the slots of next_row that hold the CTA's columns; the others hold -inf
  // from here on, so that the loads below need no bounds checks.
  const float4 none4 = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
#pragma unroll
  for (int k = 0; k < ALL; ++k) {
    if (f.column(k) >= ns) next_row[k * THREADS + threadIdx.x] = none4;
    if (f.column(k) >= n) next_row[(ALL + k) * THREADS + threadIdx.x] = none4;
  }
  cluster_sync();  // every CTA's mbarriers are ready before any push
  // One bulk copy per matrix (the Tensor Memory Accelerator's, by COPIER, once every thread has
  // read the previous row from next_row), completed on copy_bar: per thread, a copy of its own
  // columns took 7 instructions per float4 in address arithmetic. A part that ends inside a float4
  // is copied to the float4's end (inside the padded row); the load below sets the rest to -inf.
  const unsigned t_bytes = 16 * ((n + 3) / 4), s_bytes = 16 * ((ns + 3) / 4);
  auto copy_ahead = [&](int row) {
    fence_proxy_async();  // the CTA's reads of next_row (before a barrier) come before the copies
    mbar_expect_bytes(copy_bar, t_bytes + s_bytes);
    if (s_bytes != 0) bulk_copy(smem_addr(next_row), S + row * lds + lo, s_bytes, copy_bar);
    if (t_bytes != 0) bulk_copy(smem_addr(next_row + ALL * THREADS), Tl + row * ldt + lo, t_bytes, copy_bar);
  };
  // Rare, and the same in every row: biases, the models' logits (scaled, soft-capped: as
  // gradient_sums.cu's model_logits makes them), or a slice that ends inside a float4 of columns
  // (whose values past the end must be -inf).
  const bool model_t = scale_t != 1.0f || cap_t != 0.0f;
  // The row's RowMath from its statistics in row_values (lse_s: set by passes; c_h 0)
  auto row_math = [&]() {
    return RowMath{scale2, 0.0f, row_values[1], row_values[2], 0.0f, beta, one_minus_beta, w_hard, w_soft_over_t};
  };
  const bool adjust = bias_s != nullptr || bias_t != nullptr || n % 4 != 0 || ns % 4 != 0 || f.with_model || model_t;

  // This cluster's row and the next one: the first two by its index, then from row_counter.
  const int clusters = gridDim.x / CLUSTER;
  int row = blockIdx.x / CLUSTER;
  if (threadIdx.x == 0) rows_queued[1] = row + clusters;  // read after the loop's first barrier
  if (threadIdx.x == COPIER && row < rows) copy_ahead(row);
  for (unsigned parity = 0; row < rows; parity ^= 1) {
    int after = 0;  // the row after next: thread 0 of rank 0 takes it; every CTA gets it below
    if (threadIdx.x == 0) {  // the one arrival of this row's phases; the pushes bring the bytes
      mbar_expect_bytes(stats_bar, ((z_apart ? 3 : 2) + (Divergence<MODE>::RELATIVE_H)) * CLUSTER * sizeof(float4));
      mbar_expect_bytes(f.sums_bar, CLUSTER * sizeof(float4));
      // 2 * clusters, from gridDim.x read again here (kept from above, ptxas spilled it)
      if (rank == 0) after = 2 * (grid_ctas() / CLUSTER) + atomicAdd(row_counter, 1);
    }
    const int y = target[row];
    mbar_wait(copy_bar, parity);
    // 0. the thread's columns into registers (-inf past the ends), with their biases
#pragma unroll
    for (int k = 0; k < ALL; ++k) {
      f.set_s(k, ld_shared4(next_s + 16 * k * THREADS));
      f.set_t(k, ld_shared4(next_t + 16 * k * THREADS));
    }
    if (adjust) {
#pragma unroll
      for (int k = 0; k < ALL; ++k) {
        const int c = f.column(k);
        if (c < n) {
          float4 v = f.T(k);
          if (bias_t) v = add4(v, *reinterpret_cast<const float4*>(bias_t + lo + c));
          if (model_t) v = model_logits4(v, scale_t, cap_t, inv_cap_t);
          if (c + 4 > n) v = fill(v, n - c, 4, NEG_INF);
          f.set_t(k, v);
        }
        if (c < ns) {
          float4 v = f.S(k);
          if (bias_s) v = add4(v, *reinterpret_cast<const float4*>(bias_s + lo + c));
          if (f.with_model) v = model_logits4(v, scale_s, cap_s, inv_cap_s);
          if (c + 4 > ns) v = fill(v, ns - c, 4, NEG_INF);
          f.set_s(k, v);
        }
      }
    }
    // 1. the row statistics: the warp's max, then the sum of 2^(x - max) (no data-dependent
    //    branch). inv_temp > 0, so the max of x * scale2 is max(x) * scale2. Where RELATIVE_H,
    //    also the teacher's logit where s is largest (h_ref's column).
    float max_s = NEG_INF, max_t = NEG_INF, t_at_max_s = NEG_INF;
#pragma unroll
    for (int k = 0; k < ALL; ++k) {
      if (Divergence<MODE>::RELATIVE_H)
        argmax4(f.S(k), f.T(k), max_s, t_at_max_s);
      else
        max_s = fmaxf(max_s, max4(f.S(k)));
      max_t = fmaxf(max_t, max4(f.T(k)));
    }
    const float2 ref = Divergence<MODE>::RELATIVE_H ? ref_lanes(make_float2(max_s, t_at_max_s)) : make_float2(0.0f, 0.0f);
    max_s = Divergence<MODE>::RELATIVE_H ? ref.x : warp_max(max_s);
    max_t = warp_max(max_t);
    Lse ls = {max_s * LOG2E, 0.0f}, lz = {max_s * scale2, 0.0f}, lt = {max_t * scale2, 0.0f};
    // a warp with no column of s or t sums nothing (2^(-inf - -inf) would be NaN)
    if (max_t != NEG_INF) {
#pragma unroll
      for (int k = 0; k < ALL; ++k) lt.s += sum_ex2_4(f.T(k), scale2, lt.m);
      lt.s = warp_sum(lt.s);
    }
    if (max_s != NEG_INF) {
#pragma unroll
      for (int k = 0; k < ALL; ++k) ls.s += sum_ex2_4(f.S(k), LOG2E, ls.m);
      ls.s = warp_sum(ls.s);
      if (tempered) {
#pragma unroll
        for (int k = 0; k < ALL; ++k) lz.s += sum_ex2_4(f.S(k), scale2, lz.m);
        lz.s = warp_sum(lz.s);
      }
    }
    const bool holds_label = y >= lo && y < lo + ns;
    if (holds_label) {  // the label's (biased) logit, from the thread that holds it
#pragma unroll
      for (int k = 0; k < ALL; ++k)
        if (f.column(k) == ((y - lo) & ~3)) target_logit = component(f.S(k), (y - lo) & 3);
    }
    if (lane == 0) {
      warp_lse[0][warp] = ls;
      warp_lse[1][warp] = lz;  // read only where tempered
      warp_lse[2][warp] = lt;
      warp_ref[warp] = ref;    // read only where RELATIVE_H
    }
    __syncthreads();  // after it every thread's reads of next_row are done: the next row's copies start
    if (threadIdx.x == COPIER && rows_queued[parity ^ 1] < rows) copy_ahead(rows_queued[parity ^ 1]);
    // The three statistics merged at once by three warps: s by warp 0, t by warp 1, and z by
    // warp 2 where it is not s; each warp's total pushed to every CTA (lane r to rank r), then
    // every CTA's merged.
    if (warp < (z_apart ? 3 : 2)) {
      const int stat = warp;  // inbox_stats[stat][rank]
      const Lse none = {NEG_INF, 0.0f};
      // over the warps' lanes, and lanes enough for the pushes below
      constexpr int LANES = tree_lanes(WARPS > CLUSTER ? WARPS : CLUSTER);
      // warp_lse rows: 0 s, 1 z (where tempered; else z's parts are s's), 2 t
      const int from = stat == 0 ? 0 : stat == 1 ? 2 : tempered ? 1 : 0;
      const Lse mine = lse_lanes<LANES>(lane < WARPS ? warp_lse[from][lane] : none);
      const int after_of_rank = __shfl_sync(0xffffffffu, after, 0);  // warp 0's is thread 0's
      if (lane < CLUSTER)
        push4(smem_addr(inbox_stats + stat * CLUSTER + rank),
              make_float4(mine.m, mine.s, stat == 1 && holds_label ? target_logit : 0.0f,
                          __int_as_float(after_of_rank)), stats_bar, lane);
      // the CTA's largest student logit and the teacher's there, by warp 0 beside s's statistic
      const bool refs = Divergence<MODE>::RELATIVE_H && stat == 0;
      if (refs) {
        const float2 cta_ref = ref_lanes(lane < WARPS ? warp_ref[lane] : make_float2(NEG_INF, NEG_INF));
        if (lane < CLUSTER)
          push4(smem_addr(inbox_stats + 3 * CLUSTER + rank), make_float4(cta_ref.x, cta_ref.y, 0.0f, 0.0f),
                stats_bar, lane);
      }
      mbar_wait(stats_bar, parity);
      if (refs) {  // the row's: the same bits in every CTA
        const float4 v = lane < CLUSTER ? inbox_stats[3 * CLUSTER + lane] : make_float4(NEG_INF, NEG_INF, 0.0f, 0.0f);
        const float2 row_ref = ref_lanes(make_float2(v.x, v.y));
        if (lane == 0) {
          row_values[4] = row_ref.x;
          row_values[5] = row_ref.y;
        }
      }
      float4 u = make_float4(NEG_INF, 0.0f, 0.0f, 0.0f);
      if (lane < CLUSTER) u = inbox_stats[stat * CLUSTER + lane];
      if (stat == 0 && lane == 0) rows_queued[parity] = __float_as_int(u.w);  // rank 0's statistic s
      if (stat == 2 && lane == CLUSTER && vt > vs) u = make_float4(0.0f, pad_columns, 0.0f, 0.0f);  // the pad: z = 0
      // z's tree spans lane CLUSTER, which holds the pad's part
      const Lse total = stat == 2 ? lse_lanes(Lse{u.x, u.y}) : lse_lanes<tree_lanes(CLUSTER)>(Lse{u.x, u.y});
      const float label_logit = stat == 1 ? warp_sum<tree_lanes(CLUSTER)>(u.z) : 0.0f;  // one CTA's is not 0
      if (lane == 0) {
        // each sum is >= 1 (its max's own term) or NaN: lg2.approx's error is absolute (about
        // 2^-22 by the PTX ISA), small beside the log
        const float log_s = lg2(total.s), bits = total.m + log_s;
        const float eps = rounding_error(bits, total.m, log_s);
        if (stat == 0) {
          row_values[0] = bits * LN2;
          row_values[7] = total.m;
          row_values[8] = total.s;
          if (!z_apart) {
            row_values[1] = bits;
            inbox_sums[CLUSTER].x = eps;
          }
        } else if (stat == 1) {
          row_values[2] = bits;
          row_values[3] = label_logit;
          inbox_sums[CLUSTER].y = eps;
        } else {
          row_values[1] = bits;
          inbox_sums[CLUSTER].x = eps;
        }
      }
    }
    __syncthreads();
    if (Divergence<MODE>::RELATIVE_H) {  // h_ref (row_math.cuh, "A sharp row"), once for the CTA
      if (threadIdx.x == 0) {
        RowMath r = row_math();
        row_values[6] = Divergence<MODE>::SMALL_B && soft_b < SMALL_B_BELOW
                            ? take_reference<MODE, true>(row_values[4], row_values[5], r, soft_b, poly)
                            : take_reference<MODE, false>(row_values[4], row_values[5], r, soft_b, poly);
      }
      __syncthreads();  // (with the shift in every thread, held through pass 2, the kernel spilled)
    }
    if (n > ns) {  // the statistics are read: the pad columns become z = 0 for pass 2
#pragma unroll
      for (int k = 0; k < ALL; ++k) {
        const int c = f.column(k);
        if (c + 4 > ns && c < n) f.set_s(k, fill(f.S(k), ns - c, n - c, 0.0f));
      }
    }

    f.row = row;
    f.rm = row_math();  // c_h: the shift of h to h_ref (row_math.cuh, "A sharp row")
    if (Divergence<MODE>::RELATIVE_H) f.rm.c_h = Divergence<MODE>::h_shift(row_values[6], f.rm);
    f.label_apart = G != nullptr && label_dominates(row_values[3], row_values[0]);
    f.label_column = holds_label && !f.label_apart ? y - lo : -1;
    f.parity = parity;
    if (f.softmax_is_p && f.with_model)
      f.template passes<MODE, true, true>(row_values, poly);
    else if (f.softmax_is_p)
      f.template passes<MODE, true, false>(row_values, poly);
    else
      f.template passes<MODE, false, false>(row_values, poly);
    row = rows_queued[parity ^ 1];  // overwritten only after the next row's first barrier
  }
  cluster_sync();  // no CTA leaves while its pushes may still be on the way
}

#define JSD_ROWS_ARGS                                                                                   \
  const float *S, long long lds, const float *Tl, long long ldt, const float *bias_s, const float *bias_t, \
      const int *target, int vs, int vt, int slice, int rows, float inv_temp, float beta,                 \
      float one_minus_beta,                                                                              \
      float w_hard, float w_soft_over_t, float *ce_out, float *jsd_out, void *G, long long ldg, float *label_terms, \
      int *row_counter, float scale_s, float cap_s, float inv_cap_s, float scale_t, float cap_t, float inv_cap_t,  \
      float soft_b, SOFT_POLY_PARAMS
#define JSD_ROWS_CALL                                                                                      \
  S, lds, Tl, ldt, bias_s, bias_t, target, vs, vt, slice, rows, inv_temp, beta, one_minus_beta, w_hard,     \
      w_soft_over_t, ce_out, jsd_out, G, ldg, label_terms, row_counter, scale_s, cap_s, inv_cap_s, scale_t, \
      cap_t, inv_cap_t, soft_b, poly

// MODE: the divergence, a kernel of its own each: with the three modes' bodies in one kernel,
// ptxas spilled where each alone does not. MIN_CTAS: CTAs per SM that the register allocation
// must allow.
template <int MODE, int OUT, int CLUSTER, int THREADS, int GROUPS, int EXTRA, int MIN_CTAS>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, MIN_CTAS) fused_rows(JSD_ROWS_ARGS) {
  const SoftPoly poly = SOFT_POLY_OF_PARAMS;
  fused_rows_body<MODE, OUT, CLUSTER, THREADS, GROUPS, EXTRA>(JSD_ROWS_CALL);
}
