"""rows.cu compiles for sm_90 with NVRTC, on any machine (no GPU needed), without register
spills or a stack frame in any of its kernels."""

import pathlib
import re

import pytest


SOURCE = pathlib.Path(__file__).parents[1] / "jsdgpu" / "rows.cu"


def compile_sm90(source, defines=()):
    from cuda.bindings import nvrtc
    err, prog = nvrtc.nvrtcCreateProgram(source, b"rows.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [b"--gpu-architecture=sm_90", b"--ptxas-options=-v", b"-std=c++17"]
    opts += [b"-D" + d.encode() for d in defines]
    (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return result == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()


@pytest.mark.parametrize("defines", [(), ("ROW_KERNEL_VARIANTS",)])
def test_compiles_for_sm90_without_spills(defines):
    """The kernels, and with ROW_KERNEL_VARIANTS the fused kernel's other shapes (profile_rows.py)."""
    ok, log = compile_sm90(SOURCE.read_bytes(), defines)
    assert ok, log
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    assert {f"jsd_rows_{f}" for f in ("f32", "f16", "bf16")} <= set(kernels)
    assert any(k.startswith("jsd_rows_bf16_c") for k in kernels) == bool(defines)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                        log)
    assert len(frames) == len(kernels)
    assert all(f == ("0", "0", "0") for f in frames), log


def test_a_compile_error_is_caught():
    ok, log = compile_sm90(SOURCE.read_bytes() + b"\nthis is not C++;\n")
    assert not ok and "error" in log
