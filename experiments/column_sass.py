"""How many instructions does the fused kernel's pass 2 issue a column?

The row kernel is bound by its instruction issue (docs/design.md, "Small divergences"), and pass 2
(row_math.cuh, column_terms) holds most of a column's instructions. This compiles the fused
kernel's common JSD variant (bf16 gradient, the library's shape, softmax(s) = p, no model, b >=
1/6) alone for sm_90 with NVRTC, disassembles it with nvdisasm, and counts the instructions from
the second column's |d| < 1 test to the sixteenth's, over the 15 columns between them: in a
straight-line pass 2 every one of them is issued; with branches it is the code of both paths,
each column then issuing the code of the paths its lanes take. No GPU needed: NVRTC from the test
extras (cuda-bindings), nvdisasm from `pip install nvidia-cuda-nvdisasm` (or a CUDA toolkit).

    python experiments/column_sass.py                          # the library's sources
    python experiments/column_sass.py --sources OLD jsdgpu/cuda/src

Answer (NVRTC 13.0, 2026-12-06; docs/design.md, "Small divergences"): 79 instructions a column
with a branch per column for the polynomials and the mixture's log (the sources before), 58 with
the columns straight (column_terms' STRAIGHT); 54.5 since the JSD's mirroring is a constant of
the kernel, where a test of the row's beta took 58.7 (docs/design.md, "Where a divergence's math
lives").
"""

import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# the kernel's dispatches to its other variants, narrowed to the common one's (each must be found)
NARROW = {"fused_rows.cu": [("""if (f.softmax_is_p && f.with_model)
      f.template passes<MODE, true, true>(row_values, poly);
    else if (f.softmax_is_p)
      f.template passes<MODE, true, false>(row_values, poly);
    else
      f.template passes<MODE, false, false>(row_values, poly);""", "f.template passes<MODE, true, false>(row_values, poly);"),
                            ("Divergence<MODE>::SMALL_B && soft_b < SMALL_B_BELOW\n", "false\n")],
          "fused_row.cuh": [("Divergence<MODE>::SMALL_B && soft_b < SMALL_B_BELOW\n", "false\n")]}
NEAR_TEST = "1.4426950216293334961, PT"  # |d2| < log2(e), once a column


def nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia.cu13
        return str(next(pathlib.Path(list(nvidia.cu13.__path__)[0]).glob("bin/nvdisasm")))
    except (ImportError, StopIteration):
        sys.exit("needs nvdisasm: pip install nvidia-cuda-nvdisasm, or a CUDA toolkit on PATH")


def instructions_a_column(root):
    import ml_dtypes
    from test_cuda_sources import compile_sm90

    from jsdgpu.cuda import sources
    from jsdgpu.options import Divergence
    with tempfile.TemporaryDirectory() as tmp:
        narrowed = pathlib.Path(tmp) / "src"
        shutil.copytree(root, narrowed)
        for name, edits in NARROW.items():
            text = (narrowed / name).read_text()
            for old, new in edits:
                if old not in text:
                    sys.exit(f"{root}/{name}: not found, the script needs updating: {old!r}")
                text = text.replace(old, new)
            (narrowed / name).write_text(text)
        name = sources.fused_rows(ml_dtypes.bfloat16, Divergence.JSD)
        ok, log, cubin = compile_sm90(sources.source("fused_rows", narrowed), [name])
        assert ok, log
        path = pathlib.Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([nvdisasm(), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    # pass 1 tests no |d2|; the first test is take_reference's, then pass 2's 16 columns
    offsets = [int(m, 16) for m in re.findall(r"/\*([0-9a-f]{4,})\*/[^\n]*" + re.escape(NEAR_TEST), sass)]
    assert len(offsets) == 17, f"{len(offsets)} tests of |d2| (take_reference's and 16 columns' expected)"
    return (offsets[16] - offsets[1]) / 16 / 15  # 16 bytes an instruction


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", nargs="+", type=pathlib.Path, default=[ROOT / "jsdgpu" / "cuda" / "src"],
                   help="source directories (copies of jsdgpu/cuda/src)")
    a = p.parse_args()
    from test_cuda_sources import nvrtc_version
    print(f"NVRTC {nvrtc_version()}: instructions a column in pass 2, the JSD's common variant")
    for root in a.sources:
        print(f"{root}: {instructions_a_column(root):.1f}")


if __name__ == "__main__":
    main()
