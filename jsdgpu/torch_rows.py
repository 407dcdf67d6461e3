"""The rows' own losses (reduction "none") under tracing (torch.compile, export), their gradients
computed in forward and carried to backward as tensors (docs/design.md, "Token weights and the
sum").

A call of the rows' own losses keeps its gradients where G (the gradient in the student's logits)
is held for all rows (call.loss_of_call): backward only scales them by each row's grad_output
and forms grad_weight in one product. Eagerly the jsdgpu ctx carries them (jsdgpu.torch._Eager).
A traced operator carries tensors only, of shapes its fake function gives: so the engine holds G
in the operator's memory of all of the call's rows (ChunkLoss.g_memory), which fused_linear_jsd_rows
returns with grad_input's rows for grad_output 1 (float32), and what grad_weight's product needs
(the valid rows' indices, label terms, labels and row scales, each padded to the call's rows,
1/N, and the count of valid rows, on the CPU, so that backward reads it without waiting for the
GPU); backward's operator carried_weight_gradient forms grad_weight from them. These operators
run outside torch.compile's CUDA graphs (_OUTSIDE_CUDA_GRAPHS). The top-k loss's
operator fused_linear_topk_jsd_rows does the same, where both of its plans keep them
(topk.keeps_row_gradients). Where G is not held (too many rows for the budget, a student bias),
or the rows are a symbolic size (the decision depends on it), jsdgpu.torch's operators compute
the call again in backward instead.
"""

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .backend import HeldG
from .call import backend_for, scale_held
from .online import keeps_row_gradients
from .topk import keeps_row_gradients as topk_keeps_row_gradients
from .torch_bridge import _NUMPY_DTYPES, caster, current_stream, from_native, to_native, torch_dtype


def carries(xs, ws, width, student_bias, compute_dtype, chunk_size, num_valid_tokens, topk=False):
    """Whether a traced call of the rows' own losses with gradients carries them (above): its
    rows a concrete count, and the call keeping them (online.keeps_row_gradients, or with topk
    topk.keeps_row_gradients). width: the teacher's vocabulary, or with topk its k. A size that
    torch.compile traces as symbolic (dynamic shapes: rows that change from call to call) is an
    int to the Python that Dynamo runs, but not one below any bound known as it traces."""
    shape = (xs.shape[0], *ws.shape, width)
    if not all(isinstance(n, int) and statically_known_true(n < 2**62) for n in shape):
        return False
    return _keeps(xs.device.type, *shape, topk, ws.dtype if compute_dtype is None else compute_dtype, ws.dtype,
                  student_bias is not None, chunk_size, num_valid_tokens)


@torch._dynamo.assume_constant_result  # run as it is traced, on numbers: the backend's plan is no graph
def _keeps(device_type, T, vs, hs, width, topk, dtype, weight_dtype, has_bias, chunk_size, num_valid_tokens):
    from .torch import _run_options
    run_opts = _run_options(chunk_size, True, num_valid_tokens, weight_dtype, None, "none")
    backend, dtype = _backend(device_type), _NUMPY_DTYPES[dtype]
    if topk:
        return topk_keeps_row_gradients(backend, vs, hs, dtype, width, T, has_bias, run_opts)
    return keeps_row_gradients(backend, vs, width, hs, dtype, T, has_bias, run_opts)


def _backend(device_type):
    """The backend of a torch device type's arrays."""
    return backend_for("cupy" if device_type == "cuda" else "numpy")


def _g_layout(xs, ws, compute_dtype):
    """(columns, torch dtype) of a row of the carried G."""
    dtype = ws.dtype if compute_dtype is None else compute_dtype
    columns, np_dtype = _backend(xs.device.type).g_row_layout(ws.shape[0], _NUMPY_DTYPES[dtype])
    return columns, torch_dtype(np_dtype)


_OUTPUTS = tuple[(torch.Tensor,) * 11]  # (loss, soft, hard) of each row and what backward carries
# torch.compile's CUDA-graph trees (mode="reduce-overhead") run the operators below outside their
# graphs, between them: a CPU output (the count) inside a graph's partition made Inductor return
# the operator's whole output tuple from it, which kept its unused parts alive in the graphs'
# pool, which the trees refuse; a count on the device would make backward wait for the GPU's
# forward (docs/design.md, "The front ends"). Before torch had the tag, a graph with a CPU output
# ran without CUDA graphs whole.
_OUTSIDE_CUDA_GRAPHS = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}


@torch.library.custom_op("jsdgpu::fused_linear_jsd_rows", mutates_args=(), **_OUTSIDE_CUDA_GRAPHS)
def _rows(student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
          teacher_weight: torch.Tensor, target: torch.Tensor, teacher_bias: torch.Tensor | None,
          options: list[float], ignore_index: int, chunk_size: int | None, num_valid_tokens: float | None,
          compute_dtype: torch.dtype | None, token_weights: torch.Tensor | None, caps: list[float]) -> _OUTPUTS:
    """(loss, soft, hard) of each row [T], and what backward carries: grad_input [T, Hs] float32
    for grad_output 1, G [T, columns], the valid rows' indices [T] int64, their label terms [T]
    float32, labels [T] int32 (-1 past them), row scales [T] float32, 1/N (0-d float32) and their
    count (0-d int64, on the CPU); each past the count unused. options: weight_hard_loss,
    weight_soft_loss, beta, temperature, the student's and the teacher's logit scales; caps: the
    student's and the teacher's soft caps, 0 for none."""
    from .torch import _online
    G = _g_memory(student_input, student_weight, compute_dtype)
    loss, ctx = _online(student_input, student_weight, teacher_input, teacher_weight, target, None, teacher_bias,
                        _loss_fields(options, ignore_index, caps), chunk_size, num_valid_tokens, True, compute_dtype,
                        None, token_weights, "none", g_memory=G)
    return _outputs(loss, ctx, student_input, student_weight.shape[0], G)


@torch.library.custom_op("jsdgpu::fused_linear_topk_jsd_rows", mutates_args=(), **_OUTSIDE_CUDA_GRAPHS)
def _topk_rows(student_input: torch.Tensor, student_weight: torch.Tensor, teacher_indices: torch.Tensor,
               teacher_logprobs: torch.Tensor, target: torch.Tensor, missing_mass: str, options: list[float],
               ignore_index: int, chunk_size: int | None, num_valid_tokens: float | None,
               compute_dtype: torch.dtype | None, token_weights: torch.Tensor | None, caps: list[float]) -> _OUTPUTS:
    """As fused_linear_jsd_rows, against the teacher's top-k (jsdgpu.forward_topk), its arguments
    in the same places, so that the two share their autograd rule."""
    from .torch import _topk
    G = _g_memory(student_input, student_weight, compute_dtype)
    loss, ctx = _topk(student_input, student_weight, teacher_indices, teacher_logprobs, target, None, missing_mass,
                      _loss_fields(options, ignore_index, caps), chunk_size, num_valid_tokens, True, compute_dtype,
                      token_weights, "none", g_memory=G)
    return _outputs(loss, ctx, student_input, student_weight.shape[0], G)


def _loss_fields(options, ignore_index, caps):
    """The LossOptions' fields in order, from an operator's arguments."""
    w_hard, w_soft, beta, temperature, scale_s, scale_t = options
    return (w_hard, w_soft, beta, temperature, ignore_index, scale_s, scale_t, *(c or None for c in caps))


def _g_memory(xs, ws, compute_dtype):
    """The memory of the carried G, [T, columns] (_g_layout): the engine holds G in it."""
    columns, dtype = _g_layout(xs, ws, compute_dtype)
    return torch.empty((xs.shape[0], columns), dtype=dtype, device=xs.device)


def _outputs(loss, ctx, xs, vocab, G):
    """_rows' outputs: the rows' losses and parts, and what backward carries (_carried). They may be
    views of the core's arrays, unlike jsdgpu.torch's operators' (torch_bridge.operator_outputs):
    these operators run outside torch.compile's CUDA graphs (_OUTSIDE_CUDA_GRAPHS)."""
    return loss, ctx.soft_loss, ctx.hard_loss, *_carried(ctx, xs, vocab, G)


def _carried(ctx, xs, vocab, G):
    """What _rows carries of the jsdgpu ctx of its call (ctx._grads kept: call.loss_of_call), G
    held in its memory G."""
    T, device, f32 = xs.shape[0], xs.device, torch.float32
    grads = ctx._grads
    held = grads.held
    n = 0 if held is None else held.G.shape[0]
    valid = torch.arange(T, device=device) if ctx._valid_rows is None else from_native(ctx._valid_rows).long()

    def padded(a, fill, dtype):
        out = torch.full((T,), fill, dtype=dtype, device=device)
        if n:
            out[:n] = 1 if a is None else from_native(a)
        return out
    grad_input = torch.zeros((T, xs.shape[1]), dtype=f32, device=device)
    rows = torch.zeros(T, dtype=torch.int64, device=device)
    if n:
        grad_input[valid] = from_native(grads.grad_input)
        rows[:n] = valid
        assert ctx._backend.xp.may_share_memory(held.G, to_native(G)), "G held in the engine's memory, not G"
    # rows past the count and columns past the vocabulary (the row pitch's padding) are unused, but
    # an operator's outputs are its inputs' function
    G[n:] = 0
    G[:n, vocab:] = 0
    inv_n = 1.0 if held is None else held.inv_n
    inv_n = torch.full((), inv_n, dtype=f32, device=device) if isinstance(inv_n, float) else \
        from_native(inv_n).reshape(()).to(f32)
    return (grad_input, G, rows, padded(None if held is None else held.label_terms, 0.0, f32),
            padded(None if held is None else held.target, -1, torch.int32),
            padded(None if held is None else held.g_scale, 0.0, f32), inv_n, torch.tensor(n, dtype=torch.int64))


def _rows_fake(student_input, student_weight, compute_dtype):
    T, hs = student_input.shape
    columns, g_dtype = _g_layout(student_input, student_weight, compute_dtype)
    new = student_input.new_empty
    rows = lambda dtype: new((T,), dtype=dtype)  # noqa: E731
    return (rows(torch.float32), rows(torch.float32), rows(torch.float32), new((T, hs), dtype=torch.float32),
            new((T, columns), dtype=g_dtype), rows(torch.int64), rows(torch.float32), rows(torch.int32),
            rows(torch.float32), new((), dtype=torch.float32), torch.empty((), dtype=torch.int64))


@_rows.register_fake
def _online_fake(student_input, student_weight, teacher_input, teacher_weight, target, teacher_bias, options,
                 ignore_index, chunk_size, num_valid_tokens, compute_dtype, token_weights, caps):
    return _rows_fake(student_input, student_weight, compute_dtype)


@_topk_rows.register_fake
def _topk_fake(student_input, student_weight, teacher_indices, teacher_logprobs, target, missing_mass, options,
               ignore_index, chunk_size, num_valid_tokens, compute_dtype, token_weights, caps):
    return _rows_fake(student_input, student_weight, compute_dtype)


@torch.library.custom_op("jsdgpu::carried_weight_gradient", mutates_args=(), **_OUTSIDE_CUDA_GRAPHS)
def _weight_gradient(G: torch.Tensor, student_input: torch.Tensor, rows: torch.Tensor, label_terms: torch.Tensor,
                     row_target: torch.Tensor, row_scales: torch.Tensor, inv_n: torch.Tensor, count: torch.Tensor,
                     grad_output: torch.Tensor, vocab: int, compute_dtype: torch.dtype | None,
                     weight_dtype: torch.dtype) -> torch.Tensor:
    """grad_weight [vocab, Hs] in weight_dtype from _rows' carried tensors and the rows' losses'
    grad_output [T]: the one product of G held (backend.weight_product), each valid row's parts
    times its grad_output (call.scale_held, as backward does eagerly)."""
    n = int(count)
    if not n:
        return torch.zeros((vocab, student_input.shape[1]), dtype=weight_dtype, device=G.device)
    valid = rows[:n]
    scales = grad_output.to(torch.float32)[valid]
    xs = caster(compute_dtype)(student_input)[valid]
    with current_stream(G):
        held = HeldG(to_native(G[:n]), vocab, to_native(xs), to_native(inv_n), to_native(label_terms[:n]),
                     to_native(row_target[:n]), to_native(row_scales[:n]))
        scale_held(held, to_native(scales))
        out = torch.empty((vocab, student_input.shape[1]), dtype=weight_dtype, device=G.device)  # torch's own
        _backend(G.device.type).weight_product(held, None, _NUMPY_DTYPES[weight_dtype], to_native(out))
        return out


@_weight_gradient.register_fake
def _weight_gradient_fake(G, student_input, rows, label_terms, row_target, row_scales, inv_n, count, grad_output,
                          vocab, compute_dtype, weight_dtype):
    return student_input.new_empty((vocab, student_input.shape[1]), dtype=weight_dtype)


def _setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[3:])
    ctx.vocab, ctx.compute_dtype, ctx.weight_dtype = inputs[1].shape[0], inputs[10], inputs[1].dtype
    ctx.input_dtype = inputs[0].dtype
    ctx.save_for_backward(inputs[0], *output[3:])


def _rows_backward(ctx, grad_loss, grad_soft, grad_hard, *unused):
    """grad_input's rows times their grad_output, and grad_weight from the carried G (the parts'
    own gradients, where wanted, are calls of their own: jsdgpu.torch._operator_loss)."""
    xs, grad_input, G, rows, label_terms, row_target, row_scales, inv_n, count = ctx.saved_tensors
    grads = [None] * 13
    grads[0] = (grad_input * grad_loss.to(torch.float32)[:, None]).to(ctx.input_dtype)
    grads[1] = _weight_gradient(G, xs, rows, label_terms, row_target, row_scales, inv_n, count, grad_loss,
                                ctx.vocab, ctx.compute_dtype, ctx.weight_dtype)
    return tuple(grads)


_rows.register_autograd(_rows_backward, setup_context=_setup)
_topk_rows.register_autograd(_rows_backward, setup_context=_setup)


def rows_loss(xs, ws, xt, wt, target, bt, options, chunk_size, num_valid_tokens, compute_dtype, weights):
    """(loss, soft, hard) of each row by _rows. options: the LossOptions' fields in order."""
    return _rows(xs, ws, xt, wt, target, bt, *_operator_options(options), chunk_size, num_valid_tokens,
                 compute_dtype, weights, _caps(options))[:3]


def topk_rows_loss(xs, ws, ids, lq, target, missing_mass, options, chunk_size, num_valid_tokens, compute_dtype,
                   weights):
    """(loss, soft, hard) of each row by _topk_rows, as rows_loss."""
    return _topk_rows(xs, ws, ids, lq, target, missing_mass, *_operator_options(options), chunk_size,
                      num_valid_tokens, compute_dtype, weights, _caps(options))[:3]


def _operator_options(options):
    """(options, ignore_index) of the operators from the LossOptions' fields in order."""
    w_hard, w_soft, beta, temperature, ignore_index, scale_s, scale_t, _, _ = options
    return [w_hard, w_soft, beta, temperature, scale_s, scale_t], ignore_index


def _caps(options):
    return [c or 0.0 for c in options[7:]]
