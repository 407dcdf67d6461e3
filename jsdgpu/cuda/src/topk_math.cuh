// The top-k row work's math (topk_rows.cu): fixed-order merges over a block, logsumexps in bits
// and in float64, the k + 1 categories, a thread's statistics over its columns, and the rest's
// gradient; FromProduct, the statistics topk_logits' epilogue left (topk_finish).
#pragma once
#include "ptx.cuh"
#include "reduce.cuh"
#include "row_math.cuh"

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

// -log2 P_rest beyond which forward KL's rest columns take r = p / P_rest as its own exponential
// (RestGradient's path 3, below)
constexpr double REST_P_MOST_BITS = 100.0;

// The gradient of a column that is no slot's id: w_hard (softmax - onehot) + w_soft_over_t dz,
// with dz = A p + B r (p = 2^(z - lse_p2), normalized as the categories are; r = 2^(z - lse_r2);
// in the bucket mode A = u_rest - u_bar and B = 0, or in forward KL A = -u_bar and B = -q_rest, r
// being p / P_rest; both 0 in the renormalize mode). p and r differ by a factor of the row, and so
// do softmax and p without a temperature: the factors are folded in float64 where the result is a
// float, so that a column takes one ex2 (no temperature), two (a temperature), or three (forward
// KL with a rest too small for float32: r's factor 1 / P_rest past float32's range, or P_rest
// below 2^-100, where a rest column's p that counts, 2^-24 of P_rest or more, could be
// subnormal and flushed, while r = p / P_rest is of order one). Logsumexps in bits.
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
    const bool rest_tiny = B != 0.0 && !(lse_p2_ - lse_r2_ <= REST_P_MOST_BITS);
    path = rest_tiny                                                 ? 3
           : C == 0.0 || (scale2_ == LOG2E && fabs(E) <= FLT_MAX_FINITE) ? 1
           : fabs(C) <= FLT_MAX_FINITE                                 ? 2
                                                                       : 3;
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

