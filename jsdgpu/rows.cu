// The fused row kernel of jsdgpu; _cupy_backend.py compiles it with NVRTC.
//
// One thread-block cluster of CLUSTER CTAs per token row. Each CTA copies its slice of the row's
// float32 student and teacher logits into shared memory once (cp.async), then makes its passes
// over shared memory: (1) biases and the row statistics, (2) the JSD sums, (3) the gradient row.
// The CTAs of a cluster combine their partial statistics through distributed shared memory,
// every CTA in the same rank order, so all of them hold the same bits. Each logit crosses HBM
// once: 8 bytes in, 2 (or 4) bytes of gradient out.
//
// The kernel includes no header, so NVRTC compiles it anywhere (CI compiles it with no GPU).

#define NEG_INF __int_as_float(0xff800000)
#define FLT_MIN_NORMAL 1.17549435e-38f

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

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// The float4 in the shared memory of CTA `rank` of this cluster, at the address of `p` in ours.
__device__ __forceinline__ float4 ld_dsmem(const float4* p, unsigned rank) {
  unsigned remote;
  float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

template <int OUT>
__device__ __forceinline__ unsigned short to_16bit(float x) {
  unsigned short r;
  if (OUT == OUT_BF16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
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
      uint2 packed;
      packed.x = to_16bit<OUT>(g[0]) | ((unsigned)to_16bit<OUT>(g[1]) << 16);
      packed.y = to_16bit<OUT>(g[2]) | ((unsigned)to_16bit<OUT>(g[3]) << 16);
      *reinterpret_cast<uint2*>(out) = packed;
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

__device__ __forceinline__ float2 sums_warp_merge(float2 v) {
  for (int mask = 16; mask > 0; mask >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, mask);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, mask);
  }
  return v;
}

// Stats as two float4s, for 16-byte distributed shared-memory loads
__device__ __forceinline__ void stats_store(float4* dst, Stats a) {
  dst[0] = make_float4(a.s.m, a.s.s, a.z.m, a.z.s);
  dst[1] = make_float4(a.t.m, a.t.s, a.target_logit, 0.0f);
}

__device__ __forceinline__ Stats stats_load_remote(const float4* src, unsigned rank) {
  const float4 u = ld_dsmem(src, rank), v = ld_dsmem(src + 1, rank);
  Stats a = {{u.x, u.y}, {u.z, u.w}, {v.x, v.y}, v.z};
  return a;
}

// ---- the per-column math, shared by the fused kernel and the vocab-parallel phases ----
//
// MODE (FORWARD_KL, JSD, REVERSE_KL) is a template parameter: the kernels' inner loops hold no
// branch on it. Each kernel switches on its mode argument once (mode_dispatch).

// What a row's KL sums and gradient need once its statistics are known.
struct RowMath {
  float inv_temp, lse_s, lse_z, lse_t, beta, w_hard, w_soft_t;
};

// One column's share of a = sum p (log p - log m) and b = sum q (log q - log m), with m the
// mixture (JSD), p (forward KL) or q (reverse KL); p, and h, what the gradient needs of the
// teacher. z: the tempered student logit (0 in a pad column), tt: the tempered teacher logit.
struct KlTerms {
  float a, b, p, h;
};

template <int MODE>
__device__ __forceinline__ KlTerms kl_terms(float z, float tt, const RowMath& r) {
  const float lp = z - r.lse_z, lq = tt - r.lse_t;
  const float p = __expf(lp), q = __expf(lq);
  float lm, h;
  if (MODE == FORWARD_KL) {
    lm = lp;
    h = q;
  } else if (MODE == JSD) {
    // clamped to the smallest normal float so the log stays finite (the terms it touches are
    // below 1e-36); written so that a NaN passes (fmaxf would drop it)
    const float m = (1.0f - r.beta) * p + r.beta * q;
    lm = __logf(m < FLT_MIN_NORMAL ? FLT_MIN_NORMAL : m);
    h = lp - lm;
  } else {
    lm = lq;
    h = lp - lq;
  }
  // 0 log 0 = 0; "!= 0" rather than "> 0" so that a NaN reaches the loss
  KlTerms k = {p != 0.0f ? p * (lp - lm) : 0.0f, q != 0.0f ? q * (lq - lm) : 0.0f, p, h};
  return k;
}

// One gradient value: w_hard (softmax(s) - onehot) + (w_soft / temperature) dz, where kl is the
// row's a (the KL(p || m) of SPEC.md) and softmax is softmax(s) at the column.
template <int MODE>
__device__ __forceinline__ float grad_value(float softmax, float p, float h, bool onehot, float kl,
                                            const RowMath& r) {
  const float c_jsd = MODE == JSD ? 1.0f - r.beta : 1.0f;
  const float dz = MODE == FORWARD_KL ? p - h : c_jsd * p * (h - kl);
  return r.w_hard * (softmax - (onehot ? 1.0f : 0.0f)) + r.w_soft_t * dz;
}

// The row's CE and JSD values from its sums, and the label term kept out of G (with G only).
template <int MODE>
__device__ __forceinline__ void write_row_results(long long row, float target_logit, float a, float b,
                                                  bool label_apart, const RowMath& r, bool with_grad,
                                                  float* ce_out, float* jsd_out, float* label_terms) {
  if (with_grad) label_terms[row] = label_apart ? -r.w_hard : 0.0f;
  ce_out[row] = r.lse_s - target_logit;
  jsd_out[row] = MODE == FORWARD_KL ? b : MODE == JSD ? r.beta * b + (1.0f - r.beta) * a : a;
}

// f.template run<MODE>() for the runtime mode
template <typename F>
__device__ __forceinline__ void mode_dispatch(int mode, F& f) {
  if (mode == FORWARD_KL)
    f.template run<FORWARD_KL>();
  else if (mode == JSD)
    f.template run<JSD>();
  else
    f.template run<REVERSE_KL>();
}

__device__ __forceinline__ float max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// sum over the four values of exp(v * scale - shift)
__device__ __forceinline__ float sum_exp4(float4 v, float scale, float shift) {
  return __expf(v.x * scale - shift) + __expf(v.y * scale - shift) + __expf(v.z * scale - shift) +
         __expf(v.w * scale - shift);
}

// ---- the fused kernel ----
//
// S [rows, lds], Tl [rows, ldt]: float32 logits without bias (lds, ldt multiples of 4).
// bias_s, bias_t: float32 biases padded with zeros to a multiple of 4, or null.
// G [rows, ldg] in OUT's format, or null for the loss alone: the gradient with respect to the
// student logits, without the 1/N of the mean. Where softmax(s)[y] < 1/2 the label's one-hot
// term -w_hard dominates G[y] and would be rounded with it to 16 bits: it is left out of G and
// written to label_terms[row] instead (else 0), for the caller to add exactly (label_scatter).
// slice: columns per CTA, a multiple of 4, with CLUSTER * slice >= vt. Dynamic shared memory:
// 2 * slice floats.
//
// The passes work on float4 groups of columns (the profile of a scalar version showed it bound
// by instruction issue, ~136 instructions per logit). The slice's last group is completed with
// -inf in both rows (exp gives 0, so no bounds checks are needed), and the student columns past
// vs (teacher pad) hold -inf for the statistics, then 0 (z = 0) for the JSD sums.

// Passes 2 and 3 of one row, and its results: what depends on the mode.
template <int OUT, int CLUSTER, int THREADS>
struct FusedRowTail {
  float4 *sb4, *tb4;  // the slice in shared memory: student logits (later p), teacher (later h)
  int groups, ns, lo, y;
  long long row;
  unsigned rank;
  RowMath rm;
  bool label_apart, softmax_is_p;
  float *ce_out, *jsd_out, *label_terms;
  void* G;
  long long ldg;
  float2* warp_sums;
  float4* part_sums;
  float* row_values;

  template <int MODE>
  __device__ __forceinline__ void run() {
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float inv_temp = rm.inv_temp;
    // 2. a and b (kl_terms); tb becomes h, and sb becomes p where softmax(s) == p (no
    //    temperature, no pad), so that pass 3 needs no exp
    float a = 0.0f, b = 0.0f;
    for (int g = threadIdx.x; g < groups; g += THREADS) {
      const float4 s = sb4[g], t = tb4[g];
      const KlTerms k0 = kl_terms<MODE>(s.x * inv_temp, t.x * inv_temp, rm);
      const KlTerms k1 = kl_terms<MODE>(s.y * inv_temp, t.y * inv_temp, rm);
      const KlTerms k2 = kl_terms<MODE>(s.z * inv_temp, t.z * inv_temp, rm);
      const KlTerms k3 = kl_terms<MODE>(s.w * inv_temp, t.w * inv_temp, rm);
      a += (k0.a + k1.a) + (k2.a + k3.a);
      b += (k0.b + k1.b) + (k2.b + k3.b);
      tb4[g] = make_float4(k0.h, k1.h, k2.h, k3.h);
      if (softmax_is_p) sb4[g] = make_float4(k0.p, k1.p, k2.p, k3.p);
    }
    const float2 ab = sums_warp_merge(make_float2(a, b));
    if (lane == 0) warp_sums[warp] = ab;
    __syncthreads();
    if (warp == 0) {
      const float2 r = sums_warp_merge(lane < WARPS ? warp_sums[lane] : make_float2(0.0f, 0.0f));
      if (lane == 0) *part_sums = make_float4(r.x, r.y, 0.0f, 0.0f);
    }
    cluster_sync();
    if (warp == 0) {
      float2 r = make_float2(0.0f, 0.0f);
      if (lane < CLUSTER) {
        const float4 v = ld_dsmem(part_sums, lane);
        r = make_float2(v.x, v.y);
      }
      r = sums_warp_merge(r);
      if (lane == 0) row_values[4] = r.x;
      if (lane == 0 && rank == 0)
        write_row_results<MODE>(row, row_values[3], r.x, r.y, label_apart, rm, G != nullptr, ce_out, jsd_out,
                                label_terms);
    }
    // No CTA may exit while another may still read its shared memory: arrive now, wait at the end.
    cluster_arrive();
    __syncthreads();
    // 3. the gradient row
    if (G != nullptr) {
      if (softmax_is_p)
        gradient<MODE, true>();
      else
        gradient<MODE, false>();
    }
    cluster_wait();
  }

  template <int MODE, bool SOFTMAX_IS_P>
  __device__ __forceinline__ void gradient() {
    const float kl = row_values[4];
    const long long g0 = row * ldg + lo;
    for (int g = threadIdx.x; 4 * g < ns; g += THREADS) {
      const float4 s4 = sb4[g], h4 = tb4[g];
      const float sv[4] = {s4.x, s4.y, s4.z, s4.w}, hv[4] = {h4.x, h4.y, h4.z, h4.w};
      float out[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float p = SOFTMAX_IS_P ? sv[k] : __expf(sv[k] * rm.inv_temp - rm.lse_z);
        const float softmax = SOFTMAX_IS_P ? p : __expf(sv[k] - rm.lse_s);
        out[k] = grad_value<MODE>(softmax, p, hv[k], lo + 4 * g + k == y && !label_apart, kl, rm);
      }
      const int count = min(4, ns - 4 * g);
      store4<OUT>(G, g0 + 4 * g, out, count);
    }
  }
};

template <int OUT, int CLUSTER, int THREADS>
__device__ __forceinline__ void jsd_rows(const float* __restrict__ S, long long lds, const float* __restrict__ Tl,
                                         long long ldt, const float* __restrict__ bias_s,
                                         const float* __restrict__ bias_t, const int* __restrict__ target, int vs,
                                         int vt, int slice, float inv_temp, int mode, float beta, float w_hard,
                                         float w_soft_t, float* __restrict__ ce_out, float* __restrict__ jsd_out,
                                         void* __restrict__ G, long long ldg, float* __restrict__ label_terms) {
  constexpr int WARPS = THREADS / 32;
  extern __shared__ float4 dynamic_smem[];
  float* sb = reinterpret_cast<float*>(dynamic_smem);  // student logits of this CTA's slice
  float* tb = sb + slice;                               // teacher logits
  float4 *sb4 = reinterpret_cast<float4*>(sb), *tb4 = reinterpret_cast<float4*>(tb);
  __shared__ float4 part_stats[2];                      // this CTA's partials, read by the cluster
  __shared__ float4 part_sums;
  __shared__ float row_values[6];                       // the cluster's totals, for every thread
  __shared__ Stats warp_stats[WARPS];
  __shared__ float2 warp_sums[WARPS];

  const unsigned rank = cluster_ctarank();
  const long long row = blockIdx.x / CLUSTER;
  const int lo = rank * slice;
  const int n = max(0, min(slice, vt - lo));  // this CTA's columns: lo + [0, n)
  const int ns = max(0, min(n, vs - lo));     // of which student columns: lo + [0, ns)
  const int groups = (n + 3) / 4;
  const float* srow = S + row * lds + lo;
  const float* trow = Tl + row * ldt + lo;
  const int y = target[row];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool tempered = inv_temp != 1.0f;

  // 0. this CTA's slice of both rows into shared memory, 16 bytes per copy; -inf past the ends
  for (int i = 4 * threadIdx.x; i < 4 * groups; i += 4 * THREADS) {
    if (i + 4 <= n) {
      cp_async16(tb + i, trow + i);
    } else {
      for (int k = 0; k < 4; ++k) tb[i + k] = i + k < n ? trow[i + k] : NEG_INF;
    }
    if (i + 4 <= ns) {
      cp_async16(sb + i, srow + i);
    } else {
      for (int k = 0; k < 4; ++k) sb[i + k] = i + k < ns ? srow[i + k] : NEG_INF;
    }
  }
  cp_async_wait_all();
  __syncthreads();

  // 1. biases, and the row statistics: each thread takes the max of its columns, then sums
  //    exp(x - max) (no data-dependent branch). The biases are zero-padded, so a float4 of them
  //    is read whole wherever the group holds a column of theirs.
  float max_s = NEG_INF, max_t = NEG_INF;
  for (int g = threadIdx.x; g < groups; g += THREADS) {
    float4 t = tb4[g], s = sb4[g];
    if (bias_t) {
      t = add4(t, *reinterpret_cast<const float4*>(bias_t + lo + 4 * g));
      tb4[g] = t;
    }
    if (bias_s && 4 * g < ns) {
      s = add4(s, *reinterpret_cast<const float4*>(bias_s + lo + 4 * g));
      sb4[g] = s;
    }
    max_t = fmaxf(max_t, max4(t));
    max_s = fmaxf(max_s, max4(s));
  }
  // inv_temp > 0, so the max of x * inv_temp is max(x) * inv_temp. A thread whose student
  // columns are all past vs has max_s = -inf and sums nothing (exp(-inf - -inf) would be NaN).
  Stats st = {{max_s, 0.0f}, {max_s * inv_temp, 0.0f}, {max_t * inv_temp, 0.0f}, 0.0f};
  const bool has_s = max_s != NEG_INF;
  for (int g = threadIdx.x; g < groups; g += THREADS) {
    const float4 t = tb4[g], s = sb4[g];
    st.t.s += sum_exp4(t, inv_temp, st.t.m);
    if (has_s) {
      st.s.s += sum_exp4(s, 1.0f, st.s.m);
      if (tempered) st.z.s += sum_exp4(s, inv_temp, st.z.m);
    }
  }
  // the target's logit, read by the thread that wrote its (biased) group
  if (y >= lo && y < lo + ns && ((y - lo) / 4) % THREADS == threadIdx.x) st.target_logit = sb[y - lo];
  // warps, then warp 0 over the warps, then warp 0 over the cluster's CTAs (lane r reads rank r)
  st = stats_warp_merge(st);
  if (lane == 0) warp_stats[warp] = st;
  __syncthreads();
  // the statistics are read: the pad columns become z = 0 for pass 2
  for (int i = ns + threadIdx.x; i < n; i += THREADS) sb[i] = 0.0f;
  if (warp == 0) {
    const Stats r = stats_warp_merge(lane < WARPS ? warp_stats[lane] : stats_empty());
    if (lane == 0) stats_store(part_stats, r);
  }
  cluster_sync();
  if (warp == 0) {
    Stats r = stats_warp_merge(lane < CLUSTER ? stats_load_remote(part_stats, lane) : stats_empty());
    if (!tempered) r.z = r.s;
    if (vt > vs) {  // the pad columns: z = 0, vt - vs of them
      Lse pad = {0.0f, (float)(vt - vs)};
      r.z = lse_merge(r.z, pad);
    }
    if (lane == 0) {  // the other lanes merged in another order: only lane 0's bits are kept
      row_values[0] = r.s.m + logf(r.s.s);
      row_values[1] = r.z.m + logf(r.z.s);
      row_values[2] = r.t.m + logf(r.t.s);
      row_values[3] = r.target_logit;
    }
  }
  __syncthreads();

  FusedRowTail<OUT, CLUSTER, THREADS> tail;
  tail.sb4 = sb4;
  tail.tb4 = tb4;
  tail.groups = groups;
  tail.ns = ns;
  tail.lo = lo;
  tail.y = y;
  tail.row = row;
  tail.rank = rank;
  tail.rm = RowMath{inv_temp, row_values[0], row_values[1], row_values[2], beta, w_hard, w_soft_t};
  tail.label_apart = G != nullptr && __expf(row_values[3] - row_values[0]) < 0.5f;
  tail.softmax_is_p = !tempered && vt == vs;
  tail.ce_out = ce_out;
  tail.jsd_out = jsd_out;
  tail.label_terms = label_terms;
  tail.G = G;
  tail.ldg = ldg;
  tail.warp_sums = warp_sums;
  tail.part_sums = &part_sums;
  tail.row_values = row_values;
  mode_dispatch(mode, tail);
}

#define JSD_ROWS_ARGS                                                                                   \
  const float *S, long long lds, const float *Tl, long long ldt, const float *bias_s, const float *bias_t, \
      const int *target, int vs, int vt, int slice, float inv_temp, int mode, float beta, float w_hard,   \
      float w_soft_t, float *ce_out, float *jsd_out, void *G, long long ldg, float *label_terms
#define JSD_ROWS_CALL                                                                                           \
  S, lds, Tl, ldt, bias_s, bias_t, target, vs, vt, slice, inv_temp, mode, beta, w_hard, w_soft_t, ce_out, jsd_out, G, \
      ldg, label_terms

#define DEFINE_JSD_ROWS(NAME, OUT, CLUSTER, THREADS)                                   \
  extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS) \
      NAME(JSD_ROWS_ARGS) {                                                              \
    jsd_rows<OUT, CLUSTER, THREADS>(JSD_ROWS_CALL);                                      \
  }

// name: jsd_rows_<gradient format>_c<cluster size>
DEFINE_JSD_ROWS(jsd_rows_f32_c8, OUT_F32, 8, 1024)
DEFINE_JSD_ROWS(jsd_rows_f16_c8, OUT_F16, 8, 1024)
DEFINE_JSD_ROWS(jsd_rows_bf16_c8, OUT_BF16, 8, 1024)
DEFINE_JSD_ROWS(jsd_rows_f32_c16, OUT_F32, 16, 512)
DEFINE_JSD_ROWS(jsd_rows_f16_c16, OUT_F16, 16, 512)
DEFINE_JSD_ROWS(jsd_rows_bf16_c16, OUT_BF16, 16, 512)

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

// A block's Stats merged in a fixed order (warps, then warp 0 over the warps); for thread 0.
__device__ __forceinline__ Stats stats_block_merge(Stats st) {
  __shared__ Stats warp_stats[VP_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  st = stats_warp_merge(st);
  if (lane == 0) warp_stats[warp] = st;
  __syncthreads();
  return stats_warp_merge(lane < VP_THREADS / 32 ? warp_stats[lane] : stats_empty());
}

__device__ __forceinline__ float2 sums_block_merge(float2 v) {
  __shared__ float2 warp_sums[VP_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = sums_warp_merge(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  return sums_warp_merge(lane < VP_THREADS / 32 ? warp_sums[lane] : make_float2(0.0f, 0.0f));
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
  Stats r = stats_block_merge(st);
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
  RowMath r = {inv_temp,
               st[0] + logf(st[3 * (long long)rows]),
               st[(long long)rows] + logf(st[4 * (long long)rows]),
               st[2 * (long long)rows] + logf(st[5 * (long long)rows]),
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
  __device__ __forceinline__ void run() {
    for (int i = 4 * threadIdx.x; i < vt; i += 4 * VP_THREADS) {
      float s[4], t[4];
      load_columns(srow, trow, bias_s, bias_t, i, vs, s, t);
      for (int k = 0; k < 4 && i + k < vt; ++k) {
        const KlTerms terms = kl_terms<MODE>(i + k < vs ? s[k] * rm.inv_temp : 0.0f, t[k] * rm.inv_temp, rm);
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
  const float2 ab = sums_block_merge(f.ab);
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
  __device__ __forceinline__ void run() {
    const bool label_apart = G != nullptr && y >= 0 && __expf(target_logit - rm.lse_s) < 0.5f;
    if (threadIdx.x == 0)
      write_row_results<MODE>(row, target_logit, a, b, label_apart, rm, G != nullptr, ce_out, jsd_out,
                              label_terms);
    if (G == nullptr) return;
    for (int i = 4 * threadIdx.x; i < vs; i += 4 * VP_THREADS) {
      float s[4], t[4], g[4];
      load_columns(srow, trow, bias_s, bias_t, i, vs, s, t);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const KlTerms terms = kl_terms<MODE>(s[k] * rm.inv_temp, t[k] * rm.inv_temp, rm);
        // softmax(s) from its own logsumexp: the rank cannot see whether another has pad columns
        g[k] = grad_value<MODE>(__expf(s[k] - rm.lse_s), terms.p, terms.h, i + k == y && !label_apart, a, rm);
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

// ---- the label terms left out of G, added to the float32 gradient sums ----
//
// grad_weight[label] += norm * sum over the rows i with that label of label_terms[i] * x[i],
// and grad_bias[label] likewise. order: the rows sorted by label, stably; sorted_target: their
// labels (-1: a label on another rank). Block b works only where a label's rows start, and adds
// them in order: no atomics, so the sums have the same bits on every run.

template <int IN>
__device__ __forceinline__ float load_value(const void* x, long long k) {
  if (IN == OUT_F32) return static_cast<const float*>(x)[k];
  const unsigned short v = static_cast<const unsigned short*>(x)[k];
  if (IN == OUT_BF16) return __uint_as_float((unsigned)v << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}

template <int IN>
__device__ __forceinline__ void label_scatter(const float* __restrict__ label_terms, const int* __restrict__ order,
                                              const int* __restrict__ sorted_target, int n_rows,
                                              const void* __restrict__ x, int hs, float norm,
                                              float* __restrict__ grad_weight, float* __restrict__ grad_bias) {
  const int begin = blockIdx.x;
  const long long label = sorted_target[begin];
  if (label < 0 || (begin > 0 && sorted_target[begin - 1] == label)) return;
  int end = begin + 1;
  while (end < n_rows && sorted_target[end] == label) ++end;
  for (int h = threadIdx.x; h < hs; h += blockDim.x) {
    float acc = 0.0f;
    for (int r = begin; r < end; ++r) {
      const int i = order[r];
      acc += label_terms[i] * load_value<IN>(x, (long long)i * hs + h);
    }
    grad_weight[label * hs + h] += norm * acc;
  }
  if (grad_bias != nullptr && threadIdx.x == 0) {
    float acc = 0.0f;
    for (int r = begin; r < end; ++r) acc += label_terms[order[r]];
    grad_bias[label] += norm * acc;
  }
}

#define LABEL_SCATTER_ARGS                                                                                \
  const float *label_terms, const int *order, const int *sorted_target, int n_rows, const void *x, int hs, \
      float norm, float *grad_weight, float *grad_bias
#define LABEL_SCATTER_CALL label_terms, order, sorted_target, n_rows, x, hs, norm, grad_weight, grad_bias
extern "C" __global__ void label_scatter_f32(LABEL_SCATTER_ARGS) { label_scatter<OUT_F32>(LABEL_SCATTER_CALL); }
extern "C" __global__ void label_scatter_f16(LABEL_SCATTER_ARGS) { label_scatter<OUT_F16>(LABEL_SCATTER_CALL); }
extern "C" __global__ void label_scatter_bf16(LABEL_SCATTER_ARGS) { label_scatter<OUT_BF16>(LABEL_SCATTER_CALL); }
