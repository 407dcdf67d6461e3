// The top-k family's other kernels (topk_rows.cu): the check of a stored top-k, and the
// teacher's top-k of its logits.
#pragma once
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
