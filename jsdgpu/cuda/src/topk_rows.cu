// Offline distillation (docs/contract.md, "Offline distillation"): the row work of the loss
// against a teacher's stored top-k log-probabilities (topk_rows), the check of those top-k
// (topk_check), and the teacher's own top-k of its logits (teacher_topk). One CTA of THREADS per
// row; every merge in a fixed order. Instantiated by jsdgpu/cuda/topk_kernels.py.
//
// Units: the row statistics over the vocabulary are float32 logsumexps in bits (x * scale2,
// scale2 = log2(e) / temperature); the k + 1 categories' math is in float64 and natural units:
// per row it is a few thousand operations, and float64 keeps the gradient's u - u_bar free of
// the cancellation that a near one-hot P would give in float32 (docs/design.md, "Top-k").
#include "topk_math.cuh"

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
  // s's logsumexp stays in the bits it was summed in (x LOG2E): the softmax's 2^(x LOG2E - lse_s2)
  // is then 1 at a label that holds all of the mass. Taken to nats by LN2 and back by LOG2E (their
  // float32 product is 1 - 1.06e-8), p - 1 came out 1.1e-8 |x| off there: 1.3e-6 at logits of 120
  const double lse_s2 = lse_bits(st.s), lse_z2 = lse_bits(st.z), lse_rest2 = lse_bits(st.rest);

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
    const Category cat = Divergence<MODE>::category(lp, lq, beta, one_minus_beta, log_beta, log_one_minus_beta);
    sums.soft += cat.d;
    sums.pu += cat.pu;
    sums.pu_most = fmax(sums.pu_most, fabs(cat.pu));  // NaN: not kept, but u_bar is NaN then
  }
  sums = block_all<THREADS>(sums);
  const Category rest = bucket ? Divergence<MODE>::category(lp_rest, lq_rest, beta, one_minus_beta, log_beta,
                                                              log_one_minus_beta)
                               : Category{0.0, 0.0, 0.0};
  const double soft = sums.soft + rest.d, u_bar = sums.pu + rest.pu;
  const double lse_s = lse_s2 * (1.0 / (double)LOG2E);  // in the logits' units, the bits' own way back
  const bool label_apart = G != nullptr && target_logit - (float)lse_s < -LN2;  // softmax(s)[y] < 1/2
  if (threadIdx.x == 0) {
    const double ce = lse_s - (double)target_logit;
    ce_out[row] = ce < 0.0 ? 0.0f : (float)ce;  // a CE is >= 0: below by rounding alone (NaN passes)
    soft_out[row] = soft < 0.0 ? 0.0f : (float)soft;  // a divergence is >= 0: below by rounding alone (NaN passes)
    if (G != nullptr) label_terms[row] = label_apart ? -w_hard : 0.0f;
  }
  if (G == nullptr) return;

  // 4. the gradient row: every column as the rest's (RestGradient), then the slots' columns
  //    written over
  const double lse_p2 = lse_z2 + p_shift * LOG2E;
  const RestGradient g(lse_s2, lse_p2, lse_rest2, bucket ? Divergence<MODE>::rest_a(u_bar, rest) : 0.0,
                       bucket ? Divergence<MODE>::rest_b(lq_rest) : 0.0, scale2, w_hard, w_soft_over_t);
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
    const Category cat = Divergence<MODE>::category(lp, lq, beta, one_minus_beta, log_beta, log_one_minus_beta);
    const double P = exp(lp);
    const double dz = Divergence<MODE>::slot_dz(P, u_bar, cat, lq);
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
  mode_dispatch<false>(mode, [&](auto m) {
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
  mode_dispatch<false>(mode, [&](auto m) {
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

#include "topk_check.cuh"
