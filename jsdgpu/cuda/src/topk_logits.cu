// The top-k loss's student logits with the row kernel's streaming work in the product's epilogue
// (docs/design.md, "Top-k: the logits product of our own"): per chunk, S = Xs @ Ws.T + bias by
// wgmma (bf16 in, float32 accumulators), and instead of S, per 64 x 256 tile and row, G~ =
// 2^(S scale2 - ref) in bf16 (the rest's gradient up to a factor of the row), the sums of those
// terms over the tile's columns and over the columns that are no slot's id, and the float32
// logits of the row's slots (packed, k a row); topk_rows' finishing kernel (topk_finish) takes
// it from there. sm_90a (wgmma, setmaxnreg); compiled apart from the other families (topk_kernels.py).
//
// The product: persistent (a CTA per SM, tiles handed out in turn, rows fastest, so that a tile
// of Ws is read from HBM once and from L2 by the CTAs beside it); K in steps of 64 through a ring
// of STAGES shared-memory stages; a producer thread (its warpgroup's registers given back,
// setmaxnreg) loads both operands' tiles by the Tensor Memory Accelerator (128-byte swizzle, as
// wgmma reads them) onto a full mbarrier per stage and consumer; two consumer warpgroups take the
// CTA's tiles in turn (ping-pong: one's epilogue runs while the other's main loop has the tensor
// cores; the product alone 5% faster than with both on one tile of 128 rows, its epilogue after
// their main loops: docs/design.md), run wgmma m64n256k16 with one group in flight and free a
// stage (its empty mbarrier) once their group on it is done.
// ptxas allocates every warp the launch bound's 168 registers (not setmaxnreg's 232): the
// epilogue is written to fit them (24 bytes spill, with the ping-pong's loop; loading from the
// consumers' own threads instead, the product ran 1.2-1.3 times slower: docs/record.md).
//
// ref, G~'s reference: the row's first tile's max (bits, rounded up to an integer), which that
// tile's epilogue publishes (ref[], then ready[] for its 64 rows); every other tile's epilogue
// waits for it (all CTAs are resident and take their tiles in order, and the first tiles come
// first in every CTA's order: no wait can close a cycle). A tile whose max lies over 64 bits
// above ref takes its own (and says so in partials): topk_finish then rescales the row. Its
// rest's sum is taken against the rest's own max where that lies 64 bits or more below ref.
#include "common.cuh"
#include "ptx.cuh"

typedef unsigned long long u64;

struct alignas(64) TensorMap {  // CUtensorMap, made by the host (cuTensorMapEncodeTiled)
  u64 opaque[16];
};

// the box at (x: the inner coordinate, y) of the tensor map to shared memory, on the mbarrier
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap* map, int x, int y, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// the box at (x, y) of the tensor map from shared memory (a bulk group of this thread)
__device__ __forceinline__ void tma_store(const TensorMap* map, int x, int y, unsigned src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(map), "r"(x),
               "r"(y), "r"(src)
               : "memory");
}
// rest += g where `slot` is 0, else *p++ = x: one predicate for both, no branch (a tile's column
// in the epilogue's loop, where a branch per column cost 9 instructions)
__device__ __forceinline__ void rest_or_store(unsigned slot, float& rest, float g, float*& p, float x) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @!q add.f32 %0, %0, %3;\n @q st.global.f32 [%1], %4;\n"
      " @q add.u64 %1, %1, 4;\n}"
      : "+f"(rest), "+l"(p)
      : "r"(slot), "f"(g), "f"(x)
      : "memory");
}
__device__ __forceinline__ void warpgroup_sync(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

// a K-major operand's tile in shared memory as wgmma reads it: rows of 128 bytes (64 bf16),
// swizzled in 8-row atoms of 1024 bytes, as the TMA's 128-byte swizzle wrote them
__device__ __forceinline__ u64 operand(unsigned addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// d (64 x 256, this warpgroup's) += A (64 x 16) B (256 x 16).T, or = where !accumulate
__device__ __forceinline__ void wgmma_256(float (&d)[128], u64 a, u64 b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {WGMMA_OPERANDS}, %128, %129, p, 1, 1, 0, 0;\n}"
      : WGMMA_OUTPUTS
      : "l"(a), "l"(b), "r"(accumulate));
}

constexpr int BM = TOPK_LOGITS_ROWS, BN = TOPK_LOGITS_COLUMNS, BK = TOPK_LOGITS_K_STEP, CONSUMERS = 2;  // (sources.py)
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int OUT_BYTES = BM * BN * 2;  // a consumer's G~ tile: 4 boxes of 64 x 64 bf16
constexpr float APART = 64.0f;          // bits: a tile's max this far above ref, or a rest this far below, apart

// Per row and tile of the chunk's rows [0, m) (partials[row * n_tiles + tile]): x = the ref the
// tile's G~ took, y = the sum of its G~ (2^(z - x)), z and w = the rest's max and sum against it.
// slot_logits [m, lds]: the logits of the columns that are a slot's id (bitmap: [m, words_per_row] bits,
// bit c of row r: column c of row r is one), each row's packed in the order of topk_rows.cu's
// FromProduct::place: by tile (slots_before [m, n_tiles]: a row's slot columns in the tiles before),
// in a tile by thread, then by column.
template <int STAGES>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
    topk_logits(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                const __grid_constant__ TensorMap map_g, int m, int n, int k,
                const float* __restrict__ bias, float scale2, const unsigned* __restrict__ bitmap, int words_per_row, float* __restrict__ ref, int* __restrict__ ready,
                float4* __restrict__ partials, float* __restrict__ slot_logits, long long lds,
                const int* __restrict__ slots_before) {
  extern __shared__ unsigned char shared_raw[];
  // the stages (1024-byte aligned, as the swizzle's atoms must be), the consumers' G~ tiles, the
  // stages' mbarriers
  const unsigned base = (smem_addr(shared_raw) + 1023) & ~1023u;
  const unsigned staging = base + STAGES * STAGE_BYTES;
  const unsigned full = staging + CONSUMERS * OUT_BYTES, empty = full + 8 * CONSUMERS * STAGES;
  const int m_tiles = (m + BM - 1) / BM, n_tiles = (n + BN - 1) / BN, tiles = m_tiles * n_tiles;
  const int k_steps = (k + BK - 1) / BK;
  if (threadIdx.x == 0) {
    for (int s = 0; s < CONSUMERS * STAGES; ++s) mbar_init(full + 8 * s, 1);
    for (int s = 0; s < STAGES; ++s) mbar_init(empty + 8 * s, 4);  // the warps of the consumer whose tile it holds
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= 128 * CONSUMERS) {  // the producer: its first thread loads, onto the full mbarriers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 128 * CONSUMERS) {
      int stage = 0, consumer = 0;
      unsigned phase = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, consumer ^= 1)
        for (int ks = 0; ks < k_steps; ++ks) {
          mbar_wait(empty + 8 * stage, phase ^ 1);
          const unsigned a = base + stage * STAGE_BYTES, bar = full + 8 * (consumer * STAGES + stage);
          mbar_expect_bytes(bar, STAGE_BYTES);
          tma_load(a, &map_x, ks * BK, tile % m_tiles * BM, bar);
          tma_load(a + A_BYTES, &map_w, ks * BK, tile / m_tiles * BN, bar);
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, quad = lane % 4;
  // a stage is free once a lane of each warp of the consumer whose tile it held says so
  auto free_stage = [&](unsigned stage) {
    if (lane == 0) mbar_arrive(empty + 8 * stage);
  };
  const bool leader = threadIdx.x % 128 == 0;
  const unsigned out = staging + consumer * OUT_BYTES;
  float d[128];
  // The consumers take the CTA's tiles in turn (ping-pong): while one runs its tile's epilogue,
  // the other's main loop has the tensor cores (the stages are loaded for the tiles in the CTA's
  // order, so the two main loops follow each other). Each consumer has its own full mbarrier a
  // stage, so that one it waits for has seen only its own loads: never two phases behind, where
  // the parity would answer for the wrong one.
  const unsigned my_full = full + 8 * consumer * STAGES;
  // the ring as this consumer sees it, in one register (the epilogue needs all the others): bits
  // 0-7 its next stage, bit 8 + s the parity of my_full's stage s that it waits for next
  static_assert(STAGES <= 24, "a consumer's ring: 8 bits of stage, a parity bit a stage");
  unsigned ring = consumer * k_steps % STAGES;
  for (int tile = blockIdx.x + consumer * gridDim.x; tile < tiles; tile += CONSUMERS * gridDim.x) {
    const int tm = tile % m_tiles, tn = tile / m_tiles, row0 = tm * BM, col0 = tn * BN;
    for (int ks = 0; ks < k_steps; ++ks) {
      const unsigned stage = ring & 0xff;
      mbar_wait(my_full + 8 * stage, ring >> (8 + stage) & 1);
      ring ^= 1u << (8 + stage);
      const unsigned a = base + stage * STAGE_BYTES, b = a + A_BYTES;
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) wgmma_256(d, operand(a + 32 * kk), operand(b + 32 * kk), ks > 0 || kk > 0);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // the step before's group is done
      if (ks > 0) free_stage((stage + STAGES - 1) % STAGES);
      ring = stage + 1 == STAGES ? ring & ~0xffu : ring + 1;
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    free_stage(((ring & 0xff) + STAGES - 1) % STAGES);
    ring = (ring & ~0xffu) | ((ring & 0xff) + k_steps) % STAGES;  // past the other consumer's tile

    // The epilogue. Thread (warp, lane) holds rows 16 warp + lane / 4 + 8 h (h = 0, 1) of the
    // tile's 64, columns 8 i + 2 quad + e (i < 32, e = 0, 1): d[4 i + 2 h + e]; of a row's
    // bitmap words from the tile's first, word i / 4 holds those columns' bits at 8 (i % 4) +
    // 2 quad + e.
    const int r_local = warp * 16 + lane / 4;  // of the tile's rows, h = 0
    if (col0 + BN > n) {  // the last tile's columns past n: none (a pass of its own: in the one
#pragma unroll               // below, the test left the epilogue spilling)
      for (int j = 0; j < 128; ++j)
        if (col0 + 8 * (j / 4) + 2 * quad + j % 2 >= n) d[j] = NEG_INF;
    }
    if (bias) {  // (the thread's columns are the same in both rows)
#pragma unroll
      for (int j = 0; j < 128; ++j) {
        const int col = col0 + 8 * (j / 4) + 2 * quad + j % 2;
        d[j] += col < n ? bias[col] : 0.0f;
      }
    }
    const unsigned quad_lanes = 0xFu << (lane & ~3);  // a row's threads (branches below are theirs)
    auto row_max = [&](int h, unsigned lanes) {  // the row's max over the tile (NaN: NaN)
      float top = NEG_INF;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) top = max_nan(top, max_nan(d[4 * i + 2 * h], d[4 * i + 2 * h + 1]));
      top = max_nan(top, __shfl_xor_sync(lanes, top, 1));
      return max_nan(top, __shfl_xor_sync(lanes, top, 2));
    };
    // the rows' ref: published by the rows' first tile, else waited for (a flag per 64 rows)
    float ref_row[2] = {0.0f, 0.0f};
    if (tn == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + r_local + 8 * h;
        ref_row[h] = ceilf(row_max(h, 0xffffffffu) * scale2);  // NaN stays NaN
        if (quad == 0 && row < m) ref[row] = ref_row[h];
      }
      warpgroup_sync(1 + consumer);
      if (leader) {
        __threadfence();
        asm volatile("st.release.gpu.global.s32 [%0], 1;" ::"l"(ready + tm) : "memory");
      }
    } else {
      if (leader) {
        int seen = 0;
        do {
          asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(ready + tm) : "memory");
        } while (!seen);
      }
      warpgroup_sync(1 + consumer);
#pragma unroll
      for (int h = 0; h < 2; ++h) ref_row[h] = __ldcg(ref + min(row0 + r_local + 8 * h, m - 1));
    }
    if (leader) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the last tile's G~ is out
    warpgroup_sync(1 + consumer);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // a row at a time (both at once spilled)
      const int row = row0 + r_local + 8 * h;
      unsigned words[8];  // the row's slot bits over the tile (32-byte aligned)
      int slot_at;
      {
        const uint4* w = reinterpret_cast<const uint4*>(bitmap + (long long)min(row, m - 1) * words_per_row + col0 / 32);
        const uint4 lo = __ldg(w), hi = __ldg(w + 1);
        words[0] = lo.x, words[1] = lo.y, words[2] = lo.z, words[3] = lo.w;
        words[4] = hi.x, words[5] = hi.y, words[6] = hi.z, words[7] = hi.w;
        // this thread's first place in slot_row: after the tile's slots of the row's threads before it
        slot_at = __ldg(slots_before + (long long)min(row, m - 1) * n_tiles + tn);
#pragma unroll
        for (int j = 0; j < 8; ++j) slot_at += __popc(words[j] & quads_before(quad));
#pragma unroll  // (a row past the chunk's: none, so that it stores nothing)
        for (int j = 0; j < 8; ++j) words[j] = row < m ? words[j] >> 2 * quad : 0u;  // each test below: a constant mask
      }
      auto slot = [&](int i, int e) { return words[i / 4] & 1u << (8 * (i % 4) + e); };
      // G~ = 2^(s scale2 - take) into the staging tile; the sums of G~ over the tile's columns
      // and over its rest (its columns that are no slot's id), this thread's; with store,
      // the slots' logits stored in turn from slot_at of slot_row (a few a tile), in the same
      // loop (a loop of their own took as many bit tests again)
      float* slot_row = slot_logits + min(row, m - 1) * lds + slot_at;
      auto terms = [&](float take, float& all, float& rest, bool store) {
        all = rest = 0.0f;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          float g[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = d[4 * i + 2 * h + e];
            g[e] = ex2(fmaf(x, scale2, -take));
            all += g[e];
            if (store)
              rest_or_store(slot(i, e), rest, g[e], slot_row, x);
            else
              rest += slot(i, e) ? 0.0f : g[e];
          }
          const int r = warp * 16 + lane / 4 + 8 * h, chunk = (i % 8) ^ (r % 8);
          asm volatile("st.shared.u32 [%0], %1;" ::"r"(out + (i / 8) * 8192 + r * 128 + chunk * 16 + 4 * quad),
                       "r"(pack_16bit<OUT_BF16>(g[0], g[1]))
                       : "memory");
        }
      };
      auto quad_sum = [&](float& x, unsigned lanes) {
        x += __shfl_xor_sync(lanes, x, 1);
        x += __shfl_xor_sync(lanes, x, 2);
      };
      float take = ref_row[h], all, rest;
      terms(take, all, rest, true);
      quad_sum(all, 0xffffffffu);
      quad_sum(rest, 0xffffffffu);
      if (!(all <= 0x1p64f)) {
        // rare: the tile's max may lie over 64 bits above ref (or a logit is NaN): a tile far
        // above ref takes its own, its terms made again (topk_finish rescales the row); NaN
        // keeps ref's, as a NaN ref does
        const float top = row_max(h, quad_lanes);
        if (top * scale2 - take > APART) {
          take = ceilf(top * scale2);
          terms(take, all, rest, false);
          quad_sum(all, quad_lanes);
          quad_sum(rest, quad_lanes);
        }
      }
      float rest_ref = take;
      if (!(rest >= 0x1p-64f)) {
        // rare: the rest's terms may lie 64 bits or more below take, where they underflow: its
        // max, and where that is so, its sum again against it
        float rest_max = NEG_INF;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!slot(i, e)) rest_max = max_nan(rest_max, d[4 * i + 2 * h + e]);
        rest_max = max_nan(rest_max, __shfl_xor_sync(quad_lanes, rest_max, 1));
        rest_max = max_nan(rest_max, __shfl_xor_sync(quad_lanes, rest_max, 2));
        if (rest_max != NEG_INF && rest_max * scale2 < take - APART) {
          rest_ref = rest_max * scale2;
          rest = 0.0f;
#pragma unroll
          for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!slot(i, e)) rest += ex2(fmaf(d[4 * i + 2 * h + e], scale2, -rest_ref));
          quad_sum(rest, quad_lanes);
        }
      }
      if (quad == 0 && row < m) partials[(long long)row * n_tiles + tn] = make_float4(take, all, rest_ref, rest);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the tile, seen by the bulk copies
    warpgroup_sync(1 + consumer);
    if (leader) {
#pragma unroll
      for (int b = 0; b < 4; ++b) tma_store(&map_g, col0 + 64 * b, row0, out + b * 8192);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
