"""How close to the floor the design can come at best: jsdgpu with its fused row kernel replaced
by a kernel that only moves that kernel's bytes (reads each chunk's float32 student and teacher
logits, writes a bf16 row of G where the library keeps it: 8 B in and 2 B out per logit; without
gradients the 8 B in), against the four products alone (bench.py's gemm_floor), in one run.
Its results are wrong by design (G is s - t), but every other kernel, the products and the host
work are the library's. So the ratio it gives is the least that any row kernel reading the
float32 logits once can reach, with the rest of jsdgpu as it is. A third form, with no row work
at all (G left as whatever its memory held), gives what the rest costs: the products at the
library's shapes (float32 logits, grad_weight summed over chunks in float32 where G is not held
for all rows), the other kernels, the host. A fourth form ("16-bit") measures what a logits
product of our own could reach whose epilogue wrote each logit in 16 bits (a float16 offset from
its tile's row maximum, bench/NOTES.md "What to try next", item 5): the logits products write
bf16 (cuBLAS, so at cuBLAS's speed; the tile maxima, 1/128 of the bytes, left out) and the
streaming kernel reads 4 B and writes 2 B per logit. It is the least that design could reach.

    python bench/probe_bound.py
    python bench/probe_bound.py --tokens 1024 8192
    python bench/probe_bound.py --valid 0.5     # half of the rows ignored; ratios to the dense floor
"""

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# Each thread moves 4 columns of one row: the logits as float4, G as 4 bf16 (the upper halves of
# the float32 differences) in one 8-byte store. Without G, a comparison that never holds keeps
# the loads.
STREAM_SOURCE = r'''
extern "C" __global__ void stream_rows(const float4* S, long long lds4, const float4* Tl, long long ldt4,
                                       int v4, unsigned long long* G, long long ldg4, float* sink) {
  const long long row = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= v4) return;
  const float4 s = S[row * lds4 + c], t = Tl[row * ldt4 + c];
  if (G) {
    const float d[4] = {s.x - t.x, s.y - t.y, s.z - t.z, s.w - t.w};
    unsigned long long w = 0;
    for (int j = 0; j < 4; ++j) w |= (unsigned long long)(__float_as_uint(d[j]) >> 16) << (16 * j);
    G[row * ldg4 + c] = w;
  } else if (s.x + s.y + s.z + s.w + t.x + t.y + t.z + t.w == 1.2345e-30f) {
    sink[row] = 1.0f;
  }
}

// The 16-bit form: 4 columns of one row as 8 bytes of each matrix; G the bf16 differences.
__device__ float bf16_at(unsigned int word, int half) {
  return __uint_as_float(half ? word & 0xffff0000u : word << 16);
}
extern "C" __global__ void stream_rows16(const uint2* S, long long lds, const uint2* Tl, long long ldt,
                                         int v4, uint2* G, long long ldg, float* sink) {
  const long long row = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= v4) return;
  const uint2 s = S[row * lds + c], t = Tl[row * ldt + c];
  if (G) {
    unsigned int w[2];
    for (int j = 0; j < 2; ++j) {
      const unsigned int a = j ? s.y : s.x, b = j ? t.y : t.x;
      w[j] = (__float_as_uint(bf16_at(a, 0) - bf16_at(b, 0)) >> 16) |
             (__float_as_uint(bf16_at(a, 1) - bf16_at(b, 1)) & 0xffff0000u);
    }
    G[row * ldg + c] = make_uint2(w[0], w[1]);
  } else if ((s.x ^ s.y ^ t.x ^ t.y) == 0x12345678u) {
    sink[row] = 1.0f;
  }
}'''


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--valid", type=float, default=1.0,
                   help="fraction of rows with a valid target (the rest ignore_index); the floor stays dense")
    a = p.parse_args()
    import cupy

    import bench
    from jsdgpu import _cupy_backend as backend
    from jsdgpu._cupy_backend import CupyBackend

    module = cupy.RawModule(code=STREAM_SOURCE)
    library_rows, library_logits = CupyBackend.fused_rows, backend._logits

    def streaming(kernel, group_bytes):
        """A stand-in for the fused row kernel, launching kernel: each thread moves 4 columns of a
        row, group_bytes of each logits matrix (16: float32 logits, 8: 16-bit ones in the first
        half of each float32 row) and 8 bytes of G."""
        def rows_fn(work, target, opts, ce, jsd, G, label_terms):
            ls, lt = work["logits_s"], work["logits_t"]
            rows, v4 = len(target), -(-work["ws"].shape[0] // 4)
            kernel((-(-v4 // 256), rows), (256,),
                   (ls, np.int64(ls.shape[1] * 4 // group_bytes), lt, np.int64(lt.shape[1] * 4 // group_bytes),
                    np.int32(v4), np.uint64(0) if G is None else G, np.int64(0 if G is None else G.shape[1] // 4),
                    ce))
        return rows_fn

    stream_rows = streaming(module.get_function("stream_rows"), 16)
    stream_rows16 = streaming(module.get_function("stream_rows16"), 8)

    def logits16(x, w, out):
        """The library's logits product, written in bf16 into the first half of each float32 row."""
        (c, h), v = x.shape, w.shape[0]
        out16 = out.view(bench.BF16)
        backend._gemm(backend._T, backend._N, v, c, h, 1.0, w, h, x, h, 0.0, out16, out16.shape[1])

    def with_rows(rows_fn, fn, logits_fn=library_logits):
        def run(i):
            CupyBackend.fused_rows = staticmethod(rows_fn)
            backend._logits = logits_fn
            fn(i)
        return run

    bw = bench.copy_bandwidth()
    weights = bench.make_weights(2)
    rng = np.random.default_rng(0)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; valid rows {a.valid:.0%}")

    def alone(rows, rows_fn, bytes_per_logit):
        """A streaming kernel alone on a chunk of rows, as bench.py times the fused kernel (the
        16-bit one reads the float32 logits' first halves)"""
        *_, tgt, _, work = bench.one_chunk(rows, rng)
        ce = cupy.zeros(rows, np.float32)
        return bench.row_kernel_record("stream", lambda i: rows_fn(work, tgt, None, ce, None, work["G"], None),
                                       rows, bytes_per_logit, bw)

    for name, record in (("streaming kernel", alone(2048, stream_rows, 10)),
                         ("16-bit streaming kernel", alone(2048, stream_rows16, 6))):
        print(f"{name} alone, 2048 rows with G: {1e3 * record['ms'] / 2048:.3f} µs per row, "
              f"{record['fraction_of_copy']:.0%} of the copy bandwidth")
    cupy.get_default_memory_pool().free_all_blocks()

    forms = ("jsdgpu", "bytes", "16-bit", "none")
    print("| T | mode | floor ms | " + " | ".join(f"{f} ms | × floor" for f in forms) + " |")
    print("| --- " * (3 + 2 * len(forms)) + "|")
    try:
        for T in a.tokens:
            sets = bench.make_sets(T, weights, rng, a.valid)
            floor_fwd_bwd = None
            for mode in ("fwd_bwd", "fwd"):
                fns = {"floor": bench.impl_gemm_floor(sets, mode),
                       "jsdgpu": with_rows(library_rows, bench.impl_jsdgpu(sets, mode)),
                       "bytes": with_rows(stream_rows, bench.impl_jsdgpu(sets, mode)),
                       "16-bit": with_rows(stream_rows16, bench.impl_jsdgpu(sets, mode), logits16),
                       "none": with_rows(lambda *args: None, bench.impl_jsdgpu(sets, mode))}
                times = {k: [] for k in fns}
                for _ in range(2):  # two rounds, the implementations taking turns; the best kept
                    for k, fn in fns.items():
                        times[k].append(bench.time_ms(fn, len(sets), 2, a.repeats))
                best = {k: min(t) for k, t in times.items()}
                floor_fwd_bwd = floor_fwd_bwd or best["floor"]  # ratios to the fwd_bwd floor
                print(f"| {T} | {mode} | {best['floor']:.2f} | " + " | ".join(
                    f"{best[f]:.2f} | {best[f] / floor_fwd_bwd:.3f}" for f in forms) + " |", flush=True)
            del sets
            cupy.get_default_memory_pool().free_all_blocks()
    finally:
        CupyBackend.fused_rows = staticmethod(library_rows)
        backend._logits = library_logits


if __name__ == "__main__":
    main()
