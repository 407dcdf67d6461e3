"""Every kernel family of jsdgpu/cuda/src compiles for sm_90 (sm_90a: sources.SM90A) with NVRTC, on
any machine (no GPU needed), with every instantiation the library launches, without register
spills or a stack frame in any kernel but topk_logits' few; and the loader inlines each header
once. With the NVRTC the test extras install (13.5): the H200 machines' CuPy compiles with NVRTC
13.0, whose ptxas spilled in fused_rows (8-24 bytes of stores; the other families as here)."""

import re

import pytest

from jsdgpu.cuda import sources


def compile_sm90(source, names, arch="sm_90"):
    """(ok, log, kernels compiled) for the source with the template instantiations `names`."""
    from cuda.bindings import nvrtc
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"family.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    for name in names:
        (err,) = nvrtc.nvrtcAddNameExpression(prog, name.encode())
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"] + [o.encode() for o in sources.NVRTC_OPTIONS]
    (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return result == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()


# bytes of (stack frame, spill stores, spill loads) a family's kernels may have: topk_logits' epilogue
# fits the launch bound's 168 registers but for its ping-pong loop's state, a few registers stored
# once a tile, outside the main loop (cuobjdump -sass: the STL / LDL among the epilogue's code)
MOST_SPILLED = {"topk_logits": (24, 24, 40)}


@pytest.mark.parametrize("family", sorted(sources.FAMILIES))
def test_compiles_for_sm90_without_spills(family):
    names = sources.FAMILIES[family]
    ok, log = compile_sm90(sources.source(family), names, sources.arch(family))
    assert ok, log
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    assert len(kernels) == len(names), (kernels, names)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) == len(kernels)
    most = MOST_SPILLED.get(family, (0, 0, 0))
    assert all(all(int(n) <= m for n, m in zip(f, most)) for f in frames), log


def test_another_fused_shape_compiles():
    """A shape other than the library's, as experiments ask for (FusedShape): one instantiation."""
    shape = sources.FusedShape(cluster=8, threads=1024, groups=4, min_ctas=1)
    name = sources.fused_rows("float32", shape)
    ok, log = compile_sm90(sources.source("fused_rows"), [name])
    assert ok, log
    assert len(re.findall(r"Compiling entry function", log)) == 1


def test_a_compile_error_is_caught():
    ok, log = compile_sm90(sources.source("targets") + "\nthis is not C++;\n", [])
    assert not ok and "error" in log


def test_headers_inlined_once():
    text = sources.source("fused_rows")
    assert "#include" not in text and "#pragma once" not in text
    assert text.count("struct Lse {") == 1  # reduce.cuh, reached through two headers
    assert text.startswith(sources.prelude())
