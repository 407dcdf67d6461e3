"""PyTorch front end: a drop-in for Liger-Kernel's LigerFusedLinearJSDLoss.

    from jsdgpu.torch import FusedLinearJSDLoss      # was: from liger_kernel.chunked_loss import
    loss_fn = FusedLinearJSDLoss(beta=0.5, temperature=1.0)   #   LigerFusedLinearJSDLoss
    loss = loss_fn(student_hidden, student_lm_head.weight, teacher_hidden, teacher_lm_head.weight, labels)
    loss.backward()

Tensors cross to CuPy (GPU) or NumPy (CPU) through DLPack without a copy, and the work is queued
on torch's current CUDA stream with nothing added to synchronize.
"""

import contextlib

import ml_dtypes
import numpy as np
import torch

from . import api
from .options import DEFAULTS


# ---- the bridge jsdgpu.forward / backward use for torch tensors ----

def to_native(t):
    """A CuPy (CUDA) or NumPy (CPU) view of the tensor t, zero-copy."""
    t = t.detach()
    if t.is_cuda:
        import cupy
        return cupy.from_dlpack(t)
    if t.dtype == torch.bfloat16:  # NumPy's DLPack has no bfloat16: cross as int16 bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_native(a):
    """A tensor viewing the CuPy or NumPy array a, zero-copy."""
    if isinstance(a, np.ndarray):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


def current_stream(t):
    """CuPy's current stream made torch's current stream on t's device, for the block."""
    if not t.is_cuda:
        return contextlib.nullcontext()
    import cupy
    stream = torch.cuda.current_stream(t.device)
    return _Both(cupy.cuda.Device(t.device.index), cupy.cuda.ExternalStream(stream.cuda_stream, t.device.index))


class _Both(contextlib.ExitStack):
    def __init__(self, *managers):
        super().__init__()
        self._managers = managers

    def __enter__(self):
        super().__enter__()
        for m in self._managers:
            self.enter_context(m)
        return self


# ---- autograd ----

class FusedLinearJSDFunction(torch.autograd.Function):
    """Forward computes the loss and, when any student input needs it, the gradient sums;
    backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, student_input, student_weight, teacher_input, teacher_weight, target,
                student_bias, teacher_bias, options):
        loss, jctx = api.forward(student_input, student_weight, teacher_input, teacher_weight,
                                  target, student_bias, teacher_bias, **options)
        ctx.jsd_ctx = jctx
        ctx.mark_non_differentiable(jctx.soft_loss, jctx.hard_loss)
        return loss, jctx.soft_loss, jctx.hard_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_soft, grad_hard):
        grad_input, grad_weight, grad_bias = api.backward(ctx.jsd_ctx, grad_loss)
        ctx.jsd_ctx = None
        return grad_input, grad_weight, None, None, None, grad_bias, None, None


def fused_linear_jsd_loss(student_input, student_weight, teacher_input, teacher_weight,
                          true_labels, student_bias=None, teacher_bias=None, *,
                          weight_hard_loss=DEFAULTS.weight_hard_loss,
                          weight_soft_loss=DEFAULTS.weight_soft_loss, beta=DEFAULTS.beta,
                          ignore_index=DEFAULTS.ignore_index, temperature=DEFAULTS.temperature,
                          chunk_size=None,
                          return_soft_hard_loss=False, num_valid_tokens=None,
                          vocab_parallel=None):
    """The loss as a function; see FusedLinearJSDLoss. num_valid_tokens and vocab_parallel (a
    torch.distributed process group here): see jsdgpu.forward."""
    # grad mode is off inside Function.forward: decide here whether gradients are wanted
    compute_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (student_input, student_weight, student_bias))
    options = dict(weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss,
                   beta=beta, ignore_index=ignore_index, temperature=temperature,
                   chunk_size=chunk_size, compute_grad=compute_grad,
                   num_valid_tokens=num_valid_tokens, vocab_parallel=vocab_parallel)
    loss, soft, hard = FusedLinearJSDFunction.apply(student_input, student_weight, teacher_input,
                                                    teacher_weight, true_labels, student_bias,
                                                    teacher_bias, options)
    return (loss, soft, hard) if return_soft_hard_loss else loss


class FusedLinearJSDLoss(torch.nn.Module):
    """LigerFusedLinearJSDLoss's constructor and call, computed by jsdgpu.

    `compiled` is accepted for compatibility and ignored (there is nothing to compile);
    chunk_size=None picks the chunk from a memory budget. vocab_parallel: a torch.distributed
    process group whose ranks each hold a vocabulary shard of both LM heads (jsdgpu.parallel).
    """

    def __init__(self, weight_hard_loss=DEFAULTS.weight_hard_loss,
                 weight_soft_loss=DEFAULTS.weight_soft_loss, beta=DEFAULTS.beta,
                 ignore_index=DEFAULTS.ignore_index, temperature=DEFAULTS.temperature, compiled=True,
                 chunk_size=None, return_soft_hard_loss=False, vocab_parallel=None):
        super().__init__()
        self.options = dict(weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss,
                            beta=beta, ignore_index=ignore_index, temperature=temperature,
                            chunk_size=chunk_size, return_soft_hard_loss=return_soft_hard_loss,
                            vocab_parallel=vocab_parallel)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels,
                student_bias=None, teacher_bias=None):
        return fused_linear_jsd_loss(student_input, student_weight, teacher_input, teacher_weight,
                                     true_labels, student_bias, teacher_bias, **self.options)
