"""Public API: forward, backward and the loss object JSDDistillLoss (SPEC.md, "API")."""

import functools
import importlib

import numpy as np

from . import _checks, parallel
from ._driver import LossOptions, run

# Modules of the DLPack producers the bridges take, and the bridge module of each.
_BRIDGES = {"torch": "jsdgpu.torch", "jax": "jsdgpu.jax", "jaxlib": "jsdgpu.jax"}


def _bridge_for(arrays):
    """The bridge module (jsdgpu.torch or jsdgpu.jax) for framework tensors, or None."""
    for a in arrays.values():
        if a is not None and _checks.array_kind(a) is None:
            root = type(a).__module__.split(".")[0]
            if root in _BRIDGES:
                return importlib.import_module(_BRIDGES[root])
    return None


@functools.lru_cache(maxsize=None)
def _backend(kind):
    """The backend for arrays of kind 'cupy' or 'numpy' (stateless: one of each)."""
    if kind == "cupy":
        from ._cupy_backend import CupyBackend
        return CupyBackend()
    from ._numpy_backend import NumpyBackend
    return NumpyBackend()


class Context:
    """What forward hands to backward: the loss parts, and the float32 gradient sums (or G, for
    grad_weight's product)."""

    def __init__(self, hard_loss, soft_loss, grads, valid_rows, n_rows, dtype, backend,
                 grad_weight_float32, device):
        self.hard_loss = hard_loss
        self.soft_loss = soft_loss
        self._grads = grads
        self._valid_rows = valid_rows
        self._n_rows = n_rows
        self._dtype = dtype
        self._backend = backend
        self._grad_weight_float32 = grad_weight_float32
        self._device = device
        self._bridge = None  # set for framework tensors: the bridge, and an input tensor
        self._like = None
        self._done = False


def forward(student_input, student_weight, teacher_input, teacher_weight, target,
            student_bias=None, teacher_bias=None, *, weight_hard_loss=0.5, weight_soft_loss=0.5,
            beta=0.5, temperature=1.0, ignore_index=-100, chunk_size=None, compute_grad=True,
            memory_budget=None, grad_weight_float32=False, num_valid_tokens=None,
            vocab_parallel=None):
    """Return (loss, ctx): loss is a 0-d float32 array of the inputs' kind.

    chunk_size: token rows per chunk; None picks the most that fit memory_budget bytes of
    per-chunk buffers (logits and gradient rows; the backend's default budget when None).
    compute_grad=False computes the loss only. grad_weight_float32 makes backward return
    grad_weight (and grad_bias) in float32, as accumulated, instead of the student's dtype.
    num_valid_tokens: the N that the summed row losses are divided by, in place of this call's
    count of valid rows: with the count of a whole batch, the calls on its parts (data-parallel
    ranks, gradient-accumulation steps) add up to the loss and gradients of the whole.
    vocab_parallel: a communicator over ranks that each hold a shard of the vocabulary (the
    weights and biases passed are this rank's rows); see jsdgpu.parallel.
    """
    arrays = dict(student_input=student_input, student_weight=student_weight,
                  teacher_input=teacher_input, teacher_weight=teacher_weight, target=target,
                  student_bias=student_bias, teacher_bias=teacher_bias)
    options = dict(weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta,
                   temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size,
                   compute_grad=compute_grad, memory_budget=memory_budget,
                   grad_weight_float32=grad_weight_float32, num_valid_tokens=num_valid_tokens,
                   vocab_parallel=vocab_parallel)
    bridge = _bridge_for(arrays)
    if bridge is None:
        return _forward(arrays, **options)
    # framework tensors: viewed zero-copy, the work queued on the framework's current stream
    with bridge.current_stream(student_input):
        loss, ctx = _forward({k: None if v is None else bridge.to_native(v)
                              for k, v in arrays.items()}, **options)
        ctx._bridge, ctx._like = bridge, student_input
        ctx.hard_loss, ctx.soft_loss = bridge.from_native(ctx.hard_loss), bridge.from_native(ctx.soft_loss)
        return bridge.from_native(loss), ctx


def _forward(arrays, *, weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index,
             chunk_size, compute_grad, memory_budget, grad_weight_float32, num_valid_tokens,
             vocab_parallel):
    opts = LossOptions(*_checks.check_options(weight_hard_loss, weight_soft_loss, beta,
                                              temperature, ignore_index, chunk_size))
    _checks.check_normalizer(num_valid_tokens, 0)  # its type and sign, before any work
    comm = parallel.communicator(vocab_parallel)
    kind = _checks.check_arrays(arrays)
    backend = _backend(kind)
    xp = backend.xp
    xs, ws, xt, wt = (arrays[k] for k in ("student_input", "student_weight", "teacher_input",
                                          "teacher_weight"))
    bs, bt = arrays["student_bias"], arrays["teacher_bias"]
    device = xs.device.id if kind == "cupy" else None
    with backend.on_device(device):
        # all that needs no target values comes first: selecting the valid rows waits for the
        # GPU, which then idles until the first product is queued
        xs, ws, xt, wt = (xp.ascontiguousarray(a) for a in (xs, ws, xt, wt))
        budget = backend.default_memory_budget if memory_budget is None else int(memory_budget)
        # the shard sizes cross the ranks first: the targets index the whole vocabulary
        shard = None if comm is None else parallel.shard_layout(comm, xp, ws.shape[0], wt.shape[0])
        valid_rows, target, n_valid = backend.select_rows(
            arrays["target"], ws.shape[0] if shard is None else shard.vs_total, opts.ignore_index)
        n_rows = xs.shape[0]
        hard, soft, grads = run(backend, xs, ws, xt, wt, target, bs, bt, opts,
                                valid_rows=valid_rows,
                                normalizer=_checks.check_normalizer(num_valid_tokens, n_valid),
                                chunk_size=chunk_size, memory_budget=budget,
                                compute_grad=bool(compute_grad), shard=shard)
        loss = (opts.weight_hard_loss * hard.astype(np.float64)
                + opts.weight_soft_loss * soft.astype(np.float64)).astype(np.float32)
        loss = xp.asarray(loss, dtype=np.float32)
    ctx = Context(hard, soft, grads, valid_rows, n_rows, xs.dtype, backend,
                  bool(grad_weight_float32), device)
    return loss, ctx


def backward(ctx, grad_output=1.0):
    """Return (grad_input, grad_weight, grad_bias) of the student, times grad_output.

    grad_bias is None without a student bias. May be called once per ctx.
    """
    if not isinstance(ctx, Context):
        raise TypeError(f"ctx must be the Context that forward returned, got {type(ctx).__name__}")
    if ctx._done:
        raise RuntimeError("backward was already called on this ctx; call forward again")
    if ctx._grads is None:
        raise ValueError("this ctx holds no gradients: forward ran with compute_grad=False")
    ctx._done = True
    bridge = ctx._bridge
    if bridge is None:
        return _backward(ctx, grad_output)
    with bridge.current_stream(ctx._like):
        if not isinstance(grad_output, (int, float)):
            grad_output = bridge.to_native(grad_output)
        return tuple(None if a is None else bridge.from_native(a)
                     for a in _backward(ctx, grad_output))


def _backward(ctx, grad_output):
    g, ctx._grads = ctx._grads, None  # the sums (or G) are freed with the ctx's last use
    xp = ctx._backend.xp
    with ctx._backend.on_device(ctx._device):
        if isinstance(grad_output, (int, float)) and grad_output == 1:
            scale = None  # the common case: a cast, no product
        else:
            scale = xp.asarray(grad_output, dtype=np.float32)
            if scale.ndim != 0:
                raise ValueError(f"grad_output must be a scalar, got shape {tuple(scale.shape)}")
        cast = ctx._backend.scale_cast
        weight_dtype = np.float32 if ctx._grad_weight_float32 else ctx._dtype
        if g.grad_weight is None:  # G was held for all rows: one product, straight into the dtype
            grad_weight = g.weight_product(scale, weight_dtype)
        else:
            grad_weight = cast(g.grad_weight, scale, weight_dtype)
        grad_bias = None if g.grad_bias is None else cast(g.grad_bias, scale, weight_dtype)
        grad_input = cast(g.grad_input, scale, ctx._dtype)
        if ctx._valid_rows is not None:
            valid_rows_grad, grad_input = grad_input, xp.zeros((ctx._n_rows, grad_input.shape[1]),
                                                               ctx._dtype)
            grad_input[ctx._valid_rows] = valid_rows_grad
    return grad_input, grad_weight, grad_bias


class JSDDistillLoss:
    """The loss with its options held: loss_fn = JSDDistillLoss(beta=0.5, temperature=2.0);
    loss, ctx = loss_fn(student_input, student_weight, teacher_input, teacher_weight, target)."""

    def __init__(self, **options):
        self.options = options
        _checks.check_options(options.get("weight_hard_loss", 0.5),
                              options.get("weight_soft_loss", 0.5), options.get("beta", 0.5),
                              options.get("temperature", 1.0), options.get("ignore_index", -100),
                              options.get("chunk_size"))

    def __call__(self, student_input, student_weight, teacher_input, teacher_weight, target,
                 student_bias=None, teacher_bias=None):
        return forward(student_input, student_weight, teacher_input, teacher_weight, target,
                       student_bias, teacher_bias, **self.options)

    backward = staticmethod(backward)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"JSDDistillLoss({args})"
