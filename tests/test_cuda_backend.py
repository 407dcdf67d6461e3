"""The GPU backend at real sizes: the benchmark shape's accuracy, a chunk of more than 2^31
logits, the widest vocabulary of the fused row kernel and past it, the rows it hands out to its
clusters, a second GPU and a non-default stream; the gather of the valid rows and the order of
the labels."""

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, make_case, rel_err, to_xp

pytestmark = pytest.mark.gpu

V, HS, HT = 128256, 2048, 4096


def gpu_case(rng, **kw):
    import cupy
    case = make_case(rng, **kw)
    return {k: None if v is None else cupy.asarray(v) for k, v in case.items()}


def test_benchmark_shape_gradients_near_bf16_rounding(rng):
    """T = 1024, bf16, logits of std 8: the gradient error against float64 on the same inputs
    is at most twice the error of merely rounding the float64 gradient to bf16."""
    case = gpu_case(rng, T=1024, hs=HS, ht=HT, vs=V, dtype=BF16, logit_std=8.0, ignored=0.2)
    loss, ctx = jsdgpu.forward(**case)
    gi, gw, _ = jsdgpu.backward(ctx)
    ref = jsdgpu.reference(**case)
    assert abs(float(loss) - ref[0]) <= 1e-5 * ref[0]
    for name, got, want in (("grad_input", gi, ref[3]), ("grad_weight", gw, ref[4])):
        err = float(rel_err_gpu(got, want))
        floor = float(rel_err_gpu(want.astype(BF16), want))
        print(f"{name}: error {err:.3e}, bf16 rounding floor {floor:.3e}, ratio {err / floor:.2f}")
        assert err <= 2.0 * floor, (name, err, floor)


def rel_err_gpu(a, ref):
    import cupy
    d = a.astype(cupy.float64) - ref
    return cupy.linalg.norm(d) / cupy.linalg.norm(ref)


@pytest.mark.slow
def test_chunk_of_more_than_2_31_logits(rng):
    """T = chunk_size = 17000 at V = 128256: 2.18e9 logits in one chunk. The last rows (past
    2^31 / V = 16744) must be as right as the first; the loss equals that of small chunks."""
    import cupy
    T = 17000
    assert T * V > 2**31
    case = gpu_case(rng, T=T, hs=64, ht=64, vs=V, dtype=BF16, logit_std=4.0, bias=True)
    loss, ctx = jsdgpu.forward(**case, chunk_size=T, beta=0.3)
    gi, _, _ = jsdgpu.backward(ctx)
    del ctx
    loss_small, _ = jsdgpu.forward(**case, chunk_size=4000, beta=0.3, compute_grad=False)
    assert abs(float(loss) - float(loss_small)) <= 1e-5 * float(loss)
    rows = cupy.asarray([0, 1, 16743, 16744, 16745, T - 2, T - 1])
    sub = dict(case, student_input=case["student_input"][rows],
               teacher_input=case["teacher_input"][rows], target=case["target"][rows])
    ref = jsdgpu.reference(**sub, beta=0.3)
    # reference rows are divided by the subset's size, ours by T
    assert rel_err(gi[rows].astype(cupy.float32) * (T / len(rows)), ref[3].get()) <= 2**-8


FUSED_MAX = 131072, 163840, 262144, 327680  # jsdgpu.cuda.sources: the widest teacher vocabulary of each fused shape
REVERSE_T2, JSD = dict(beta=1.0, temperature=2.0), dict(beta=0.3)
CAPS = dict(beta=0.5, student_logit_scale=1.5, student_logit_softcap=5.0, teacher_logit_softcap=30.0)


@pytest.mark.parametrize("vs, vt, options", [
    (V, V + 77, REVERSE_T2), (V, V + 77, JSD), (FUSED_MAX[0], FUSED_MAX[0], JSD),
    (FUSED_MAX[0] - 5, FUSED_MAX[0] + 1, JSD), (FUSED_MAX[0] + 3, FUSED_MAX[0] + 3, REVERSE_T2),
    (151936, 151936, JSD), (151936 - 9, 151936, CAPS), (FUSED_MAX[1], FUSED_MAX[1], JSD),
    (FUSED_MAX[1] - 5, FUSED_MAX[1] + 1, REVERSE_T2), (201088, 201088, CAPS), (FUSED_MAX[2], FUSED_MAX[2], JSD),
    (FUSED_MAX[2] - 5, FUSED_MAX[2] + 1, JSD), (262208, 262208, CAPS), (FUSED_MAX[3], FUSED_MAX[3], REVERSE_T2),
    (FUSED_MAX[3] - 5, FUSED_MAX[3] + 1, JSD), (FUSED_MAX[3] + 1, FUSED_MAX[3] + 1, CAPS)])
def test_vocabularies_up_to_and_past_the_fused_kernel(rng, vs, vt, options):
    """The reference's answer from the fused kernel at the benchmark vocabulary with teacher pad
    columns (reverse KL: a column past the teacher's taken for a pad one makes the loss inf),
    from each of its shapes at its widest (every group of every thread full) and just past the
    narrower one's widest, at Qwen's, GPT-OSS's and Gemma 3's vocabularies (with soft caps: the
    models' logits formed in the kernel), and from the three phases just past the widest shape's widest (with
    soft caps: the passes around them); each with G held for all rows and with G written over
    the chunks' student logits (the phases: G of the chunk's own)."""
    from jsdgpu.cuda import sources
    shapes = sources.FUSED_SHAPES
    assert tuple(s.max_vocab for s in shapes) == FUSED_MAX
    case = gpu_case(rng, T=33, hs=64, ht=96, vs=vs, vt=vt, dtype=np.float32, bias=True,
                    logit_std=8.0, ignored=0.3)
    assert fused_shape_taken(case) == next((s for s, most in zip(shapes, FUSED_MAX) if vt <= most), None)
    against_reference(case, options)


def fused_shape_taken(case):
    """The fused kernel's shape a call on the case takes, or None: the phases."""
    from jsdgpu.cuda.backend import CudaBackend
    work = CudaBackend.prepare(case["student_weight"], case["teacher_weight"], None, None, 1, fused=True)
    return None if work.fused is None else work.fused.shape


def against_reference(case, options):
    ref = jsdgpu.reference(**case, **options)
    # G held for all rows (one chunk), and G of 4-row chunks written over their student logits
    for run in (dict(), dict(chunk_size=4, memory_budget=1)):
        loss, ctx = jsdgpu.forward(**case, **options, **run)
        gi, gw, gb = jsdgpu.backward(ctx)
        assert abs(float(loss) - ref[0]) <= 1e-5 * ref[0], run
        for got, want in zip((gi, gw, gb), ref[3:]):
            assert rel_err(got.get(), want.get()) <= 1e-4, run


@pytest.mark.parametrize("vt, options", [(FUSED_MAX[1] + 1, JSD), (201088, CAPS), (262208, JSD)])
def test_wide_rows_where_the_gpu_fits_no_wide_cluster(rng, monkeypatch, vt, options):
    """On a GPU where no cluster of the wide shapes fits (none of its GPCs has 16 SMs), their rows
    take the phase kernels, with the reference's answer (the H200 fits 7: here the fit is
    denied)."""
    from jsdgpu.cuda import kernels, sources
    fits = kernels.FusedKernel.fits
    wide = (sources.FUSED_WIDE, sources.FUSED_WIDE_EXTRA)
    monkeypatch.setattr(kernels.FusedKernel, "fits", lambda self: self.shape not in wide and fits(self))
    case = gpu_case(rng, T=33, hs=64, ht=96, vs=vt - 3, vt=vt, dtype=np.float32, bias=True, logit_std=8.0,
                    ignored=0.3)
    assert fused_shape_taken(case) is None
    against_reference(case, options)


@pytest.mark.parametrize("vt", [1040, FUSED_MAX[0] + 8, FUSED_MAX[1] + 8, FUSED_MAX[2] + 8])
def test_rows_handed_out_to_the_clusters(rng, vt):
    """One chunk of T rows for T around multiples of the fused kernel's clusters (each takes its
    first two rows by its index, the rest from a counter as it asks), in each of its shapes:
    every row's loss and gradient, as the reference's."""
    import cupy
    from jsdgpu.cuda.backend import CudaBackend
    case = gpu_case(rng, vs=1031, vt=vt)
    clusters = CudaBackend.prepare(case["student_weight"], case["teacher_weight"], None, None, 1,
                                   fused=True).fused.max_clusters
    for T in (1, clusters - 1, clusters, clusters + 1, 2 * clusters - 1, 2 * clusters, 2 * clusters + 1,
              5 * clusters + 3):
        case = make_case(rng, T=T, hs=32, ht=48, vs=1031, vt=vt, bias=True, logit_std=4.0)
        ref = jsdgpu.reference(**case, beta=0.3)
        loss, ctx = jsdgpu.forward(**to_xp(case, cupy), beta=0.3, chunk_size=T)
        gi, gw, gb = jsdgpu.backward(ctx)
        assert abs(float(loss) - ref[0]) <= 1e-5 * ref[0], T
        for got, want in zip((gi, gw, gb), ref[3:]):
            assert rel_err(got.get(), want) <= 1e-4, T


def test_on_a_second_gpu(rng):
    """The same call on GPU 0 and on GPU 1 (the kernels, the selection's result buffer and
    cuBLASLt's choices are kept per device): both as the reference's, their results on their
    inputs' device."""
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    case = make_case(rng, T=100, hs=32, ht=48, vs=1031, vt=1040, bias=True, ignored=0.3)
    ref = jsdgpu.reference(**case)
    for device in (0, 1):
        with cupy.cuda.Device(device):
            arrays = to_xp(case, cupy)
        loss, ctx = jsdgpu.forward(**arrays)
        grads = jsdgpu.backward(ctx)
        assert loss.device.id == device and all(g.device.id == device for g in grads)
        assert abs(float(loss) - ref[0]) <= 1e-5 * ref[0]
        for got, want in zip(grads, ref[3:]):
            assert rel_err(got.get(), want) <= 1e-4


def test_runs_on_the_current_stream(rng):
    """Work queued on a non-default stream gives the right answer."""
    import cupy
    case = make_case(rng, T=40, bias=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        arrays = {k: None if v is None else cupy.asarray(v) for k, v in case.items()}
        loss, ctx = jsdgpu.forward(**arrays, chunk_size=7)
        gi, gw, gb = jsdgpu.backward(ctx)
        host = [a.get(stream=stream) for a in (loss, gi, gw, gb)]
    stream.synchronize()
    ref = jsdgpu.reference(**case)
    assert abs(float(host[0]) - ref[0]) <= 1e-5 * ref[0]
    for got, want in zip(host[1:], ref[3:]):
        assert rel_err(got, want) <= 1e-4


# rows of 64 and 128 bytes in float32 (16-byte words), of 26 and 48 bytes in bf16 (2-byte words)
@pytest.mark.parametrize("dtype,widths", [(np.float32, (16, 32)), (BF16, (13, 24))])
@pytest.mark.parametrize("n_rows", [0, 1, 37])
def test_take_rows(rng, dtype, widths, n_rows):
    import cupy
    from jsdgpu.cuda.backend import CudaBackend
    a, b = (rng.standard_normal((50, h)).astype(dtype) for h in widths)
    rows = np.sort(rng.choice(50, n_rows, replace=False)).astype(np.int32)
    out_a, out_b = CudaBackend.take_rows(cupy.asarray(rows), cupy.asarray(a), cupy.asarray(b))
    assert out_a.shape == (n_rows, widths[0]) and out_b.shape == (n_rows, widths[1])
    assert out_a.get().tobytes() == a[rows].tobytes() and out_b.get().tobytes() == b[rows].tobytes()


@pytest.mark.parametrize("n", [1, 7, 33, 8192 + 5])  # within a warp, past one, past a block's rows
def test_label_order_is_a_stable_argsort(rng, n):
    """label_order (the order in which label_scatter adds the label terms, so that its bits repeat)
    is NumPy's stable argsort of the labels: many repeated, -1 (a label on another rank) among them."""
    import cupy
    from jsdgpu.cuda import kernels
    labels = rng.integers(-1, max(2, n // 4), n).astype(np.int32)
    got = kernels.label_order(cupy.asarray(labels)).get()
    np.testing.assert_array_equal(got, np.argsort(labels, kind="stable"))
