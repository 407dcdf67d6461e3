// Merges in a fixed order: logsumexp parts, the row statistics, sums over the lanes of a warp and
// over the warps of a block, and a warp's inclusive scan. Every tree here gives its result's bits
// from its inputs alone, not from timing: two runs on the same inputs agree bit for bit.
#pragma once

#include "common.cuh"

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
// the target's logit (held by one thread; the others hold 0, so a sum finds it), and the largest
// s with the t of its column (the largest t of the columns that hold it): reverse KL's reference
// column (row_math.cuh, "A sharp row").
struct Stats {
  Lse s, z, t;
  float target_logit;
  float ref_s, ref_t;
};

__device__ __forceinline__ Stats stats_empty() {
  Stats r = {{NEG_INF, 0.0f}, {NEG_INF, 0.0f}, {NEG_INF, 0.0f}, 0.0f, NEG_INF, NEG_INF};
  return r;
}

// (ref_s, ref_t) taken on by a column (s, t) with a larger s, or the same s and a larger t: the
// same choice in any order of merging
__device__ __forceinline__ void ref_take(Stats& st, float s, float t) {
  if (s > st.ref_s || (s == st.ref_s && t > st.ref_t)) {
    st.ref_s = s;
    st.ref_t = t;
  }
}

__device__ __forceinline__ Stats stats_merge(Stats a, Stats b) {
  Stats r = {lse_merge(a.s, b.s), lse_merge(a.z, b.z), lse_merge(a.t, b.t), a.target_logit + b.target_logit,
             a.ref_s, a.ref_t};
  ref_take(r, b.ref_s, b.ref_t);
  return r;
}

// Merged over the 32 lanes of a warp by an xor tree: lane 0's result depends only on the
// inputs, not on timing, so every CTA of a cluster gets the same bits from the same inputs.
__device__ __forceinline__ Stats stats_warp_merge(Stats st) {
  for (int mask = 16; mask > 0; mask >>= 1) {
    Stats o = {lse_shfl(st.s, mask), lse_shfl(st.z, mask), lse_shfl(st.t, mask),
               __shfl_xor_sync(0xffffffffu, st.target_logit, mask), __shfl_xor_sync(0xffffffffu, st.ref_s, mask),
               __shfl_xor_sync(0xffffffffu, st.ref_t, mask)};
    st = stats_merge(st, o);
  }
  return st;
}

// The xor trees below merge over groups of LANES lanes (a power of 2): where only the first
// LANES lanes hold values, those lanes get the total in log2(LANES) steps, not 5.
__device__ __forceinline__ void add_xor(float2& v, int mask) {
  v.x += __shfl_xor_sync(0xffffffffu, v.x, mask);
  v.y += __shfl_xor_sync(0xffffffffu, v.y, mask);
}
__device__ __forceinline__ void add_xor(float4& v, int mask) {
  v.x += __shfl_xor_sync(0xffffffffu, v.x, mask);
  v.y += __shfl_xor_sync(0xffffffffu, v.y, mask);
  v.z += __shfl_xor_sync(0xffffffffu, v.z, mask);
  v.w += __shfl_xor_sync(0xffffffffu, v.w, mask);
}

// the sums of a float2 or float4 of sums over the lanes
template <int LANES, typename V>
__device__ __forceinline__ V sums_warp_merge(V v) {
  for (int mask = LANES / 2; mask > 0; mask >>= 1) add_xor(v, mask);
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

// the sum of v over the block's threads before this one, and (total) over all of them; every
// thread of the block calls it, and may call it again at once
template <int THREADS>
__device__ __forceinline__ int block_exclusive_sum(int v, int& total) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 32");
  constexpr int WARPS = THREADS / 32;
  __shared__ int warp_sums[WARPS];  // the warps' inclusive sums, then the warps' running totals
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, through = warp_inclusive_sum(v);
  if (lane == 31) warp_sums[warp] = through;
  __syncthreads();
  if (warp == 0) {
    const int sum = warp_inclusive_sum(lane < WARPS ? warp_sums[lane] : 0);
    if (lane < WARPS) warp_sums[lane] = sum;
  }
  __syncthreads();
  total = warp_sums[WARPS - 1];
  const int before = through - v + (warp ? warp_sums[warp - 1] : 0);
  __syncthreads();  // every thread has read warp_sums before a next call writes them
  return before;
}
