"""How close to its floor can this design come on a run's inputs, with the present code?

In the benchmark's run (bench/bench_run.py: its history of other shapes, then ten steps at each
T, the row JSD falling, 0-40% of the rows ignored, other rows each step), each step is timed in
turns, step by step, as the floor (the four products at its valid rows) and as jsdgpu in four
forms. The last three are copies of the package (in a temporary folder, each imported under a
name of its own, as experiments/ab_versions.py --against does) with a stand-in written into
them; their results are wrong by design, but every other kernel, product and host step is the
library's:

- jsdgpu: the library as it is;
- bytes: the fused row kernel replaced by a kernel that only moves its bytes (each chunk's float32
  student and teacher logits read, a bf16 row of G written where the library keeps it: 10 bytes a
  logit): the least any row kernel reading float32 logits can reach;
- 16-bit: the logits products write bf16 (cuBLAS, at cuBLAS's speed) and the streaming kernel
  reads 4 bytes and writes 2 a logit: the least a logits product of our own whose epilogue wrote
  16-bit logits could reach (what "The bound of this design" in docs/design.md weighs);
- none: no row work at all (G whatever its memory held): the products at the library's shapes,
  the other kernels and the host.

    python experiments/design_bound.py --out /tmp/bound
    python experiments/design_bound.py --run-tokens 1024 --repeats 5

Prints each T's sums over its ten steps and their ratios to the floor's, and writes the
per-step medians to OUT/design_bound.json.

Answer (docs/design.md, "The bound of this design"), the ten steps over their floor's at T =
1024 / 4096 / 8192. One H100, 2026-12-07 (floor 36.34 / 133.29 / 267.67 ms): jsdgpu 1.269 / 1.220
/ 1.220, bytes 1.174 / 1.118 / 1.123, 16-bit 1.112 / 1.059 / 1.075, none 1.076 / 1.007 / 1.025.
One H200, 2026-12-07, two runs (floor 35.43 / 133.31 / 268.32 ms in the first): jsdgpu 1.269-1.270
/ 1.215-1.219 / 1.206-1.209, bytes 1.148-1.149 / 1.079-1.090 / 1.075-1.080, 16-bit 1.112-1.118 /
1.044-1.055 / 1.045-1.050, none 1.071-1.077 / 1.008-1.015 / 1.009-1.014.
"""

import argparse
import json
import pathlib
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# The stand-ins, a module written into each copy (jsdgpu/cuda/_bound_form.py). Each thread of
# the streaming kernels moves 4 columns of one row: the logits as float4 (or, 16-bit, 4 bf16 in
# the first half of each float32 row), G as 4 bf16 in one 8-byte store (the upper halves of the
# float32 differences). The values are wrong and may race with G's stores over the student's
# logits.
FORM_MODULE = '''
import cupy
import ml_dtypes
import numpy as np

from . import products

FORM = "@FORM@"
SOURCE = r"""
extern "C" __global__ void stream32(const float4* S, long long lds, const float4* Tl, long long ldt, int v4,
                                    unsigned long long* G, long long ldg) {
  const long long row = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= v4) return;
  const float4 s = S[row * lds + c], t = Tl[row * ldt + c];
  const float d[4] = {s.x - t.x, s.y - t.y, s.z - t.z, s.w - t.w};
  unsigned long long w = 0;
  for (int j = 0; j < 4; ++j) w |= (unsigned long long)(__float_as_uint(d[j]) >> 16) << (16 * j);
  G[row * ldg + c] = w;
}

__device__ float bf16_at(unsigned int word, int high) {
  return __uint_as_float(high ? word & 0xffff0000u : word << 16);
}
extern "C" __global__ void stream16(const uint2* S, long long lds, const uint2* Tl, long long ldt, int v4,
                                    uint2* G, long long ldg) {
  const long long row = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= v4) return;
  const uint2 s = S[row * lds + c], t = Tl[row * ldt + c];
  unsigned int w[2];
  for (int j = 0; j < 2; ++j) {
    const unsigned int a = j ? s.y : s.x, b = j ? t.y : t.x;
    w[j] = (__float_as_uint(bf16_at(a, 0) - bf16_at(b, 0)) >> 16) |
           (__float_as_uint(bf16_at(a, 1) - bf16_at(b, 1)) & 0xffff0000u);
  }
  G[row * ldg + c] = make_uint2(w[0], w[1]);
}"""
_module = []


def fused_rows(work, target, opts, ce, jsd, G, label_terms):
    # the fused kernel's stand-in: nothing ("none"), or a kernel moving its bytes
    if FORM == "none" or G is None:
        return
    if not _module:
        _module.append(cupy.RawModule(code=SOURCE))
    name, group_bytes = ("stream16", 8) if FORM == "16-bit" else ("stream32", 16)
    ls, lt = work.logits_s, work.logits_t
    v4 = -(-work.ws.shape[0] // 4)
    _module[0].get_function(name)(
        (-(-v4 // 256), len(target)), (256,),
        (ls, np.int64(ls.shape[1] * 4 // group_bytes), lt, np.int64(lt.shape[1] * 4 // group_bytes),
         np.int32(v4), G, np.int64(G.shape[1] // 4)))


def logits16(x, w, out):
    # products.logits written in bf16 into the first half of each float32 row of out
    (c, h), v = x.shape, w.shape[0]
    out16 = out.view(ml_dtypes.bfloat16)
    products.gemm(products.T, products.N, v, c, h, 1.0, w, h, x, h, 0.0, out16, out16.shape[1])
'''
# appended to the copy's cuda/online_work.py (every form) and cuda/products.py (16-bit)
ROWS_PATCH = '''
from . import _bound_form  # experiments/design_bound.py's stand-in for the fused kernel
CudaOnlineRows.fused_rows = staticmethod(_bound_form.fused_rows)
'''
LOGITS_PATCH = '''

def logits(x, w, out):  # experiments/design_bound.py: the logits written in bf16
    from ._bound_form import logits16
    logits16(x, w, out)
'''
FORMS = ("bytes", "16-bit", "none")


def copy_with_form(form, root):
    """A copy of the package at root/jsdgpu with the form's stand-ins written into it, imported as
    jsdgpu_<form>."""
    from ab_versions import load_other
    package = root / "jsdgpu"
    shutil.copytree(ROOT / "jsdgpu", package, ignore=shutil.ignore_patterns("__pycache__"))
    cuda = package / "cuda"
    (cuda / "_bound_form.py").write_text(FORM_MODULE.replace("@FORM@", form))
    with open(cuda / "online_work.py", "a") as f:
        f.write(ROWS_PATCH)
    if form == "16-bit":
        with open(cuda / "products.py", "a") as f:
            f.write(LOGITS_PATCH)
    return load_other(root, "jsdgpu_" + form.replace("-", "_"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warm-seconds", type=float, default=1.0)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    a = p.parse_args()
    import cupy

    import bench_run
    import harness
    import jsdgpu

    def step_of(lib, step):
        """fn() running one forward + backward of step by the package lib (as
        bench_run.implementation's, whose index it ignores)."""
        fn = harness.impl_jsdgpu([step], "fwd_bwd", lib=lib)
        return lambda i=0: fn(0)

    libs = {"jsdgpu": jsdgpu}
    with tempfile.TemporaryDirectory() as tmp:
        for form in FORMS:
            libs[form] = copy_with_form(form, pathlib.Path(tmp) / form)
        ws, wn = bench_run.heads(cupy, 4.0, 1)
        for lib in libs.values():  # the run's history, for each package
            for step in bench_run.history_steps(cupy, ws, wn):
                harness.time_ms(step_of(lib, step), 1, 2, 3)
        names = ["floor", *libs]
        result = dict(device=harness.device_name(), date=time.strftime("%Y-%m-%d"),
                      command="python experiments/design_bound.py " + " ".join(sys.argv[1:]), run=[])
        lines = ["| T | floor ms | " + " | ".join(f"{f} ms | × floor" for f in libs) + " |",
                 "| --- " * (2 + 2 * len(libs)) + "|"]
        for T in a.run_tokens:
            steps = bench_run.run_steps(cupy, T, ws, wn)
            fns = [fn for s in steps for fn in (bench_run.implementation("gemm_floor", s),
                                                *(step_of(lib, s) for lib in libs.values()))]
            times = bench_run.timed_turns(fns, a.repeats, a.warm_seconds)
            ms = {name: times[i::len(names)] for i, name in enumerate(names)}
            result["run"].append(dict(T=T, ms=ms))
            floor = sum(ms["floor"])
            lines.append(f"| {T} | {floor:.2f} | " + " | ".join(
                f"{sum(ms[f]):.2f} | {sum(ms[f]) / floor:.3f}" for f in libs) + " |")
            print(lines[-1], flush=True)
            del steps, fns
            cupy.get_default_memory_pool().free_all_blocks()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "design_bound.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, {result['date']}: the run's ten steps a T, ms")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
