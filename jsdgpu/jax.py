"""JAX front end: the loss as a differentiable function (jax.custom_vjp).

    from jsdgpu.jax import fused_linear_jsd_loss
    loss, (g_x, g_w) = jax.value_and_grad(fused_linear_jsd_loss, argnums=(0, 1))(
        student_hidden, student_head, teacher_hidden, teacher_head, labels)

Arrays cross to CuPy (GPU) or NumPy (CPU) through DLPack without a copy. The work runs eagerly
outside of JAX's tracing: under jax.jit the function raises a TypeError that says so (see the
README for why).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import api
from .options import LOSS_FIELDS


# ---- the bridge jsdgpu.forward / backward use for JAX arrays ----

def to_native(x):
    """A CuPy (GPU) or NumPy (CPU) view of the JAX array x."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            "jsdgpu cannot run under jax.jit or another JAX transformation that traces its "
            "inputs (it launches its own CUDA kernels eagerly): call "
            "jsdgpu.jax.fused_linear_jsd_loss outside jit, e.g. jit the model and compute the "
            "loss and its gradient with jax.value_and_grad on concrete arrays.")
    device = next(iter(x.devices()))
    if device.platform == "gpu":
        import cupy
        with cupy.cuda.Device(device.id):
            return cupy.from_dlpack(x)
    return np.asarray(x)  # zero-copy on the CPU; bfloat16 included (JAX's is ml_dtypes')


def from_native(a):
    if isinstance(a, np.ndarray):
        return jnp.asarray(a)
    return jnp.from_dlpack(a)


def current_stream(x):
    """JAX exposes no stream of its own to join: DLPack's exchange orders the work."""
    return contextlib.nullcontext()


# ---- the differentiable function ----

_OPTIONS = LOSS_FIELDS + ("chunk_size", "num_valid_tokens")


def fused_linear_jsd_loss(student_input, student_weight, teacher_input, teacher_weight, target,
                          student_bias=None, teacher_bias=None, **options):
    """The loss of docs/contract.md; differentiable with respect to the student input, weight and bias.
    options: weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index, chunk_size,
    num_valid_tokens (see jsdgpu.forward)."""
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    return _loss(student_input, student_weight, student_bias, teacher_input, teacher_weight,
                 teacher_bias, target, tuple(sorted(options.items())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _loss(student_input, student_weight, student_bias, teacher_input, teacher_weight,
          teacher_bias, target, options):
    loss, _ = api.forward(student_input, student_weight, teacher_input, teacher_weight, target,
                           student_bias, teacher_bias, compute_grad=False, **dict(options))
    return loss


def _loss_fwd(student_input, student_weight, student_bias, teacher_input, teacher_weight,
              teacher_bias, target, options):
    loss, ctx = api.forward(student_input, student_weight, teacher_input, teacher_weight, target,
                             student_bias, teacher_bias, **dict(options))
    # residuals must be JAX arrays: the gradients themselves, scaled in the backward rule
    return loss, api.backward(ctx)


def _loss_bwd(options, grads, g):
    grad_input, grad_weight, grad_bias = grads
    scale = lambda a: None if a is None else (a * g).astype(a.dtype)
    return (scale(grad_input), scale(grad_weight), scale(grad_bias), None, None, None, None)


_loss.defvjp(_loss_fwd, _loss_bwd)
