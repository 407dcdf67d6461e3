// Offline distillation (docs/contract.md, "Offline distillation"): the row work of the loss
// against a teacher's stored top-k log-probabilities (topk_rows), the check of those top-k
// (topk_check), and the teacher's own top-k of its logits (teacher_topk). One CTA of THREADS per
// row; every merge in a fixed order. Instantiated by jsdgpu/cuda/kernels.py.
//
// Units: the row statistics over the vocabulary are float32 logsumexps in bits (x * scale2,
// scale2 = log2(e) / temperature); the k + 1 categories' math is in float64 and natural units:
// per row it is a few thousand operations, and float64 keeps the gradient's u - u_bar free of
// the cancellation that a near one-hot P would give in float32 (docs/design.md, "Top-k").
#include "ptx.cuh"
#include "reduce.cuh"
#include "row_math.cuh"

#define D_INF __longlong_as_double(0x7ff0000000000000LL)

// ---- fixed-order merges over the block, the total in every thread ----

struct DLse {
  double m, s;  // a max and the sum of exp(x - m); s == 0: no value
};

// the row statistics: logsumexp parts (bits) of s, of z = s / T, and of z over the rest (the
// columns that are no slot's id)
struct RowLse {
  Lse s, z, rest;
};

// the categories' sums: logsumexp parts (natural) of the teacher's log-probabilities and of the
// student's, over the used slots
struct SlotLse {
  DLse q, p;
};

struct SlotSums {
  double soft, pu;  // the slots' shares of the divergence and of u_bar = sum_c P_c u_c
  double pu_most;   // the largest |P_c u_c| of a slot (a bound of the slots' gradients)
};

struct Max {
  float m;
};

struct Sum {
  double s;
};

__device__ __forceinline__ float shfl_x(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ double shfl_x(double v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ Lse shfl_x(Lse v, int mask) { return {shfl_x(v.m, mask), shfl_x(v.s, mask)}; }
__device__ __forceinline__ DLse shfl_x(DLse v, int mask) { return {shfl_x(v.m, mask), shfl_x(v.s, mask)}; }
__device__ __forceinline__ RowLse shfl_x(RowLse v, int mask) {
  return {shfl_x(v.s, mask), shfl_x(v.z, mask), shfl_x(v.rest, mask)};
}
__device__ __forceinline__ SlotLse shfl_x(SlotLse v, int mask) { return {shfl_x(v.q, mask), shfl_x(v.p, mask)}; }
__device__ __forceinline__ SlotSums shfl_x(SlotSums v, int mask) {
  return {shfl_x(v.soft, mask), shfl_x(v.pu, mask), shfl_x(v.pu_most, mask)};
}
__device__ __forceinline__ Max shfl_x(Max v, int mask) { return {shfl_x(v.m, mask)}; }
__device__ __forceinline__ Sum shfl_x(Sum v, int mask) { return {shfl_x(v.s, mask)}; }
__device__ __forceinline__ int shfl_x(int v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

// Lse in bits; a part of NaNs keeps s = NaN
__device__ __forceinline__ Lse merge(Lse a, Lse b) {
  if (b.s == 0.0f) return a;
  if (a.s == 0.0f) return b;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * ex2(a.m - m) + b.s * ex2(b.m - m)};
}
__device__ __forceinline__ DLse merge(DLse a, DLse b) {
  if (b.s == 0.0) return a;
  if (a.s == 0.0) return b;
  const double m = fmax(a.m, b.m);
  return {m, a.s * exp(a.m - m) + b.s * exp(b.m - m)};
}
__device__ __forceinline__ RowLse merge(RowLse a, RowLse b) { return {merge(a.s, b.s), merge(a.z, b.z), merge(a.rest, b.rest)}; }
__device__ __forceinline__ SlotLse merge(SlotLse a, SlotLse b) { return {merge(a.q, b.q), merge(a.p, b.p)}; }
__device__ __forceinline__ SlotSums merge(SlotSums a, SlotSums b) {
  return {a.soft + b.soft, a.pu + b.pu, fmax(a.pu_most, b.pu_most)};
}
__device__ __forceinline__ Max merge(Max a, Max b) { return {fmaxf(a.m, b.m)}; }
__device__ __forceinline__ Sum merge(Sum a, Sum b) { return {a.s + b.s}; }
__device__ __forceinline__ int merge(int a, int b) { return a | b; }

// v merged over the block: lanes by an xor tree, then the warps' totals in warp order by every
// thread, so every thread holds the same bits
template <int THREADS, typename T>
__device__ __forceinline__ T block_all(T v) {
  __shared__ T per_warp[THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v = merge(v, shfl_x(v, mask));
  __syncthreads();  // per_warp's last use is done
  if (lane == 0) per_warp[warp] = v;
  __syncthreads();
  T total = per_warp[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) total = merge(total, per_warp[w]);
  return total;
}

// x (bits) into a logsumexp part; -inf adds nothing, NaN makes s NaN
__device__ __forceinline__ void lse_add(Lse& a, float x) {
  if (x > a.m) {
    a.s = fmaf(a.s, ex2(a.m - x), 1.0f);
    a.m = x;
  } else if (x != NEG_INF) {
    a.s += ex2(x - a.m);
  }
}

__device__ __forceinline__ void dlse_add(DLse& a, double x) {
  if (x > a.m) {
    a.s = a.s * exp(a.m - x) + 1.0;
    a.m = x;
  } else if (x != -D_INF) {
    a.s += exp(x - a.m);
  }
}

__device__ __forceinline__ double lse_bits(Lse a) { return a.s == 0.0f ? -D_INF : (double)a.m + log2((double)a.s); }
__device__ __forceinline__ double lse_of(DLse a) { return a.s == 0.0 ? -D_INF : a.m + log(a.s); }

// a float64 logsumexp as two floats, hi + lo: 2^(fmaf(x, scale, -hi) - lo) keeps float32's relative
// precision where the logsumexp is hundreds of bits (low temperatures), where 2^(x scale - float(lse))
// would be off by float(lse)'s rounding, up to 1e-5 of the value
struct Split {
  float hi, lo;
};
__device__ __forceinline__ Split split(double x) {
  const float hi = (float)x;
  return {hi, isfinite(x) ? (float)(x - (double)hi) : 0.0f};
}
__device__ __forceinline__ float ex2_minus(float x, float scale, Split lse) { return ex2(fmaf(x, scale, -lse.hi) - lse.lo); }

__device__ __forceinline__ double log_add_exp(double a, double b) {
  if (isnan(a) || isnan(b)) return a + b;
  const double m = fmax(a, b);
  return m == -D_INF ? m : m + log1p(exp(-fabs(a - b)));
}

// One category's share of the divergence (d) and of u_bar (pu = P u), and u, for log P = lp,
// log q = lq (natural); u is dD/dP up to a constant (which cancels in the gradient), and in forward
// KL, where u = -q / P, the gradient takes P u = -q, so u is not formed.
struct Category {
  double d, pu, u;
};

template <int MODE>
__device__ __forceinline__ Category category(double lp, double lq, double beta, double one_minus_beta,
                                             double log_beta, double log_one_minus_beta) {
  const double P = exp(lp), q = exp(lq);
  if (MODE == FORWARD_KL) return {q != 0.0 ? q * (lq - lp) : 0.0, -q, 0.0};
  if (MODE == REVERSE_KL) {
    const double u = P != 0.0 ? lp - lq : 0.0;
    return {P * u, P * u, u};
  }
  const double lm = log_add_exp(log_one_minus_beta + lp, log_beta + lq);
  const double u = P != 0.0 ? one_minus_beta * (lp - lm) : 0.0;
  return {beta * (q != 0.0 ? q * (lq - lm) : 0.0) + P * u, P * u, u};
}

// A thread's share of the row statistics, built over batches of its columns: the max of its
// logits, the max of those that are no slot's id (the rest), and the sums of 2^(x scale - max
// scale) of s, z and the rest (bits). A batch's max comes first, then its sums with no
// data-dependent branch (rescaled where the max grows; inv_temp > 0, so the max of x scale is
// max(x) scale). The rest's sum shares z's exps; rest_apart() says where the rest's largest term
// is 2^-64 of z's max or less, where terms that matter may have underflowed: the caller then sums
// the rest again against its own max (rest_term). A thread with no finite value sums against 0
// (its NaNs must reach the row).
struct ThreadStats {
  float scale2;
  bool bucket, tempered;
  float mx, mr, sz, ss, sr;

  __device__ __forceinline__ ThreadStats(float scale2_, bool bucket_, bool tempered_)
      : scale2(scale2_), bucket(bucket_), tempered(tempered_), mx(NEG_INF), mr(NEG_INF), sz(0.0f), ss(0.0f),
        sr(0.0f) {}
  __device__ __forceinline__ float m_z() const { return mx == NEG_INF ? 0.0f : mx * scale2; }
  __device__ __forceinline__ float m_s() const { return mx == NEG_INF ? 0.0f : mx * LOG2E; }
  __device__ __forceinline__ float m_rest() const { return mr == NEG_INF ? 0.0f : mr * scale2; }
  __device__ __forceinline__ bool rest_apart() const { return bucket && m_z() - m_rest() > 64.0f; }
  // a rest column's term against the rest's own max (where rest_apart)
  __device__ __forceinline__ float rest_term(float x) const { return ex2(fmaf(x, scale2, -m_rest())); }

  // N float4s of logits (-inf: no column); bit 4 g + j of slot_bits: x[g]'s value j is a slot's id
  template <int N>
  __device__ __forceinline__ void add(const float4 (&x)[N], unsigned slot_bits) {
    float bm = NEG_INF, brm = NEG_INF;
#pragma unroll
    for (int g = 0; g < N; ++g) {
      bm = fmaxf(bm, max4(x[g]));
      const unsigned b = slot_bits >> (4 * g);
      brm = fmaxf(brm, fmaxf(fmaxf(b & 1u ? NEG_INF : x[g].x, b & 2u ? NEG_INF : x[g].y),
                             fmaxf(b & 4u ? NEG_INF : x[g].z, b & 8u ? NEG_INF : x[g].w)));
    }
    if (bucket) mr = fmaxf(mr, brm);
    if (bm > mx) {  // the sums against the new max (none before: no sums to move)
      if (mx != NEG_INF) {
        const float to_z = ex2(m_z() - bm * scale2);
        sz *= to_z;
        sr *= to_z;
        if (tempered) ss *= ex2(m_s() - bm * LOG2E);
      }
      mx = bm;
    }
    const float mz = m_z(), ms = m_s();
#pragma unroll
    for (int g = 0; g < N; ++g) {
      const float xv[4] = {x[g].x, x[g].y, x[g].z, x[g].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float e = ex2(fmaf(xv[j], scale2, -mz));
        sz += e;
        if (bucket && !(slot_bits >> (4 * g + j) & 1u)) sr += e;
        if (tempered) ss += ex2(fmaf(xv[j], LOG2E, -ms));
      }
    }
  }

  // the thread's RowLse; rest_sum: the rest's sum against m_rest() where rest_apart(), else sr
  __device__ __forceinline__ RowLse parts(float rest_sum) const {
    const float mz = m_z();
    return {{tempered ? m_s() : mz, tempered ? ss : sz}, {mz, sz}, {rest_apart() ? m_rest() : mz, rest_sum}};
  }
};

// the slot bits of the 4 columns of a float4 group that starts at column c (a multiple of 4) of bitmap
__device__ __forceinline__ unsigned group_slots(const unsigned* bitmap, int c) { return bitmap[c >> 5] >> (c & 31) & 15u; }

// The gradient of a column that is no slot's id: w_hard (softmax - onehot) + w_soft_over_t dz,
// with dz = A p + B r (p = 2^(z - lse_p2), normalized as the categories are; r = 2^(z - lse_r2);
// in the bucket mode A = u_rest - u_bar and B = 0, or in forward KL A = -u_bar and B = -q_rest, r
// being p / P_rest; both 0 in the renormalize mode). p and r differ by a factor of the row, and so
// do softmax and p without a temperature: the factors are folded in float64 where the result is a
// float, so that a column takes one ex2 (no temperature), two (a temperature), or three (forward
// KL with a rest too small for float32). Logsumexps in bits.
struct RestGradient {
  Split lse_s2, lse_p2, lse_r2;
  float scale2, w_hard, w_soft_over_t;
  float e;     // path 1: the factor of softmax
  float c;     // path 2: w_soft_over_t (A + B 2^(lse_p2 - lse_r2)), the factor of p
  float a, b;  // path 3: A and B
  int path;

  __device__ __forceinline__ RestGradient(double lse_s2_, double lse_p2_, double lse_r2_, double A, double B,
                                          float scale2_, float w_hard_, float w_soft_over_t_)
      : lse_s2(split(lse_s2_)), lse_p2(split(lse_p2_)), lse_r2(split(lse_r2_)), scale2(scale2_), w_hard(w_hard_),
        w_soft_over_t(w_soft_over_t_), a((float)A), b((float)B) {
    const double C = w_soft_over_t_ * (A + (B != 0.0 ? B * exp2(lse_p2_ - lse_r2_) : 0.0));
    const double E = w_hard_ + (C != 0.0 ? C * exp2(lse_s2_ - lse_p2_) : 0.0);
    c = (float)C;
    e = (float)E;
    // fabs(NaN) <= x is false: a NaN row takes path 3, which makes its NaN
    path = C == 0.0 || (scale2_ == LOG2E && fabs(E) <= FLT_MAX_FINITE) ? 1 : fabs(C) <= FLT_MAX_FINITE ? 2 : 3;
  }

  __device__ __forceinline__ float value(float x, bool onehot) const {
    const float softmax = ex2_minus(x, LOG2E, lse_s2), hot = onehot ? w_hard : 0.0f;
    if (path == 1) return fmaf(e, softmax, -hot);
    const float p = ex2_minus(x, scale2, lse_p2);
    if (path == 2) return fmaf(w_hard, softmax, fmaf(c, p, -hot));
    return fmaf(w_hard, softmax, fmaf(w_soft_over_t, fmaf(a, p, b * ex2_minus(x, scale2, lse_r2)), -hot));
  }
};

// What topk_finish reads beside the slots' logits (S [rows, lds], biased, in the places that
// place() gives), from topk_logits.cu's epilogue: per row, the tiles' partials (G~'s ref, its
// sum, the rest's max and sum) and the row's ref; the ref flags, which it clears for the next
// chunk; the chunk's slot bitmap and slots_before (topk_slot_bits'). The label's logit it makes
// itself, from the row of Xs and the label's of Ws (bf16; bias: padded, or null).
struct FromProduct {
  static constexpr int TILE_COLUMNS = TOPK_LOGITS_COLUMNS;  // topk_logits.cu's BN (sources.py)
  static_assert(TILE_COLUMNS == 256, "place() reads a tile's slot bits as 8 words");
  const float4* partials;
  int n_tiles;
  const float* ref;
  const unsigned short* xs;  // the chunk's rows
  const unsigned short* ws;
  int hs;
  const float* bias;
  const unsigned* bitmap;
  int words;
  int* ready;
  const int* slots_before;

  // Where the epilogue put the logit of slot column `id` of the row (topk_logits.cu): the row's
  // slot columns in tiles before id's come first (slots_before), then, in id's tile, those of the
  // threads before id's (a row's 4 threads take columns 8 i + 2 quad + e), then that thread's
  // before id, in column order
  __device__ __forceinline__ int place(long long row, int id) const {
    const int t = id / TILE_COLUMNS, j = id % TILE_COLUMNS, quad = j / 2 % 4, w = j / 32;
    const uint4* p = reinterpret_cast<const uint4*>(bitmap + row * words + t * 8);
    const uint4 lo = p[0], hi = p[1];
    const unsigned tile_words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    int at = slots_before[row * n_tiles + t];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      at += __popc(tile_words[i] & quads_before(quad)) +
            __popc(tile_words[i] & quad_columns(quad) & (i < w ? ~0u : i == w ? (1u << j % 32) - 1u : 0u));
    return at;
  }
};

// ---- the loss's row work ----
//
// S [rows, lds]: the chunk's float32 student logits without bias; bias_s: float32, padded with
// zeros to a multiple of 4, or null. ids, lq [rows, k]: the slots (an id, the teacher's
// log-probability; -inf: unused). bucket: the k + 1 categories (else the k renormalized). Writes
// ce_out, soft_out (natural units) and, with G, the row's gradient in the student logits without
// 1/N in OUT's format, the label's one-hot term kept out where softmax(s)[y] < 1/2 (label_terms,
// as the fused kernel's). Dynamic shared memory: the slot bitmap, (vs + 31) / 32 words (bucket).
//
// The gradient in the tempered logits z is p_j (u_j - u_bar), u_j the u of column j's category:
// the rest's for every column that is no slot's id, written by a streaming pass; then the slots'
// columns (and the label's) are written over by their own.
//
// row_scale not null (asked for where the rest's gradient is one exponential of the row's
// columns: no temperature, or no hard part; G in bf16 or float32): one streaming pass. Its
// statistics pass also writes G~ = 2^(x scale2 - r2), r2 the first batch's max, and the row's
// gradient is row_scale[row] G~ (the slots' and label's columns written over as their value /
// row_scale), which the gradient products apply ([T, Hs] work, not [T, V]): the row is read once,
// 6 bytes a column where two passes move 10. Where that cannot hold the row's values (its
// logsumexp over 64 bits above r2, a scale outside 2^-100..2^100, a slot's value over 2^64 G~,
// another kind of rest gradient, NaN), the row takes the second pass as without row_scale, and
// row_scale[row] = 1 (docs/design.md, "Top-k").
//
// FUSED (topk_finish): the row's statistics from the product's epilogue (FromProduct), S its
// slots' logits (biased: bias_s null; each read once, into dynamic shared memory with the slots'
// ids and log-probabilities: 12 bytes a slot), the label's logit made here; G holds G~ (bf16)
// already, against the row's ref, and the row keeps it as the one pass does, or (where that
// cannot hold it, or a tile took its own ref) each tile's G~ is rescaled in place (its ref and
// the row's factor known): no logits are read. Temperature 1 and bf16 only (the caller's choice).
template <int MODE, int OUT, int THREADS, int STAGES, bool FUSED = false>
__device__ __forceinline__ void topk_rows_body(const float* __restrict__ S, long long lds, const float* __restrict__ bias_s,
                                          const int* __restrict__ target, int vs, const int* __restrict__ ids,
                                          const float* __restrict__ lq_in, int k, float scale2, int bucket,
                                          double beta, double one_minus_beta, float w_hard, float w_soft_over_t,
                                          float* __restrict__ ce_out, float* __restrict__ soft_out, void* G,
                                          long long ldg, float* __restrict__ label_terms,
                                          float* __restrict__ row_scale, FromProduct fp = {}) {
  // Dynamic shared memory: the ring of STAGES batches of the row (BATCH columns each), then the
  // slot bitmap (bucket)
  constexpr int UNROLL = 4, BATCH = 4 * THREADS * UNROLL;
  extern __shared__ float4 ring[];
  unsigned* bitmap = reinterpret_cast<unsigned*>(ring + STAGES * BATCH / 4);
  __shared__ unsigned long long bars[STAGES];  // a batch's bytes in its stage, one phase per use
  __shared__ float target_logit;
  const long long row = blockIdx.x;
  const float* srow = S + row * lds;
  // FUSED, in dynamic shared memory: slot c's logit, id and teacher log-probability, which the
  // slot loops read there (read from global memory, each of the five loops waited for them again)
  float* fused_slots = reinterpret_cast<float*>(ring);
  int* fused_ids = reinterpret_cast<int*>(fused_slots + k);
  float* fused_lq = fused_slots + 2 * k;
  const int* rids = FUSED ? fused_ids : ids + row * k;
  const float* rlq = FUSED ? fused_lq : lq_in + row * k;
  const int y = target[row];
  const double scale2d = scale2;  // the float32 scale the streaming passes use, so both agree
  auto logit = [&](int column) { return srow[column] + (bias_s ? bias_s[column] : 0.0f); };
  auto slot_logit = [&](int c) { return FUSED ? fused_slots[c] : logit(rids[c]); };
  // (the row's G made where it is needed, as copies() below: held in registers, they left the
  // kernel spilling)
  auto grow = [&] { return static_cast<void*>(static_cast<char*>(G) + row * ldg * (OUT == OUT_F32 ? 4 : 2)); };
  const bool one_pass = G != nullptr && row_scale != nullptr;
  bool second_pass = G != nullptr && !one_pass;  // one pass: set where the row needs the second after all

  // The streaming passes read the row batch by batch from the ring: thread 0 keeps STAGES
  // batches on their way (bulk copies, in the order the passes take them: the row, then again
  // for the gradient), so that more of the row is in flight than the threads' registers hold,
  // the first ones from here on, while the slots' bitmap is made.
  // (copies() made where it is needed: held in a register, it left the kernel spilling)
  const int batches = (vs + BATCH - 1) / BATCH;
  auto copies = [&] { return second_pass ? 2 * batches : batches; };
  auto copy_batch = [&](int n) {  // copy n (of the passes' batches in order) into stage n % STAGES
    const int c0 = n % batches * BATCH;
    const unsigned bytes = 16 * ((min(BATCH, vs - c0) + 3) / 4), bar = smem_addr(bars + n % STAGES);
    mbar_expect_bytes(bar, bytes);
    bulk_copy(smem_addr(ring + n % STAGES * (BATCH / 4)), srow + c0, bytes, bar);
  };
  if (!FUSED && threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) mbar_init(smem_addr(bars + i), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int n = 0; n < min(STAGES, copies()); ++n) copy_batch(n);
  }

  if (!FUSED && bucket) {
    for (int w = threadIdx.x; w < (vs + 31) / 32; w += THREADS) bitmap[w] = 0u;
    __syncthreads();
    for (int c = threadIdx.x; c < k; c += THREADS)
      if (rlq[c] != NEG_INF) atomicOr(bitmap + (rids[c] >> 5), 1u << (rids[c] & 31));
  }
  // FUSED: the row's first PREFETCHED tile partials a thread (every tile up to V = 8 THREADS 256),
  // and the row's ref, loaded before the label's dot product, whose loads they then wait with
  // (loaded after it, their merge took a quarter of the row's time, 13-15 of 50-54 thousand cycles)
  constexpr int PREFETCHED = 8;
  float4 partial[FUSED ? PREFETCHED : 1];
  float row_ref;
  if constexpr (FUSED) {
    row_ref = fp.ref[row];
#pragma unroll
    for (int i = 0; i < PREFETCHED; ++i)
      if (threadIdx.x + i * THREADS < fp.n_tiles) partial[i] = fp.partials[row * fp.n_tiles + threadIdx.x + i * THREADS];
#pragma unroll 4
    for (int c = threadIdx.x; c < k; c += THREADS) {  // the slots, into shared memory (seen after the
      fused_ids[c] = ids[row * k + c];                 // __syncthreads below)
      fused_lq[c] = lq_in[row * k + c];
    }
  }
  if constexpr (FUSED) {  // the label's logit, Xs[row] . Ws[y] (+ bias), summed in float64, 8
    // columns a thread at a time (hs is a multiple of 8 and the rows 16-byte aligned: the own
    // product's condition), so that a thread's loads are few and all on their way at once
    Sum dot = {0.0};
    if (y >= 0) {
      const uint4* x8 = reinterpret_cast<const uint4*>(fp.xs + row * fp.hs);
      const uint4* w8 = reinterpret_cast<const uint4*>(fp.ws + (long long)y * fp.hs);
#pragma unroll 4
      for (int h = threadIdx.x; h < fp.hs / 8; h += THREADS) {
        const uint4 a = __ldg(x8 + h), b = __ldg(w8 + h);
        const unsigned* av = &a.x;
        const unsigned* bv = &b.x;
#pragma unroll
        for (int j = 0; j < 4; ++j)  // each product exact in float32
          dot.s += (double)(__uint_as_float(av[j] << 16) * __uint_as_float(bv[j] << 16)) +
                   (double)(__uint_as_float(av[j] & 0xffff0000u) * __uint_as_float(bv[j] & 0xffff0000u));
      }
    }
    dot = block_all<THREADS>(dot);
    if (threadIdx.x == 0) target_logit = y < 0 ? 0.0f : (float)dot.s + (fp.bias ? fp.bias[y] : 0.0f);
  } else if (threadIdx.x == 0) {  // y = -1: a masked row (capturable)
    target_logit = y < 0 ? 0.0f : logit(y);
  }
  __syncthreads();  // the bitmap, the target's logit and the ring's mbarriers are ready

  // 1. the row statistics over the vocabulary, UNROLL float4 groups of a thread at a time
  // batch n's groups base + u 4 THREADS (base: the thread's first column; -inf past vs), biased,
  // from the ring; then, once every thread has them, the stage takes copy n + STAGES
  auto batch = [&](int n, int base, float4 (&x)[UNROLL]) {
    mbar_wait(smem_addr(bars + n % STAGES), n / STAGES & 1);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + 4 * THREADS * u;
      x[u] = i < vs ? ring[n % STAGES * (BATCH / 4) + threadIdx.x + THREADS * u]
                    : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
      if (i < vs && bias_s) x[u] = add4(x[u], *reinterpret_cast<const float4*>(bias_s + i));
      if (i < vs && i + 4 > vs) x[u] = fill(x[u], vs - i, 4, NEG_INF);
    }
    __syncthreads();
    if (threadIdx.x == 0 && n + STAGES < copies()) {
      fence_proxy_async();  // the CTA's reads of the stage come before the copy's writes
      copy_batch(n + STAGES);
    }
  };
  auto batch_slots = [&](int base) {  // bit 4 u + j: column j of group u is a slot's id
    unsigned bits = 0u;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + 4 * THREADS * u;
      if (bucket && i < vs) bits |= group_slots(bitmap, i) << (4 * u);
    }
    return bits;
  };
  __shared__ float r2;  // one pass: G~'s reference (bits of z), the first batch's max (in a register: spills)
  __shared__ int own_refs;  // FUSED: a tile of the row took a ref of its own
  RowLse st;
  if constexpr (FUSED) {  // the tiles' partials merged (a thread's in tile order)
    Lse z = {NEG_INF, 0.0f}, rest = {NEG_INF, 0.0f};
    int own = 0;
    auto add_tile = [&](float4 part) {
      z = merge(z, Lse{part.x, part.y});
      rest = merge(rest, Lse{part.z, part.w});
      own |= !(part.x == row_ref);
    };
#pragma unroll
    for (int i = 0; i < PREFETCHED; ++i)
      if (threadIdx.x + i * THREADS < fp.n_tiles) add_tile(partial[i]);
    for (int t = threadIdx.x + PREFETCHED * THREADS; t < fp.n_tiles; t += THREADS)
      add_tile(fp.partials[row * fp.n_tiles + t]);
    st = block_all<THREADS>(RowLse{z, z, rest});  // temperature 1: s is z
    own = block_all<THREADS>(own);
    if (threadIdx.x == 0) {
      r2 = row_ref;
      own_refs = own;
    }
    __syncthreads();
  } else {
    ThreadStats ts(scale2, bucket, scale2 != LOG2E);
    for (int n = 0; n < batches; ++n) {
      const int base = n * BATCH + 4 * threadIdx.x;
      float4 x[UNROLL];
      batch(n, base, x);
      ts.add(x, batch_slots(base));
      if (!one_pass) continue;
      if (n == 0) {
        const float first_max = block_all<THREADS>(Max{ts.mx}).m;
        if (threadIdx.x == 0) r2 = first_max * scale2;
        __syncthreads();
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = base + 4 * THREADS * u;
        if (i >= vs) break;
        const float out[4] = {ex2(fmaf(x[u].x, scale2, -r2)), ex2(fmaf(x[u].y, scale2, -r2)),
                              ex2(fmaf(x[u].z, scale2, -r2)), ex2(fmaf(x[u].w, scale2, -r2))};
        store4<OUT>(grow(), i, out, min(4, vs - i));
      }
    }
    float rest_sum = ts.sr;
    if (ts.rest_apart()) {  // rare: the rest far below the max; its sum again, against its own max
      rest_sum = 0.0f;
      for (int base = 4 * threadIdx.x; base < vs; base += BATCH) {  // from global memory: some threads only
        float4 x[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int i = base + 4 * THREADS * u;
          x[u] = i < vs ? *reinterpret_cast<const float4*>(srow + i) : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
          if (i < vs && bias_s) x[u] = add4(x[u], *reinterpret_cast<const float4*>(bias_s + i));
          if (i < vs && i + 4 > vs) x[u] = fill(x[u], vs - i, 4, NEG_INF);
        }
        const unsigned bits = batch_slots(base);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const float xv[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (!(bits >> (4 * u + j) & 1u)) rest_sum += ts.rest_term(xv[j]);
        }
      }
    }
    st = block_all<THREADS>(ts.parts(rest_sum));
  }
  const double lse_s = lse_bits(st.s) * LN2, lse_z2 = lse_bits(st.z), lse_rest2 = lse_bits(st.rest);

  if constexpr (FUSED)  // the slots' logits from their places (each thread reads back only its own slots)
#pragma unroll 4
    for (int c = threadIdx.x; c < k; c += THREADS)
      if (rlq[c] != NEG_INF) fused_slots[c] = srow[fp.place(row, rids[c])];

  // 2. the categories' normalizations: log P_c = z_c - lse_z, normalized by the sum of every
  //    category's P (bucket; that takes out lse_z's float32 rounding) or over the slots
  //    (renormalize); log q_c as given, renormalized over the used slots there
  const double log_beta = log(beta), log_one_minus_beta = log1p(-beta);
  SlotLse sl = {{-D_INF, 0.0}, {-D_INF, 0.0}};
  for (int c = threadIdx.x; c < k; c += THREADS) {
    const float l = rlq[c];
    if (l == NEG_INF) continue;
    dlse_add(sl.q, l);
    dlse_add(sl.p, ((double)slot_logit(c) * scale2d - lse_z2) * LN2);
  }
  sl = block_all<THREADS>(sl);
  double lp_rest = -D_INF, lq_rest = -D_INF, p_shift, q_shift = 0.0;
  const double lse_q = lse_of(sl.q);
  if (bucket) {
    lp_rest = (lse_rest2 - lse_z2) * LN2;
    p_shift = log_add_exp(lse_of(sl.p), lp_rest);
    lp_rest -= p_shift;
    // log(1 - sum q), without cancellation where the top-k hold nearly all of it; 0 above 1
    lq_rest = isnan(lse_q) ? lse_q : lse_q < 0.0 ? log(-expm1(lse_q)) : -D_INF;
    if (st.rest.s == 0.0f) lq_rest = -D_INF;  // the slots hold every id: no rest (what is left of q is rounding)
  } else {
    p_shift = lse_of(sl.p);
    q_shift = lse_q;
  }
  auto slot_logs = [&](int c, double& lp, double& lq) {
    lp = ((double)slot_logit(c) * scale2d - lse_z2) * LN2 - p_shift;
    lq = (double)rlq[c] - q_shift;
  };

  // 3. the divergence and u_bar
  SlotSums sums = {0.0, 0.0, 0.0};
  for (int c = threadIdx.x; c < k; c += THREADS) {
    if (rlq[c] == NEG_INF) continue;
    double lp, lq;
    slot_logs(c, lp, lq);
    const Category cat = category<MODE>(lp, lq, beta, one_minus_beta, log_beta, log_one_minus_beta);
    sums.soft += cat.d;
    sums.pu += cat.pu;
    sums.pu_most = fmax(sums.pu_most, fabs(cat.pu));  // NaN: not kept, but u_bar is NaN then
  }
  sums = block_all<THREADS>(sums);
  const Category rest = bucket ? category<MODE>(lp_rest, lq_rest, beta, one_minus_beta, log_beta, log_one_minus_beta)
                               : Category{0.0, 0.0, 0.0};
  const double soft = sums.soft + rest.d, u_bar = sums.pu + rest.pu;
  const bool label_apart = G != nullptr && target_logit - (float)lse_s < -LN2;  // softmax(s)[y] < 1/2
  if (threadIdx.x == 0) {
    ce_out[row] = (float)(lse_s - (double)target_logit);
    soft_out[row] = soft < 0.0 ? 0.0f : (float)soft;  // a divergence is >= 0: below by rounding alone (NaN passes)
    if (G != nullptr) label_terms[row] = label_apart ? -w_hard : 0.0f;
  }
  if (G == nullptr) return;

  // 4. the gradient row: every column as the rest's (RestGradient), then the slots' columns
  //    written over
  const double lse_s2 = lse_s * LOG2E, lse_p2 = lse_z2 + p_shift * LOG2E;
  const RestGradient g(lse_s2, lse_p2, lse_rest2, bucket ? (MODE == FORWARD_KL ? -u_bar : rest.u - u_bar) : 0.0,
                       bucket && MODE == FORWARD_KL ? -exp(lq_rest) : 0.0, scale2, w_hard, w_soft_over_t);
  const int label = label_apart ? -1 : y;  // where G takes the label's one-hot term
  // one pass: the rest's gradient is F 2^(x scale2 - L) = scale G~ (path 1 without a temperature,
  // path 2 with no hard part, as the caller asks); the slots' and label's values are below
  // `most`, which G~ must hold after dividing by scale. Decided by thread 0 (every thread holds
  // the same bits; in every thread, it left the kernel spilling).
  __shared__ float row_unscale;  // 1 / row_scale[row] where one pass holds, 0 where the row takes the second
  if (one_pass) {
    if (threadIdx.x == 0) {
      const bool plain = scale2 == LOG2E;
      const double L = plain ? lse_s2 : lse_p2, F = plain ? g.e : g.c;
      const double scale = F * exp2((double)r2 - L);
      const double most = fabs(F) + 2.0 * fabs(w_hard) + fabs(w_soft_over_t) * (sums.pu_most + fabs(u_bar) + 1.0);
      const bool holds = g.path == (plain ? 1 : 2) && isfinite(r2) && L - r2 <= 64.0 && fabs(scale) >= 0x1p-100
                         && fabs(scale) <= 0x1p100 && most <= 0x1p64 * fabs(scale)  // false for NaN
                         && !(FUSED && own_refs);
      row_scale[row] = holds ? (float)scale : 1.0f;
      const float inv = 1.0f / (float)scale;
      row_unscale = holds ? inv : 0.0f;
      if (holds && label >= 0) {
        const float value = g.value(target_logit, true) * inv;
        store4<OUT>(grow(), label, &value, 1);
      }
      if (!FUSED && !holds) {  // the second pass's first batches (every stage is free)
        fence_proxy_async();
        for (int n = batches; n < min(batches + STAGES, 2 * batches); ++n) copy_batch(n);
      }
    }
    __syncthreads();
    second_pass = row_unscale == 0.0f;
  }
  if (FUSED && second_pass) {  // G = E 2^(ref_t - L) G~ in each tile t, 8 columns a thread at a time
    const double L = g.lse_s2.hi + (double)g.lse_s2.lo;
    uint4* grow8 = static_cast<uint4*>(grow());
    for (int c8 = threadIdx.x; 8 * c8 < vs; c8 += THREADS) {
      const float factor = (float)(g.e * exp2((double)fp.partials[row * fp.n_tiles + 8 * c8 / FromProduct::TILE_COLUMNS].x - L));
      uint4 v = grow8[c8];
      unsigned* w = &v.x;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        w[j] = pack_16bit<OUT_BF16>(__uint_as_float(w[j] << 16) * factor, __uint_as_float(w[j] & 0xffff0000u) * factor);
      grow8[c8] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0 && label >= 0) {
      const float value = g.value(target_logit, true);
      store4<OUT>(grow(), label, &value, 1);
    }
  }
  for (int n = 0; !FUSED && second_pass && n < batches; ++n) {
    const int base = n * BATCH + 4 * threadIdx.x;
    float4 x[UNROLL];
    batch(batches + n, base, x);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + 4 * THREADS * u;
      if (i >= vs) break;
      const float xv[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
      float out[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) out[j] = g.value(xv[j], i + j == label);
      store4<OUT>(grow(), i, out, min(4, vs - i));
    }
  }
  __syncthreads();  // the streaming pass's writes come before the slots' own
  const float unscale = one_pass && !second_pass ? row_unscale : 1.0f;
  for (int c = threadIdx.x; c < k; c += THREADS) {
    if (rlq[c] == NEG_INF) continue;
    double lp, lq;  // (its category made again: kept from the divergence's pass, no faster, docs/record.md)
    slot_logs(c, lp, lq);
    const Category cat = category<MODE>(lp, lq, beta, one_minus_beta, log_beta, log_one_minus_beta);
    const double P = exp(lp);
    const double dz = MODE == FORWARD_KL ? P * -u_bar - exp(lq) : P * (cat.u - u_bar);
    const int id = rids[c];
    const float softmax = ex2_minus(slot_logit(c), LOG2E, g.lse_s2);
    const float value =
        fmaf(w_hard, softmax - (id == y && !label_apart ? 1.0f : 0.0f), (float)(w_soft_over_t * dz)) * unscale;
    store4<OUT>(grow(), id, &value, 1);
  }
  if constexpr (FUSED)  // the chunk's ref flags cleared for the next chunk
    if (threadIdx.x == 0 && row % 64 == 0) fp.ready[row / 64] = 0;
}

template <int OUT, int THREADS, int STAGES>
__global__ void __launch_bounds__(THREADS, 3) topk_rows(const float* S, long long lds, const float* bias_s,
                                                     const int* target, int vs, const int* ids, const float* lq,
                                                     int k, float scale2, int mode, int bucket, double beta,
                                                     double one_minus_beta, float w_hard, float w_soft_over_t,
                                                     float* ce_out, float* soft_out, void* G, long long ldg,
                                                     float* label_terms, float* row_scale) {
  mode_dispatch(mode, [&](auto m) {
    topk_rows_body<decltype(m)::value, OUT, THREADS, STAGES>(S, lds, bias_s, target, vs, ids, lq, k, scale2, bucket, beta,
                                                     one_minus_beta, w_hard, w_soft_over_t, ce_out, soft_out, G,
                                                     ldg, label_terms, row_scale);
  });
}

// The rows after topk_logits (FUSED above): temperature 1, G bf16, row_scale given; S [rows, lds]:
// the slots' logits in their places (biased). A row is short work with long waits (loads,
// reductions over the block): small CTAs, many resident (docs/design.md, "Top-k: the logits
// product of our own": at 64 threads a row 2.4 times as fast as at 256 with k = 64, 1.3 times
// with k = 256).
template <int THREADS>
__global__ void __launch_bounds__(THREADS, 640 / THREADS)  // 20 warps an SM at least
    topk_finish(const float* S, long long lds, const int* target, int vs, const int* ids, const float* lq, int k,
                int mode, int bucket, double beta, double one_minus_beta, float w_hard, float w_soft_over_t,
                float* ce_out, float* soft_out, void* G, long long ldg, float* label_terms, float* row_scale,
                const float4* partials, int n_tiles, const float* ref, const unsigned short* xs,
                const unsigned short* ws, int hs, const float* bias, const unsigned* bitmap, int words, int* ready,
                const int* slots_before) {
  const FromProduct fp = {partials, n_tiles, ref, xs, ws, hs, bias, bitmap, words, ready, slots_before};
  mode_dispatch(mode, [&](auto m) {
    topk_rows_body<decltype(m)::value, OUT_BF16, THREADS, 1, true>(
        S, lds, nullptr, target, vs, ids, lq, k, LOG2E, bucket, beta, one_minus_beta, w_hard, w_soft_over_t,
        ce_out, soft_out, G, ldg, label_terms, row_scale, fp);
  });
}

// The slots' bitmap of the chunk's rows for topk_logits, and where its epilogue puts the slots'
// logits: per row, every word of its bitmap (words, a multiple of 4; bit id set for every used
// slot), and slots_before[row * n_tiles + t], the row's slot columns in the product's column tiles
// before t (FromProduct::place). A CTA per row. The row's bitmap is made in shared memory and
// written whole, 16 bytes a store: nothing of an earlier chunk is left in it, so nothing clears
// it after (setting bits in global memory and clearing them after the chunk took two scattered
// read-modify-writes a slot). An id outside [0, vs) is left out: the product may run before the
// ids are checked (the call then raises, or in a capturable call its row is NaN, its ids
// clipped). Dynamic shared memory: words + n_tiles ints.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) topk_slot_bits(const int* ids, const float* lq, int k, int vs,
                                                          unsigned* bitmap, int words, int* slots_before, int n_tiles) {
  extern __shared__ uint4 row_words[];  // the row's bitmap (16-byte aligned), then its slot columns per tile
  unsigned* row_bits = reinterpret_cast<unsigned*>(row_words);
  int* in_tile = reinterpret_cast<int*>(row_bits + words);
  const long long row = blockIdx.x;
  for (int w = threadIdx.x; w < words + n_tiles; w += THREADS) row_bits[w] = 0u;
  __syncthreads();
  for (int c = threadIdx.x; c < k; c += THREADS) {
    const int id = ids[row * k + c];
    if (lq[row * k + c] == NEG_INF || id < 0 || id >= vs) continue;
    const unsigned bit = 1u << (id & 31);
    if (!(atomicOr(row_bits + (id >> 5), bit) & bit))  // a repeated id counts once, as its bit
      atomicAdd(in_tile + id / TOPK_LOGITS_COLUMNS, 1);
  }
  __syncthreads();
  uint4* out = reinterpret_cast<uint4*>(bitmap + row * words);
  for (int w4 = threadIdx.x; w4 < words / 4; w4 += THREADS) out[w4] = row_words[w4];
  // the exclusive prefix sum over the tiles: each thread a run of them, then over the threads
  const int per = (n_tiles + THREADS - 1) / THREADS, t0 = min(threadIdx.x * per, n_tiles), t1 = min(t0 + per, n_tiles);
  int run = 0, total;
  for (int t = t0; t < t1; ++t) run += in_tile[t];
  run = block_exclusive_sum<THREADS>(run, total);
  for (int t = t0; t < t1; ++t) {
    slots_before[row * n_tiles + t] = run;
    run += in_tile[t];
  }
}

// ---- the check of the stored top-k ----
//
// Per row: a used slot's id outside [0, vs) (code 1), an id used twice (2), and in the bucket mode
// probabilities summing above 1 + slack (3); the smallest code of the row. *first = min over the
// bad rows of (row << 2 | code) (it starts at ~0). Dynamic shared memory: the bitmap of ids.
template <typename I, int THREADS>
__global__ void __launch_bounds__(THREADS) topk_check(const I* ids, const float* lq, int k, int vs, int bucket,
                                                      double slack, unsigned long long* first) {
  extern __shared__ unsigned seen[];
  const long long row = blockIdx.x;
  for (int w = threadIdx.x; w < (vs + 31) / 32; w += THREADS) seen[w] = 0u;
  __syncthreads();
  int flags = 0;  // bit 0: an id out of range, bit 1: an id twice
  double total = 0.0;
  for (int c = threadIdx.x; c < k; c += THREADS) {
    const float l = lq[row * k + c];
    if (l == NEG_INF) continue;
    total += exp((double)l);
    const long long id = (long long)ids[row * k + c];
    if (id < 0 || id >= vs) {
      flags |= 1;
    } else {
      const unsigned bit = 1u << (id & 31);
      if (atomicOr(seen + (id >> 5), bit) & bit) flags |= 2;
    }
  }
  flags = block_all<THREADS>(flags);
  SlotSums sum = block_all<THREADS>(SlotSums{total, 0.0});
  const int code = flags & 1 ? 1 : flags & 2 ? 2 : bucket && sum.soft > 1.0 + slack ? 3 : 0;
  if (threadIdx.x == 0 && code) atomicMin(first, (unsigned long long)row << 2 | code);
}

// ---- the teacher's top-k ----
//
// Per row of the float32 logits Tl [rows, ldt] (bias: padded, or null): the k largest, by a radix
// select on the floats' bits mapped to unsigned integers of the same order (3 digits of 11, 11
// and 10 bits: a histogram per digit over the values that match the digits found so far), then
// a bitonic sort of the k found, descending (ties: the lower id first), written with their
// log-softmax at the temperature (scale2 = log2(e) / T). Which of several equal values at the
// k-th place are taken is not fixed. Dynamic shared memory: 8 * K2 bytes, K2 the power of 2 >= k.

__device__ __forceinline__ unsigned order_key(float x) {
  const unsigned b = __float_as_uint(x);
  return b & 0x80000000u ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float key_value(unsigned key) {
  return __uint_as_float(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS) teacher_topk(const float* Tl, long long ldt, const float* bias, int v,
                                                        int k, int k2, float scale2, int* ids_out, float* lp_out) {
  constexpr int BINS = 2048;
  extern __shared__ unsigned keys[];  // [k2] keys, then [k2] ids
  int* kept = reinterpret_cast<int*>(keys + k2);
  __shared__ int hist[BINS];
  __shared__ unsigned prefix_s;
  __shared__ int remaining_s, n_gt, n_eq;
  const long long row = blockIdx.x;
  const float* trow = Tl + row * ldt;
  auto value = [&](int column) { return trow[column] + (bias ? bias[column] : 0.0f); };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  Lse lse = {NEG_INF, 0.0f};
  unsigned prefix = 0u, mask = 0u;
  int remaining = k;
  const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
  for (int d = 0; d < 3; ++d) {
    for (int b = threadIdx.x; b < BINS; b += THREADS) hist[b] = 0;
    __syncthreads();
    const unsigned digit_mask = (1u << widths[d]) - 1u;
    for (int i = threadIdx.x; i < v; i += THREADS) {
      const float x = value(i);
      if (d == 0) lse_add(lse, x * scale2);
      const unsigned key = order_key(x);
      if ((key & mask) == prefix) atomicAdd(hist + (key >> shifts[d] & digit_mask), 1);
    }
    __syncthreads();
    if (warp == 0) {  // the bin (from the top) where the count reaches `remaining`
      const int per_lane = BINS / 32, top = BINS - per_lane * lane;  // lane 0: the highest bins
      int count = 0;
      for (int b = top - 1; b >= top - per_lane; --b) count += hist[b];
      const int through = warp_inclusive_sum(count);
      const unsigned reached = __ballot_sync(0xffffffffu, through >= remaining);
      const int first_lane = __ffs(reached) - 1;
      if (lane == first_lane) {
        int above = through - count;
        int b = top - 1;
        while (above + hist[b] < remaining) above += hist[b--];
        prefix_s = prefix | (unsigned)b << shifts[d];
        remaining_s = remaining - above;
      }
    }
    __syncthreads();
    prefix = prefix_s;
    remaining = remaining_s;
    mask |= digit_mask << shifts[d];
    __syncthreads();
  }
  lse = block_all<THREADS>(lse);
  const float lse2 = (float)lse_bits(lse);
  // collect: the values above the k-th, then as many equal to it as are needed
  if (threadIdx.x == 0) n_gt = n_eq = 0;
  for (int i = threadIdx.x + k; i < k2; i += THREADS) {
    keys[i] = 0u;
    kept[i] = 0x7fffffff;
  }
  __syncthreads();
  const int greater = k - remaining;
  for (int i = threadIdx.x; i < v; i += THREADS) {
    const unsigned key = order_key(value(i));
    int at = -1;
    if (key > prefix) {
      at = atomicAdd(&n_gt, 1);
    } else if (key == prefix) {
      const int e = atomicAdd(&n_eq, 1);
      if (e < remaining) at = greater + e;
    }
    if (at >= 0) {
      keys[at] = key;
      kept[at] = i;
    }
  }
  __syncthreads();
  // bitonic sort of k2 entries: descending key, then ascending id
  for (int size = 2; size <= k2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < k2; i += THREADS) {
        const int j = i ^ stride;
        if (j > i) {
          const bool descending = (i & size) == 0;
          const unsigned ki = keys[i], kj = keys[j];
          const int ii = kept[i], ij = kept[j];
          const bool i_first = ki > kj || (ki == kj && ii < ij);
          if (i_first != descending) {
            keys[i] = kj;
            keys[j] = ki;
            kept[i] = ij;
            kept[j] = ii;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int c = threadIdx.x; c < k; c += THREADS) {
    ids_out[row * k + c] = kept[c];
    lp_out[row * k + c] = fmaf(key_value(keys[c]), scale2, -lse2) * LN2;
  }
}
