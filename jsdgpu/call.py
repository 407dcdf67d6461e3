"""What every loss call shares (jsdgpu.api's online loss, jsdgpu.topk's): its setup and run
(call_loss: the first product queued ahead, the arrays' checks, the backend by their kind, the
chunk engine on the loss), the framework bridge, the Context forward hands to backward, and
backward, which turns the gradient sums the chunk engine left into the gradients
(docs/contract.md, "API")."""

import dataclasses
import functools
import importlib

import numpy as np

from . import checks
from .ahead import FirstProduct
from .engine import run

# Modules of the DLPack producers the bridges take, and the bridge module of each.
_BRIDGES = {"torch": "jsdgpu.torch", "jax": "jsdgpu.jax", "jaxlib": "jsdgpu.jax"}


def _bridge_for(arrays):
    """The bridge module (jsdgpu.torch or jsdgpu.jax) for framework tensors, or None."""
    return _bridge_for_types(tuple(map(type, arrays.values())))


@functools.lru_cache(maxsize=64)
def _bridge_for_types(types):
    for t in types:
        if t is not type(None) and checks.array_kind_of_type(t) is None:
            root = t.__module__.split(".")[0]
            if root in _BRIDGES:
                return importlib.import_module(_BRIDGES[root])
    return None


@functools.lru_cache(maxsize=None)
def backend_for(kind):
    """The backend for arrays of kind 'cupy' or 'numpy' (stateless: one of each)."""
    if kind == "cupy":
        from .cuda.backend import CudaBackend
        return CudaBackend()
    from .cpu.backend import CpuBackend
    return CpuBackend()


class Context:
    """What forward hands to backward: the loss parts (hard_loss, soft_loss), and the float32
    gradient sums (or G held for grad_weight's product). bad_target_row, in a capturable call:
    a 0-d int32 array of the first row whose target is neither ignore_index nor in [0, Vs), T
    where there is none (the loss and gradients are NaN where there is one); None in a default
    call, which raises ValueError for a bad target instead. bad_topk_row: likewise for the rows
    of a top-k call's teacher (jsdgpu.forward_topk), None elsewhere."""

    def __init__(self, hard_loss, soft_loss, grads, valid_rows, n_rows, dtype, backend,
                 grad_weight_float32, device, bad_target_row=None):
        self.hard_loss = hard_loss
        self.soft_loss = soft_loss
        self.bad_target_row = bad_target_row
        self.bad_topk_row = None
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
        self._rows_own = False  # reduction "none" with gradients: backward's grad_output is [T]
        self._recompute = None  # with it, where forward computed no gradients: (row scales, out) ->
                                # the gradients (rows_own_backward)

    def gradient_dtypes(self):
        """(grad_input's dtype, grad_weight's and grad_bias's) as backward makes them."""
        return self._dtype, np.dtype(np.float32) if self._grad_weight_float32 else self._dtype


def bridged(arrays, compute):
    """compute(arrays) -> (loss, ctx), with framework tensors (torch, JAX) among the arrays
    viewed zero-copy as CuPy or NumPy arrays, the work queued on the framework's current stream,
    and the loss and its parts returned as the framework's tensors."""
    bridge = _bridge_for(arrays)
    if bridge is None:
        return compute(arrays)
    like = next(a for a in arrays.values() if a is not None)
    with bridge.current_stream(like):
        loss, ctx = compute({k: v if v is None or k in checks.FUNCTIONS else bridge.to_native(v)
                             for k, v in arrays.items()})
        ctx._bridge, ctx._like = bridge, like
        ctx.hard_loss, ctx.soft_loss = bridge.from_native(ctx.hard_loss), bridge.from_native(ctx.soft_loss)
        return bridge.from_native(loss), ctx


def runs_capturable(run_opts, kind):
    """Whether the call runs capturable: as asked, else while CuPy's current stream is capturing.
    During a capture the memory must come from an allocator of the caller's (a pool of its own,
    or torch's through jsdgpu.torch), not CuPy's default pool, whose blocks freed during the
    capture would be handed to other work that the graph's replays then overwrite."""
    if kind != "cupy":
        return bool(run_opts.capturable)  # on the CPU: the GPU's masked rows, on request
    import cupy
    capturing = cupy.cuda.get_current_stream().is_capturing()
    if capturing and cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc:
        raise RuntimeError(
            "jsdgpu.forward inside a CUDA-graph capture needs memory that outlives the capture and "
            "is not reused by other work: capture under cupy.cuda.using_allocator(pool.malloc) with "
            "a cupy.cuda.MemoryPool() of the graph's own (kept as long as the graph), or through "
            "jsdgpu.torch, whose memory comes from torch's graph pool")
    return capturing if run_opts.capturable is None else run_opts.capturable


def call_loss(name, arrays, opts, run_opts, check_arrays, loss_for, forward):
    """One call of a loss on native arrays (forward's: api's online loss as "online", topk's as
    "topk"): (loss, ctx). check_arrays(arrays) checks them and gives their kind; loss_for(backend,
    capturable) makes what the loss needs on the call's device, (make_loss, xs, other): its
    ChunkLoss for a RunOptions, the rows' student inputs and what goes with them through the
    engine (the teacher's inputs, the top-k's ids); forward is the caller's, for a backward that
    runs the call again (rows_own_backward)."""
    # first of all, where this call is like the last: its first product (ahead.FirstProduct)
    first = FirstProduct((name, run_opts), arrays["student_input"], arrays["student_weight"])
    kind = check_arrays(arrays)
    backend = backend_for(kind)
    capturable = runs_capturable(run_opts, kind)
    device = arrays["student_input"].device.id if kind == "cupy" else None
    with backend.on_device(device):
        make_loss, xs, other = loss_for(backend, capturable)
        chunk_loss = loss_of_call(make_loss, arrays, run_opts, xs.shape[0])
        hard, soft, grads, rows = run(chunk_loss, xs, other, first)
        loss = weighted_loss(backend.xp, opts, hard, soft)
    ctx = Context(hard, soft, grads, rows.valid_rows, xs.shape[0], xs.dtype, backend, run_opts.grad_weight_float32,
                  device, None if rows.status is None else rows.status[1])
    ctx.bad_topk_row = chunk_loss.bad_topk_row
    if run_opts.rows_own:
        rows_own_backward(ctx, forward, arrays, opts, run_opts)
    return loss, ctx


def loss_of_call(make_loss, arrays, run_opts, n_rows):
    """make_loss(run_opts), the chunk loss of a call of n_rows rows, with the call's token weights
    and row scales (arrays'); in a call of the rows' own losses, with gradients only where it
    keeps them for backward (ChunkLoss.keeps_row_gradients), else computing the rows' values
    alone (compute_grad False: rows_own_backward)."""
    loss = make_loss(run_opts)
    if run_opts.rows_own and not loss.keeps_row_gradients(n_rows):
        loss = make_loss(dataclasses.replace(run_opts, compute_grad=False))
    loss.token_weights, loss.row_scales = arrays["token_weights"], arrays.get("row_scales")
    loss.g_memory, loss.weight_memory = arrays.get("g_memory"), arrays.get("weight_memory")
    return loss


def rows_own_backward(ctx, forward, arrays, opts, run_opts):
    """ctx of a call of the rows' own losses (RunOptions.rows_own), made by forward(arrays, opts, run_opts)
    (the online loss's or the top-k's, on native arrays): its backward(grad_output [T]) scales the
    gradients forward kept (loss_of_call) by each row's grad_output, or, where forward computed
    the rows' values alone, runs the call again as the sum of the rows' losses, each times its
    grad_output (arrays' row_scales: the engine's)."""
    ctx._rows_own = True
    if ctx._grads is None:
        sums = dataclasses.replace(run_opts, reduction="sum")
        ctx._recompute = lambda scales, out: _backward(forward(dict(arrays, row_scales=scales), opts, sums)[1],
                                                       1.0, out)


def weighted_loss(xp, opts, hard, soft):
    """weight_hard_loss * hard + weight_soft_loss * soft, formed in float64, as a 0-d float32 array."""
    loss = opts.weight_hard_loss * hard.astype(np.float64) + opts.weight_soft_loss * soft.astype(np.float64)
    return xp.asarray(loss.astype(np.float32), dtype=np.float32)


def backward(ctx, grad_output=1.0, out=None):
    """Return (grad_input, grad_weight, grad_bias) of the student, times grad_output.

    grad_bias is None without a student bias. May be called once per ctx. out: where given,
    arrays of the gradients' shapes and dtypes (the bias's None without a bias) that they are
    written into and returned, with no copy (how jsdgpu.jax writes into XLA's buffers).
    """
    if not isinstance(ctx, Context):
        raise TypeError(f"ctx must be the Context that forward returned, got {type(ctx).__name__}")
    if ctx._done:
        raise RuntimeError("backward was already called on this ctx, and freed its gradient rows; call forward (in "
                           "PyTorch eagerly, the loss) again for another backward")
    if ctx._grads is None and ctx._recompute is None:  # (rows_own_backward's, or none)
        raise ValueError("this ctx holds no gradients: forward ran with compute_grad=False")
    ctx._done = True
    bridge = ctx._bridge
    if bridge is None:
        return _backward(ctx, grad_output, out or (None, None, None))
    with bridge.current_stream(ctx._like):
        if not isinstance(grad_output, (int, float)):
            grad_output = bridge.to_native(grad_output)
        out = tuple(None if a is None else bridge.to_native(a) for a in out or (None, None, None))
        return tuple(None if a is None else bridge.from_native(a) for a in _backward(ctx, grad_output, out))


def _backward(ctx, grad_output, out):
    g, ctx._grads = ctx._grads, None  # the sums (or G) are freed with the ctx's last use
    backend = ctx._backend
    xp = backend.xp
    with backend.on_device(ctx._device):
        if ctx._rows_own:  # the rows' own losses: grad_output [T] (a scalar: each row's)
            scales = xp.asarray(grad_output, dtype=np.float32)
            if scales.shape not in ((), (ctx._n_rows,)):
                raise ValueError(f"grad_output must have shape ({ctx._n_rows},) with reduction='none', got "
                                 f"{tuple(scales.shape)}")
            scales = xp.ascontiguousarray(xp.broadcast_to(scales, (ctx._n_rows,)))
            if ctx._recompute is not None:
                return ctx._recompute(scales, out)
            _scale_rows(g, scales if ctx._valid_rows is None else scales[ctx._valid_rows])
            grad_output = 1.0
        if isinstance(grad_output, (int, float)):
            # a fill, not a copy from the host: a capture may not copy
            scale = None if grad_output == 1 else xp.full((), grad_output, np.float32)
        else:
            scale = xp.asarray(grad_output, dtype=np.float32)
            if scale.ndim != 0:
                raise ValueError(f"grad_output must be a scalar, got shape {tuple(scale.shape)}")
        input_dtype, weight_dtype = ctx.gradient_dtypes()
        out_input, out_weight, out_bias = out
        if g.held is not None:  # G was held for all rows: one product, straight into the dtype
            grad_weight = backend.weight_product(g.held, scale, weight_dtype, out_weight)
        else:
            grad_weight = backend.scale_cast(g.grad_weight, scale, weight_dtype, out_weight)
        grad_bias = None if g.grad_bias is None else backend.scale_cast(g.grad_bias, scale, weight_dtype, out_bias)
        if ctx._valid_rows is None:
            grad_input = backend.scale_cast(g.grad_input, scale, input_dtype, out_input)
        else:  # the valid rows' among zeros
            valid_rows_grad = backend.scale_cast(g.grad_input, scale, input_dtype)
            if out_input is None:
                grad_input = xp.zeros((ctx._n_rows, valid_rows_grad.shape[1]), input_dtype)
            else:
                grad_input = out_input
                grad_input[...] = 0
            grad_input[ctx._valid_rows] = valid_rows_grad
    return grad_input, grad_weight, grad_bias


def _scale_rows(g, scales):
    """The gradients g kept by a call of the rows' own losses, each computed row's part times its
    grad_output (scales, float32 [computed rows]): grad_input's rows, and G's rows held for
    grad_weight's product (scale_held)."""
    assert g.grad_bias is None, "kept only with no bias (keeps_row_gradients)"
    g.grad_input *= scales[:, None]
    if g.held is None:  # no row computed (every row ignored): the sums are zero, and stay so
        assert len(scales) == 0, "kept only with G held (keeps_row_gradients)"
        return
    scale_held(g.held, scales)


def scale_held(held, scales):
    """G held for all rows (backend.HeldG) of a call of the rows' own losses, each computed row's
    part of grad_weight times its grad_output (scales, float32 [computed rows]): G's row scales,
    which the product takes with Xs's rows, and the label terms kept out of G. (The front ends
    that carry G from forward to backward: jsdgpu.torch_rows, jsdgpu.jax.)"""
    held.g_scale = scales if held.g_scale is None else held.g_scale * scales
    held.label_terms = held.label_terms * scales
