"""The options of a call, each stated once with its default and its check.

LossOptions holds what the loss computes (docs/contract.md, "Forward"); RunOptions how a call
runs it (chunking, memory, gradients, the normaliser, vocab parallelism). The API, the front ends,
the reference and the benchmark all build from these two.
"""

import dataclasses
import enum
import functools
import math
import numbers

import numpy as np


class Divergence(enum.IntEnum):
    """The soft part's form, by beta; the codes are the row kernels' mode argument."""
    FORWARD_KL = 0  # beta == 0: KL(q || p)
    JSD = 1         # 0 < beta < 1: the generalized Jensen-Shannon divergence
    REVERSE_KL = 2  # beta == 1: KL(p || q)


def _real(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _integer(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    return int(value)


def _positive_integer_or_none(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer or None, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value}")
    return int(value)


def _flag(name, value, none_allowed=False):
    if value is None and none_allowed:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False{' or None' if none_allowed else ''}, got {value!r}")
    return bool(value)


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """loss = weight_hard_loss * hard_loss + weight_soft_loss * soft_loss; the soft part's
    divergence by beta, on logits divided by temperature; rows whose target is ignore_index count
    for nothing. Each model's logits are z = scale (x @ W.T + b), then, where a soft cap c is
    given, c tanh(z / c) (Gemma's final_logit_softcapping, Cohere's logit_scale). Checked on
    construction (TypeError or ValueError naming the option)."""
    weight_hard_loss: float = 0.5
    weight_soft_loss: float = 0.5
    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    student_logit_scale: float = 1.0
    teacher_logit_scale: float = 1.0
    student_logit_softcap: float = None
    teacher_logit_softcap: float = None

    def __post_init__(self):
        for name in ("weight_hard_loss", "weight_soft_loss", "beta", "temperature"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must lie in [0, 1], got {self.beta}")
        if self.temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        object.__setattr__(self, "ignore_index", _integer("ignore_index", self.ignore_index))
        for who in ("student", "teacher"):
            scale = _real(f"{who}_logit_scale", getattr(self, f"{who}_logit_scale"))
            if scale <= 0.0:
                raise ValueError(f"{who}_logit_scale must be > 0, got {scale}")
            object.__setattr__(self, f"{who}_logit_scale", scale)
            cap = getattr(self, f"{who}_logit_softcap")
            if cap is not None:
                cap = _real(f"{who}_logit_softcap", cap)
                if cap <= 0.0:
                    raise ValueError(f"{who}_logit_softcap must be > 0 or None, got {cap}")
                object.__setattr__(self, f"{who}_logit_softcap", cap)

    @property
    def models(self):
        """((scale, cap) of the student, of the teacher), or None where both are the plain logits
        (scale 1, no cap): what the row work applies to the chunk's logits first."""
        models = ((self.student_logit_scale, self.student_logit_softcap),
                  (self.teacher_logit_scale, self.teacher_logit_softcap))
        return None if models == ((1.0, None), (1.0, None)) else models

    @property
    def divergence(self):
        if self.beta == 0.0:
            return Divergence.FORWARD_KL
        return Divergence.REVERSE_KL if self.beta == 1.0 else Divergence.JSD

    @property
    def one_minus_beta(self):
        """1 - beta in float64 (the kernels take it apart from beta: float32 holds a beta near 1
        only to about 3e-8, a few percent of 1 - beta at beta = 1 - 1e-6)."""
        return 1.0 - self.beta

    @property
    def w_soft_over_t(self):
        """weight_soft_loss / temperature: the soft part's factor in the gradient (its logits
        are divided by the temperature)."""
        return self.weight_soft_loss / self.temperature


MISSING_MASS = ("bucket", "renormalize")
REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class TopKOptions(LossOptions):
    """The top-k loss's LossOptions (jsdgpu.forward_topk), and missing_mass: "bucket" (the
    teacher's and the student's mass outside the k ids as one more category) or "renormalize"
    (both renormalized over the k ids)."""
    missing_mass: str = "bucket"

    def __post_init__(self):
        super().__post_init__()
        if (self.teacher_logit_scale, self.teacher_logit_softcap) != (1.0, None):
            raise ValueError("teacher_logit_scale and teacher_logit_softcap have no meaning for the top-k loss: the "
                             "stored log-probabilities are the teacher's (give them to teacher_topk)")
        if self.missing_mass not in MISSING_MASS:
            raise ValueError(f"missing_mass must be one of {', '.join(map(repr, MISSING_MASS))}, "
                             f"got {self.missing_mass!r}")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a call runs.

    chunk_size: token rows per chunk; None picks the most that fit memory_budget bytes of
    per-chunk buffers (the backend's default budget where memory_budget is None).
    compute_grad=False computes the loss only. grad_weight_float32: backward returns grad_weight
    (and grad_bias) in float32, as accumulated, instead of the student's dtype.
    num_valid_tokens: the N that the summed row losses are divided by, in place of this call's
    count of valid rows (give every part of a batch the whole batch's count, and the parts add
    up to the whole). reduction: "mean" (the summed row losses over N), "sum" (not divided: N =
    1, with no num_valid_tokens) or "none" (each row's own loss, an array [T]). vocab_parallel:
    a communicator over ranks that each hold a shard of the vocabulary (jsdgpu.parallel).
    capturable: no host synchronization anywhere in forward and backward, so that a CUDA graph
    can capture them (every row computed, the ignored ones masked; a bad target gives a NaN loss
    and ctx.bad_target_row, not ValueError); None: while the current stream is capturing.
    """
    chunk_size: int = None
    memory_budget: int = None
    compute_grad: bool = True
    grad_weight_float32: bool = False
    num_valid_tokens: float = None
    vocab_parallel: object = None
    capturable: bool = None
    reduction: str = "mean"

    def __post_init__(self):
        object.__setattr__(self, "chunk_size", _positive_integer_or_none("chunk_size", self.chunk_size))
        # bytes (a budget of 0 or less has no meaning: it had been taken as 1 byte)
        object.__setattr__(self, "memory_budget", _positive_integer_or_none("memory_budget", self.memory_budget))
        if self.num_valid_tokens is not None:
            n = _real("num_valid_tokens", self.num_valid_tokens)
            if n <= 0.0:
                raise ValueError(f"num_valid_tokens must be > 0, got {n}")
            object.__setattr__(self, "num_valid_tokens", n)
        object.__setattr__(self, "compute_grad", _flag("compute_grad", self.compute_grad))
        object.__setattr__(self, "grad_weight_float32", _flag("grad_weight_float32", self.grad_weight_float32))
        object.__setattr__(self, "capturable", _flag("capturable", self.capturable, none_allowed=True))
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {self.reduction!r}")
        if self.reduction != "mean" and self.num_valid_tokens is not None:
            raise ValueError(f"num_valid_tokens divides a mean: it has no meaning with reduction={self.reduction!r}")

    @property
    def rows_own(self):
        """Whether a call computes the rows' own losses (reduction "none") with gradients: its
        backward's grad_output is [T], known only there."""
        return self.reduction == "none" and self.compute_grad

    @property
    def given_divisor(self):
        """N where the call does not count it: num_valid_tokens, 1 where nothing is divided (a sum,
        the rows' own losses); None (the valid rows' count)."""
        return self.num_valid_tokens if self.reduction == "mean" else 1.0

    def normalizer(self, n_valid):
        """N, the divisor of the summed row losses (divisor)."""
        return divisor(self.given_divisor, n_valid)

    def budget(self, backend, call_bytes):
        """The bytes of per-chunk buffers: memory_budget, or the backend's default for a call
        whose chunk buffers for all of its rows would take call_bytes; a call of the rows' own
        losses takes the default of the largest call, where G held for all of its rows spares
        computing the call again in backward (about 1.6 times the step: docs/design.md, "Token
        weights and the sum")."""
        return backend_budget(self.memory_budget, backend, None if self.rows_own else call_bytes)


def backend_budget(memory_budget, backend, call_bytes):
    """memory_budget, or where it is None the backend's default for a call whose chunk buffers
    for all of its rows would take call_bytes (None: the largest call's): the one place it is
    resolved."""
    return backend.default_budget(call_bytes) if memory_budget is None else memory_budget


def divisor(num_valid_tokens, n_valid):
    """N, the divisor of the summed row losses: num_valid_tokens where given, else max(1, n_valid)
    (the capturable GPU call forms it on the device: targets.cu, mark_rows)."""
    return float(max(1, n_valid)) if num_valid_tokens is None else float(num_valid_tokens)


@functools.lru_cache(maxsize=None)
def field_names(options_class):
    """The option names of an options class (LossOptions, TopKOptions, RunOptions)."""
    return tuple(f.name for f in dataclasses.fields(options_class))


RUN_FIELDS = field_names(RunOptions)
DEFAULTS = LossOptions()  # the defaults, for signatures that must spell them out (Liger's)


def split_options(options, loss=LossOptions):
    """(loss's options, RunOptions) from keyword options, loss LossOptions or TopKOptions;
    TypeError for an unknown one. The same options (values of the same types) give the same,
    checked once: the checks took a tenth of a call's host time before its first product
    (docs/design.md, "The host before the first product")."""
    try:
        return _split_once(tuple((k, type(v), v) for k, v in options.items()), loss)
    except TypeError:  # an unhashable value (or a bad one: raised again below)
        return _split(options, loss)


@functools.lru_cache(maxsize=64)
def _split_once(items, loss):
    return _split({k: v for k, _, v in items}, loss)


def _split(options, loss):
    fields = field_names(loss)
    unknown = set(options) - set(fields) - set(RUN_FIELDS)
    if unknown:
        raise TypeError(f"unknown options: {', '.join(sorted(unknown))}")
    return (loss(**{k: v for k, v in options.items() if k in fields}),
            RunOptions(**{k: v for k, v in options.items() if k in RUN_FIELDS}))
