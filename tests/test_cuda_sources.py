"""Every kernel family of jsdgpu/cuda/src compiles for sm_90 (sm_90a: sources.SM90A) with NVRTC, on
any machine (no GPU needed), with every instantiation the library launches, without register
spills or a stack frame in any kernel but topk_logits' few; and the loader inlines each header
once. With the NVRTC that is installed, whichever it is: the test extras take 13.x, which is 13.0
beside PyTorch's CUDA build (as CuPy's on the H200 machines) and the newest 13.x elsewhere; both
were checked (docs/design.md, "Registers")."""

import re

import numpy as np
import pytest

from jsdgpu.cuda import sources
from jsdgpu.options import Divergence


def compile_sm90(source, names, arch="sm_90"):
    """(ok, log, cubin) for the source with the template instantiations `names` (cubin: the compiled
    module, None where compilation failed; experiments/column_sass.py disassembles it)."""
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
    ok = result == nvrtc.nvrtcResult.NVRTC_SUCCESS
    cubin = None
    if ok:
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    return ok, log.decode(), cubin


# bytes of (stack frame, spill stores, spill loads) a family's kernels may have: topk_logits' epilogue
# fits the launch bound's 168 registers but for its ping-pong loop's state, a few registers stored
# once a tile, outside the main loop (nvdisasm: the STL / LDL among the epilogue's code); NVRTC
# 13.0 stores one more than 13.5 (24 / 28 / 44 against 24 / 24 / 40)
MOST_SPILLED = {"topk_logits": (24, 28, 44)}


def nvrtc_version():
    from cuda.bindings import nvrtc
    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


@pytest.mark.parametrize("family", sorted(sources.FAMILIES))
def test_compiles_for_sm90_without_spills(family):
    names = sources.FAMILIES[family]
    ok, log, _ = compile_sm90(sources.source(family), names, sources.arch(family))
    assert ok, log
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    assert len(kernels) == len(names), (kernels, names)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) == len(kernels)
    most = MOST_SPILLED.get(family, (0, 0, 0))
    assert all(all(int(n) <= m for n, m in zip(f, most)) for f in frames), f"NVRTC {nvrtc_version()}\n{log}"


# Hopper: the shared memory of an SM, and what the system takes of it for each CTA
SM_SHARED_BYTES, CTA_RESERVED_BYTES = 228 * 1024, 1024


@pytest.mark.parametrize("shape", sources.FUSED_SHAPES)
def test_each_fused_shape_fits_an_sm_as_often_as_it_asks(shape):
    """A shape's CTAs per SM (min_ctas) fit an SM's shared memory: each CTA's next row, its extra
    groups (shared_bytes) and its static shared memory (the compiler's count)."""
    ok, log, _ = compile_sm90(sources.source("fused_rows"), [sources.fused_rows("bfloat16", 1, shape)])
    assert ok, log
    static = int(re.search(r"(\d+) bytes smem", log).group(1))
    assert shape.min_ctas * (shape.shared_bytes + static + CTA_RESERVED_BYTES) <= SM_SHARED_BYTES


def test_each_teacher_vocabulary_takes_the_narrowest_fused_shape_that_holds_it():
    narrow, extra, wide, wide_extra = sources.FUSED_SHAPES
    cases = [(1, narrow), (131072, narrow), (131073, extra), (151936, extra), (163840, extra), (163841, wide),
             (262144, wide), (262145, wide_extra), (262208, wide_extra), (327680, wide_extra), (327681, None)]
    assert [sources.fused_shape(vt) for vt, _ in cases] == [shape for _, shape in cases]


def test_the_row_kernels_mirror_the_jsd_where_they_took_beta_above_a_half_in_float32():
    """sources.row_mode: JSD_MIRRORED exactly where the kernels' own test of the row's beta (float32,
    above 1/2) mirrored the JSD before it became a code; the KLs (beta 0 and 1) keep their codes."""
    jsd, mirrored = int(Divergence.JSD), sources.JSD_MIRRORED
    assert mirrored not in [int(d) for d in Divergence]
    above = float(np.nextafter(np.float32(0.5), np.float32(1)))  # the float32 next above 1/2
    cases = [(Divergence.FORWARD_KL, 0.0, int(Divergence.FORWARD_KL)), (Divergence.REVERSE_KL, 1.0,
             int(Divergence.REVERSE_KL)), (Divergence.JSD, 1e-6, jsd), (Divergence.JSD, 0.5, jsd),
             (Divergence.JSD, 0.5 + 1e-9, jsd), (Divergence.JSD, above, mirrored), (Divergence.JSD, 0.9, mirrored),
             (Divergence.JSD, 1 - 1e-6, mirrored)]
    assert [sources.row_mode(d, beta) for d, beta, _ in cases] == [mode for _, _, mode in cases]


def test_another_fused_shape_compiles():
    """A shape other than the library's, as experiments ask for (FusedShape): one instantiation."""
    shape = sources.FusedShape(cluster=8, threads=1024, groups=4, min_ctas=1)
    name = sources.fused_rows("float32", 1, shape)
    ok, log, _ = compile_sm90(sources.source("fused_rows"), [name])
    assert ok, log
    assert len(re.findall(r"Compiling entry function", log)) == 1


def test_a_compile_error_is_caught():
    ok, log, _ = compile_sm90(sources.source("targets") + "\nthis is not C++;\n", [])
    assert not ok and "error" in log


def test_headers_inlined_once():
    text = sources.source("fused_rows")
    assert "#include" not in text and "#pragma once" not in text
    assert text.count("struct Lse {") == 1  # reduce.cuh, reached through two headers
    assert text.startswith(sources.prelude())


def _horner32(coeffs, x):
    """The polynomial of coeffs (of x^0 upwards) at x as the kernels evaluate it: Horner in float32."""
    import numpy as np
    acc = np.full(x.shape, coeffs[-1], np.float32)
    for c in coeffs[-2::-1]:
        acc = (acc * x + c).astype(np.float32)
    return acc


@pytest.mark.parametrize("divergence,beta", [(0, 0.0), (2, 1.0), (1, 0.5), (1, 0.3), (1, 0.9), (1, 1.0 / 6.0),
                                             (1, 1e-6), (1, 1.0 - 1e-6)])
@pytest.mark.parametrize("unit", ["bits", "nats"])
def test_soft_polynomial_is_good_to_float32(divergence, beta, unit):
    """The precise soft terms' polynomial (F(d) / d^2, row_math.cuh's column_terms) as the kernels
    take it, in bits on |d| < 1 (sources.soft_terms, the GPU's) and in nats on |d| < 1/2
    (divergences.precise_terms, the CPU's fused kernel's), evaluated as they do (Horner in
    float32), against F in float64: within a few float32 roundings everywhere; and the float64 F
    against its plain formula where that does not cancel (|d| >= 1/2)."""
    import numpy as np
    from jsdgpu import soft_poly
    from jsdgpu.cpu import divergences
    from jsdgpu.options import Divergence
    b = soft_poly.mixture_weight(divergence, beta)
    if unit == "bits":
        coeffs = sources.soft_terms(Divergence(divergence), beta)[1:1 + soft_poly.SOFT_POLY_TERMS]
        per_unit, near = np.log(2.0), 1.0
    else:
        coeffs = divergences.precise_terms(divergence, beta)[1][:divergences.NEAR_TERMS]
        per_unit, near = 1.0, float(divergences.NEAR_BELOW)
    d = np.linspace(-near, near, 4001)
    d = d[d != 0.0]
    du = (d / per_unit).astype(np.float32)  # in the kernel's unit, as it takes it
    acc = _horner32(coeffs, du)
    got = acc.astype(np.float64) * du.astype(np.float64) ** 2
    want = soft_poly.soft_term(Divergence(divergence), b, du * per_unit) * (du * per_unit) ** 2
    assert np.max(np.abs(got / want - 1)) <= 4e-7
    far = np.array([-1.0, -0.75, -0.5, 0.5, 0.75, 1.0])
    phi = 1 + np.exp(far) * (far - 1)
    y = b * np.expm1(far)
    plain = phi if divergence != 1 else b * phi - ((1 + y) * np.log1p(y) - y)
    np.testing.assert_allclose(soft_poly.soft_term(Divergence(divergence), b, far) * far**2, plain, rtol=1e-9)


@pytest.mark.parametrize("divergence,beta", [(0, 0.0), (1, 0.5), (1, 0.3), (1, 0.9), (1, 1.0 / 6.0), (1, 1e-6),
                                             (1, 1.0 - 1e-6)])
@pytest.mark.parametrize("unit", ["bits", "nats"])
def test_gradient_polynomial_is_good_to_float32(divergence, beta, unit):
    """The gradient's d Q(d) (forward KL's e^d - 1, the JSD's ln(m / w); row_math.cuh's SoftPoly)
    as the kernels take it, in bits on |d| < 1 (sources.soft_terms: 2^d2 - 1 and log2(m / w)) and
    in nats on |d| < 1/2 (divergences.precise_terms, the CPU's), evaluated as they do (Horner in
    float32), against float64's expm1 and log1p: within a few float32 roundings, relative, down to
    d = 0."""
    import numpy as np
    from jsdgpu import soft_poly
    from jsdgpu.cpu import divergences
    from jsdgpu.options import Divergence
    b = soft_poly.mixture_weight(divergence, beta)
    if unit == "bits":
        coeffs = sources.soft_terms(Divergence(divergence), beta)[1 + soft_poly.SOFT_POLY_TERMS:]
        per_unit, near = np.log(2.0), 1.0
        assert len(coeffs) == soft_poly.SOFT_POLY_TERMS
    else:
        coeffs = divergences.precise_terms(divergence, beta)[1][-divergences.NEAR_TERMS:]
        per_unit, near = 1.0, float(divergences.NEAR_BELOW)
    d = np.concatenate([np.linspace(-near, near, 4001), [-1e-7, 1e-7]])
    d = d[d != 0.0]
    du = (d / per_unit).astype(np.float32)
    acc = _horner32(coeffs, du)
    got = acc.astype(np.float64) * du.astype(np.float64)
    x = du.astype(np.float64) * per_unit  # d in nats
    # 2^d2 - 1 is e^d - 1; log2(m / w) is ln(m / w) / ln 2
    want = np.expm1(x) if divergence == 0 else np.log1p(b * np.expm1(x)) / per_unit
    assert np.max(np.abs(got / want - 1)) <= 4e-7


def test_tanh_polynomial_within_2_ulp():
    """The soft caps' tanh below sources.TANH_POLY_BELOW (common.cuh, tanh_poly), evaluated as the
    kernels do (float32, each fmaf rounded once), against tanh in float64: within 2 ulp of the
    float32 result (the exponential's branch above it is the GPU's: test_model_logits.py)."""
    import numpy as np
    f32 = np.float32

    def fma(a, b, c):  # a float32 product is exact in float64
        return (a.astype(np.float64) * b + c).astype(f32)

    u = np.concatenate([np.linspace(0.0, sources.TANH_POLY_BELOW, 200001, dtype=f32)[1:-1],
                        f32(2.0) ** -np.arange(1, 127, dtype=f32)])  # normal floats (the kernels flush the others)
    u = np.concatenate([u, -u])
    s = u * u
    p = np.full_like(s, sources.tanh_poly()[3])
    for c in sources.tanh_poly()[2::-1]:
        p = fma(s, p, c)
    got = fma(u * s, p, u)
    want = np.tanh(u.astype(np.float64))
    ulp = np.spacing(np.abs(want).astype(f32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 2.0


def test_every_divergence_has_its_type():
    """Each code of options.Divergence has its type in divergences.cuh, where a divergence's math
    lives (docs/design.md, "Where a divergence's math lives"), and a branch of mode_dispatch."""
    from jsdgpu.options import Divergence
    text = (sources.SRC / "divergences.cuh").read_text()
    for d in Divergence:
        assert f"struct Divergence<{d.name}>" in text and f"f(Mode<{d.name}>())" in text, d.name
