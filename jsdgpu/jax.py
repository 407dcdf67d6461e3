"""JAX front end: the loss as a differentiable function (jax.custom_vjp) that works eagerly and
under jax.jit, on the GPU and the CPU.

    from jsdgpu.jax import fused_linear_jsd_loss
    loss, (g_x, g_w) = jax.jit(jax.value_and_grad(fused_linear_jsd_loss, argnums=(0, 1)))(
        student_hidden, student_head, teacher_hidden, teacher_head, labels)

The loss is a jax.experimental.buffer_callback: its Python runs when XLA reaches it (once per
call, eager or jitted), with XLA's own buffers (zero-copy) and, on the GPU, XLA's CUDA stream,
on which jsdgpu queues its products and kernels in its capturable mode (no host
synchronization). The forward pass computes the gradients too, written straight into XLA's
output buffers; the backward rule scales them by the cotangent. With reduction "none" the
gradients are carried to backward where the call holds G (below: "the rows' own losses"), else
backward computes the call again. Options are static.

Working memory comes from CuPy's pool (the GPU's own allocations, beside XLA's): XLA takes 75%
of the GPU's memory at start by default and the loss takes from the rest; its peak is
docs/design.md's (about 1.3 GB at T = 1024 and 3 GB at T = 8192 at the benchmark shape). Where
the rest is too little, lower XLA_PYTHON_CLIENT_MEM_FRACTION. XLA_PYTHON_CLIENT_PREALLOCATE=false
also leaves room, but XLA then grows its own memory by device allocations as steps need it:
ten steps queued while the ten before them were held took four times as long a step
(README, "JAX").

Not supported yet: jax.vmap of the loss, and vocab parallelism (under shard_map or otherwise).
"""

import functools

try:
    import jax
    import jax.numpy as jnp
except ImportError as e:
    raise ImportError("jsdgpu.jax needs JAX: pip install 'jsdgpu[jax]' (or jax itself)") from e
import ml_dtypes
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from . import api, online, topk
from .backend import HeldG
from .call import backend_for, scale_held
from .options import LossOptions, RunOptions, TopKOptions, field_names

_RUN_FIELDS = ("chunk_size", "num_valid_tokens", "reduction")


# ---- the bridge jsdgpu.forward / backward use for JAX arrays (eager calls of the core) ----

def to_native(x):
    """A CuPy (GPU) or NumPy (CPU) view of the concrete JAX array x."""
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
    """A concrete array's work is done: DLPack's exchange orders it."""
    import contextlib
    return contextlib.nullcontext()


# ---- the loss as an XLA callback ----

def _native(buffer, gpu):
    """A CuPy (GPU) or NumPy (CPU) view of an XLA buffer, zero-copy."""
    if gpu:
        import cupy
        a = cupy.asarray(buffer)  # __cuda_array_interface__, which has no bfloat16: 2-byte voids
        return a.view(ml_dtypes.bfloat16) if a.dtype.kind == "V" else a
    return np.asarray(buffer)


@functools.lru_cache(maxsize=64)
def _options(options, with_grads, gpu, loss=LossOptions):
    """(loss's options: LossOptions or TopKOptions, RunOptions) of a callback's static options,
    made once per set (a call's host work before its first product runs with the GPU idle); on the
    GPU capturable: nothing waits on the host, nothing blocks XLA's stream."""
    fields = field_names(loss)
    loss_opts = loss(**{k: v for k, v in options if k in fields})
    run = {k: v for k, v in options if k in _RUN_FIELDS}
    return loss_opts, RunOptions(compute_grad=with_grads, capturable=gpu or None, **run)


def _online(arrays, options, with_grads, gpu, g_memory=None, weight_memory=None):
    """jsdgpu.forward on the callback's arrays (xs, ws, bs, target, the token weights and row
    scales, then the teacher's xt, wt, bt); g_memory: G's, where the call carries it (_carried);
    weight_memory: a float32 grad_weight's output buffer, as api.forward_with takes it (_call)."""
    xs, ws, bs, target, weights, scales, xt, wt, bt = arrays
    return api.forward_with(xs, ws, xt, wt, target, bs, bt, *_options(options, with_grads, gpu), weights, scales,
                            g_memory, weight_memory)


def _topk(arrays, options, with_grads, gpu, g_memory=None, weight_memory=None):
    """jsdgpu.forward_topk on the callback's arrays (xs, ws, bs, target, the token weights and row
    scales, then the teacher's ids and logprobs); a bad row of the top-k, like a bad target,
    makes the loss NaN on the GPU. g_memory, weight_memory: as _online's."""
    xs, ws, bs, target, weights, scales, ids, lq = arrays
    return topk.forward_topk_with(xs, ws, ids, lq, target, bs, *_options(options, with_grads, gpu, TopKOptions),
                                  weights, scales, g_memory, weight_memory)


def _callback(compute, present):
    """The buffer_callback's function: (ctx, out, *arrays), arrays the present ones of a loss's
    (None where not present), compute(out, arrays, gpu) with both viewed natively."""

    def callback(ctx, out, *buffers):
        try:
            stream = ctx.stream  # XLA's CUDA stream: a GPU call
        except jax.errors.JaxRuntimeError:  # a CPU call has no GPU context
            stream = None
        it = iter(buffers)
        gpu = stream is not None
        arrays = [_native(next(it), gpu) if p else None for p in present]
        out = [_native(b, gpu) for b in out]
        if not gpu:
            return compute(out, arrays, False)
        import cupy
        with cupy.cuda.ExternalStream(stream):  # the work queued on XLA's stream
            compute(out, arrays, True)

    return callback


def _run_callback(compute, arrays, shapes):
    """compute's outputs (of shapes: jax.ShapeDtypeStruct) by one callback on arrays."""
    run = buffer_callback(_callback(compute, tuple(a is not None for a in arrays)), tuple(shapes))
    return run(*(a for a in arrays if a is not None))


def _call(forward, options, with_grads, arrays, student):
    """The loss (and with with_grads the gradients of student: (xs, ws, bs)) by one callback."""
    rows = (student[0].shape[0],) if _rows_own(options) else ()
    shapes = [jax.ShapeDtypeStruct(rows, jnp.float32)]
    if with_grads:
        shapes += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in student if a is not None]

    def compute(out, arrays, gpu):
        # a float32 grad_weight's sum over chunks kept in its output buffer (api.forward_with):
        # backward then writes nothing more there
        weight_memory = (lambda: out[2]) if with_grads and out[2].dtype == np.float32 else None
        loss, ctx = forward(arrays, options, with_grads, gpu, weight_memory=weight_memory)
        out[0][...] = loss
        if with_grads:
            api.backward(ctx, 1.0, out=tuple(out[1:]) + (None,) * (4 - len(out)))
    return _run_callback(compute, arrays, shapes)


def _rows_own(options):
    """Whether a callback's static options ask for the rows' own losses (reduction "none")."""
    return dict(options).get("reduction") == "none"


# ---- the rows' own losses, their gradients carried from forward to backward ----
#
# As in jsdgpu.torch_rows: where a call of the rows' own losses (of either loss) holds G for all
# rows (and has no student bias), its forward computes the gradients for grad_output 1 and
# hands backward what scales them by each row's grad_output:
# grad_input's rows (float32), and G with what grad_weight's one product needs (the computed
# rows' indices, their label terms kept out of G, labels and row scales, 1/N and their count),
# as residuals of the custom_vjp; G is held in the forward callback's output buffer, and
# backward's callback runs the backend's product on it.
# G's layout, and whether the call holds it at all, are the backend's, which the platform
# decides, and a traced array does not tell its platform: they are planned for JAX's default
# platform, and the carrying code is that platform's branch of jax.lax.platform_dependent, which
# XLA keeps where the call runs there; elsewhere the other branch computes the rows' values
# alone and backward computes the call again.

def _default_platform():
    """(JAX's default platform as jax.lax.platform_dependent names it, whether it is a GPU)."""
    gpu = jax.default_backend() == "gpu"
    return "cuda" if gpu else "cpu", gpu


def _carried(forward, options, student, teacher):
    """(platform, (columns, dtype) of G) where a call of forward (_online or _topk) of the rows'
    own losses on JAX's default platform carries its gradients (above), else None. teacher: the
    rows' other arrays (_loss's)."""
    xs, ws, bs = student
    (vs, hs), dtype, T = ws.shape, np.dtype(ws.dtype), xs.shape[0]
    platform, gpu = _default_platform()
    backend = backend_for("cupy" if gpu else "numpy")
    if forward is _online:  # teacher: (weights, scales, xt, wt, bt)
        keeps = online.keeps_row_gradients(backend, vs, teacher[3].shape[0], hs, dtype, T, bs is not None,
                                           _options(options, True, gpu)[1])
    else:  # teacher: (weights, scales, ids, logprobs)
        keeps = topk.keeps_row_gradients(backend, vs, hs, dtype, teacher[3].shape[1], T, bs is not None,
                                         _options(options, True, gpu, TopKOptions)[1])
    return (platform, backend.g_row_layout(vs, dtype)) if keeps else None


def _carried_shapes(student, g_layout):
    """The carried arrays' shapes: grad_input [T, Hs] float32, G [T, columns], the computed rows'
    indices [T] int32, their label terms [T] float32, labels [T] int32 and row scales [T]
    float32 (each first in its rows, the rest unused), 1/N and their count."""
    (T, hs), f32, i32 = student[0].shape, jnp.float32, jnp.int32
    return (jax.ShapeDtypeStruct((T, hs), f32), jax.ShapeDtypeStruct((T, g_layout[0]), g_layout[1]),
            *(jax.ShapeDtypeStruct((T,), d) for d in (i32, f32, i32, f32)), jax.ShapeDtypeStruct((), f32),
            jax.ShapeDtypeStruct((), i32))


def _call_carrying(forward, options, arrays, student, g_layout):
    """(the rows' losses, the carried arrays) of a call of forward by one callback, G held in its
    output buffer."""

    def compute(out, arrays, gpu):
        loss_rows, grad_input, G, rows, label_terms, labels, g_scale, inv_n, count = out
        loss, ctx = forward(arrays, options, True, gpu, g_memory=G)
        loss_rows[...] = loss
        grads, valid, xp = ctx._grads, ctx._valid_rows, ctx._backend.xp
        held = grads.held
        n = 0 if held is None else held.G.shape[0]
        assert n == 0 or xp.may_share_memory(held.G, G), "G held in the engine's memory, not the buffer"
        if valid is None:
            grad_input[:n] = grads.grad_input
            grad_input[n:] = 0
            rows[:n] = xp.arange(n)
        else:  # the valid rows' among zeros
            grad_input[...] = 0
            grad_input[valid] = grads.grad_input
            rows[:n] = valid
        if n:
            label_terms[:n], labels[:n] = held.label_terms, held.target
            g_scale[:n] = 1 if held.g_scale is None else held.g_scale
        inv_n[...] = 1 if held is None else held.inv_n
        count[...] = n

    loss, *carried = _run_callback(compute, arrays, (jax.ShapeDtypeStruct(student[0].shape[:1], jnp.float32),
                                                     *_carried_shapes(student, g_layout)))
    return loss, tuple(carried)


def _carried_gradients(g, carried, xs, ws):
    """(grad_input, grad_weight) of the rows' own losses for their grad_output g [T], from the
    carried arrays: grad_input's rows times g, and grad_weight by the backend's one product of G
    held (backend.weight_product), each computed row's part times its grad_output
    (call.scale_held), by a callback."""
    grad_input, G, *held_parts = carried
    vocab, dtype = ws.shape[0], np.dtype(ws.dtype)

    def compute(out, arrays, gpu):
        G, xs, rows, label_terms, labels, g_scale, inv_n, count, g = arrays
        if gpu:  # every row is computed (masked): the rows are all of them, in order
            n, xs_held, g_held = G.shape[0], xs, g
        else:
            n = int(count)
            xs_held, g_held = xs[rows[:n]], g[rows[:n]]
        held = HeldG(G[:n], vocab, xs_held, inv_n, label_terms[:n], labels[:n], g_scale[:n])
        scale_held(held, g_held.astype(np.float32))
        backend_for("cupy" if gpu else "numpy").weight_product(held, None, dtype, out[0])

    grad_weight, = _run_callback(compute, (G, xs, *held_parts, g), (jax.ShapeDtypeStruct(ws.shape, ws.dtype),))
    return (grad_input * g.astype(jnp.float32)[:, None]).astype(xs.dtype), grad_weight


def _check_options(options, loss=LossOptions):
    fields = field_names(loss)
    unknown = set(options) - set(fields) - set(_RUN_FIELDS)
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    arrays = sorted(k for k, v in options.items() if isinstance(v, jax.Array))  # (a tracer is one too)
    if arrays:  # such as a schedule's value passed through jit: each value is a trace of its own
        raise TypeError(f"{', '.join(arrays)}: the options are Python numbers, static under jax.jit, not JAX "
                        "arrays (mark them static: jax.jit(..., static_argnames=...))")
    loss(**{k: v for k, v in options.items() if k in fields})  # their checks, at trace time
    RunOptions(**{k: v for k, v in options.items() if k in _RUN_FIELDS})
    return tuple(sorted(options.items()))


# ---- the differentiable function ----

def fused_linear_jsd_loss(student_input, student_weight, teacher_input, teacher_weight, target,
                          student_bias=None, teacher_bias=None, *, token_weights=None, **options):
    """The loss of docs/contract.md; differentiable with respect to the student input, weight
    and bias. token_weights: None or [T] (an array, traced under jit). options: those of
    jsdgpu.LossOptions, chunk_size, num_valid_tokens and reduction (see jsdgpu.forward); static
    under jit."""
    return _loss(_online, (token_weights, None, teacher_input, teacher_weight, teacher_bias), student_input,
                 student_weight, student_bias, target, _check_options(options))


def fused_linear_topk_jsd_loss(student_input, student_weight, teacher_indices, teacher_logprobs, target,
                               student_bias=None, *, token_weights=None, **options):
    """Offline distillation (jsdgpu.forward_topk): the loss against a teacher's stored top-k
    log-probabilities; differentiable with respect to the student input, weight and bias.
    token_weights and options: those of fused_linear_jsd_loss, and missing_mass; static under
    jit. On the GPU it runs capturable on XLA's stream, as fused_linear_jsd_loss does."""
    return _loss(_topk, (token_weights, None, teacher_indices, teacher_logprobs), student_input, student_weight,
                 student_bias, target, _check_options(options, TopKOptions))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _loss(forward, teacher, student_input, student_weight, student_bias, target, options):
    """forward's loss: the student's arrays, the target, then the rows' other arrays (the token
    weights, the row scales: None here, the teacher's; a tuple, given no gradient)."""
    student = (student_input, student_weight, student_bias)
    return _call(forward, options, False, (*student, target, *teacher), student)[0]


def _loss_fwd(forward, teacher, student_input, student_weight, student_bias, target, options):
    student = (student_input, student_weight, student_bias)
    arrays = (*student, target, *teacher)
    if _rows_own(options):  # grad_output [T] is known only in backward
        values = lambda arrays: _call(forward, options, False, arrays, student)[0]  # noqa: E731
        carried = _carried(forward, options, student, teacher)
        if not carried:
            return values(arrays), (student, target, None, teacher)
        platform, g_layout = carried
        elsewhere = lambda arrays: (values(arrays), tuple(jnp.zeros(a.shape, a.dtype)  # noqa: E731
                                                          for a in _carried_shapes(student, g_layout)))
        loss, kept = jax.lax.platform_dependent(
            arrays, **{platform: lambda arrays: _call_carrying(forward, options, arrays, student, g_layout)},
            default=elsewhere)
        return loss, (student, target, kept, teacher)
    loss, *grads = _call(forward, options, True, arrays, student)
    return loss, (tuple(grads), teacher)


def _loss_bwd(forward, options, residuals, g):
    no_teacher_grad = jax.tree_util.tree_map(lambda a: None, residuals[-1])
    if _rows_own(options):
        student, target, kept, teacher = residuals

        def again(g):  # the call again, as the rows' sum times g
            weights, _, *teacher_arrays = teacher
            sums = tuple(sorted(dict(options, reduction="sum").items()))
            return _call(forward, sums, True, (*student, target, weights, g, *teacher_arrays), student)[1:]
        if kept is None:
            grad_input, grad_weight, *grad_bias = again(g)
            return no_teacher_grad, grad_input, grad_weight, grad_bias[0] if grad_bias else None, None
        grad_input, grad_weight = jax.lax.platform_dependent(
            g, **{_default_platform()[0]: lambda g: _carried_gradients(g, kept, *student[:2])}, default=again)
        return no_teacher_grad, grad_input, grad_weight, None, None
    (grad_input, grad_weight, *grad_bias), _ = residuals
    scale = lambda a: (a * g).astype(a.dtype)  # noqa: E731
    return (no_teacher_grad, scale(grad_input), scale(grad_weight), scale(grad_bias[0]) if grad_bias else None,
            None)


_loss.defvjp(_loss_fwd, _loss_bwd)


def teacher_topk(teacher_input, teacher_weight, k, temperature=1.0, teacher_bias=None, **options):
    """jsdgpu.teacher_topk on concrete JAX arrays (eagerly, not under jit: the top-k is made once,
    ahead of training): (indices int32, logprobs float32), inputs [..., H] -> [..., k]."""
    lead, h = teacher_input.shape[:-1], teacher_input.shape[-1]
    ids, logprobs = topk.teacher_topk(to_native(teacher_input.reshape(-1, h)), to_native(teacher_weight), k,
                                      temperature, None if teacher_bias is None else to_native(teacher_bias),
                                      **options)
    return from_native(ids).reshape(*lead, k), from_native(logprobs).reshape(*lead, k)
