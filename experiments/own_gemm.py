"""Can a logits product of our own run at cuBLAS's speed on the H200?

The top-k step's last gap to its target is the float32 logits crossing HBM twice (written by
cuBLAS, read by the row kernel: docs/design.md, "Top-k"). A product of our own could take the
row statistics in its epilogue and write G in 16 bits instead, but only pays where the product
itself is within a few percent of cuBLAS's. This times a plain one (bf16 in, float32 logits out,
C = A @ B.T with A [M, K] and B [N, K] row-major, the student's logits) against the library's
cuBLASLt product (jsdgpu.cuda.products.logits, its tuned algorithm), at the benchmark's shape,
each at the GPU's power cap, after checking its result against cuBLAS's.

The kernel: persistent (a CTA per SM, tiles handed out in turn, M fastest so that a B tile is
read from HBM once and from L2 by the CTAs beside it), 128 x 256 tiles, K in steps of 64 through
a ring of STAGES shared-memory stages; one producer thread (its warpgroup's registers given back,
setmaxnreg) loads both operands' tiles by the Tensor Memory Accelerator (128-byte swizzle, as
wgmma reads them) onto an mbarrier per stage; two consumer warpgroups of 64 rows each run
wgmma m64n256k16 (float32 accumulators in registers), keep one group of them in flight, release
a stage once its group is done, and store their tile straight from the registers.

    python experiments/own_gemm.py                      # M = 1024, 2048 and 8192
    python experiments/own_gemm.py --rows 1024 --stages 3 4 --warm-seconds 0
"""

import argparse
import ctypes
import functools
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

BM, BN, BK = 128, 256, 64
CONSUMERS = 2  # warpgroups of 64 rows each

_WGMMA_OPERANDS = ", ".join(f"%{i}" for i in range(128))
_WGMMA_OUTPUTS = ", ".join(f'"+f"(d[{i}])' for i in range(128))

SOURCE = r"""
typedef unsigned long long u64;

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_bytes(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
// the box at (x: the inner coordinate, y) of the tensor map (in global memory) to shared memory
__device__ __forceinline__ void tma_load(unsigned dst, const void* map, int x, int y, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(bar) : "memory");
}
// the box at (x, y) of the tensor map from shared memory (a bulk group of this thread)
__device__ __forceinline__ void tma_store(const void* map, int x, int y, unsigned src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
               ::"l"(map), "r"(x), "r"(y), "r"(src) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// a K-major operand's tile in shared memory as wgmma reads it: rows of 128 bytes (64 bf16),
// swizzled in 8-row atoms of 1024 bytes, as the TMA's 128-byte swizzle wrote them
__device__ __forceinline__ u64 smem_desc(unsigned addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void wgmma_256(float* d, u64 a, u64 b, int accumulate) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {OPERANDS}, %128, %129, p, 1, 1, 0, 0;\n}"
               : OUTPUTS
               : "l"(a), "l"(b), "r"(accumulate));
}

// MODE 0: float32 C stored from the registers; 1: bf16 C through shared memory and TMA stores;
// 2: as the fused kernel's epilogue would: G~ = 2^(c2 acc - r2[row]) in bf16 (TMA stores), and
// per row and tile the sums of G~ over all columns and over those not in the row's bitmap, and
// the largest c2 acc - r2, to partials[row][tile]
constexpr int BM = 128, BN = 256, BK = 64, STAGES = NSTAGES, CONSUMERS = 2, MODE = NMODE;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int OUT_BYTES = MODE == 0 ? 0 : 64 * BN * 2;  // a consumer's staging: 4 boxes of 64 x 64 bf16

extern "C" __global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
gemm_tn(const void* map_a, const void* map_b, float* c, int m, int n, int k, int ldc, const void* map_c,
        const float* r2, float c2, const unsigned* bitmap, int words, float4* partials) {
  extern __shared__ unsigned char shared_raw[];
  // stages (1024-byte aligned, as the swizzle's atoms must be), the consumers' staging, the barriers
  const unsigned base = (smem_addr(shared_raw) + 1023) & ~1023u;
  const unsigned staging = base + STAGES * STAGE_BYTES;
  const unsigned full = staging + CONSUMERS * OUT_BYTES, empty = full + 8 * STAGES;
  const int m_tiles = (m + BM - 1) / BM, tiles = m_tiles * ((n + BN - 1) / BN), k_steps = (k + BK - 1) / BK;
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 4 * CONSUMERS);  // a lane of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (wg == 0) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int stage = 0;
      unsigned phase = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int row0 = (tile % m_tiles) * BM, col0 = (tile / m_tiles) * BN;
        for (int ks = 0; ks < k_steps; ++ks) {
          mbar_wait(empty + 8 * stage, phase ^ 1);
          const unsigned a = base + stage * STAGE_BYTES, bar = full + 8 * stage;
          mbar_expect_bytes(bar, STAGE_BYTES);
          tma_load(a, map_a, ks * BK, row0, bar);
          tma_load(a + A_BYTES, map_b, ks * BK, col0, bar);
          if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float d[128];
  int stage = 0;
  unsigned phase = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int row0 = (tile % m_tiles) * BM, col0 = (tile / m_tiles) * BN;
    int last = 0;
    for (int ks = 0; ks < k_steps; ++ks) {
      mbar_wait(full + 8 * stage, phase);
      const unsigned a = base + stage * STAGE_BYTES + consumer * (A_BYTES / CONSUMERS), b = base + stage * STAGE_BYTES + A_BYTES;
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma_256(d, smem_desc(a + 32 * kk), smem_desc(b + 32 * kk), ks > 0 || kk > 0);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // the step before's group is done
      if (ks > 0 && lane == 0) mbar_arrive(empty + 8 * last);
      last = stage;
      if (++stage == STAGES) { stage = 0; phase ^= 1; }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (lane == 0) mbar_arrive(empty + 8 * last);
    // thread (warp, lane) holds rows 16 warp + lane / 4 (+ 8) of its 64, columns 8 i + 2 (lane % 4) (+ 1)
    const int r = row0 + consumer * 64 + warp * 16 + lane / 4;
    if constexpr (MODE == 0) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        const int col = col0 + 8 * i + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r + 8 * h;
          if (row < m && col + 1 < n) {
            *reinterpret_cast<float2*>(c + (size_t)row * ldc + col) = make_float2(d[4 * i + 2 * h], d[4 * i + 2 * h + 1]);
          } else if (row < m && col < n) {
            c[(size_t)row * ldc + col] = d[4 * i + 2 * h];
          }
        }
      }
    } else {
      const unsigned out = staging + consumer * OUT_BYTES;
      const bool leader = threadIdx.x % 128 == 0;
      float ref[2] = {0.f, 0.f}, all[2] = {0.f, 0.f}, rest[2] = {0.f, 0.f}, top[2] = {-__int_as_float(0x7f800000), -__int_as_float(0x7f800000)};
      unsigned bits[2][8];
      if constexpr (MODE == 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = min(r + 8 * h, m - 1);
          ref[h] = r2[row];
          const uint4* w = reinterpret_cast<const uint4*>(bitmap + (size_t)row * words + col0 / 32);
          const uint4 w0 = w[0], w1 = w[1];
          bits[h][0] = w0.x; bits[h][1] = w0.y; bits[h][2] = w0.z; bits[h][3] = w0.w;
          bits[h][4] = w1.x; bits[h][5] = w1.y; bits[h][6] = w1.z; bits[h][7] = w1.w;
        }
      }
      if (leader) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the last tile's stores
      named_sync(1 + consumer, 128);
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v0 = d[4 * i + 2 * h], v1 = d[4 * i + 2 * h + 1];
          if constexpr (MODE == 2) {
            const float x0 = fmaf(v0, c2, -ref[h]), x1 = fmaf(v1, c2, -ref[h]);
            top[h] = fmaxf(top[h], fmaxf(x0, x1));
            v0 = ex2(x0);
            v1 = ex2(x1);
            all[h] += v0 + v1;
            const unsigned b = bits[h][i / 4] >> (8 * (i % 4) + 2 * (lane % 4));
            rest[h] += (b & 1 ? 0.f : v0) + (b & 2 ? 0.f : v1);
          }
          const int row = warp * 16 + lane / 4 + 8 * h, chunk = (i % 8) ^ (row % 8);
          asm volatile("st.shared.u32 [%0], %1;" ::"r"(out + (i / 8) * 8192 + row * 128 + chunk * 16 + 4 * (lane % 4)),
                       "r"(pack_bf16(v0, v1)) : "memory");
        }
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      named_sync(1 + consumer, 128);
      if (leader) {
#pragma unroll
        for (int b = 0; b < 4; ++b) tma_store(map_c, col0 + 64 * b, row0 + consumer * 64, out + b * 8192);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
      if constexpr (MODE == 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int o = 1; o < 4; o *= 2) {
            all[h] += __shfl_xor_sync(0xffffffff, all[h], o);
            rest[h] += __shfl_xor_sync(0xffffffff, rest[h], o);
            top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffff, top[h], o));
          }
          if (lane % 4 == 0 && r + 8 * h < m)
            partials[(size_t)(r + 8 * h) * ((n + BN - 1) / BN) + col0 / BN] = make_float4(all[h], rest[h], top[h], 0.f);
        }
      }
    }
  }
  if (MODE != 0 && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
""".replace("OPERANDS", _WGMMA_OPERANDS).replace("OUTPUTS", _WGMMA_OUTPUTS)


def source(stages, mode):
    return SOURCE.replace("NSTAGES", str(stages)).replace("NMODE", str(mode))


def shared_bytes(stages, mode):
    return stages * (BM + BN) * BK * 2 + (mode != 0) * CONSUMERS * 64 * BN * 2 + 16 * stages + 1024


_LOADED = []


@functools.lru_cache(maxsize=None)
def kernel(stages, mode):
    """The compiled kernel (NVRTC, sm_90a: wgmma and setmaxnreg are not in sm_90)."""
    import cupy
    from cupy.cuda import driver
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source(stages, mode), "own_gemm.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90a", "-std=c++17"])
    except Exception:
        print(nvrtc.getProgramLog(prog))
        raise
    module = cupy.cuda.function.Module()
    module.load(nvrtc.getCUBIN(prog))
    fn = module.get_function("gemm_tn")
    driver.funcSetAttribute(fn.ptr, 8, shared_bytes(stages, mode))  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _LOADED.append(module)  # kept loaded while its function is
    return fn


@functools.lru_cache(maxsize=None)
def _encode():
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuTensorMapEncodeTiled
    f.restype = ctypes.c_int
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64), ctypes.POINTER(u64),
                  ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return f


def tensor_map(a, cols, box_rows, box_cols=BK):
    """A CUtensorMap (in device memory) of the first `cols` columns of a row-major bf16 2-D
    array, boxes of box_rows x box_cols, 128-byte swizzle; boxes out of bounds read as zeros and
    write nothing there."""
    import cupy
    rows = a.shape[0]
    raw = (ctypes.c_uint64 * 16)()
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    status = _encode()(ctypes.addressof(raw), 9, 2, ctypes.c_void_p(a.data.ptr), (u64 * 2)(cols, rows),
                       (u64 * 1)(a.shape[1] * 2), (u32 * 2)(box_cols, box_rows), (u32 * 2)(1, 1), 0, 3, 3, 0)
    if status:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {status}")
    return cupy.asarray(np.frombuffer(bytes(raw), np.uint64))


class OwnLogits:
    """The kernel's launches for x [M, K] and w [N, K] into out (float32 in mode 0, else bf16,
    [M, ld]); mode 2 also takes r2 [M], the bitmap [M, words] and writes partials [M, tiles, 4]."""

    def __init__(self, x, w, out, stages, mode, r2=None, c2=1.0, bitmap=None):
        import cupy
        m, k = x.shape
        n = w.shape[0]
        self.maps = tensor_map(x, k, BM), tensor_map(w, k, BN), (tensor_map(out, n, 64, 64) if mode else None)
        n_tiles = -(-n // BN)
        self.partials = cupy.empty((m, n_tiles, 4), np.float32) if mode == 2 else None
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self.grid = min(-(-m // BM) * n_tiles, sms)
        self.fn, self.shared = kernel(stages, mode), shared_bytes(stages, mode)
        null = np.uint64(0)
        self.args = (self.maps[0], self.maps[1], out if mode == 0 else null, np.int32(m), np.int32(n), np.int32(k),
                     np.int32(out.shape[1]), self.maps[2] if mode else null, r2 if r2 is not None else null,
                     np.float32(c2), bitmap if bitmap is not None else null,
                     np.int32(0 if bitmap is None else bitmap.shape[1]),
                     self.partials if self.partials is not None else null)

    def __call__(self):
        self.fn((self.grid,), (128 * (CONSUMERS + 1),), self.args, shared_mem=self.shared)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 2048, 8192])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--stages", type=int, nargs="+", default=[3])
    p.add_argument("--modes", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--k", type=int, default=64, help="slots a row, for the row kernel and mode 2's bitmap")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warm-seconds", type=float, default=1.0)
    args = p.parse_args()

    import cupy
    import harness
    import ml_dtypes
    from jsdgpu.cuda import kernels, products
    from jsdgpu.cuda.backend import leading_dim
    from jsdgpu.options import split_options

    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    v, ld = args.vocab, leading_dim(args.vocab)
    print("rows | variant | ms | TFLOP/s | check")
    for m in args.rows:
        x = cupy.asarray(rng.standard_normal((m, args.hidden)).astype(bf16))
        w = cupy.asarray((rng.standard_normal((v, args.hidden)) * 0.05).astype(bf16))
        ref = cupy.empty((m, ld), np.float32)
        products.logits(x, w, ref)
        flop = 2 * m * v * args.hidden

        def timed(fn):
            return harness.time_ms(lambda i: fn(), 1, 3, args.repeats, args.warm_seconds)

        t = timed(lambda: products.logits(x, w, ref))
        print(f"{m} | cuBLASLt, float32 | {t:.3f} | {flop / t / 1e9:.0f} | -")
        # the library's row kernel after it (the default options, k slots a row, read once)
        ids = cupy.asarray(np.stack([rng.choice(v, args.k, replace=False) for _ in range(min(m, 64))]), np.int32)
        ids = cupy.tile(ids, (-(-m // len(ids)), 1))[:m]
        lq = cupy.full((m, args.k), np.log(0.9 / args.k), np.float32)
        target = cupy.asarray(rng.integers(0, v, m), np.int32)
        opts = split_options(dict(beta=0.5))[0]
        ce, soft, scale, label_terms = (cupy.zeros(m, np.float32) for _ in range(4))
        G = cupy.empty((m, ld), bf16)

        def step():
            products.logits(x, w, ref)
            kernels.topk_rows(ref, None, target, v, ids, lq, opts, True, ce, soft, G, label_terms, scale)

        t = timed(step)
        print(f"{m} | cuBLASLt + topk_rows (k = {args.k}) | {t:.3f} | {flop / t / 1e9:.0f} | -")
        # mode 2's inputs: the row's first tile's max as the reference, the slots' bitmap
        c2 = float(np.log2(np.e))
        r2 = ref[:, :BN].max(axis=1) * c2
        words = -(-ld // 256) * 8
        rows = cupy.arange(m)[:, None]
        member = cupy.zeros((m, words * 32), bool)
        member[rows, ids] = True
        bitmap = cupy.packbits(member.ravel(), bitorder="little").view(np.uint32).reshape(m, words)
        for stages in args.stages:
            for mode in args.modes:
                out = cupy.full((m, ld), np.nan, np.float32 if mode == 0 else bf16)
                run = OwnLogits(x, w, out, stages, mode, r2, c2, bitmap)
                run()
                cupy.cuda.Device().synchronize()
                got = out[:, :v].astype(np.float32)
                if mode == 0:
                    check = f"max |err| {float(cupy.abs(got - ref[:, :v]).max()):.3g}"
                elif mode == 1:
                    check = f"max |err| / |C| {float((cupy.abs(got - ref[:, :v]) / cupy.abs(ref[:, :v])).max()):.3g}"
                else:
                    want = cupy.exp2(ref[:, :v] * c2 - r2[:, None])
                    rel = float((cupy.abs(got - want) / want).max())
                    part = run.partials
                    w_all = want.reshape(m, -1, BN).sum(2) if v % BN == 0 else None
                    w_rest = cupy.where(member[:, :v], 0, want).reshape(m, -1, BN).sum(2) if v % BN == 0 else None
                    sums = (f", sums {float(cupy.abs(part[..., 0] / w_all - 1).max()):.2g} / "
                            f"{float(cupy.abs(part[..., 1] / w_rest - 1).max()):.2g}") if w_all is not None else ""
                    check = f"G~ max rel err {rel:.3g}{sums}"
                t = timed(run)
                print(f"{m} | own, mode {mode}, {stages} stages | {t:.3f} | {flop / t / 1e9:.0f} | {check}")


if __name__ == "__main__":
    main()
