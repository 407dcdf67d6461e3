"""jsdgpu.torch: the Liger-compatible module, on the CPU and on the GPU."""

import contextlib

import numpy as np
import pytest

import jsdgpu
from conftest import BF16, make_case, process_group, rel_err, run_processes, weight_sums_spied

torch = pytest.importorskip("torch")
jtorch = pytest.importorskip("jsdgpu.torch")

ARGS = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target",
        "student_bias", "teacher_bias")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return request.param


def tensors(case, device, requires_grad=True):
    out = []
    for name in ARGS:
        a = case[name]
        if a is None:
            out.append(None)
            continue
        t = jtorch.from_native(a).to(device)  # bfloat16 included
        if requires_grad and name != "target":
            t.requires_grad_(True)
        out.append(t)
    return out


def grads_of(ts):
    return [None if t is None or t.grad is None else t.grad.float().cpu().numpy() for t in ts]


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.5, 2.0), (1.0, 0.5), (0.3, 1.0)])
def test_module_against_reference(rng, device, dtype, beta, temperature):
    case = make_case(rng, T=11, dtype=dtype, bias=True, ignored=0.3, vt=1040)
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=0.3, weight_soft_loss=0.7)
    ts = tensors(case, device)
    loss, soft, hard = jtorch.FusedLinearJSDLoss(**opts, chunk_size=4, return_soft_hard_loss=True)(*ts)
    (2.0 * loss).backward()  # grad_output 2
    ref = jsdgpu.reference(**case, **opts)
    assert loss.device.type == device and loss.dtype == torch.float32 and loss.shape == ()
    for got, want in ((loss, ref[0]), (hard, ref[1]), (soft, ref[2])):
        assert abs(float(got.detach()) - want) <= 1e-5 * max(1.0, abs(want))
    g = grads_of(ts)
    tol = 1e-4 if dtype == np.float32 else 2.0**-7  # 16-bit: 2 eps, tiny arrays are noisy
    for got, want in zip((g[0], g[1], g[5]), ref[3:]):
        assert rel_err(got, 2.0 * want) <= tol
    assert g[2] is None and g[3] is None and g[6] is None  # the teacher gets no gradient
    assert ts[0].grad.dtype == ts[0].dtype


def test_no_grad_computes_the_loss_only(rng, device):
    case = make_case(rng, T=6)
    ts = tensors(case, device)
    with torch.no_grad():
        loss = jtorch.fused_linear_jsd_loss(*ts)
    assert not loss.requires_grad
    assert abs(float(loss) - jsdgpu.reference(**case)[0]) <= 1e-5 * float(loss)


def test_zero_copy_both_ways(rng, device):
    t = torch.randn(5, 7, device=device).to(torch.bfloat16)
    a = jtorch.to_native(t)
    ptr = a.data.ptr if device == "cuda" else a.ctypes.data
    assert ptr == t.data_ptr() and a.dtype == BF16 and a.shape == (5, 7)
    back = jtorch.from_native(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_views_cross_as_they_are(rng, device, dtype):
    """A view with an offset and strides (a slice, a transpose, a row) crosses zero-copy with its
    values, and the native array keeps the tensor's memory alive once the tensor is gone (memory
    handed out after it would overwrite it)."""
    values = rng.standard_normal((9, 14)) * 100
    for take in (lambda t: t[2:, 1::3], lambda t: t.t(), lambda t: t[4]):
        view = take(torch.from_numpy(values).to(device=device, dtype=dtype))
        want = view.float().cpu().numpy()
        a = jtorch.to_native(view)
        del view
        torch.full((9, 14), 7, device=device, dtype=dtype)
        got = a.get() if device == "cuda" else a
        assert a.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want)


def test_eager_calls_take_the_function_and_traces_the_operator(rng, device):
    """Eagerly the loss is the autograd Function, whose backward hands grad_output to
    jsdgpu.backward (the operator's eager dispatch and its pass over the gradients cost up to a
    millisecond a step); what a trace sees (here a FakeTensor's shapes) is the operator."""
    ts = tensors(make_case(rng, T=5), device)
    assert type(jtorch.FusedLinearJSDLoss()(*ts).grad_fn).__name__ == "_EagerBackward"
    assert not jtorch._runs_eagerly(torch._subclasses.FakeTensorMode().from_tensor(ts[0]))


def test_eager_step_adds_no_work_of_its_own(rng, device):
    """The eager step's host path before the first product and in backward (docs/design.md, "The
    front ends"): 2-D inputs reach the Function as they are (no reshape, whose view would be an
    autograd node of its own), and backward makes no zeros for the gradients of the loss's
    non-differentiable parts (an autograd Function materializes them unless told not to); the
    gradients stay the reference's."""
    case = make_case(rng, T=6)
    ts = tensors(case, device)
    loss = jtorch.FusedLinearJSDLoss()(*ts)
    inputs = {fn.variable.data_ptr() for fn, _ in loss.grad_fn.next_functions
              if type(fn).__name__ == "AccumulateGrad"}
    assert {ts[0].data_ptr(), ts[1].data_ptr()} <= inputs  # straight into the leaves: no view between
    with torch.profiler.profile() as prof:
        loss.backward()
    assert not [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zero_")]
    ref = jsdgpu.reference(**case)
    assert rel_err(ts[0].grad.float().cpu().numpy(), ref[3]) < 1e-4
    assert rel_err(ts[1].grad.float().cpu().numpy(), ref[4]) < 1e-4


def test_a_second_backward_says_so(rng, device):
    """The gradients are made once per call (jsdgpu.backward frees its sums): a second backward
    through a retained graph raises, not a silent wrong gradient."""
    ts = tensors(make_case(rng, T=5), device)
    loss = jtorch.FusedLinearJSDLoss()(*ts)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already"):
        loss.backward()


def test_a_compiled_loss_backpropagates_a_retained_graph_again(rng, device):
    """Traced, the operator's gradients are its outputs: a second backward through a retained graph
    adds the same gradients again (docs/contract.md, "Front ends")."""
    ts = tensors(make_case(rng, T=5), device)
    torch._dynamo.reset()
    loss = torch.compile(jtorch.FusedLinearJSDLoss(), fullgraph=True)(*ts)
    loss.backward(retain_graph=True)
    first = ts[0].grad.clone()
    loss.backward()
    torch.testing.assert_close(ts[0].grad, 2 * first)


@pytest.mark.parametrize("held", [True, False])
def test_compiled_float32_weight_gradient_in_its_output(rng, device, monkeypatch, held):
    """Traced, an fp32 weight's gradient is formed in the operator's output buffer: where G is not
    held for all rows, its float32 sum over the chunks is kept there (torch_bridge.GradWeight: no
    copy into it after); where G is held, the core never asks for the buffer (made after forward,
    it adds nothing to forward's peak) and its one product writes there. The reference's gradients
    either way."""
    given = weight_sums_spied(monkeypatch, held)
    case = make_case(rng, T=13, bias=True, ignored=0.3)
    ts = tensors(case, device)
    torch._dynamo.reset()
    step = torch.compile(jtorch.FusedLinearJSDLoss(beta=0.4, chunk_size=4), fullgraph=True)
    loss = step(*ts)
    (3.0 * loss).backward()
    # (hold_g, weight_memory given, asked for that often, the sum kept there): G held, not made
    assert given == [(held, True, int(not held), not held)]
    ref = jsdgpu.reference(**case, beta=0.4)
    g = grads_of(ts)
    for got, want in zip((g[0], g[1], g[5]), ref[3:]):
        assert rel_err(got, 3.0 * want) <= 1e-4
    assert ts[1].grad.dtype == torch.float32
    ts[4][:] = -100  # no valid row: no chunk, the sum (in the buffer, whatever it held) zero
    ts[1].grad = None
    step(*ts).backward()
    assert given[-1] == (False, True, 1, True) and not ts[1].grad.any()


def test_gradients_land_without_copies(rng, device):
    """The module's gradients are the tensors jsdgpu.backward made, viewed (pointer check on
    the functional form's outputs through the bridge)."""
    case = make_case(rng, T=4)
    ts = tensors(case, device, requires_grad=False)
    loss, ctx = jsdgpu.forward(*ts)
    assert isinstance(loss, torch.Tensor) and isinstance(ctx.soft_loss, torch.Tensor)
    gi, gw, gb = jsdgpu.backward(ctx)
    assert isinstance(gi, torch.Tensor) and gi.device.type == device and gb is None


@pytest.mark.parametrize("numpy_faster", [False, True])
def test_cpu_products_by_the_faster_blas(rng, monkeypatch, numpy_faster):
    """On CPU tensors the products (both logits, grad_input, grad_weight) are torch's where
    NumPy's did not run the trial product faster (jsdgpu.cpu.products.faster_of), else NumPy's,
    with the reference's answer either way: through the module (G held for all rows, grad_weight
    in backward's one product) and through jsdgpu.forward on the tensors with G per chunk
    (grad_weight summed chunk by chunk); a call on NumPy arrays after each takes NumPy's (the
    choice ends with its call)."""
    import jsdgpu.torch_bridge as bridge
    from jsdgpu.cpu import products
    monkeypatch.setattr(products, "numpy_is_faster", lambda other: numpy_faster)
    calls, by_torch = [], bridge._torch_matmul
    monkeypatch.setattr(bridge, "_torch_matmul", lambda a, b, out: calls.append(a.shape) or by_torch(a, b, out))
    case = make_case(rng, T=11, bias=True, ignored=0.3, vt=1040)
    ref = jsdgpu.reference(**case)
    for per_chunk in (False, True):
        if per_chunk:
            loss, ctx = jsdgpu.forward(*tensors(case, "cpu", requires_grad=False), chunk_size=4, memory_budget=1)
            grads = [g.numpy() for g in jsdgpu.backward(ctx)]
        else:
            ts = tensors(case, "cpu")
            loss = jtorch.FusedLinearJSDLoss()(*ts)
            loss.backward()
            g = grads_of(ts)
            grads = g[0], g[1], g[5]
        assert abs(float(loss.detach()) - ref[0]) <= 1e-5 * ref[0]
        for got, want in zip(grads, ref[3:]):
            assert rel_err(got, want) <= 1e-4
        assert len(calls) >= 4 if not numpy_faster else not calls, calls
        calls.clear()
        jsdgpu.backward(jsdgpu.forward(**case, chunk_size=4, memory_budget=1)[1])
        assert not calls


@pytest.mark.gpu
def test_runs_on_the_current_torch_stream(rng):
    """Work queued on a non-default torch stream gives the right answer; nothing is
    synchronized for it (the result is read only after the stream is)."""
    case = make_case(rng, T=64, bias=True, ignored=0.2)
    ts = tensors(case, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        loss = jtorch.FusedLinearJSDLoss(chunk_size=16)(*ts)
        loss.backward()
    stream.synchronize()
    ref = jsdgpu.reference(**case)
    assert abs(float(loss.detach()) - ref[0]) <= 1e-5 * ref[0]
    g = grads_of(ts)
    for got, want in zip((g[0], g[1], g[5]), ref[3:]):
        assert rel_err(got, want) <= 1e-4


@pytest.mark.gpu
def test_the_stream_block_puts_cupy_on_torchs_stream_and_memory_and_puts_it_back():
    """Inside current_stream(t), CuPy's current stream is torch's and its memory is torch's; after
    it, CuPy's device, stream and allocator are what they were, also where the block raised."""
    import cupy
    t = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    before = cupy.cuda.get_current_stream().ptr, cupy.cuda.get_allocator(), cupy.cuda.runtime.getDevice()
    made = []
    for raises in (False, True):
        with torch.cuda.stream(stream), contextlib.suppress(KeyError):
            with jtorch.current_stream(t):
                assert cupy.cuda.get_current_stream().ptr == stream.cuda_stream
                held = torch.cuda.memory_allocated()
                made.append(cupy.empty(1 << 20, cupy.uint8))
                assert torch.cuda.memory_allocated() >= held + made[-1].nbytes
                if raises:
                    raise KeyError
        assert (cupy.cuda.get_current_stream().ptr, cupy.cuda.get_allocator(), cupy.cuda.runtime.getDevice()) == before
    stream.synchronize()


def test_the_stream_block_leaves_every_context_when_one_fails_to_leave():
    """The block's contexts are left in reverse order, each even where one before it raised on
    leaving (a device or stream not restored would outlive the call), and the first failure
    reaches the caller; where one fails to enter, those entered before it are left so. On the
    CPU: the block built around stand-in contexts."""
    from jsdgpu import torch_bridge
    events = []

    class Context:
        def __init__(self, name, fails_to_leave=False, fails_to_enter=False):
            self.name, self.fails_to_leave, self.fails_to_enter = name, fails_to_leave, fails_to_enter

        def __enter__(self):
            if self.fails_to_enter:
                raise KeyError(self.name)
            events.append("enter " + self.name)
            return self

        def __exit__(self, *exc):
            events.append("leave " + self.name)
            if self.fails_to_leave:
                raise RuntimeError(self.name)

    def block(*contexts):
        made = torch_bridge._OnTorchStream.__new__(torch_bridge._OnTorchStream)
        made._contexts = contexts
        return made

    with pytest.raises(RuntimeError, match="^stream$"):
        with block(Context("device"), Context("torch", fails_to_leave=True), Context("stream", fails_to_leave=True),
                   Context("allocator")):
            pass
    assert events == ["enter device", "enter torch", "enter stream", "enter allocator",
                      "leave allocator", "leave stream", "leave torch", "leave device"]
    events.clear()
    with pytest.raises(RuntimeError, match="^torch$") as raised:
        with block(Context("device", fails_to_leave=True), Context("torch", fails_to_leave=True),
                   Context("stream", fails_to_enter=True), Context("allocator")):
            events.append("body")
    assert events == ["enter device", "enter torch", "leave torch", "leave device"]
    assert isinstance(raised.value.__context__, KeyError)


@pytest.mark.gpu
@pytest.mark.parametrize("logit_std", [1.0, 8.0])
@pytest.mark.parametrize("beta,temperature,weights,bias,ignore_index", [
    (0.5, 1.0, (0.5, 0.5), False, -100), (0.0, 2.0, (0.3, 0.7), True, -100),
    (1.0, 0.5, (0.7, 0.3), False, 3), (0.3, 1.0, (1.0, 0.0), True, 3)])
def test_matches_liger(rng, beta, temperature, weights, bias, ignore_index, logit_std):
    """Against Liger 0.8.5 on the same bf16 inputs: gradients at least as close to float64 as
    Liger's; the loss within 1e-4 of Liger's where Liger's own loss is that accurate (logits of
    std 1), and at std 8, where Liger's bf16 logits cost it more, closer to float64 than
    Liger's or within 1e-6 of it, relative. (At std 8, beta 1 and temperature 0.5, 96 draws on
    the H200: our loss 2e-5 from float64, 5e-7 relative; Liger's 8e-4 to 1.6e-2. Liger's error,
    a sum of roundings, can pass near 0 by chance: "closer than Liger's" alone failed once.)"""
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    case = make_case(rng, T=300, hs=256, ht=512, vs=32003, vt=32003, dtype=BF16, ignored=0.25,
                     logit_std=logit_std, bias=bias, ignore_index=ignore_index)
    opts = dict(beta=beta, temperature=temperature, weight_hard_loss=weights[0],
                weight_soft_loss=weights[1], ignore_index=ignore_index)
    ref = jsdgpu.reference(**case, **opts)
    results = []
    for module in (jtorch.FusedLinearJSDLoss(**opts), liger.LigerFusedLinearJSDLoss(**opts)):
        ts = tensors(case, "cuda")
        loss = module(*ts)
        loss.backward()
        results.append((float(loss.detach()), grads_of(ts)))
    (ours, g_ours), (theirs, g_theirs) = results
    print(f"loss: jsdgpu {ours:.7f}, liger {theirs:.7f}, float64 {ref[0]:.7f}")
    assert abs(ours - ref[0]) <= 1e-5 * max(1.0, ref[0])
    if logit_std == 1.0:
        assert abs(ours - theirs) <= 1e-4 * max(1.0, abs(theirs)), (ours, theirs)
    else:
        assert abs(ours - ref[0]) <= max(abs(theirs - ref[0]), 1e-6 * abs(ref[0]))
    for k, want in ((0, ref[3]), (1, ref[4])) + (((5, ref[5]),) if bias else ()):
        e_ours, e_theirs = rel_err(g_ours[k], want), rel_err(g_theirs[k], want)
        print(f"grad {k}: jsdgpu {e_ours:.2e}, liger {e_theirs:.2e}")
        assert e_ours <= e_theirs


@pytest.mark.parametrize("form", ["function", "module"])
def test_num_valid_tokens(rng, device, form):
    """num_valid_tokens per call, in the functional form and the module's call (a data-parallel
    user of the module passes the whole batch's count at every step)."""
    case = make_case(rng, T=6, ignored=0.3)
    ts = tensors(case, device)
    n = max(1, int((case["target"] != -100).sum()))
    loss_fn = jtorch.fused_linear_jsd_loss if form == "function" else jtorch.FusedLinearJSDLoss()
    loss = loss_fn(*ts, num_valid_tokens=4.0 * n)
    loss.backward()
    ref = jsdgpu.reference(**case)
    assert abs(float(loss.detach()) - ref[0] / 4.0) <= 1e-5 * ref[0]
    assert rel_err(grads_of(ts)[1], ref[4] / 4.0) <= 1e-4


# ---- a training step, as a user runs one ----

V_STEP, H_IN, H_S, H_T = 1031, 24, 32, 48


class Models(torch.nn.Module):
    """A student (a linear body and an LM head) and a frozen teacher: what feeds the loss."""

    def __init__(self, device, bias=False):
        super().__init__()
        self.student_body = torch.nn.Sequential(torch.nn.Linear(H_IN, H_S), torch.nn.Tanh())
        self.student_head = torch.nn.Linear(H_S, V_STEP, bias=bias)
        self.teacher_body = torch.nn.Sequential(torch.nn.Linear(H_IN, H_T), torch.nn.Tanh())
        self.teacher_head = torch.nn.Linear(H_T, V_STEP, bias=bias)
        for m in (self.student_head, self.teacher_head):
            torch.nn.init.normal_(m.weight, std=4.0 / H_S**0.5)
        self.teacher_body.requires_grad_(False)
        self.teacher_head.requires_grad_(False)
        self.to(device)

    def forward(self, x, labels, loss_fn):
        hs, ht = self.student_body(x), self.teacher_body(x)
        return loss_fn(hs, self.student_head.weight, ht, self.teacher_head.weight, labels,
                       self.student_head.bias, self.teacher_head.bias)


def batches(rng, device, n, shape=(3, 7)):
    out = []
    for _ in range(n):
        x = torch.from_numpy(rng.standard_normal((*shape, H_IN)).astype(np.float32)).to(device)
        labels = torch.from_numpy(rng.integers(0, V_STEP, shape)).to(device)
        labels[torch.from_numpy(rng.random(shape) < 0.25).to(device)] = -100
        out.append((x, labels))
    return out


def train(models, data, forward, steps_autocast=None):
    """A few AdamW steps; the losses and the student's gradients of each step."""
    opt = torch.optim.AdamW([p for p in models.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for x, labels in data:
        if steps_autocast is None:
            loss = forward(x, labels)
        else:
            with torch.autocast(x.device.type, dtype=steps_autocast):
                loss = forward(x, labels)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append([p.grad.detach().clone() for p in models.parameters() if p.requires_grad])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def train_each(device, seed, data, loss_fn, compile_options, bias=False, steps_autocast=None):
    """train() once per entry of compile_options (None: eager; else torch.compile's keywords),
    each from the same seeded models."""
    results = []
    for options in compile_options:
        torch.manual_seed(seed)
        models = Models(device, bias)
        forward = lambda x, labels: models(x, labels, loss_fn)  # noqa: E731
        if options is not None:
            torch._dynamo.reset()
            forward = torch.compile(forward, **options)
        results.append(train(models, data, forward, steps_autocast))
    return results


def assert_same_training(a, b, tol):
    (la, ga), (lb, gb) = a, b
    assert np.allclose(la, lb, rtol=tol, atol=tol), (la, lb)
    for step_a, step_b in zip(ga, gb):
        for x, y in zip(step_a, step_b):
            assert x.dtype == y.dtype
            assert rel_err(x.float().cpu().numpy(), y.float().cpu().numpy()) <= tol


@pytest.mark.parametrize("bias", [False, True])
def test_training_step_compiled_fullgraph(rng, device, bias):
    """torch.compile(fullgraph=True) of the step's forward (the models and the loss): no graph
    break, and the same losses and gradients as eager over a few AdamW steps (on one batch: its
    loss falls)."""
    data = batches(rng, device, 1) * 3
    loss_fn = jtorch.FusedLinearJSDLoss(beta=0.3, temperature=2.0)
    results = train_each(device, 0, data, loss_fn, (None, dict(fullgraph=True)), bias=bias)
    assert_same_training(*results, 1e-4)
    assert results[0][0][-1] < results[0][0][0]  # it trains


@pytest.mark.parametrize("loss", ["online", "topk"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_steps_whose_rows_and_options_change(rng, device, loss, reduction, dynamic):
    """torch.compile(fullgraph=True) of the loss over steps whose row count and options change
    from step to step (a temperature and a soft weight schedule, ragged batches), with dynamic
    shapes as torch.compile finds them (dynamic=None: symbolic from the second shape on) or from
    the first (dynamic=True): every step's loss and student gradients as the float64
    reference's."""
    compiled_steps(rng, device, loss, reduction, (9, 13, 6, 13), fullgraph=True, dynamic=dynamic)


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["online", "topk"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_alone_compiled_with_cuda_graphs(rng, loss, reduction):
    """torch.compile(mode="reduce-overhead") of the loss alone (torch's CUDA-graph trees, which
    take over the storage of its outputs, and of the gradients it saves for backward) over steps
    with fresh inputs, a temperature and soft weight schedule, and row counts met again (graphs
    replayed): every step as the float64 reference."""
    compiled_steps(rng, "cuda", loss, reduction, (64, 64, 96, 64, 80, 96, 64), mode="reduce-overhead")


def compiled_steps(rng, device, loss, reduction, rows, **compile_options):
    """The loss compiled with compile_options, a step for each of `rows` (its T), the options and
    the ignored rows (a quarter, a fifth with the top-k) changing from step to step: each step's
    loss and student gradients against the reference."""
    from test_topk import make_topk_case
    torch._dynamo.reset()
    module = (jtorch.FusedLinearJSDLoss if loss == "online" else jtorch.FusedLinearTopKJSDLoss)(reduction=reduction)
    step = torch.compile(lambda *a: module(*a), **compile_options)
    for i, T in enumerate(rows):
        module.temperature, module.weight_soft_loss = 1.0 + 0.5 * i, 0.5 + 0.1 * i
        if loss == "online":
            case = make_case(rng, T=T, bias=False, ignored=0.25)
            names, reference = ARGS[:5], jsdgpu.reference
        else:
            case = make_topk_case(rng, T=T, bias=False)
            names, reference = ("student_input", "student_weight", "teacher_indices", "teacher_logprobs",
                                "target"), jsdgpu.reference_topk
        ts = [torch.from_numpy(case[n]).to(device) for n in names]
        ts[0].requires_grad_(True), ts[1].requires_grad_(True)
        out = step(*ts)
        upstream = rng.standard_normal(T) if reduction == "none" else None
        (out if upstream is None else out * torch.from_numpy(upstream).float().to(device)).sum().backward()
        want = reference(**{n: case[n] for n in names}, reduction=reduction, grad_output=upstream,
                         temperature=module.temperature, weight_soft_loss=module.weight_soft_loss)
        np.testing.assert_allclose(out.detach().cpu().numpy(), want[0], rtol=1e-5, atol=1e-6, err_msg=f"step {i}")
        assert rel_err(ts[0].grad.cpu().numpy(), want[3]) <= 1e-4, i
        assert rel_err(ts[1].grad.cpu().numpy(), want[4]) <= 1e-4, i


def test_compiled_call_traces_without_warnings_of_ours(rng, device):
    """Dynamo traces the front end's Python before the operator: no caches of ours in that path
    (Dynamo warns of each lru_cache it meets, and traces through it)."""
    import warnings
    ts = tensors(make_case(rng, T=6), device)
    loss_fn = jtorch.FusedLinearJSDLoss(beta=0.3)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(lambda *a: loss_fn(*a), fullgraph=True)(*ts).backward()
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


def test_training_step_under_autocast(rng, device):
    """fp32 models under autocast(bfloat16): the loss computes on bf16 operands with float32
    accumulation (as the float64 reference of the bf16-rounded operands), and the fp32 head's
    gradient comes back in fp32; eager and compiled agree."""
    data = batches(rng, device, 2)
    loss_fn = jtorch.FusedLinearJSDLoss(beta=0.5)
    results = train_each(device, 1, data, loss_fn, (None, dict(fullgraph=True)), steps_autocast=torch.bfloat16)
    # the first step (the same parameters), at bf16 level: the bodies' products under autocast
    # round differently compiled and eager (and AdamW turns such differences into whole steps)
    assert_same_training(*[(r[0][:1], r[1][:1]) for r in results], 2.0**-7)
    assert all(g.dtype == torch.float32 for g in results[0][1][0])
    # the first step against float64 on the bf16 operands autocast hands over
    torch.manual_seed(1)
    models = Models(device)
    x, labels = data[0]
    with torch.autocast(device, dtype=torch.bfloat16):
        hs, ht = models.student_body(x), models.teacher_body(x)
    bf16 = lambda t: t.detach().to(torch.bfloat16).float().cpu().numpy().astype(np.float64)  # noqa: E731
    ref = jsdgpu.reference(bf16(hs).reshape(-1, H_S), bf16(models.student_head.weight),
                           bf16(ht).reshape(-1, H_T), bf16(models.teacher_head.weight),
                           labels.reshape(-1).cpu().numpy(), beta=0.5)
    assert abs(results[0][0][0] - ref[0]) <= 1e-5 * ref[0]


def test_mismatched_dtypes_outside_autocast_say_what_to_do(rng, device):
    ts = tensors(make_case(rng, T=4, dtype=np.float32), device)
    with pytest.raises(TypeError, match="autocast"):
        jtorch.FusedLinearJSDLoss()(ts[0].to(torch.bfloat16), *ts[1:5])


def test_any_leading_shape(rng, device):
    """[B, S, H] inputs with [B, S] labels: the flattened call's loss, and gradients in the
    inputs' shapes."""
    case = make_case(rng, T=12, bias=True, ignored=0.3)
    ts = tensors(case, device)
    flat = jtorch.fused_linear_jsd_loss(*ts, beta=0.3)
    flat.backward()
    g_flat = ts[0].grad.clone()
    ts3 = tensors(case, device)
    xs3, xt3 = ts3[0].detach().reshape(3, 4, -1).requires_grad_(), ts3[2].reshape(3, 4, -1)
    loss = jtorch.fused_linear_jsd_loss(xs3, ts3[1], xt3, ts3[3], ts3[4].reshape(3, 4), ts3[5], ts3[6], beta=0.3)
    loss.backward()
    assert float(loss.detach()) == float(flat.detach())
    assert xs3.grad.shape == (3, 4, 16) and torch.equal(xs3.grad.reshape(12, -1), g_flat)


def test_attributes_are_read_at_each_call(rng, device):
    case = make_case(rng, T=6)
    ts = tensors(case, device, requires_grad=False)
    loss_fn = jtorch.FusedLinearJSDLoss()
    loss_fn.temperature, loss_fn.beta = 2.0, 0.2
    assert abs(float(loss_fn(*ts)) - jsdgpu.reference(**case, temperature=2.0, beta=0.2)[0]) <= 1e-5


@pytest.mark.parametrize("part", ["loss", "soft", "hard"])
def test_parts_are_differentiable(rng, device, part):
    """With return_soft_hard_loss, each part's backward gives that part's own gradient."""
    case = make_case(rng, T=9, bias=True, ignored=0.2)
    ts = tensors(case, device)
    out = dict(zip(("loss", "soft", "hard"), jtorch.FusedLinearJSDLoss(
        weight_hard_loss=0.3, weight_soft_loss=0.7, return_soft_hard_loss=True)(*ts)))
    out[part].backward()
    weights = {"loss": (0.3, 0.7), "soft": (0.0, 1.0), "hard": (1.0, 0.0)}[part]
    ref = jsdgpu.reference(**case, weight_hard_loss=weights[0], weight_soft_loss=weights[1])
    g = grads_of(ts)
    for got, want in zip((g[0], g[1], g[5]), ref[3:]):
        assert rel_err(got, want) <= 1e-4


def test_liger_positional_function(rng, device):
    case = make_case(rng, T=7, bias=True)
    ts = tensors(case, device)
    loss, soft, hard = jtorch.FusedLinearJSDFunction.apply(*ts, 0.2, 0.8, 0.7, -100, 1.5, True, None, True)
    ref = jsdgpu.reference(**case, weight_hard_loss=0.2, weight_soft_loss=0.8, beta=0.7, temperature=1.5)
    assert abs(float(loss.detach()) - ref[0]) <= 1e-5 * ref[0] and abs(float(hard.detach()) - ref[1]) <= 1e-5 * ref[1]


def test_opcheck(rng, device):
    case = make_case(rng, T=5, bias=True, ignored=0.2)
    ts = tensors(case, device)
    weights = torch.from_numpy(rng.uniform(0.0, 2.0, 5).astype(np.float32)).to(device)
    # the rows' own losses ("none") are computed without gradients: backward calls the operator
    # again, as a sum with row_scales (tests/test_token_weights.py, compiled)
    plain, models = (1.0, 1.0, None, None), (0.5, 2.0, 5.0, 30.0)  # scales and soft caps
    for compute_grad, token_weights, reduction, model in (
            (True, None, "mean", plain), (False, None, "mean", plain), (True, weights, "sum", models),
            (False, weights, "none", plain)):
        torch.library.opcheck(torch.ops.jsdgpu.fused_linear_jsd.default,
                              (*ts, 0.5, 0.5, 0.3, 2.0, -100, None, None, compute_grad, None, token_weights, reduction,
                               None, *model))
    # with no student bias, where G is held, "none" traced carries its gradients (jsdgpu.torch_rows)
    for token_weights, caps in ((None, [0.0, 0.0]), (weights, [5.0, 30.0])):
        torch.library.opcheck(torch.ops.jsdgpu.fused_linear_jsd_rows.default,
                              (*ts[:5], ts[6], [0.5, 0.5, 0.3, 2.0, 0.5, 2.0], -100, None, None, None, token_weights,
                               caps))


# ---- data parallel: two CPU processes ----

def _ddp_rank(rank, world, rendezvous, data, results):
    from torch.nn.parallel import DistributedDataParallel
    with process_group(rendezvous, rank, world):
        torch.manual_seed(0)
        models = Models("cpu")
        ddp = DistributedDataParallel(models)
        x, labels = data
        n = float((labels != -100).sum())  # the whole batch's count of valid tokens
        part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)

        def loss_fn(*args):
            return jtorch.fused_linear_jsd_loss(*args, beta=0.3, num_valid_tokens=n)
        loss = ddp(x[part], labels[part], loss_fn)
        (loss * world).backward()  # DDP averages the ranks' gradients: the sum is the whole batch's
        results.put((rank, float(loss.detach()), [p.grad.numpy().copy() for p in models.parameters()
                                                  if p.requires_grad]))


def test_distributed_data_parallel_equals_one_process(rng, tmp_path):
    """Two CPU processes (gloo) under DistributedDataParallel, each with half of a batch and the
    whole batch's num_valid_tokens: their losses add up to the one-process loss, and their
    averaged gradients are its gradients."""
    data = batches(rng, "cpu", 1, shape=(4, 6))[0]
    torch.manual_seed(0)
    models = Models("cpu")
    loss = models(*data, jtorch.FusedLinearJSDLoss(beta=0.3))
    loss.backward()
    want = [p.grad.numpy() for p in models.parameters() if p.requires_grad]
    out = sorted(run_processes(_ddp_rank, 2, f"file://{tmp_path / 'rendezvous'}", data))
    assert abs(out[0][1] + out[1][1] - float(loss.detach())) <= 1e-5 * float(loss.detach())
    for g0, g1, w in zip(out[0][2], out[1][2], want):
        assert np.array_equal(g0, g1) and rel_err(g0, w) <= 1e-5


# ---- CUDA graphs and torch's memory ----

def _eager_step(models, x, labels, loss_fn):
    loss = models(x, labels, loss_fn)
    grads = torch.autograd.grad(loss, [p for p in models.parameters() if p.requires_grad])
    return loss.detach(), grads


@pytest.mark.gpu
def test_training_step_in_a_cuda_graph(rng):
    """forward + backward of a step captured by torch.cuda.graph (static inputs), replayed on
    new batches: the same loss and gradients as an eager step (capturable) on them."""
    torch.manual_seed(0)
    models = Models("cuda", bias=True)
    loss_fn = jtorch.FusedLinearJSDLoss(beta=0.3, temperature=2.0)
    params = [p for p in models.parameters() if p.requires_grad]
    static_x, static_labels = batches(rng, "cuda", 1)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, products' algorithms chosen
        for _ in range(2):
            _eager_step(models, static_x, static_labels, loss_fn)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = models(static_x, static_labels, loss_fn)
        static_grads = torch.autograd.grad(static_loss, params)
    for x, labels in batches(rng, "cuda", 2):
        static_x.copy_(x)
        static_labels.copy_(labels)
        graph.replay()
        loss, grads = _eager_step(models, x, labels, jtorch.FusedLinearJSDLoss(beta=0.3, temperature=2.0))
        assert abs(float(static_loss) - float(loss)) <= 1e-6 * abs(float(loss))
        for a, b in zip(static_grads, grads):
            assert rel_err(a.cpu().numpy(), b.cpu().numpy()) <= 1e-4


@pytest.mark.gpu
def test_compiled_reduce_overhead(rng):
    """torch.compile(mode="reduce-overhead") (CUDA graphs by torch) of the step's forward: the
    same losses and gradients as eager."""
    data = batches(rng, "cuda", 1) * 4
    loss_fn = jtorch.FusedLinearJSDLoss(beta=0.5)
    results = train_each("cuda", 2, data, loss_fn, (None, dict(mode="reduce-overhead")))
    assert_same_training(*results, 1e-4)


@pytest.mark.gpu
def test_memory_beside_the_callers_stream_is_never_a_block_the_caller_just_freed():
    """CuPy's memory from torch inside kernels.beside (the selection's, beside the head's
    products) is the side stream's: a block freed on the caller's stream a moment before, which
    the caller's queued work may still be using, is taken again on the caller's stream only."""
    import cupy

    from jsdgpu.cuda import kernels
    t = torch.zeros(1, device="cuda")
    with jtorch.current_stream(t):
        after = kernels.mark()
        freed = cupy.empty(4096, cupy.uint8).data.ptr  # allocated and freed on the caller's stream
        assert cupy.empty(4096, cupy.uint8).data.ptr == freed  # (the caller's next block is that one)
        with kernels.beside(after):
            beside = cupy.empty(4096, cupy.uint8)
        assert beside.data.ptr != freed
        beside.fill(1)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_memory_comes_from_torch(rng):
    """The loss's working memory is torch's: max_memory_allocated counts its logits buffers (two
    float32 [T, V] chunks here), and once the step is done it is back in torch's cache."""
    case = make_case(rng, T=2048, hs=64, ht=64, vs=32000, dtype=BF16)
    ts = tensors(case, "cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = jtorch.FusedLinearJSDLoss()(*ts[:5])
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    logits = 2 * 2048 * 32000 * 4
    assert peak >= logits, (peak, logits)
    del loss
    grads = sum(t.grad.numel() * t.grad.element_size() for t in ts if t is not None and t.grad is not None)
    assert torch.cuda.memory_allocated() - base <= grads + 2**20
