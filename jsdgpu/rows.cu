// The row kernels of jsdgpu; _cupy_backend.py compiles them with NVRTC.
//
// The fused kernel (one thread-block cluster per token row, the row held in registers) does all
// of a row's work with one read of its logits; the three vocab-parallel phases do it in three
// streaming passes, with the ranks' partial results combined between them; scale_cast,
// label_rows and label_scatter serve the gradient sums.
//
// The file includes no header, so NVRTC compiles it anywhere (CI compiles it with no GPU).

#define NEG_INF __int_as_float(0xff800000)
#define FLT_MIN_NORMAL 1.17549435e-38f
#define FLT_MAX_FINITE 3.40282347e+38f

#define FORWARD_KL 0  // beta == 0: KL(q || p)
#define JSD 1         // 0 < beta < 1
#define REVERSE_KL 2  // beta == 1: KL(p || q)

#define OUT_F32 0
#define OUT_F16 1
#define OUT_BF16 2

// ---- cluster, shared-memory and conversion primitives (PTX, sm_90) ----

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned long long s;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"(p));
  return (unsigned)s;
}

__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// The lane's index and gridDim.x, read where they are used (volatile: ptxas kept values made
// from them in registers through the fused kernel's row loop, and spilled them)
__device__ __forceinline__ int lane_id() {
  int r;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(r));
  return r;
}

__device__ __forceinline__ int grid_ctas() {
  int r;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// mbarriers in shared memory (by shared-memory address), for the partial results that the CTAs
// of a cluster push to one another with st.async: a push completes its bytes on the receiver's
// mbarrier, so neither side waits on a cluster barrier (whose release fence also waits for every
// global store in flight).

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// The one arrival of the barrier's current phase, which completes once `bytes` more have come
__device__ __forceinline__ void mbar_expect_bytes(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// v to the shared memory of CTA `rank` of this cluster at the address dst has in ours, its 16
// bytes completed on that CTA's mbarrier at the address bar has in ours
__device__ __forceinline__ void push4(unsigned dst, float4 v, unsigned bar, unsigned rank) {
  unsigned remote_dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_dst) : "r"(dst), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   remote_dst),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar)
               : "memory");
}

// bytes (a multiple of 16) from global memory at src to the shared-memory address dst (both
// 16-byte aligned), by the Tensor Memory Accelerator, completed on the mbarrier at bar
__device__ __forceinline__ void bulk_copy(unsigned dst, const float* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Orders this thread's view of shared memory (and, after a barrier, the CTA's) before the
// async proxy's writes to it (bulk copies).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ float4 ld_shared4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr)
               : "memory");
  return v;
}

template <int OUT>
__device__ __forceinline__ unsigned short to_16bit(float x) {
  unsigned short r;
  if (OUT == OUT_BF16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// lo and hi in OUT's 16-bit format, lo in the low half (the lower address)
template <int OUT>
__device__ __forceinline__ unsigned pack_16bit(float lo, float hi) {
  unsigned r;
  if (OUT == OUT_BF16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Four consecutive gradient values to G[k..k + n), n <= 4, in OUT's format; G + k is 16-byte
// (f32) / 8-byte aligned.
template <int OUT>
__device__ __forceinline__ void store4(void* G, long long k, const float g[4], int n) {
  if (OUT == OUT_F32) {
    float* out = static_cast<float*>(G) + k;
    if (n == 4) {
      *reinterpret_cast<float4*>(out) = make_float4(g[0], g[1], g[2], g[3]);
    } else {
      for (int j = 0; j < n; ++j) out[j] = g[j];
    }
  } else {
    unsigned short* out = static_cast<unsigned short*>(G) + k;
    if (n == 4) {
      *reinterpret_cast<uint2*>(out) = make_uint2(pack_16bit<OUT>(g[0], g[1]), pack_16bit<OUT>(g[2], g[3]));
    } else {
      for (int j = 0; j < n; ++j) out[j] = to_16bit<OUT>(g[j]);
    }
  }
}

// ---- logsumexp in parts ----

struct Lse {
  float m, s;  // a max, and the sum of exp(x - m) over the values; s == 0: no value
};

__device__ __forceinline__ Lse lse_merge(Lse a, Lse b) {
  // s == 0 only when a part holds no value; a part of NaNs has m = -inf (fmaxf skips NaN) but
  // s = NaN, and must not be dropped as empty
  if (b.s == 0.0f) return a;
  if (a.s == 0.0f) return b;
  const float m = fmaxf(a.m, b.m);
  Lse r = {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
  return r;
}

__device__ __forceinline__ Lse lse_shfl(Lse a, int lane_mask) {
  Lse r = {__shfl_xor_sync(0xffffffffu, a.m, lane_mask), __shfl_xor_sync(0xffffffffu, a.s, lane_mask)};
  return r;
}

// Row statistics: logsumexp of s (temperature 1), of z = s / temperature, of t / temperature,
// and the target's logit (held by one thread; the others hold 0, so a sum finds it).
struct Stats {
  Lse s, z, t;
  float target_logit;
};

__device__ __forceinline__ Stats stats_empty() {
  Stats r = {{NEG_INF, 0.0f}, {NEG_INF, 0.0f}, {NEG_INF, 0.0f}, 0.0f};
  return r;
}

__device__ __forceinline__ Stats stats_merge(Stats a, Stats b) {
  Stats r = {lse_merge(a.s, b.s), lse_merge(a.z, b.z), lse_merge(a.t, b.t), a.target_logit + b.target_logit};
  return r;
}

// Merged over the 32 lanes of a warp by an xor tree: lane 0's result depends only on the
// inputs, not on timing, so every CTA of a cluster gets the same bits from the same inputs.
__device__ __forceinline__ Stats stats_warp_merge(Stats st) {
  for (int mask = 16; mask > 0; mask >>= 1) {
    Stats o = {lse_shfl(st.s, mask), lse_shfl(st.z, mask), lse_shfl(st.t, mask),
               __shfl_xor_sync(0xffffffffu, st.target_logit, mask)};
    st = stats_merge(st, o);
  }
  return st;
}

// The xor trees below merge over groups of LANES lanes (a power of 2): where only the first
// LANES lanes hold values, those lanes get the total in log2(LANES) steps, not 5.
template <int LANES = 32>
__device__ __forceinline__ float2 sums_warp_merge(float2 v) {
  for (int mask = LANES / 2; mask > 0; mask >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, mask);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, mask);
  }
  return v;
}

// v merged over the block in a fixed order: each warp by warp_merge (an xor tree), then the
// warps' results by warps_merge (a tree over the lanes that hold them) in warp 0, whose first
// THREADS / 32 lanes get the total, with the same bits. The other warps' return values are partial.
template <int THREADS, typename T, typename WarpMerge, typename WarpsMerge>
__device__ __forceinline__ T block_merge(T v, T none, WarpMerge warp_merge, WarpsMerge warps_merge) {
  __shared__ T per_warp[THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_merge(v);
  if (lane == 0) per_warp[warp] = v;
  __syncthreads();
  return warp == 0 ? warps_merge(lane < THREADS / 32 ? per_warp[lane] : none) : v;
}

// ---- the per-column math, shared by the fused kernel and the vocab-parallel phases ----
//
// In log2 units ("bits"): a logit x at temperature T is x * scale2 bits, scale2 = log2(e) / T,
// so that each exp is one ex2 of one FFMA and each log one lg2. The log-ratio h and the KL sums
// a and b are in bits; they turn into natural units (times ln 2) once per row.
//
// MODE (FORWARD_KL, JSD, REVERSE_KL) is a template parameter: the kernels' inner loops hold no
// branch on it. Each kernel switches on its mode argument once (mode_dispatch).

#define LOG2E 1.44269504088896341f
#define LN2 0.693147180559945309f

// .ftz: a result below the smallest normal float (1.2e-38) is 0, and lg2 is only given normal
// numbers; without it each one costs three more instructions (the profile counted them)
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float lg2(float x) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// What a row's KL sums and gradient need once its statistics are known.
struct RowMath {
  float scale2;          // log2(e) / temperature
  float lse_s;           // logsumexp of s, natural units (the CE)
  float lse_z2, lse_t2;  // logsumexp of s / T and of t / T, in bits
  float beta, w_hard, w_soft_t;
};

// One column's share of a = sum p (log p - log m) and b = sum q (log q - log m), in bits, with m
// the mixture (JSD), p (forward KL) or q (reverse KL); the sum a KL does not use is 0 (a in
// forward KL, b in reverse KL). p, and h, what the gradient needs of the teacher (bits but in
// forward KL, where h = q). s: the student logit (0 in a pad column), t: the teacher logit.
struct KlTerms {
  float a, b, p, h;
};

// max(x, y), but NaN where either is NaN
__device__ __forceinline__ float max_nan(float x, float y) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}

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
  const float k = MODE == FORWARD_KL ? r.w_soft_t : r.w_soft_t * ((MODE == JSD ? 1.0f - r.beta : 1.0f) * LN2);
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

__device__ __forceinline__ float max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// ---- the fused kernel ----
//
// A thread-block cluster of CLUSTER CTAs works on one token row at a time. CTA r holds the row's
// columns r * slice + [0, slice) (slice: a multiple of 4), and its thread i holds GROUPS float4
// groups of them in registers: group k is the CTA's columns 4 (i + k THREADS) + [0, 4). The
// passes, (1) the row statistics, (2) the JSD sums, (3) the gradient row, work on registers
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
// padded with zeros to a multiple of 4, or null. G [rows, ldg] in OUT's format, or null for the
// loss alone: the gradient with respect to the student logits, without the 1/N of the mean. Where
// softmax(s)[y] < 1/2 the label's one-hot term -w_hard dominates G[y] and would be rounded with
// it to 16 bits: it is left out of G and written to label_terms[row] instead (else 0), for the
// caller to add exactly (label_scatter). CLUSTER * slice >= vt, slice <= 4 * THREADS * GROUPS.
// G may be S's own memory (so S and G are not __restrict__): a row's gradient goes over its
// student logits, which every CTA of the cluster has read by then (each pushed its KL sums after
// reading its part of the row, and pass 3 comes after every CTA's sums are in).
//
// Columns past the CTA's part of the row hold -inf in s and t (2^-inf = 0: no bounds checks in
// the passes); student columns past vs (the teacher's pad) hold -inf for the statistics, then 0
// (z = 0) for the JSD sums.

// v with its values j in [from, to) replaced by x
__device__ __forceinline__ float4 fill(float4 v, int from, int to, float x) {
  const bool r[4] = {from <= 0 && 0 < to, from <= 1 && 1 < to, from <= 2 && 2 < to, from <= 3 && 3 < to};
  return make_float4(r[0] ? x : v.x, r[1] ? x : v.y, r[2] ? x : v.z, r[3] ? x : v.w);
}

__device__ __forceinline__ float component(float4 v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// sum over the four values of 2^(v * scale2 - m2)
__device__ __forceinline__ float sum_ex2_4(float4 v, float scale2, float m2) {
  return (ex2(fmaf(v.x, scale2, -m2)) + ex2(fmaf(v.y, scale2, -m2))) +
         (ex2(fmaf(v.z, scale2, -m2)) + ex2(fmaf(v.w, scale2, -m2)));
}

// The max over the warp by one redux.sync (integers only) on the floats' bits mapped to integers
// of the same order (a negative float's bits but the sign flipped), where a shuffle tree took 10
// instructions in a chain. A NaN with the sign bit clear is above +inf, one with it set below
// -inf; either way the sums against the max are NaN, as with a tree of fmaxf.
__device__ __forceinline__ int ordered_bits(int i) { return i ^ ((i >> 31) & 0x7fffffff); }
__device__ __forceinline__ float warp_max(float v) {
  return __int_as_float(ordered_bits(__reduce_max_sync(0xffffffffu, ordered_bits(__float_as_int(v)))));
}

template <int LANES = 32>
__device__ __forceinline__ float warp_sum(float v) {
  for (int mask = LANES / 2; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

// Logsumexp parts in bits, one per lane (m: a max, s: the sum of 2^(x - m); s == 0: no value),
// merged over the first LANES lanes, where the others hold no value (their total is then that
// max, and partial sums). A part of NaNs has s = NaN and is kept.
template <int LANES = 32>
__device__ __forceinline__ Lse lse_lanes(Lse a) {
  const float m = warp_max(a.m);
  Lse r = {m, warp_sum<LANES>(a.s == 0.0f ? 0.0f : a.s * ex2(a.m - m))};
  return r;
}

// The smallest power of 2 >= n (n <= 32): the lanes of an xor tree over n values
__host__ __device__ constexpr int tree_lanes(int n) { return n <= 1 ? 1 : 2 * tree_lanes((n + 1) / 2); }

// Passes 2 and 3 of one row over the thread's registers, and the row's results.
template <int OUT, int CLUSTER, int THREADS, int GROUPS>
struct FusedRow {
  static constexpr int WARPS = THREADS / 32;
  float4 s[GROUPS], t[GROUPS];  // student logits (later p where softmax(s) == p), teacher (later h)
  int n, ns, lo, label_column;  // label_column: the label's column in the slice if its one-hot
                                // term goes into G, else -1
  long long row;
  unsigned rank;
  RowMath rm;
  bool label_apart, softmax_is_p;
  float *ce_out, *jsd_out, *label_terms;
  void* G;
  long long ldg;
  float4* inbox_sums;  // the cluster's CTAs' (a, b), by rank (pushed there)
  unsigned sums_bar, parity;  // their mbarrier, and the parity of this row's phase
  float target_logit;         // the row's logit at its label (for the CE)

  __device__ __forceinline__ int column(int k) const { return 4 * (threadIdx.x + k * THREADS); }

  template <int MODE, bool SOFTMAX_IS_P>
  __device__ __forceinline__ void passes() {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // 2. a and b; t becomes h, and s becomes p where softmax(s) == p (no temperature, no pad),
    //    so that pass 3 needs no exp
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int k = 0; k < GROUPS; ++k) {
      if (column(k) >= n) continue;
      const float sv[4] = {s[k].x, s[k].y, s[k].z, s[k].w}, tv[4] = {t[k].x, t[k].y, t[k].z, t[k].w};
      float pv[4], hv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const KlTerms kt = kl_terms<MODE>(sv[j], tv[j], rm);
        a += kt.a;
        b += kt.b;
        pv[j] = kt.p;
        hv[j] = kt.h;
      }
      t[k] = make_float4(hv[0], hv[1], hv[2], hv[3]);
      if (SOFTMAX_IS_P) s[k] = make_float4(pv[0], pv[1], pv[2], pv[3]);
    }
    const float2 mine = block_merge<THREADS>(make_float2(a, b), make_float2(0.0f, 0.0f), sums_warp_merge<32>,
                                             sums_warp_merge<tree_lanes(WARPS > CLUSTER ? WARPS : CLUSTER)>);
    // this CTA's sums, pushed to every CTA (lane r to rank r)
    if (warp == 0 && lane < CLUSTER)
      push4(smem_addr(inbox_sums + rank), make_float4(mine.x, mine.y, 0.0f, 0.0f), sums_bar, lane);
    // The cluster's sums: every warp that needs them waits for them and merges them itself (the
    // same tree, so the same bits), with no block barrier behind one warp's merge. Without G only
    // warp 0 needs them (for the row's results); the others go on to the next row.
    if (G == nullptr && warp != 0) return;
    mbar_wait(sums_bar, parity);
    float2 r = make_float2(0.0f, 0.0f);
    if (lane < CLUSTER) {
      const float4 v = ld_shared4(smem_addr(inbox_sums) + 16 * lane_id());
      r = make_float2(v.x, v.y);
    }
    r = sums_warp_merge<32>(r);  // the other lanes hold zeros: every lane gets the CLUSTER lanes' tree's bits
    if (warp == 0 && lane == 0 && rank == 0)
      write_row_results<MODE>(row, target_logit, r.x, r.y, label_apart, rm, G != nullptr, ce_out, jsd_out,
                              label_terms);
    // 3. the gradient row: the loop writes the groups of 4 student columns, without the
    //    label's one-hot term; after it, the thread that holds them writes the group that ends
    //    inside a float4 (where ns % 4 != 0) and, where the one-hot term goes into G, the label's
    //    value over its group's. So the loop holds one check per group. Group k's values go to
    //    g0 + 4 k THREADS: offsets the stores take as immediates.
    if (G != nullptr) {
      const float kl = r.x;
      const long long g0 = row * ldg + lo + column(0);
      const int ns4 = ns & ~3;
#pragma unroll
      for (int k = 0; k < GROUPS; ++k) {
        if (column(k) >= ns4) continue;
        float out[4];
        gradient<MODE, SOFTMAX_IS_P>(k, kl, -1, out);
        store4<OUT>(G, g0 + 4 * k * THREADS, out, 4);
      }
      if (label_column >= 0 || ns4 != ns) {
#pragma unroll
        for (int k = 0; k < GROUPS; ++k) {
          const int c = column(k);
          const bool tail = c == ns4 && ns4 != ns, label = (label_column & ~3) == c;
          if (!tail && !label) continue;
          float out[4];
          gradient<MODE, SOFTMAX_IS_P>(k, kl, label ? label_column - c : -1, out);
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

  // The gradient values of group k; its value j_label (if 0..3) with the label's one-hot term.
  template <int MODE, bool SOFTMAX_IS_P>
  __device__ __forceinline__ void gradient(int k, float kl, int j_label, float out[4]) const {
    const float sv[4] = {s[k].x, s[k].y, s[k].z, s[k].w}, hv[4] = {t[k].x, t[k].y, t[k].z, t[k].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p = SOFTMAX_IS_P ? sv[j] : ex2(fmaf(sv[j], rm.scale2, -rm.lse_z2));
      const float softmax = SOFTMAX_IS_P ? p : softmax_of(sv[j], rm);
      out[j] = grad_value<MODE, SOFTMAX_IS_P>(softmax, p, hv[j], j == j_label, kl, rm);
    }
  }
};

template <int MODE, int OUT, int CLUSTER, int THREADS, int GROUPS>
__device__ __forceinline__ void jsd_rows(const float* S, long long lds, const float* __restrict__ Tl,
                                         long long ldt, const float* __restrict__ bias_s,
                                         const float* __restrict__ bias_t, const int* __restrict__ target, int vs,
                                         int vt, int slice, int rows, float inv_temp, float beta,
                                         float w_hard, float w_soft_t, float* __restrict__ ce_out,
                                         float* __restrict__ jsd_out, void* G, long long ldg,
                                         float* __restrict__ label_terms, int* __restrict__ row_counter) {
  static_assert(CLUSTER < 32, "lane CLUSTER of warp 2 holds the pad columns' part of z");
  static_assert(THREADS >= 128, "warps 0, 1 and 2 merge one statistic each; a thread of warp 3 copies");
  constexpr int WARPS = THREADS / 32;
  constexpr int COPIER = 96;  // the thread that starts the copies: in warp 3, which merges nothing
  // The next row's part of this CTA, copied ahead while this row is worked on: the student's
  // GROUPS * THREADS float4s, then the teacher's, each in the order of its columns, so that float4
  // k * THREADS + i is thread i's group k.
  extern __shared__ float4 next_row[];
  __shared__ Lse warp_lse[3][WARPS];
  __shared__ float target_logit;  // in the CTA that holds the label's column
  // The cluster's CTAs push their partial results here: the statistics by statistic (s, t with
  // the label's logit, z where it is apart), then rank; then the KL sums, by rank. Row i + 1's
  // pushes cannot come before this CTA has read row i's: a CTA pushes its statistics of row i + 1
  // only after it has all sums of row i, this CTA's among them, pushed after it read the
  // statistics of row i; likewise for the sums.
  __shared__ float4 inbox_stats[3 * CLUSTER], inbox_sums[CLUSTER];
  __shared__ unsigned long long bars[3];  // their mbarriers, and the copies': one phase per row
  __shared__ float row_values[4];  // the cluster's statistics, for every thread
  __shared__ int row_after;        // the row after the next one (from rank 0), for every thread
  // vt - vs, read from here by the one lane that needs it: held in a register through the loop,
  // it was spilled in jsd_rows_f32
  __shared__ float pad_columns;

  FusedRow<OUT, CLUSTER, THREADS, GROUPS> f;
  const unsigned rank = cluster_ctarank();
  const int lo = rank * slice;
  const int n = max(0, min(slice, vt - lo));  // this CTA's columns: lo + [0, n)
  const int ns = max(0, min(n, vs - lo));     // of which student columns: lo + [0, ns)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool tempered = inv_temp != 1.0f;
  const bool z_apart = tempered || vt > vs;  // z = s / T is not s: it has a temperature or pad columns
  const float scale2 = inv_temp * LOG2E;
  // shared-memory addresses of this thread's group 0 there; group k is k * THREADS float4s on
  const unsigned next_s = smem_addr(next_row + threadIdx.x), next_t = next_s + 16 * GROUPS * THREADS;
  f.n = n;
  f.ns = ns;
  f.lo = lo;
  f.rank = rank;
  f.softmax_is_p = !tempered && vt == vs;
  f.ce_out = ce_out;
  f.jsd_out = jsd_out;
  f.label_terms = label_terms;
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
  for (int k = 0; k < GROUPS; ++k) {
    if (f.column(k) >= ns) next_row[k * THREADS + threadIdx.x] = none4;
    if (f.column(k) >= n) next_row[(GROUPS + k) * THREADS + threadIdx.x] = none4;
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
    if (t_bytes != 0) bulk_copy(smem_addr(next_row + GROUPS * THREADS), Tl + row * ldt + lo, t_bytes, copy_bar);
  };
  // Rare, and the same in every row: biases, or a slice that ends inside a float4 of columns
  // (whose values past the end must be -inf).
  const bool adjust = bias_s != nullptr || bias_t != nullptr || n % 4 != 0 || ns % 4 != 0;

  // This cluster's row and the next one: the first two by its index, then from row_counter.
  const int clusters = gridDim.x / CLUSTER;
  int row = blockIdx.x / CLUSTER, next = row + clusters;
  if (threadIdx.x == COPIER && row < rows) copy_ahead(row);
  for (unsigned parity = 0; row < rows; parity ^= 1) {
    int after = 0;  // the row after next: thread 0 of rank 0 takes it; every CTA gets it below
    if (threadIdx.x == 0) {  // the one arrival of this row's phases; the pushes bring the bytes
      mbar_expect_bytes(stats_bar, (z_apart ? 3 : 2) * CLUSTER * sizeof(float4));
      mbar_expect_bytes(f.sums_bar, sizeof(inbox_sums));
      // 2 * clusters, from gridDim.x read again here (kept from above, ptxas spilled it)
      if (rank == 0) after = 2 * (grid_ctas() / CLUSTER) + atomicAdd(row_counter, 1);
    }
    const int y = target[row];
    mbar_wait(copy_bar, parity);
    // 0. the thread's columns into registers (-inf past the ends), with their biases
#pragma unroll
    for (int k = 0; k < GROUPS; ++k) {
      f.s[k] = ld_shared4(next_s + 16 * k * THREADS);
      f.t[k] = ld_shared4(next_t + 16 * k * THREADS);
    }
    if (adjust) {
#pragma unroll
      for (int k = 0; k < GROUPS; ++k) {
        const int c = f.column(k);
        if (c < n) {
          if (bias_t) f.t[k] = add4(f.t[k], *reinterpret_cast<const float4*>(bias_t + lo + c));
          if (c + 4 > n) f.t[k] = fill(f.t[k], n - c, 4, NEG_INF);
        }
        if (c < ns) {
          if (bias_s) f.s[k] = add4(f.s[k], *reinterpret_cast<const float4*>(bias_s + lo + c));
          if (c + 4 > ns) f.s[k] = fill(f.s[k], ns - c, 4, NEG_INF);
        }
      }
    }
    // 1. the row statistics: the warp's max, then the sum of 2^(x - max) (no data-dependent
    //    branch). inv_temp > 0, so the max of x * scale2 is max(x) * scale2.
    float max_s = NEG_INF, max_t = NEG_INF;
#pragma unroll
    for (int k = 0; k < GROUPS; ++k) {
      max_s = fmaxf(max_s, max4(f.s[k]));
      max_t = fmaxf(max_t, max4(f.t[k]));
    }
    max_s = warp_max(max_s);
    max_t = warp_max(max_t);
    Lse ls = {max_s * LOG2E, 0.0f}, lz = {max_s * scale2, 0.0f}, lt = {max_t * scale2, 0.0f};
    // a warp with no column of s or t sums nothing (2^(-inf - -inf) would be NaN)
    if (max_t != NEG_INF) {
#pragma unroll
      for (int k = 0; k < GROUPS; ++k) lt.s += sum_ex2_4(f.t[k], scale2, lt.m);
      lt.s = warp_sum(lt.s);
    }
    if (max_s != NEG_INF) {
#pragma unroll
      for (int k = 0; k < GROUPS; ++k) ls.s += sum_ex2_4(f.s[k], LOG2E, ls.m);
      ls.s = warp_sum(ls.s);
      if (tempered) {
#pragma unroll
        for (int k = 0; k < GROUPS; ++k) lz.s += sum_ex2_4(f.s[k], scale2, lz.m);
        lz.s = warp_sum(lz.s);
      }
    }
    const bool holds_label = y >= lo && y < lo + ns;
    if (holds_label) {  // the label's (biased) logit, from the thread that holds it
#pragma unroll
      for (int k = 0; k < GROUPS; ++k)
        if (f.column(k) == ((y - lo) & ~3)) target_logit = component(f.s[k], (y - lo) & 3);
    }
    if (lane == 0) {
      warp_lse[0][warp] = ls;
      warp_lse[1][warp] = lz;  // read only where tempered
      warp_lse[2][warp] = lt;
    }
    __syncthreads();  // after it every thread's reads of next_row are done: the next row's copies start
    if (threadIdx.x == COPIER && next < rows) copy_ahead(next);
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
      mbar_wait(stats_bar, parity);
      float4 u = make_float4(NEG_INF, 0.0f, 0.0f, 0.0f);
      if (lane < CLUSTER) u = inbox_stats[stat * CLUSTER + lane];
      if (stat == 0 && lane == 0) row_after = __float_as_int(u.w);  // rank 0's statistic s
      if (stat == 2 && lane == CLUSTER && vt > vs) u = make_float4(0.0f, pad_columns, 0.0f, 0.0f);  // the pad: z = 0
      // z's tree spans lane CLUSTER, which holds the pad's part
      const Lse total = stat == 2 ? lse_lanes(Lse{u.x, u.y}) : lse_lanes<tree_lanes(CLUSTER)>(Lse{u.x, u.y});
      const float label_logit = stat == 1 ? warp_sum<tree_lanes(CLUSTER)>(u.z) : 0.0f;  // one CTA's is not 0
      if (lane == 0) {
        // each sum is >= 1 (its max's own term) or NaN: lg2.approx's error is absolute (about
        // 2^-22 by the PTX ISA), small beside the log
        const float bits = total.m + lg2(total.s);
        if (stat == 0) {
          row_values[0] = bits * LN2;
          if (!z_apart) row_values[1] = bits;
        } else if (stat == 1) {
          row_values[2] = bits;
          row_values[3] = label_logit;
        } else {
          row_values[1] = bits;
        }
      }
    }
    __syncthreads();
    if (n > ns) {  // the statistics are read: the pad columns become z = 0 for pass 2
#pragma unroll
      for (int k = 0; k < GROUPS; ++k) {
        const int c = f.column(k);
        if (c + 4 > ns && c < n) f.s[k] = fill(f.s[k], ns - c, n - c, 0.0f);
      }
    }

    f.row = row;
    const int after_row = row_after;  // read before the next row's statistics overwrite it
    f.rm = RowMath{scale2, row_values[0], row_values[1], row_values[2], beta, w_hard, w_soft_t};
    f.target_logit = row_values[3];
    f.label_apart = G != nullptr && label_dominates(f.target_logit, row_values[0]);
    f.label_column = holds_label && !f.label_apart ? y - lo : -1;
    f.parity = parity;
    if (f.softmax_is_p)
      f.template passes<MODE, true>();
    else
      f.template passes<MODE, false>();
    row = next;
    next = after_row;
  }
  cluster_sync();  // no CTA leaves while its pushes may still be on the way
}

#define JSD_ROWS_ARGS                                                                                   \
  const float *S, long long lds, const float *Tl, long long ldt, const float *bias_s, const float *bias_t, \
      const int *target, int vs, int vt, int slice, int rows, float inv_temp, int mode, float beta,       \
      float w_hard, float w_soft_t, float *ce_out, float *jsd_out, void *G, long long ldg, float *label_terms, \
      int *row_counter
#define JSD_ROWS_CALL                                                                                      \
  S, lds, Tl, ldt, bias_s, bias_t, target, vs, vt, slice, rows, inv_temp, beta, w_hard, w_soft_t, ce_out, \
      jsd_out, G, ldg, label_terms, row_counter

// MIN_CTAS: CTAs per SM that the register allocation must allow
#define DEFINE_JSD_ROWS(NAME, OUT, CLUSTER, THREADS, GROUPS, MIN_CTAS)                            \
  extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, MIN_CTAS) \
      NAME(JSD_ROWS_ARGS) {                                                                        \
    mode_dispatch(mode, [=](auto m) { jsd_rows<decltype(m)::value, OUT, CLUSTER, THREADS, GROUPS>(JSD_ROWS_CALL); }); \
  }

// The kernels of _cupy_backend.py: 16 CTAs of 512 threads, 4 groups each: up to 131072 columns;
// two CTAs per SM (64 registers a thread).
DEFINE_JSD_ROWS(jsd_rows_f32, OUT_F32, 16, 512, 4, 2)
DEFINE_JSD_ROWS(jsd_rows_f16, OUT_F16, 16, 512, 4, 2)
DEFINE_JSD_ROWS(jsd_rows_bf16, OUT_BF16, 16, 512, 4, 2)

#ifdef ROW_KERNEL_VARIANTS  // other shapes, for bench/profile_rows.py
DEFINE_JSD_ROWS(jsd_rows_bf16_c16_t512_g4_m1, OUT_BF16, 16, 512, 4, 1)
DEFINE_JSD_ROWS(jsd_rows_bf16_c8_t1024_g4_m1, OUT_BF16, 8, 1024, 4, 1)
DEFINE_JSD_ROWS(jsd_rows_bf16_c16_t256_g8_m2, OUT_BF16, 16, 256, 8, 2)
#endif

// ---- vocab parallel: the row kernel in three phases ----
//
// Under vocab parallelism each rank holds columns [v0, v0 + vt) of every row (student columns
// [v0, v0 + vs)). The row statistics and the KL sums are combined across ranks (NCCL, by the
// driver) between the phases, so each phase is a kernel of its own that streams this rank's
// logits from HBM: one CTA per row, 16-byte loads, partial sums merged in a fixed order.
//
// stats [7, rows]: the maxima of s, z and t; the sums of exp(x - max) of s, z (with this
// rank's pad columns) and t; the target logit where this rank owns the label (else 0).
// kl [2, rows]: a and b. target: the label's column in this rank's shard, -1 where not owned.

#define VP_THREADS 256

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

#define VP_ROW_ARGS                                                                                    \
  const float *S, long long lds, const float *Tl, long long ldt, const float *bias_s, const float *bias_t, \
      const int *target, int vs, int vt, float inv_temp, int rows

// Phase 1: this rank's part of the row statistics.
extern "C" __global__ void __launch_bounds__(VP_THREADS) vp_stats(VP_ROW_ARGS, float* stats) {
  const long long row = blockIdx.x;
  const float *srow = S + row * lds, *trow = Tl + row * ldt;
  const int y = target[row];
  const bool tempered = inv_temp != 1.0f;
  Stats st = stats_empty();
  for (int i = 4 * threadIdx.x; i < vt; i += 4 * VP_THREADS) {
    float s[4], t[4];
    load_columns(srow, trow, bias_s, bias_t, i, vs, s, t);
    const int cs = max(0, min(4, vs - i)), ct = min(4, vt - i);
    st.s = lse_merge(st.s, lse_of4(s, 1.0f, cs));
    if (tempered) st.z = lse_merge(st.z, lse_of4(s, inv_temp, cs));
    st.t = lse_merge(st.t, lse_of4(t, inv_temp, ct));
    if (y >= i && y < i + cs) st.target_logit = s[y - i];
  }
  Stats r = block_merge<VP_THREADS>(st, stats_empty(), stats_warp_merge, stats_warp_merge);
  if (threadIdx.x == 0) {
    if (!tempered) r.z = r.s;
    if (vt > vs) {  // this rank's pad columns: z = 0, vt - vs of them
      Lse pad = {0.0f, (float)(vt - vs)};
      r.z = lse_merge(r.z, pad);
    }
    const float v[7] = {r.s.m, r.z.m, r.t.m, r.s.s, r.z.s, r.t.s, r.target_logit};
    for (int k = 0; k < 7; ++k) stats[k * (long long)rows + row] = v[k];
  }
}

// The row's RowMath from the statistics combined over all ranks
__device__ __forceinline__ RowMath vp_row_math(const float* stats, long long row, int rows, float inv_temp,
                                               float beta, float w_hard, float w_soft_t) {
  const float* st = stats + row;
  RowMath r = {inv_temp * LOG2E,
               st[0] + logf(st[3 * (long long)rows]),
               (st[(long long)rows] + logf(st[4 * (long long)rows])) * LOG2E,
               (st[2 * (long long)rows] + logf(st[5 * (long long)rows])) * LOG2E,
               beta, w_hard, w_soft_t};
  return r;
}

// Phase 2: this thread's part of the row's KL sums a and b.
struct VpKlSums {
  const float *srow, *trow, *bias_s, *bias_t;
  int vs, vt;
  RowMath rm;
  float2 ab;

  template <int MODE>
  __device__ __forceinline__ void operator()(Mode<MODE>) {
    for (int i = 4 * threadIdx.x; i < vt; i += 4 * VP_THREADS) {
      float s[4], t[4];
      load_columns(srow, trow, bias_s, bias_t, i, vs, s, t);
      for (int k = 0; k < 4 && i + k < vt; ++k) {
        const KlTerms terms = kl_terms<MODE>(i + k < vs ? s[k] : 0.0f, t[k], rm);
        ab.x += terms.a;
        ab.y += terms.b;
      }
    }
  }
};

extern "C" __global__ void __launch_bounds__(VP_THREADS)
    vp_kl(VP_ROW_ARGS, int mode, float beta, const float* stats, float* kl) {
  const long long row = blockIdx.x;
  VpKlSums f = {S + row * lds, Tl + row * ldt, bias_s, bias_t, vs, vt,
                vp_row_math(stats, row, rows, inv_temp, beta, 0.0f, 0.0f), make_float2(0.0f, 0.0f)};
  mode_dispatch(mode, f);
  const float2 ab = block_merge<VP_THREADS>(f.ab, make_float2(0.0f, 0.0f), sums_warp_merge<32>,
                                              sums_warp_merge<tree_lanes(VP_THREADS / 32)>);
  if (threadIdx.x == 0) {
    kl[row] = ab.x;
    kl[rows + row] = ab.y;
  }
}

// Phase 3: the row's CE and JSD values (every rank the same), and this rank's gradient columns.
template <int OUT>
struct VpFinish {
  const float *srow, *trow, *bias_s, *bias_t;
  int vs, y;
  long long row;
  RowMath rm;
  float target_logit, a, b;
  float *ce_out, *jsd_out, *label_terms;
  void* G;
  long long ldg;

  template <int MODE>
  __device__ __forceinline__ void operator()(Mode<MODE>) {
    const bool label_apart = G != nullptr && y >= 0 && label_dominates(target_logit, rm.lse_s);
    if (threadIdx.x == 0)
      write_row_results<MODE>(row, target_logit, a, b, label_apart, rm, G != nullptr, ce_out, jsd_out,
                              label_terms);
    if (G == nullptr) return;
    for (int i = 4 * threadIdx.x; i < vs; i += 4 * VP_THREADS) {
      float s[4], t[4], g[4];
      load_columns(srow, trow, bias_s, bias_t, i, vs, s, t);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const KlTerms terms = kl_terms<MODE>(s[k], t[k], rm);
        // softmax(s) from its own logsumexp: the rank cannot see whether another has pad columns
        g[k] = grad_value<MODE, false>(softmax_of(s[k], rm), terms.p, terms.h, i + k == y && !label_apart, a, rm);
      }
      const int count = min(4, vs - i);
      store4<OUT>(G, row * ldg + i, g, count);
    }
  }
};

template <int OUT>
__device__ __forceinline__ void vp_finish(VP_ROW_ARGS, int mode, float beta, float w_hard, float w_soft_t,
                                          const float* stats, const float* kl, float* ce_out, float* jsd_out,
                                          void* G, long long ldg, float* label_terms) {
  const long long row = blockIdx.x;
  VpFinish<OUT> f = {S + row * lds, Tl + row * ldt, bias_s, bias_t, vs, target[row], row,
                     vp_row_math(stats, row, rows, inv_temp, beta, w_hard, w_soft_t),
                     stats[6 * (long long)rows + row], kl[row], kl[rows + row],
                     ce_out, jsd_out, label_terms, G, ldg};
  mode_dispatch(mode, f);
}

#define DEFINE_VP_FINISH(NAME, OUT)                                                                         \
  extern "C" __global__ void __launch_bounds__(VP_THREADS)                                                 \
      NAME(VP_ROW_ARGS, int mode, float beta, float w_hard, float w_soft_t, const float* stats, const float* kl, \
           float* ce_out, float* jsd_out, void* G, long long ldg, float* label_terms) {                   \
    vp_finish<OUT>(S, lds, Tl, ldt, bias_s, bias_t, target, vs, vt, inv_temp, rows, mode, beta, w_hard,    \
                   w_soft_t, stats, kl, ce_out, jsd_out, G, ldg, label_terms);                            \
  }

DEFINE_VP_FINISH(vp_finish_f32, OUT_F32)
DEFINE_VP_FINISH(vp_finish_f16, OUT_F16)
DEFINE_VP_FINISH(vp_finish_bf16, OUT_BF16)

// ---- float32 sums to 16-bit gradients, times grad_output (scale null: 1) ----

template <int OUT>
__device__ __forceinline__ void scale_cast(const float* __restrict__ in, unsigned short* __restrict__ out,
                                           long long n, const float* __restrict__ scale) {
  const float k = scale ? *scale : 1.0f;
  const long long stride = 4LL * gridDim.x * blockDim.x;
  for (long long i = 4LL * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n; i += stride) {
    float g[4];
    const int count = n - i < 4 ? (int)(n - i) : 4;
    if (count == 4) {
      const float4 v = *reinterpret_cast<const float4*>(in + i);
      g[0] = v.x * k; g[1] = v.y * k; g[2] = v.z * k; g[3] = v.w * k;
    } else {
      for (int c = 0; c < count; ++c) g[c] = in[i + c] * k;
    }
    store4<OUT>(out, i, g, count);
  }
}

extern "C" __global__ void scale_cast_bf16(const float* in, unsigned short* out, long long n, const float* scale) {
  scale_cast<OUT_BF16>(in, out, n, scale);
}
extern "C" __global__ void scale_cast_f16(const float* in, unsigned short* out, long long n, const float* scale) {
  scale_cast<OUT_F16>(in, out, n, scale);
}

// ---- the label terms left out of G, added to the gradient ----

// a value of x (of IN's dtype) as float32
template <int IN>
__device__ __forceinline__ float load_value(const void* x, long long k) {
  if (IN == OUT_F32) return static_cast<const float*>(x)[k];
  const unsigned short v = static_cast<const unsigned short*>(x)[k];
  if (IN == OUT_BF16) return __uint_as_float((unsigned)v << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}

// label_rows: grad_input[i] += norm * label_terms[i] * ws[target[i]] for the rows whose label this
// rank owns (target[i] >= 0); grad_input float32 [rows, hs], one block per row.
template <int IN>
__device__ __forceinline__ void label_rows(const float* __restrict__ label_terms, const int* __restrict__ target,
                                           const void* __restrict__ ws, int hs, float norm,
                                           float* __restrict__ grad_input) {
  const int i = blockIdx.x;
  const long long label = target[i];
  if (label < 0) return;
  const float k = label_terms[i] * norm;
  for (int h = threadIdx.x; h < hs; h += blockDim.x)
    grad_input[(long long)i * hs + h] += k * load_value<IN>(ws, label * hs + h);
}

#define LABEL_ROWS_ARGS \
  const float *label_terms, const int *target, const void *ws, int hs, float norm, float *grad_input
extern "C" __global__ void label_rows_f32(LABEL_ROWS_ARGS) { label_rows<OUT_F32>(label_terms, target, ws, hs, norm, grad_input); }
extern "C" __global__ void label_rows_f16(LABEL_ROWS_ARGS) { label_rows<OUT_F16>(label_terms, target, ws, hs, norm, grad_input); }
extern "C" __global__ void label_rows_bf16(LABEL_ROWS_ARGS) { label_rows<OUT_BF16>(label_terms, target, ws, hs, norm, grad_input); }

// grad_weight[label] += k * sum over the rows i with that label of label_terms[i] * x[i], and
// grad_bias[label] likewise, with k = norm (times *scale where scale is not null). order: the
// rows sorted by label, stably; sorted_target: their labels (-1: a label on another rank).
// grad_weight (or grad_bias) null: left alone. grad_weight is the float32 sums (OUT = OUT_F32) or
// the finished gradient in the inputs' dtype (OUT = IN); grad_bias is always float32 sums.
// Block b works only where a label's rows start, and adds them in order: no atomics, so the
// results have the same bits on every run.

template <int IN, int OUT>
__device__ __forceinline__ void label_scatter(const float* __restrict__ label_terms, const int* __restrict__ order,
                                              const int* __restrict__ sorted_target, int n_rows,
                                              const void* __restrict__ x, int hs, float norm,
                                              const float* __restrict__ scale, void* __restrict__ grad_weight,
                                              float* __restrict__ grad_bias) {
  const int begin = blockIdx.x;
  const long long label = sorted_target[begin];
  if (label < 0 || (begin > 0 && sorted_target[begin - 1] == label)) return;
  int end = begin + 1;
  while (end < n_rows && sorted_target[end] == label) ++end;
  const float k = scale ? norm * *scale : norm;
  for (int h = threadIdx.x; grad_weight != nullptr && h < hs; h += blockDim.x) {
    float acc = 0.0f;
    for (int r = begin; r < end; ++r) {
      const int i = order[r];
      acc += label_terms[i] * load_value<IN>(x, (long long)i * hs + h);
    }
    const float sum = load_value<OUT>(grad_weight, label * hs + h) + k * acc;
    store4<OUT>(grad_weight, label * hs + h, &sum, 1);
  }
  if (grad_bias != nullptr && threadIdx.x == 0) {
    float acc = 0.0f;
    for (int r = begin; r < end; ++r) acc += label_terms[order[r]];
    grad_bias[label] += k * acc;
  }
}

#define LABEL_SCATTER_ARGS                                                                                \
  const float *label_terms, const int *order, const int *sorted_target, int n_rows, const void *x, int hs, \
      float norm, const float *scale, void *grad_weight, float *grad_bias
#define LABEL_SCATTER_CALL label_terms, order, sorted_target, n_rows, x, hs, norm, scale, grad_weight, grad_bias
// label_scatter_<inputs' dtype>_<grad_weight's dtype>
extern "C" __global__ void label_scatter_f32_f32(LABEL_SCATTER_ARGS) { label_scatter<OUT_F32, OUT_F32>(LABEL_SCATTER_CALL); }
extern "C" __global__ void label_scatter_f16_f32(LABEL_SCATTER_ARGS) { label_scatter<OUT_F16, OUT_F32>(LABEL_SCATTER_CALL); }
extern "C" __global__ void label_scatter_bf16_f32(LABEL_SCATTER_ARGS) { label_scatter<OUT_BF16, OUT_F32>(LABEL_SCATTER_CALL); }
extern "C" __global__ void label_scatter_f16_f16(LABEL_SCATTER_ARGS) { label_scatter<OUT_F16, OUT_F16>(LABEL_SCATTER_CALL); }
extern "C" __global__ void label_scatter_bf16_bf16(LABEL_SCATTER_ARGS) { label_scatter<OUT_BF16, OUT_BF16>(LABEL_SCATTER_CALL); }

// ---- the valid rows: which token rows count, and their targets ----
//
// One CTA scans the targets in order, in tiles of SELECT_THREADS * SELECT_ITEMS: rows gets the
// indices of the rows whose target is not ignore_index (has_ignore: ignore_index is an int64), in
// order, and row_target their targets as int32; out[0] = their count, out[1] = the first row
// whose target is neither ignore_index nor in [0, vocab) (n where there is none). One CTA keeps
// the order with no second kernel; the targets of T = 8192 rows are one tile.
#define SELECT_THREADS 1024
#define SELECT_ITEMS 8

// the sum of v over lanes 0 to this one
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += x;
  }
  return v;
}

template <typename T>
__device__ __forceinline__ void select_rows(const T* __restrict__ target, int n, long long ignore_index,
                                            int has_ignore, long long vocab, int* __restrict__ rows,
                                            int* __restrict__ row_target, int* __restrict__ out) {
  constexpr int WARPS = SELECT_THREADS / 32;
  __shared__ int warp_total[WARPS];
  __shared__ int done, first_bad;  // rows selected by the tiles before; the first bad row
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    done = 0;
    first_bad = n;
  }
  __syncthreads();
  for (int tile = 0; tile < n; tile += SELECT_THREADS * SELECT_ITEMS) {
    const int i0 = tile + threadIdx.x * SELECT_ITEMS;
    int v[SELECT_ITEMS];  // the targets as int32 (where they are not bad, they fit)
    unsigned valid = 0;   // bit j: row i0 + j is selected
#pragma unroll
    for (int j = 0; j < SELECT_ITEMS; ++j) {
      const long long t = i0 + j < n ? (long long)target[i0 + j] : 0;
      v[j] = (int)t;
      if (i0 + j < n && !(has_ignore && t == ignore_index)) {
        valid |= 1u << j;
        // as unsigned, a negative target is >= vocab too
        if ((unsigned long long)t >= (unsigned long long)vocab) atomicMin(&first_bad, i0 + j);
      }
    }
    // where this thread's rows go: an exclusive scan of the counts over the block
    const int mine = __popc(valid);
    int before = warp_inclusive_sum(mine);  // then made exclusive
    if (lane == 31) warp_total[warp] = before;
    before -= mine;
    __syncthreads();
    if (warp == 0) warp_total[lane] = warp_inclusive_sum(warp_total[lane]);  // the warps' totals, inclusive
    __syncthreads();
    int at = done + (warp ? warp_total[warp - 1] : 0) + before;
#pragma unroll
    for (int j = 0; j < SELECT_ITEMS; ++j) {
      if (valid >> j & 1) {
        rows[at] = i0 + j;
        row_target[at] = v[j];
        ++at;
      }
    }
    __syncthreads();  // every thread has read done and warp_total
    if (threadIdx.x == 0) done += warp_total[WARPS - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[0] = done;
    out[1] = first_bad;
  }
}

#define SELECT_ROWS_ARGS \
  int n, long long ignore_index, int has_ignore, long long vocab, int *rows, int *row_target, int *out
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) select_rows_i32(const int* target, SELECT_ROWS_ARGS) {
  select_rows(target, n, ignore_index, has_ignore, vocab, rows, row_target, out);
}
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) select_rows_i64(const long long* target, SELECT_ROWS_ARGS) {
  select_rows(target, n, ignore_index, has_ignore, vocab, rows, row_target, out);
}

// ---- rows of two matrices, gathered ----
//
// out_a[i] = a[rows[i]] and out_b[i] = b[rows[i]] for i < count (blockIdx.y: 0 for a, 1 for b),
// in words of W: rows of a_words and b_words words each (W = uint4 where every row is 16-byte
// aligned, else unsigned short: every dtype here has an even size). One CTA per output row.
template <typename W>
__device__ __forceinline__ void gather_rows(const int* __restrict__ rows, const W* __restrict__ a, W* __restrict__ out_a,
                                            long long a_words, const W* __restrict__ b, W* __restrict__ out_b,
                                            long long b_words) {
  const bool is_a = blockIdx.y == 0;
  const long long words = is_a ? a_words : b_words;
  const W* src = (is_a ? a : b) + rows[blockIdx.x] * words;
  W* dst = (is_a ? out_a : out_b) + blockIdx.x * words;
  for (long long k = threadIdx.x; k < words; k += blockDim.x) dst[k] = src[k];
}

#define GATHER_ROWS_ARGS(W) \
  const int *rows, const W *a, W *out_a, long long a_words, const W *b, W *out_b, long long b_words
extern "C" __global__ void gather_rows_16(GATHER_ROWS_ARGS(uint4)) { gather_rows(rows, a, out_a, a_words, b, out_b, b_words); }
extern "C" __global__ void gather_rows_2(GATHER_ROWS_ARGS(unsigned short)) {
  gather_rows(rows, a, out_a, a_words, b, out_b, b_words);
}
