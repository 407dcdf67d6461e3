"""The public API: forward, backward and the loss object JSDDistillLoss (docs/contract.md, "API").

forward checks the options and arrays, picks the backend by the arrays' kind (NumPy: jsdgpu.cpu,
CuPy: jsdgpu.cuda; PyTorch or JAX tensors are viewed as one of those by their bridge), selects
the valid rows and runs the chunk engine (jsdgpu.engine) on the online loss (jsdgpu.online);
backward (jsdgpu.call) turns the gradient sums it left into the gradients.
"""

from . import checks, parallel
from .call import backward, bridged, call_loss
from .online import OnlineLoss
from .options import LossOptions, RunOptions, split_options


def forward(student_input, student_weight, teacher_input, teacher_weight, target,
            student_bias=None, teacher_bias=None, *, token_weights=None, **options):
    """Return (loss, ctx): loss is a 0-d float32 array of the inputs' kind; ctx.hard_loss and
    ctx.soft_loss are the unweighted, normalized parts.

    token_weights: None, or [T] floats, finite and >= 0: each row's hard and soft parts times its
    weight (N unchanged: a weighted mean takes num_valid_tokens = the weights' sum).
    options: the fields of jsdgpu.LossOptions (weight_hard_loss, weight_soft_loss, beta,
    temperature, ignore_index, the models' logit scales and soft caps) and of jsdgpu.RunOptions
    (chunk_size, memory_budget, compute_grad, grad_weight_float32, num_valid_tokens, reduction,
    vocab_parallel), with their defaults and meanings.
    """
    loss_opts, run_opts = split_options(options)
    return forward_with(student_input, student_weight, teacher_input, teacher_weight, target,
                        student_bias, teacher_bias, loss_opts, run_opts, token_weights)


def forward_with(student_input, student_weight, teacher_input, teacher_weight, target,
                 student_bias, teacher_bias, loss_opts, run_opts, token_weights=None, row_scales=None,
                 g_memory=None, weight_memory=None):
    """forward with its options as a LossOptions and a RunOptions. row_scales: the front ends'
    backward of reduction "none" (call.rows_own_backward): grad_output [T], a sum's rows' factors.
    g_memory: where a call of the rows' own losses keeps its gradients, the memory G is held in
    ([T, columns] of the backend's g_row_layout: a front end's buffer that carries it to backward,
    jsdgpu.jax). weight_memory: a function that returns float32 [Vs, Hs] (the backend's array),
    called where grad_weight is summed over the chunks (G not held) for the sum's memory: the
    buffer a front end then has backward write a float32 gradient into (its `out`), which takes no
    copy there (jsdgpu.torch's operators, jsdgpu.jax)."""
    arrays = dict(student_input=student_input, student_weight=student_weight,
                  teacher_input=teacher_input, teacher_weight=teacher_weight, target=target,
                  student_bias=student_bias, teacher_bias=teacher_bias, token_weights=token_weights,
                  row_scales=row_scales, g_memory=g_memory, weight_memory=weight_memory)
    return bridged(arrays, lambda native: _forward(native, loss_opts, run_opts))


def _forward(arrays, opts, run_opts):
    def loss_for(backend, capturable):
        xs, ws, xt, wt = (backend.xp.ascontiguousarray(arrays[k]) for k in ("student_input", "student_weight",
                                                                            "teacher_input", "teacher_weight"))
        shard = parallel.call_shard(run_opts.vocab_parallel, capturable, backend.xp, ws.shape[0], wt.shape[0])
        return (lambda call_opts: OnlineLoss(backend, ws, wt, arrays["student_bias"], arrays["teacher_bias"],
                                             arrays["target"], opts, call_opts, capturable, shard)), xs, xt
    return call_loss("online", arrays, opts, run_opts, checks.check_arrays, loss_for, _forward)


class JSDDistillLoss:
    """The loss with its options held: loss_fn = JSDDistillLoss(beta=0.5, temperature=2.0);
    loss, ctx = loss_fn(student_input, student_weight, teacher_input, teacher_weight, target).
    The options are checked here; loss_options and run_options hold them."""

    def __init__(self, **options):
        self.loss_options, self.run_options = split_options(options)

    def __call__(self, student_input, student_weight, teacher_input, teacher_weight, target,
                 student_bias=None, teacher_bias=None, *, token_weights=None):
        return forward_with(student_input, student_weight, teacher_input, teacher_weight, target,
                            student_bias, teacher_bias, self.loss_options, self.run_options, token_weights)

    backward = staticmethod(backward)

    def __repr__(self):
        return f"JSDDistillLoss({self.loss_options!r}, {self.run_options!r})"


__all__ = ["forward", "backward", "JSDDistillLoss", "LossOptions", "RunOptions"]
