"""The capturable mode (docs/contract.md, "Without host synchronization"): every row computed,
the ignored ones masked, 1/N on the device, a bad target a NaN loss and ctx.bad_target_row; and
on the GPU, forward and backward captured in a CUDA graph and replayed on new inputs."""

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, make_case, rel_err, to_numpy, to_xp

OPTIONS = [dict(beta=0.5), dict(beta=0.0, temperature=2.0), dict(beta=1.0, temperature=0.5),
           dict(beta=0.3, weight_hard_loss=0.8, weight_soft_loss=0.2)]


@pytest.mark.parametrize("memory_budget", [None, 1])  # G held for all rows; G per chunk
@pytest.mark.parametrize("index", range(len(OPTIONS)))
def test_masked_rows_as_the_reference(xp, rng, index, memory_budget):
    case = make_case(rng, T=23, vs=1031, vt=1040, bias=index % 2 == 0, ignored=0.4)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), capturable=True, chunk_size=5, memory_budget=memory_budget,
                               **OPTIONS[index])
    gi, gw, gb = jsdgpu.backward(ctx, 2.0)
    ref = jsdgpu.reference(**case, **OPTIONS[index])
    assert int(ctx.bad_target_row) == 23
    for got, want in ((loss, ref[0]), (ctx.hard_loss, ref[1]), (ctx.soft_loss, ref[2])):
        assert abs(float(got) - want) <= 1e-5 * max(1.0, abs(want)), (float(got), want)
    for got, want in zip((gi, gw, gb), ref[3:]):
        if want is not None:
            assert rel_err(got, 2.0 * want) <= 1e-4
    ignored = case["target"] == -100
    assert not to_numpy(gi)[ignored].any()  # exactly zero: their G rows were zeroed


def test_masked_rows_num_valid_tokens(xp, rng):
    case = make_case(rng, T=9, ignored=0.3)
    n = max(1, int((case["target"] != -100).sum()))
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), capturable=True, num_valid_tokens=3.0 * n)
    gi, gw, _ = jsdgpu.backward(ctx)
    ref = jsdgpu.reference(**case)
    assert abs(float(loss) - ref[0] / 3.0) <= 1e-5 * ref[0]
    assert rel_err(gw, ref[4] / 3.0) <= 1e-4


@pytest.mark.parametrize("value", [1031, -1, -100])
def test_a_bad_target_gives_nan_and_the_row(xp, rng, value):
    """No ValueError (a capture cannot raise): the loss, its parts and every gradient NaN, and
    ctx.bad_target_row the first bad row (-100 is bad where ignore_index is another)."""
    case = make_case(rng, T=11, bias=True, ignored=0.2, ignore_index=5)
    case["target"][[4, 8]] = value
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), capturable=True, ignore_index=5)
    grads = jsdgpu.backward(ctx)
    assert int(ctx.bad_target_row) == 4
    assert np.isnan(float(loss)) and np.isnan(float(ctx.hard_loss)) and np.isnan(float(ctx.soft_loss))
    for g in grads:
        assert np.isnan(to_numpy(g).astype(np.float32)).all()
    with pytest.raises(ValueError, match=r"target\[4\]"):  # the default mode raises
        jsdgpu.forward(**to_xp(case, xp), ignore_index=5)


@pytest.mark.parametrize("T,ignored", [(0, 0.0), (6, 1.0)])
def test_no_valid_rows(xp, rng, T, ignored):
    case = make_case(rng, T=T, bias=True, ignored=ignored)
    loss, ctx = jsdgpu.forward(**to_xp(case, xp), capturable=True)
    gi, gw, gb = jsdgpu.backward(ctx)
    assert float(loss) == 0.0 and int(ctx.bad_target_row) == T
    for g in (gi, gw, gb):
        assert not to_numpy(g).any()


def test_default_mode_has_no_bad_target_row(xp, rng):
    loss, ctx = jsdgpu.forward(**to_xp(make_case(rng, T=3), xp))
    assert ctx.bad_target_row is None


# ---- CUDA graphs ----

def _captured_step(cupy, static, options):
    """The graph of forward + backward on the static inputs, and its outputs' arrays."""
    stream = cupy.cuda.get_current_stream()
    stream.begin_capture()
    try:
        loss, ctx = jsdgpu.forward(**static, **options)
        grads = jsdgpu.backward(ctx)
    finally:
        graph = stream.end_capture()
    return graph, (loss, ctx.hard_loss, ctx.soft_loss, ctx.bad_target_row, *grads)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,options,budget", [
    (BF16, dict(beta=0.5), None), (np.float32, dict(beta=0.0, temperature=2.0), 1),
    (BF16, dict(beta=1.0, temperature=0.5), None), (np.float16, dict(beta=0.3), 1)])
def test_cuda_graph_replays_on_new_inputs(rng, dtype, options, budget):
    """forward + backward captured once (capturable by itself: the stream is capturing), then
    replayed after new inputs and targets (other rows ignored) are copied into the captured
    buffers: the same bits as a capturable eager call on those inputs, and the reference's
    answer."""
    import cupy
    shape = dict(T=75, hs=32, ht=48, vs=1031, vt=1040, dtype=dtype, bias=True, logit_std=4.0)
    pool = cupy.cuda.MemoryPool()  # the graph's memory: its own, kept as long as the graph
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, cupy.cuda.using_allocator(pool.malloc):
        static = to_xp(make_case(rng, ignored=0.3, **shape), cupy)
        run = dict(options, chunk_size=32, memory_budget=budget)
        for _ in range(2):  # warm-up: the kernels compiled, the products' algorithms chosen
            jsdgpu.backward(jsdgpu.forward(**static, capturable=True, **run)[1])
        stream.synchronize()
        graph, outputs = _captured_step(cupy, static, run)
        for replay in range(2):
            case = make_case(rng, ignored=(0.5, 0.1)[replay], **shape)
            for k, v in case.items():
                static[k][...] = cupy.asarray(v)
            graph.launch(stream)
            captured = [to_numpy(a).copy() for a in outputs]
            eager_loss, ctx = jsdgpu.forward(**static, capturable=True, **run)
            eager = [to_numpy(a) for a in (eager_loss, ctx.hard_loss, ctx.soft_loss, ctx.bad_target_row,
                                           *jsdgpu.backward(ctx))]
            for a, b in zip(captured, eager):
                assert a.tobytes() == b.tobytes()
            ref = jsdgpu.reference(**case, **options)
            assert abs(float(captured[0]) - ref[0]) <= 1e-5 * ref[0] and int(captured[3]) == shape["T"]
            tol = 1e-4 if dtype == np.float32 else 2.0**-7
            for got, want in zip(captured[4:], ref[3:]):
                assert rel_err(got, want) <= tol


@pytest.mark.gpu
def test_cuda_graph_with_a_bad_target(rng):
    """A bad target copied in before a replay: NaN, and the row, with no exception."""
    import cupy
    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with stream, cupy.cuda.using_allocator(pool.malloc):
        static = to_xp(make_case(rng, T=20, bias=True), cupy)
        jsdgpu.backward(jsdgpu.forward(**static, capturable=True)[1])
        stream.synchronize()
        graph, outputs = _captured_step(cupy, static, {})
        target = to_numpy(static["target"]).copy()
        target[13] = 10**6
        static["target"][...] = cupy.asarray(target)
        graph.launch(stream)
        assert np.isnan(float(outputs[0])) and int(outputs[3]) == 13


@pytest.mark.gpu
def test_capture_from_the_default_pool_raises(rng):
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        case = to_xp(make_case(rng, T=4), cupy)
        jsdgpu.forward(**case)
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="using_allocator"):
                jsdgpu.forward(**case)
        finally:
            stream.end_capture()


@pytest.mark.gpu
def test_capturable_equals_default_mode(rng):
    """The same loss and gradients in both modes within float32 noise (the products run over
    other rows: all of them, or the valid ones gathered)."""
    import cupy
    case = make_case(rng, T=300, hs=64, ht=96, vs=4099, dtype=BF16, bias=True, ignored=0.4, logit_std=4.0)
    out = []
    for capturable in (False, True):
        loss, ctx = jsdgpu.forward(**to_xp(case, cupy), capturable=capturable, beta=0.3)
        out.append([to_numpy(a).astype(np.float64) for a in (loss, *jsdgpu.backward(ctx))])
    assert abs(out[0][0] - out[1][0]) <= 1e-6 * abs(out[0][0])
    for a, b in zip(out[0][1:], out[1][1:]):
        assert rel_err(a, b) <= 2.0**-8
