"""PyTorch front end: a drop-in for Liger-Kernel's LigerFusedLinearJSDLoss and
LigerFusedLinearJSDFunction that torch.compile, autocast and CUDA graphs take whole.

    from jsdgpu.torch import FusedLinearJSDLoss      # was: from liger_kernel.chunked_loss import
    loss_fn = FusedLinearJSDLoss(beta=0.5, temperature=1.0)   #   LigerFusedLinearJSDLoss
    loss = loss_fn(student_hidden, student_lm_head.weight, teacher_hidden, teacher_lm_head.weight, labels)
    loss.backward()

Traced (torch.compile, export), the loss is the operator jsdgpu::fused_linear_jsd
(torch.library.custom_op): opaque to Dynamo (no graph break, fullgraph=True works), its shapes
given by a fake implementation, its gradient computed in forward (as Liger's is) and scaled by
grad_output in backward (with reduction "none", where G is held for all rows, the operators of
jsdgpu.torch_rows carry it to backward instead). Eagerly it is an autograd Function that calls
jsdgpu.forward and, in backward, jsdgpu.backward with grad_output (no operator: _runs_eagerly).
Tensors cross to CuPy (GPU) or NumPy (CPU) without a copy; the work is queued on
torch's current CUDA stream with nothing added to synchronize, and its memory comes from torch's
caching allocator (so torch.cuda.max_memory_allocated counts it, freed blocks return to torch's
cache, and a CUDA-graph capture takes it from the graph's pool). Inside a capture the core runs
capturable by itself.

Under autocast the loss computes as a matmul would there: 16-bit operands (cast inside the
call, the copies the products need), float32 accumulation, and each gradient in its tensor's
own dtype (a float32 master weight's in float32, as accumulated).
"""

import functools
import inspect


try:
    import torch
except ImportError as e:
    raise ImportError("jsdgpu.torch needs PyTorch: pip install 'jsdgpu[torch]' (or torch itself)") from e
from torch._subclasses.functional_tensor import FunctionalTensor

from . import api, topk, torch_rows
from .options import DEFAULTS, LossOptions, RunOptions, TopKOptions
from .torch_bridge import (GradWeight, as_rows, autocast_dtype, caster, check_dtypes, operator_outputs, rows_shaped,
                           weight_rows)
from .torch_bridge import current_stream, from_native, to_native  # noqa: F401 (the bridge call.py uses)
from .torch_sharding import are_plain, plain_inputs


# ---- the custom operator ----

@torch.library.custom_op("jsdgpu::fused_linear_jsd", mutates_args=())
def _fused_linear_jsd(student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                      teacher_weight: torch.Tensor, target: torch.Tensor, student_bias: torch.Tensor | None,
                      teacher_bias: torch.Tensor | None, weight_hard_loss: float, weight_soft_loss: float,
                      beta: float, temperature: float, ignore_index: int, chunk_size: int | None,
                      num_valid_tokens: float | None, compute_grad: bool, compute_dtype: torch.dtype | None,
                      token_weights: torch.Tensor | None, reduction: str, row_scales: torch.Tensor | None,
                      student_logit_scale: float, teacher_logit_scale: float, student_logit_softcap: float | None,
                      teacher_logit_softcap: float | None) -> tuple[
                          torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, soft_loss, hard_loss, grad_input, grad_weight, grad_bias) for grad_output 1, the
    gradients empty without compute_grad (or without a bias). student_input [T, Hs], target,
    token_weights and row_scales [T] (row_scales: backward's, of reduction "none": _backward);
    compute_dtype: autocast's, or None for the tensors' own; the models' scales and caps last."""
    grad_weight = GradWeight.of(student_weight, compute_grad)
    loss, ctx = _online(student_input, student_weight, teacher_input, teacher_weight, target, student_bias,
                        teacher_bias, (weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index,
                                       student_logit_scale, teacher_logit_scale, student_logit_softcap,
                                       teacher_logit_softcap),
                        chunk_size, num_valid_tokens, compute_grad, compute_dtype, None, token_weights, reduction,
                        row_scales, weight_memory=grad_weight)
    return operator_outputs(loss, ctx, compute_grad, student_input, student_weight, student_bias, grad_weight)


def _online(xs, ws, xt, wt, target, bs, bt, options, chunk_size, num_valid_tokens, compute_grad, compute_dtype,
            vocab_parallel=None, token_weights=None, reduction="mean", row_scales=None, g_memory=None,
            weight_memory=None):
    """jsdgpu.forward on the tensors, the inputs and weights cast to compute_dtype (autocast's;
    None: as they are): (loss, jsdgpu ctx). options: the LossOptions' fields in order; g_memory
    and weight_memory: api.forward_with's (jsdgpu.torch_rows, torch_bridge.GradWeight)."""
    cast = caster(compute_dtype)
    return api.forward_with(cast(xs), cast(ws), cast(xt), cast(wt), target, bs, bt, _loss_options(*options),
                            _run_options(chunk_size, compute_grad, num_valid_tokens, ws.dtype, vocab_parallel,
                                         reduction), token_weights, row_scales, g_memory, weight_memory)


@functools.lru_cache(maxsize=64)  # the options' checks, once per set of values
def _loss_options(*options):
    return LossOptions(*options)


@functools.lru_cache(maxsize=64)
def _topk_options(options, missing_mass):
    """TopKOptions of the LossOptions' fields in order, and missing_mass."""
    return TopKOptions(*options, missing_mass=missing_mass)


@functools.lru_cache(maxsize=64)
def _run_options(chunk_size, compute_grad, num_valid_tokens, weight_dtype, vocab_parallel=None, reduction="mean"):
    """RunOptions of a front-end call: a float32 weight's gradient comes back in float32."""
    return RunOptions(chunk_size=chunk_size, compute_grad=compute_grad, num_valid_tokens=num_valid_tokens,
                      grad_weight_float32=weight_dtype == torch.float32, vocab_parallel=vocab_parallel,
                      reduction=reduction)


@_fused_linear_jsd.register_fake
def _fake_online(student_input, student_weight, teacher_input, teacher_weight, target, student_bias, teacher_bias,
                 weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index, chunk_size, num_valid_tokens,
                 compute_grad, compute_dtype, token_weights, reduction, row_scales, student_logit_scale,
                 teacher_logit_scale, student_logit_softcap, teacher_logit_softcap):
    return _fake_outputs(student_input, student_weight, student_bias, compute_grad, reduction)


def _fake_outputs(student_input, student_weight, student_bias, compute_grad, reduction):
    """The loss operators' outputs' shapes and dtypes (for torch.compile and opcheck)."""
    rows = (student_input.shape[0],) if reduction == "none" else ()  # the loss and its parts
    scalar = lambda: student_input.new_empty(rows, dtype=torch.float32)  # noqa: E731
    empty = lambda: student_input.new_empty(0, dtype=torch.float32)  # noqa: E731
    if not compute_grad:
        return scalar(), scalar(), scalar(), empty(), empty(), empty()
    return (scalar(), scalar(), scalar(), torch.empty_like(student_input), torch.empty_like(student_weight),
            empty() if student_bias is None else torch.empty_like(student_bias))


# The two loss operators' inputs, by position (their signatures share it: the student's
# tensors, then compute_grad's place; checked below, as each is registered)
_N_INPUTS, _COMPUTE_GRAD, _REDUCTION, _ROW_SCALES = 23, 14, 17, 18
# the differentiable inputs' positions: the student's input, weight and bias
_STUDENT_INPUT, _STUDENT_WEIGHT, _STUDENT_BIAS = 0, 1, 5


def _check_positions(fake):
    """The positions above are the operator's (its fake function's parameters are its own)."""
    names = list(inspect.signature(fake).parameters)
    assert len(names) == _N_INPUTS and [names[i] for i in (_COMPUTE_GRAD, _REDUCTION, _ROW_SCALES)] == [
        "compute_grad", "reduction", "row_scales"], names
    assert [names[i] for i in (_STUDENT_INPUT, _STUDENT_WEIGHT, _STUDENT_BIAS)] == [
        "student_input", "student_weight", "student_bias"], names


def _autograd(op):
    """op's setup_context: the gradients computed in forward saved, or with reduction "none" (its
    forward computes none: grad_output [T] is known only in backward) the inputs, for backward to
    call op again as the rows' sum times grad_output (row_scales)."""
    def setup_context(ctx, inputs, output):
        ctx.has_grads, ctx.rows = inputs[_COMPUTE_GRAD], inputs[_REDUCTION] == "none"
        ctx.mark_non_differentiable(*output[3:])  # the gradients: no graph of their own
        if not ctx.rows:
            ctx.save_for_backward(*output[3:])
            return
        ctx.op, ctx.tensor_at = op, [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.inputs = [None if i in ctx.tensor_at else a for i, a in enumerate(inputs)]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_at))
    return setup_context


def _backward(ctx, grad_loss, grad_soft, grad_hard, *unused):
    """The gradients computed in forward, times the loss's grad_output (the parts' own
    gradients, where they are wanted, come from calls of their own: _operator_loss); with
    reduction "none", those of the op called again (_autograd)."""
    grads = [None] * _N_INPUTS
    if ctx.rows:
        if any(ctx.needs_input_grad[i] for i in (_STUDENT_INPUT, _STUDENT_WEIGHT, _STUDENT_BIAS)):
            inputs = list(ctx.inputs)
            for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
                inputs[i] = t
            inputs[_COMPUTE_GRAD], inputs[_REDUCTION], inputs[_ROW_SCALES] = True, "sum", grad_loss
            gi, gw, gb = ctx.op(*inputs)[3:]
            grads[_STUDENT_INPUT], grads[_STUDENT_WEIGHT] = gi, gw
            grads[_STUDENT_BIAS] = gb if gb.numel() else None
        return tuple(grads)
    if not ctx.has_grads:  # the wrapper asks for none only where no student tensor requires one
        return tuple(grads)
    gi, gw, gb = ctx.saved_tensors
    # eagerly in place: the gradients are this operator's alone (the callers keep only its loss
    # parts), and a copy of grad_weight would cost its size again in memory; a traced backward
    # (compile, opcheck) stays functional, and its compiler frees what it can
    traced = isinstance(gw, FunctionalTensor) or torch.compiler.is_compiling()
    scale = lambda g: (g * grad_loss.to(g.dtype) if traced else g.mul_(grad_loss.to(g.dtype))) if g.numel() else None  # noqa: E731
    grads[_STUDENT_INPUT], grads[_STUDENT_WEIGHT], grads[_STUDENT_BIAS] = scale(gi), scale(gw), scale(gb)
    return tuple(grads)


_check_positions(_fake_online)
_fused_linear_jsd.register_autograd(_backward, setup_context=_autograd(_fused_linear_jsd))


def _runs_eagerly(*tensors):
    """Whether the call runs eagerly on plain tensors: not traced (torch.compile, export), not
    under a torch.func transform, no tensor subclass (FakeTensor, FunctionalTensor). Then the loss
    is the autograd Function _Eager, not the custom operator, whose eager dispatch cost host time
    before the step's first product and a pass over the gradients in backward (docs/design.md,
    "The front ends")."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return are_plain(*tensors)


class _Eager(torch.autograd.Function):
    """The loss run eagerly: forward(run, student_input, student_weight, student_bias), run() the
    jsdgpu call on the tensors ((loss, jsdgpu ctx); the student's tensors are passed for autograd
    to see). backward hands the loss's grad_output to jsdgpu.backward, which folds it into the
    gradients' products and casts (no pass of its own), and returns each gradient in its tensor's
    dtype. That frees the call's gradient rows: a second backward (a retained graph) raises."""

    @staticmethod
    def forward(ctx, run, xs, ws, bs):
        # the parts are not differentiable: no zeros made for their gradients (two fills and their
        # host time in backward, where the GPU waits for its product)
        ctx.set_materialize_grads(False)
        loss, ctx.jsd_ctx = run()
        ctx.dtypes = (xs.dtype, ws.dtype, None if bs is None else bs.dtype)
        ctx.mark_non_differentiable(ctx.jsd_ctx.soft_loss, ctx.jsd_ctx.hard_loss)
        return loss, ctx.jsd_ctx.soft_loss, ctx.jsd_ctx.hard_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_soft, grad_hard):
        if grad_loss is None:  # (not materialized: the loss took no part in what is differentiated)
            return None, None, None, None
        grads = api.backward(ctx.jsd_ctx, grad_loss)  # frees its sums; a second call raises
        return None, *(None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes))


def fused_linear_jsd_loss(student_input, student_weight, teacher_input, teacher_weight, true_labels,
                          student_bias=None, teacher_bias=None, *, weight_hard_loss=DEFAULTS.weight_hard_loss,
                          weight_soft_loss=DEFAULTS.weight_soft_loss, beta=DEFAULTS.beta,
                          ignore_index=DEFAULTS.ignore_index, temperature=DEFAULTS.temperature,
                          chunk_size=None, return_soft_hard_loss=False, num_valid_tokens=None,
                          vocab_parallel=None, token_weights=None, reduction="mean", student_logit_scale=1.0,
                          teacher_logit_scale=1.0, student_logit_softcap=None, teacher_logit_softcap=None):
    """The loss as a function (see FusedLinearJSDLoss): inputs [..., H], labels and token_weights
    [...]. num_valid_tokens: N for the mean (a whole batch's count of valid tokens, for data
    parallelism); token_weights, reduction ("none": the loss in the labels' shape), the models'
    logit scales and soft caps: jsdgpu.forward's;
    vocab_parallel: a torch.distributed process group (jsdgpu.parallel), or a 1-D DeviceMesh over
    which the heads are DTensors sharded by the vocabulary's rows (tensor parallelism); else a
    weight or bias may be a DTensor that FSDP2 shards (jsdgpu.torch_sharding)."""
    plain, vocab_parallel = plain_inputs(
        vocab_parallel, student_input=student_input, student_weight=student_weight, teacher_input=teacher_input,
        teacher_weight=teacher_weight, true_labels=true_labels, student_bias=student_bias, teacher_bias=teacher_bias)
    student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias = \
        plain.values()
    hs, ht = student_input.shape[-1], teacher_input.shape[-1]
    xs, xt, target = as_rows(student_input, hs), as_rows(teacher_input, ht), as_rows(true_labels)
    weights = weight_rows(token_weights)
    compute_dtype = autocast_dtype(xs.device.type)
    check_dtypes(compute_dtype, ("student", xs, student_weight), ("teacher", xt, teacher_weight))
    compute_grad, options = _call_options(student_input, student_weight, student_bias, weight_hard_loss,
                                          weight_soft_loss, beta, temperature, ignore_index, student_logit_scale,
                                          teacher_logit_scale, student_logit_softcap, teacher_logit_softcap)
    # a process group is no operator argument: vocab parallel runs eagerly, traced or not
    eager = vocab_parallel is not None or _runs_eagerly(xs, student_weight, xt, teacher_weight, target,
                                                        student_bias, teacher_bias, weights)

    def call(w_hard, w_soft, with_grads):
        if with_grads and reduction == "none" and not eager and torch_rows.carries(
                xs, student_weight, teacher_weight.shape[0], student_bias, compute_dtype, chunk_size, num_valid_tokens):
            return torch_rows.rows_loss(xs, student_weight, xt, teacher_weight, target, teacher_bias,
                                        (w_hard, w_soft, *options[2:]), chunk_size, num_valid_tokens, compute_dtype,
                                        weights)
        if eager:
            return _Eager.apply(lambda: _online(xs, student_weight, xt, teacher_weight, target, student_bias,
                                                teacher_bias, (w_hard, w_soft, *options[2:]), chunk_size,
                                                num_valid_tokens, with_grads, compute_dtype, vocab_parallel, weights,
                                                reduction),
                                xs, student_weight, student_bias)
        return _fused_linear_jsd(xs, student_weight, xt, teacher_weight, target, student_bias, teacher_bias, w_hard,
                                 w_soft, *options[2:5], chunk_size, num_valid_tokens,
                                 with_grads and reduction != "none", compute_dtype, weights, reduction, None,
                                 *options[5:])
    return rows_shaped(_operator_loss(call, options, compute_grad, return_soft_hard_loss), reduction, true_labels)


def _call_options(student_input, student_weight, student_bias, *loss_options):
    """(compute_grad, options): whether a student tensor wants a gradient, and the loss options
    (LossOptions' fields in order: weight_hard_loss, weight_soft_loss, beta, temperature,
    ignore_index, the models' scales and soft caps) as the operators take them, checked before
    any work; traced, by the operator as it runs (a schedule's options are symbolic floats there)."""
    compute_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (student_input, student_weight, student_bias))
    w_hard, w_soft, beta, temperature, ignore_index, *models = loss_options
    options = (float(w_hard), float(w_soft), float(beta), float(temperature), int(ignore_index),
               *(None if m is None else float(m) for m in models))
    if not torch.compiler.is_compiling():
        _loss_options(*options)
    return compute_grad, options


def _operator_loss(call, options, compute_grad, return_soft_hard_loss):
    """The loss by call(w_hard, w_soft, with_grads), one of the operators; with
    return_soft_hard_loss (loss, soft, hard), each differentiable with its own gradient: where a
    gradient is wanted, the hard part's and the soft part's are two calls, with weights (1, 0)
    and (0, 1), and the loss's their combination (twice the work of the loss alone)."""
    if return_soft_hard_loss and compute_grad:
        hard, soft = call(1.0, 0.0, True)[0], call(0.0, 1.0, True)[0]  # each call's loss is its one part
        return options[0] * hard + options[1] * soft, soft, hard
    loss, soft, hard, *_ = call(*options[:2], compute_grad)
    return (loss, soft, hard) if return_soft_hard_loss else loss


class FusedLinearJSDLoss(torch.nn.Module):
    """LigerFusedLinearJSDLoss's constructor, attributes and call, computed by jsdgpu. The
    attributes are read at every call. `compiled` is accepted for compatibility and ignored
    (there is nothing to compile); chunk_size=None picks the chunk from a memory budget.
    vocab_parallel: a torch.distributed process group whose ranks each hold a vocabulary shard of
    both LM heads (jsdgpu.parallel)."""

    def __init__(self, weight_hard_loss=DEFAULTS.weight_hard_loss, weight_soft_loss=DEFAULTS.weight_soft_loss,
                 beta=DEFAULTS.beta, ignore_index=DEFAULTS.ignore_index, temperature=DEFAULTS.temperature,
                 compiled=True, chunk_size=None, return_soft_hard_loss=False, vocab_parallel=None, reduction="mean",
                 student_logit_scale=1.0, teacher_logit_scale=1.0, student_logit_softcap=None,
                 teacher_logit_softcap=None):
        super().__init__()  # the options checked here too
        LossOptions(weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index, student_logit_scale,
                    teacher_logit_scale, student_logit_softcap, teacher_logit_softcap)
        RunOptions(reduction=reduction)
        self.student_logit_scale, self.teacher_logit_scale = student_logit_scale, teacher_logit_scale
        self.student_logit_softcap, self.teacher_logit_softcap = student_logit_softcap, teacher_logit_softcap
        self.weight_hard_loss, self.weight_soft_loss = weight_hard_loss, weight_soft_loss
        self.beta, self.ignore_index, self.temperature = beta, ignore_index, temperature
        self.compiled, self.chunk_size, self.reduction = compiled, chunk_size, reduction
        self.return_soft_hard_loss, self.vocab_parallel = return_soft_hard_loss, vocab_parallel

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels,
                student_bias=None, teacher_bias=None, *, num_valid_tokens=None, token_weights=None):
        """num_valid_tokens: this call's N for the mean (such as a data-parallel batch's whole count
        of valid tokens; None: this call's own count); token_weights: its weights (labels' shape)."""
        return fused_linear_jsd_loss(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
            weight_hard_loss=self.weight_hard_loss, weight_soft_loss=self.weight_soft_loss, beta=self.beta,
            ignore_index=self.ignore_index, temperature=self.temperature, chunk_size=self.chunk_size,
            return_soft_hard_loss=self.return_soft_hard_loss, num_valid_tokens=num_valid_tokens,
            vocab_parallel=self.vocab_parallel, token_weights=token_weights, reduction=self.reduction,
            student_logit_scale=self.student_logit_scale, teacher_logit_scale=self.teacher_logit_scale,
            student_logit_softcap=self.student_logit_softcap, teacher_logit_softcap=self.teacher_logit_softcap)


class FusedLinearJSDFunction:
    """LigerFusedLinearJSDFunction's positional form: apply(student_input, student_weight,
    teacher_input, teacher_weight, target, student_bias, teacher_bias, weight_hard_loss,
    weight_soft_loss, beta, ignore_index, temperature, compiled, chunk_size,
    return_soft_hard_loss), Liger's defaults for the ones left out."""

    @staticmethod
    def apply(student_input, student_weight, teacher_input, teacher_weight, target, student_bias=None,
              teacher_bias=None, weight_hard_loss=DEFAULTS.weight_hard_loss,
              weight_soft_loss=DEFAULTS.weight_soft_loss, beta=DEFAULTS.beta, ignore_index=DEFAULTS.ignore_index,
              temperature=DEFAULTS.temperature, compiled=True, chunk_size=None, return_soft_hard_loss=False):
        return fused_linear_jsd_loss(
            student_input, student_weight, teacher_input, teacher_weight, target, student_bias, teacher_bias,
            weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta,
            ignore_index=ignore_index, temperature=temperature, chunk_size=chunk_size,
            return_soft_hard_loss=return_soft_hard_loss)


# ---- offline distillation: the loss against a teacher's stored top-k (jsdgpu.topk) ----

@torch.library.custom_op("jsdgpu::fused_linear_topk_jsd", mutates_args=())
def _fused_linear_topk_jsd(student_input: torch.Tensor, student_weight: torch.Tensor, teacher_indices: torch.Tensor,
                           teacher_logprobs: torch.Tensor, target: torch.Tensor, student_bias: torch.Tensor | None,
                           missing_mass: str, weight_hard_loss: float, weight_soft_loss: float, beta: float,
                           temperature: float, ignore_index: int, chunk_size: int | None,
                           num_valid_tokens: float | None, compute_grad: bool, compute_dtype: torch.dtype | None,
                           token_weights: torch.Tensor | None, reduction: str,
                           row_scales: torch.Tensor | None, student_logit_scale: float, teacher_logit_scale: float,
                           student_logit_softcap: float | None, teacher_logit_softcap: float | None) -> tuple[
                               torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As jsdgpu::fused_linear_jsd, against the teacher's top-k (jsdgpu.forward_topk): the same
    outputs, and the same positions of the student's tensors and of compute_grad, so that the
    two operators share their autograd rule."""
    grad_weight = GradWeight.of(student_weight, compute_grad)
    loss, ctx = _topk(student_input, student_weight, teacher_indices, teacher_logprobs, target, student_bias,
                      missing_mass, (weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index,
                                     student_logit_scale, teacher_logit_scale, student_logit_softcap,
                                     teacher_logit_softcap), chunk_size,
                      num_valid_tokens, compute_grad, compute_dtype, token_weights, reduction, row_scales,
                      weight_memory=grad_weight)
    return operator_outputs(loss, ctx, compute_grad, student_input, student_weight, student_bias, grad_weight)


def _topk(xs, ws, ids, lq, target, bs, missing_mass, options, chunk_size, num_valid_tokens, compute_grad,
          compute_dtype, token_weights=None, reduction="mean", row_scales=None, vocab_parallel=None, g_memory=None,
          weight_memory=None):
    """jsdgpu.forward_topk on the tensors, as _online."""
    cast = caster(compute_dtype)
    return topk.forward_topk_with(cast(xs), cast(ws), ids, lq, target, bs, _topk_options(options, missing_mass),
                                  _run_options(chunk_size, compute_grad, num_valid_tokens, ws.dtype, vocab_parallel,
                                               reduction),
                                  token_weights, row_scales, g_memory, weight_memory)


@_fused_linear_topk_jsd.register_fake
def _fake_topk(student_input, student_weight, teacher_indices, teacher_logprobs, target, student_bias, missing_mass,
               weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index, chunk_size, num_valid_tokens,
               compute_grad, compute_dtype, token_weights, reduction, row_scales, student_logit_scale,
               teacher_logit_scale, student_logit_softcap, teacher_logit_softcap):
    return _fake_outputs(student_input, student_weight, student_bias, compute_grad, reduction)


_check_positions(_fake_topk)
_fused_linear_topk_jsd.register_autograd(_backward, setup_context=_autograd(_fused_linear_topk_jsd))


def fused_linear_topk_jsd_loss(student_input, student_weight, teacher_indices, teacher_logprobs, true_labels,
                               student_bias=None, *, missing_mass="bucket",
                               weight_hard_loss=DEFAULTS.weight_hard_loss, weight_soft_loss=DEFAULTS.weight_soft_loss,
                               beta=DEFAULTS.beta, ignore_index=DEFAULTS.ignore_index,
                               temperature=DEFAULTS.temperature, chunk_size=None, return_soft_hard_loss=False,
                               num_valid_tokens=None, token_weights=None, reduction="mean", student_logit_scale=1.0,
                               student_logit_softcap=None, vocab_parallel=None):
    """The top-k loss as a function (see FusedLinearTopKJSDLoss): inputs [..., H], the teacher's
    top-k [..., k] (ids of the whole vocabulary), labels and token_weights [...]; the student's
    logit scale and soft cap. The weight and bias may be DTensors that FSDP2 shards
    (jsdgpu.torch_sharding); vocab_parallel: as fused_linear_jsd_loss's (a process group whose
    ranks each hold a shard of the student head's rows, or a 1-D DeviceMesh over which the head is
    a DTensor sharded by them)."""
    plain, vocab_parallel = plain_inputs(
        vocab_parallel, student_input=student_input, student_weight=student_weight, teacher_indices=teacher_indices,
        teacher_logprobs=teacher_logprobs, true_labels=true_labels, student_bias=student_bias)
    student_input, student_weight, teacher_indices, teacher_logprobs, true_labels, student_bias = plain.values()
    hs, k = student_input.shape[-1], teacher_indices.shape[-1]
    xs, target = as_rows(student_input, hs), as_rows(true_labels)
    ids, lq = as_rows(teacher_indices, k), as_rows(teacher_logprobs, teacher_logprobs.shape[-1])
    weights = weight_rows(token_weights)
    compute_dtype = autocast_dtype(xs.device.type)
    check_dtypes(compute_dtype, ("student", xs, student_weight))
    compute_grad, options = _call_options(student_input, student_weight, student_bias, weight_hard_loss,
                                          weight_soft_loss, beta, temperature, ignore_index, student_logit_scale,
                                          1.0, student_logit_softcap, None)
    if not torch.compiler.is_compiling():  # missing_mass's check, before any work (traced: the operator's)
        _topk_options(options, missing_mass)
    # a process group is no operator argument: vocab parallel runs eagerly, traced or not
    eager = vocab_parallel is not None or _runs_eagerly(xs, student_weight, ids, lq, target, student_bias, weights)

    def call(w_hard, w_soft, with_grads):
        if with_grads and reduction == "none" and not eager and torch_rows.carries(
                xs, student_weight, k, student_bias, compute_dtype, chunk_size, num_valid_tokens, topk=True):
            return torch_rows.topk_rows_loss(xs, student_weight, ids, lq, target, missing_mass,
                                             (w_hard, w_soft, *options[2:]), chunk_size, num_valid_tokens,
                                             compute_dtype, weights)
        if eager:
            return _Eager.apply(lambda: _topk(xs, student_weight, ids, lq, target, student_bias, missing_mass,
                                              (w_hard, w_soft, *options[2:]), chunk_size, num_valid_tokens,
                                              with_grads, compute_dtype, weights, reduction, None, vocab_parallel),
                                xs, student_weight, student_bias)
        return _fused_linear_topk_jsd(xs, student_weight, ids, lq, target, student_bias, missing_mass, w_hard, w_soft,
                                      *options[2:5], chunk_size, num_valid_tokens, with_grads and reduction != "none",
                                      compute_dtype, weights, reduction, None, *options[5:])
    return rows_shaped(_operator_loss(call, options, compute_grad, return_soft_hard_loss), reduction, true_labels)


class FusedLinearTopKJSDLoss(torch.nn.Module):
    """Offline distillation: the student's loss against a teacher's stored top-k log-probabilities
    (jsdgpu.forward_topk), with FusedLinearJSDLoss's conventions:

        loss_fn = FusedLinearTopKJSDLoss(beta=0.5, missing_mass="bucket")
        loss = loss_fn(student_hidden, student_lm_head.weight, topk_indices, topk_logprobs, labels)

    The attributes are read at every call. Through the operator jsdgpu::fused_linear_topk_jsd
    (torch.compile fullgraph, autocast over fp32 weights); inside a CUDA-graph capture the core
    runs capturable by itself, and a bad row of the top-k makes the loss NaN (jsdgpu.forward_topk).
    vocab_parallel: as FusedLinearJSDLoss's, the student's head alone sharded (eagerly)."""

    def __init__(self, weight_hard_loss=DEFAULTS.weight_hard_loss, weight_soft_loss=DEFAULTS.weight_soft_loss,
                 beta=DEFAULTS.beta, ignore_index=DEFAULTS.ignore_index, temperature=DEFAULTS.temperature,
                 missing_mass="bucket", chunk_size=None, return_soft_hard_loss=False, reduction="mean",
                 student_logit_scale=1.0, student_logit_softcap=None, vocab_parallel=None):
        super().__init__()  # the options checked here too
        TopKOptions(weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index, student_logit_scale,
                    student_logit_softcap=student_logit_softcap, missing_mass=missing_mass)
        RunOptions(reduction=reduction)
        self.student_logit_scale, self.student_logit_softcap = student_logit_scale, student_logit_softcap
        self.missing_mass, self.vocab_parallel = missing_mass, vocab_parallel
        self.weight_hard_loss, self.weight_soft_loss = weight_hard_loss, weight_soft_loss
        self.beta, self.ignore_index, self.temperature = beta, ignore_index, temperature
        self.chunk_size, self.return_soft_hard_loss, self.reduction = chunk_size, return_soft_hard_loss, reduction

    def forward(self, student_input, student_weight, teacher_indices, teacher_logprobs, true_labels,
                student_bias=None, *, num_valid_tokens=None, token_weights=None):
        """num_valid_tokens, token_weights: as FusedLinearJSDLoss.forward's."""
        return fused_linear_topk_jsd_loss(
            student_input, student_weight, teacher_indices, teacher_logprobs, true_labels, student_bias,
            missing_mass=self.missing_mass, weight_hard_loss=self.weight_hard_loss,
            weight_soft_loss=self.weight_soft_loss, beta=self.beta, ignore_index=self.ignore_index,
            temperature=self.temperature, chunk_size=self.chunk_size, return_soft_hard_loss=self.return_soft_hard_loss,
            num_valid_tokens=num_valid_tokens, token_weights=token_weights, reduction=self.reduction,
            student_logit_scale=self.student_logit_scale, student_logit_softcap=self.student_logit_softcap,
            vocab_parallel=self.vocab_parallel)


@torch.no_grad()
def teacher_topk(teacher_input, teacher_weight, k, temperature=1.0, teacher_bias=None, **options):
    """jsdgpu.teacher_topk on torch tensors (inputs [..., H]; options: its keywords): (indices
    [..., k] int32, logprobs [..., k] float32), zero-copy, on torch's current stream, the memory
    from torch's allocator."""
    lead, h = teacher_input.shape[:-1], teacher_input.shape[-1]
    with current_stream(teacher_input):
        ids, logprobs = topk.teacher_topk(to_native(teacher_input.reshape(-1, h)), to_native(teacher_weight), k,
                                          temperature, None if teacher_bias is None else to_native(teacher_bias),
                                          **options)
        return from_native(ids).reshape(*lead, k), from_native(logprobs).reshape(*lead, k)
