"""What NVRTC compiles: each kernel family's CUDA source (jsdgpu/cuda/src) with its headers
inlined, and the instantiations of its templates. The kernels' shapes and codes are stated here,
once, and passed to the templates; nothing here needs a GPU (CI compiles every family for sm_90).
"""

import dataclasses
import functools
import pathlib
import re

import ml_dtypes
import numpy as np

from .. import soft_poly
from ..options import Divergence

SRC = pathlib.Path(__file__).with_name("src")
OPTIONS = ("-std=c++17",)  # ours, for CuPy's RawModule, which adds the two below
# what NVRTC compiles with, by CuPy or directly (topk_logits: kernels.py): unannotated functions,
# the generic lambdas among them, are device functions (NVRTC 13.0, the H200 machines', took
# them for host functions without it; 13.5 does not), and float32 denormals flush to zero
NVRTC_OPTIONS = OPTIONS + ("--device-as-default-execution-space", "-ftz=true")

# The format codes of the kernels' 16-bit and float32 arrays (their OUT and IN parameters)
FORMATS = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(ml_dtypes.bfloat16): 2}
_FORMAT_NAMES = ("OUT_F32", "OUT_F16", "OUT_BF16")

# The online loss's row kernels take the JSD whose weight distribution is q (beta > 1/2:
# divergences.cuh, Jsd) as a code of its own, so that their column terms hold no test of it
JSD_MIRRORED = len(Divergence)
ROW_MODES = tuple(int(d) for d in Divergence) + (JSD_MIRRORED,)


def row_mode(divergence, beta):
    """The online loss's row kernels' mode: the divergence's code, JSD_MIRRORED for the JSD where
    beta > 1/2 in float32 (as the kernels take beta)."""
    mirrored = Divergence(divergence) == Divergence.JSD and np.float32(beta) > np.float32(0.5)
    return JSD_MIRRORED if mirrored else int(divergence)


@dataclasses.dataclass(frozen=True)
class FusedShape:
    """The fused row kernel's shape: CTAs per cluster (one cluster per row), threads per CTA,
    float4 groups of columns per thread held in registers, the CTAs per SM that its register
    allocation must allow, and float4 groups per thread held in shared memory beyond them."""
    cluster: int = 16
    threads: int = 512
    groups: int = 4
    min_ctas: int = 2
    extra: int = 0

    @property
    def max_vocab(self):
        """The widest teacher vocabulary one cluster holds; wider rows take the phase kernels."""
        return self.cluster * self.threads * (self.groups + self.extra) * 4

    @property
    def shared_bytes(self):
        """Dynamic shared memory: the next row's columns, a float4 per group, of s and of t; then
        the extra groups of this row's."""
        return 2 * (self.groups + 2 * self.extra) * self.threads * 16


# 16 CTAs of 512 threads, 4 groups each: up to 131072 columns, two CTAs per SM (64 registers a
# thread); the other shapes measured slower (docs/design.md, "The fused row kernel")
FUSED = FusedShape()
# One more group a thread in shared memory: up to 163840 columns (Qwen's 151936), still two CTAs
# per SM (96 KiB of shared memory each) (docs/design.md, "Wide vocabularies")
FUSED_EXTRA = FusedShape(extra=1)
# Wider teacher vocabularies (GPT-OSS's 201088, Gemma 2's 256000 and Gemma 3 1B's 262144): 16
# CTAs of 1024 threads, one per SM, so that a row's columns are held by the registers of 16 SMs:
# up to 262144 columns
FUSED_WIDE = FusedShape(threads=1024, min_ctas=1)
# and one more group a thread in shared memory (192 KiB a CTA): up to 327680 columns (Gemma 3
# 4B-27B's 262208); wider rows take the phase kernels
FUSED_WIDE_EXTRA = FusedShape(threads=1024, min_ctas=1, extra=1)
FUSED_SHAPES = (FUSED, FUSED_EXTRA, FUSED_WIDE, FUSED_WIDE_EXTRA)  # the narrowest first


def fused_shape(vt):
    """The fused kernel's shape for a teacher vocabulary of vt columns: the narrowest that holds
    it; None past the widest."""
    return next((shape for shape in FUSED_SHAPES if vt <= shape.max_vocab), None)


PHASE_THREADS = 256  # one CTA of these per row in each phase kernel
SELECT_THREADS, SELECT_ITEMS = 1024, 8  # select_rows: one CTA, tiles of 8192 targets
MARK_THREADS = 1024  # mark_rows: one CTA
ORDER_THREADS = 256  # label_order: a warp per row
TOPK_THREADS = 256  # topk_rows, topk_slot_bits, topk_check, teacher_topk: one CTA of these per row (topk_rows: 80 registers a thread, 3 CTAs per SM)
TOPK_FINISH_THREADS = 64  # topk_finish: one CTA of these per row
TOPK_STAGES = 3  # topk_rows: batches of a row on their way at once (16 KiB each, in shared memory)
# topk_logits: shared-memory stages of the product's ring (40 KiB each, beside 64 KiB of G~ tiles:
# four fit)
TOPK_LOGITS_STAGES = 4
TOPK_LOGITS_TILE = (64, 256)  # rows, columns: a consumer's tiles (BM, BN in topk_logits.cu, by the prelude)
TOPK_LOGITS_K_STEP = 64  # its K step (BK): the columns of Xs and Ws a box of theirs holds


# ---- the precise soft part's polynomial (row_math.cuh, column_terms) ----

SOFT_POLY_TERMS = soft_poly.SOFT_POLY_TERMS


@functools.lru_cache(maxsize=None)
def soft_terms(divergence, beta):
    """The kernels' (soft_b, P2's coefficients of d2^0 .. d2^8, then Q2's), float32: the JSD's b
    (0 for the KLs), and with d2 = d / ln 2 the polynomial P2 with d2^2 P2(d2) = F(d) on |d| < 1
    (jsdgpu/soft_poly.py's P, in bits), and Q2 with d2 Q2(d2) = forward KL's 2^d2 - 1 or the
    JSD's log2(m / w) there (soft_poly.grad_poly's Q: row_math.cuh, SoftPoly)."""
    powers = np.log(2.0) ** np.arange(SOFT_POLY_TERMS)
    # d2^2 P2(d2) = d^2 P(d): P2's coefficient of d2^j is P's times ln(2)^(j + 2). d2 Q2(d2) =
    # d Q(d) = e^d - 1 (forward KL): Q's times ln(2)^(j + 1); = d Q(d) / ln 2 = ln(m / w) / ln 2
    # (the JSD): Q's times ln(2)^j
    grad_powers = powers * np.log(2.0) if Divergence(divergence) == Divergence.FORWARD_KL else powers
    return tuple(np.float32(c) for c in (soft_poly.mixture_weight(divergence, beta),
                                         *(soft_poly.soft_poly(divergence, beta) * powers * np.log(2.0) ** 2),
                                         *(soft_poly.grad_poly(divergence, beta) * grad_powers)))


# ---- the soft caps' tanh (common.cuh, soft_tanh) ----

TANH_POLY_BELOW = 0.6  # below it, tanh(u) = u + u^3 P(u^2); above, 1 - 2 / (e^2|u| + 1) cancels by less than 2


@functools.lru_cache(maxsize=None)
def tanh_poly():
    """P's four float32 coefficients (of s^0 .. s^3, s = u^2) with u + u^3 P(u^2) = tanh(u) on |u| <
    TANH_POLY_BELOW: a Chebyshev fit in s at 16 nodes, each residual weighted by s (so that the
    error is tanh's relative one), within 2 ulp in float32 (tests/test_cuda_sources.py)."""
    top = TANH_POLY_BELOW**2
    x = np.cos(np.pi * (np.arange(16) + 0.5) / 16)  # s = top (x + 1) / 2
    s = top * (x + 1) / 2
    u = np.sqrt(s)
    cheb = np.polynomial.chebyshev.chebfit(x, (np.tanh(u) / u - 1) / s, 3, w=s)
    in_x = np.polynomial.Polynomial(np.polynomial.chebyshev.cheb2poly(cheb))
    return tuple(np.float32(c) for c in in_x(np.polynomial.Polynomial([-1.0, 2 / top])).coef)


def fused_rows(dtype, mode, shape=FUSED):
    return (f"fused_rows<{int(mode)}, {FORMATS[np.dtype(dtype)]}, {shape.cluster}, {shape.threads}, "
            f"{shape.groups}, {shape.extra}, {shape.min_ctas}>")


def phase_stats():
    return f"phase_stats<{PHASE_THREADS}>"


def phase_kl():
    return f"phase_kl<{PHASE_THREADS}>"


def phase_finish(dtype):
    return f"phase_finish<{FORMATS[np.dtype(dtype)]}, {PHASE_THREADS}>"


def scale_cast(dtype):
    return f"scale_cast<{FORMATS[np.dtype(dtype)]}>"


def scale_rows(dtype):
    return f"scale_rows<{FORMATS[np.dtype(dtype)]}>"


def model_gradient(dtype):
    return f"model_gradient<{FORMATS[np.dtype(dtype)]}>"


def label_rows(dtype):
    return f"label_rows<{FORMATS[np.dtype(dtype)]}>"


def label_scatter(input_dtype, output_dtype):
    return f"label_scatter<{FORMATS[np.dtype(input_dtype)]}, {FORMATS[np.dtype(output_dtype)]}>"


def _index(dtype):
    """The C type of the int32 or int64 ids a kernel reads (targets, top-k ids)."""
    return "int" if np.dtype(dtype) == np.int32 else "long long"


def select_rows(target_dtype):
    return f"select_rows<{_index(target_dtype)}, {SELECT_THREADS}, {SELECT_ITEMS}>"


def mark_rows(target_dtype):
    return f"mark_rows<{_index(target_dtype)}, {MARK_THREADS}>"


def label_order():
    return f"label_order<{ORDER_THREADS}>"


def gather_rows(word_bytes):
    return f"gather_rows<{'uint4' if word_bytes == 16 else 'unsigned short'}>"


def topk_rows(dtype, stages=TOPK_STAGES):
    return f"topk_rows<{FORMATS[np.dtype(dtype)]}, {TOPK_THREADS}, {stages}>"


def topk_ring_bytes(stages=TOPK_STAGES):
    """topk_rows' shared memory for its batches of the row in flight (4 float4 groups a thread each)."""
    return stages * 16 * 4 * TOPK_THREADS


def topk_finish():
    return f"topk_finish<{TOPK_FINISH_THREADS}>"


def topk_slot_bits():
    return f"topk_slot_bits<{TOPK_THREADS}>"


def topk_logits(stages=TOPK_LOGITS_STAGES):
    return f"topk_logits<{stages}>"


def topk_logits_shared_bytes(stages=TOPK_LOGITS_STAGES):
    """topk_logits' dynamic shared memory: its stages, two consumers' G~ tiles, the mbarriers (three
    a stage: a full one a consumer, an empty one), and 1 KiB to align the stages to."""
    rows, columns = TOPK_LOGITS_TILE
    return stages * (rows + columns) * TOPK_LOGITS_K_STEP * 2 + 2 * rows * columns * 2 + 24 * stages + 1024


def topk_check(ids_dtype):
    return f"topk_check<{_index(ids_dtype)}, {TOPK_THREADS}>"


def teacher_topk():
    return f"teacher_topk<{TOPK_THREADS}>"


_ALL_DTYPES = tuple(FORMATS)
_16BIT = _ALL_DTYPES[1:]
# Every instantiation the library launches, by family (the source file's stem)
FAMILIES = {
    "fused_rows": [fused_rows(d, m, shape) for shape in FUSED_SHAPES for d in _ALL_DTYPES for m in ROW_MODES],
    "phase_rows": [phase_stats(), phase_kl()] + [phase_finish(d) for d in _ALL_DTYPES],
    "gradient_sums": ([scale_cast(d) for d in _16BIT] + [label_rows(d) for d in _ALL_DTYPES]
                      + [scale_rows(d) for d in _ALL_DTYPES] + ["model_logits"]
                      + [model_gradient(d) for d in _ALL_DTYPES]
                      + [label_scatter(d, np.float32) for d in _ALL_DTYPES]
                      + [label_scatter(d, d) for d in _16BIT] + [label_order()]),
    "targets": [select_rows(np.int32), select_rows(np.int64), gather_rows(16), gather_rows(2),
                mark_rows(np.int32), mark_rows(np.int64), "zero_rows", "first_bad_weight"],
    "topk_rows": ([topk_rows(d) for d in _ALL_DTYPES] + [topk_finish(), topk_slot_bits()]
                  + [topk_check(np.int32), topk_check(np.int64), teacher_topk()]),
    "topk_logits": [topk_logits()],
}
# the families that take sm_90a's instructions (wgmma, setmaxnreg), compiled for it
SM90A = ("topk_logits",)


def arch(family):
    return "sm_90a" if family in SM90A else "sm_90"


def prelude():
    """The codes the sources use, from Python's: the divergences (and the row kernels'
    JSD_MIRRORED), the formats, topk_logits' tiles (which topk_finish reads the partials of), and
    the soft caps' tanh polynomial."""
    codes = [(d.name, int(d)) for d in Divergence] + [("JSD_MIRRORED", JSD_MIRRORED)]
    codes += list(zip(_FORMAT_NAMES, range(3)))
    codes += [("TOPK_LOGITS_ROWS", TOPK_LOGITS_TILE[0]), ("TOPK_LOGITS_COLUMNS", TOPK_LOGITS_TILE[1]),
              ("TOPK_LOGITS_K_STEP", TOPK_LOGITS_K_STEP), ("TANH_POLY_BELOW", f"{TANH_POLY_BELOW}f")]
    codes += [(f"TANH_P{i}", f"{float(c):.9g}f") for i, c in enumerate(tanh_poly())]
    return "".join(f"#define {name} {value}\n" for name, value in codes)


def source(family, root=SRC):
    """The family's source with the codes defined and its headers inlined (each once), so that
    the text alone decides the compiled code (CuPy caches compiled modules by their text)."""
    seen = set()

    def inline(path):
        out = []
        for line in path.read_text().splitlines(keepends=True):
            include = re.match(r'#include "([\w.]+)"', line)
            if include:
                name = include.group(1)
                if name not in seen:
                    seen.add(name)
                    out.append(inline(root / name))
            elif not line.startswith("#pragma once"):
                out.append(line)
        return "".join(out)

    # wgmma's 128 accumulator registers as asm operands, spelt out once here
    return (prelude() + inline(root / f"{family}.cu")).replace(
        "WGMMA_OPERANDS", ", ".join(f"%{i}" for i in range(128))).replace(
        "WGMMA_OUTPUTS", ", ".join(f'"+f"(d[{i}])' for i in range(128)))
