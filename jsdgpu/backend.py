"""The contract between the chunk engine (jsdgpu.engine, its losses) and a backend (jsdgpu.cpu, jsdgpu.cuda),
and the gradient sums that pass from forward to backward."""

import dataclasses
from typing import Any, ContextManager, Protocol


@dataclasses.dataclass
class HeldG:
    """G held for all rows: what backward needs to form grad_weight = inv_n (G.T @ Xs + the
    label terms) in one product, once it knows grad_output."""
    G: Any            # [rows, >= vocab] in the inputs' dtype, without 1/N
    vocab: int        # Vs: G's columns that are gradient
    xs: Any           # [rows, Hs]: the rows' student inputs
    inv_n: float      # 1/N
    label_terms: Any  # [rows] float32: the label terms kept out of G
    target: Any       # [rows] int32: the labels (-1: on another rank)
    g_scale: Any = None  # [rows] float32: G's row scales (Gradients.g_scale), None: 1


@dataclasses.dataclass
class Rows:
    """The rows a call computes, once known. Default: the valid rows (valid_rows their indices,
    None where every row is), gathered before the products, with their count; masked (a
    capturable call): every row, the ignored ones computed and then masked, nothing known on the
    host (count None, status: a device array of the valid rows' count and the first bad row)."""
    valid_rows: Any       # indices of the computed rows among the call's, or None: all of them
    target: Any           # [computed rows] int32; -1: no label here (on another rank, or ignored where masked)
    inv_n: Any            # 1/N: a float, or a 0-d float32 device array (masked)
    count: Any            # the valid rows' count, None where masked
    masked: bool = False
    status: Any = None
    leading: int = 0      # a default GPU call's: its first rows that are valid, all before its first ignored one
    weights: Any = None   # a default call's token weights, float32 [the call's rows] and checked (None: none)


@dataclasses.dataclass
class Gradients:
    """float32 sums of the gradient over the valid rows, before grad_output is applied."""
    grad_input: Any         # [Tv, Hs], the valid rows only
    grad_weight: Any        # [Vs, Hs], or None where held makes it
    grad_bias: Any          # [Vs] or None
    held: HeldG = None      # G of all rows, where grad_weight is None
    g_scale: Any = None     # [Tv] float32 where G is stored scaled (topk_scales_g): G's row i is
                            # g_scale[i] times its stored values


class Selection(Protocol):
    """The valid rows being selected (Backend.select_rows): where the backend queues ahead,
    rows, the valid rows' indices first, and row_target, their int32 targets (any prefix of
    either can be read on the device before wait()); wait(normalizer) gives the Rows, with 1/N =
    1 / normalizer(count), or raises the ValueError of a bad target."""
    rows: Any
    row_target: Any

    def wait(self, normalizer) -> Rows: ...


class Work(Protocol):
    """A call's buffers, made by Backend.prepare; fused is truthy where the backend's fused row
    kernel runs."""
    fused: Any


class CallSteps(Protocol):
    """The steps of a call that every loss takes, on one kind of array (NumPy or CuPy): the
    selection of the valid rows, the student's logits queued ahead, and the products and sums of
    the gradient. Common to the three parts of a backend: opts is a LossOptions; target the
    rows' int32 labels (-1 where the label is on another rank); ce, jsd, soft and label_terms
    per-row float32 outputs; G the rows' gradient w.r.t. the student logits, without the 1/N of
    the mean, or None for the loss alone; inv_n 1/N, a float or a 0-d device array; work what
    the loss's prepare made. Each part of both backends implements every method of its protocol
    with these parameters, and no other public one (tests/test_backend.py); a step a backend
    never takes raises NotImplementedError there."""
    xp: Any                     # the array module
    # whether a default call's first products run ahead of its selection, while the host waits
    # for it (ahead.queue_head): where the work is done as it is called, there is no wait to fill
    queues_ahead: bool

    def on_device(self, device) -> ContextManager: ...

    def default_budget(self, call_bytes):
        """The bytes of per-chunk buffers where the caller gives no memory_budget, for a call
        whose chunk buffers for all of its rows would take call_bytes (None: the largest call)."""

    def mark(self):
        """A point in the work queued so far (an event on the GPU, None on the CPU), for `after`."""

    def ahead_key(self, xs, ws):
        """Where the backend queues ahead: what a product of xs @ ws.T queued ahead of a call's
        checks depends on (ahead.FirstProduct), None where none may be queued now."""

    def logits_ahead(self, xs, ws, rows, head):
        """Where the backend queues ahead: a student logits' buffer for chunks of `rows` rows, with
        the products of xs's first `head` rows queued into it."""

    def select_rows(self, target, vocab, ignore_index, after=None, weights=None) -> Selection:
        """The rows whose target is not ignore_index, being selected; a target outside [0, vocab)
        that is not ignore_index makes wait() raise ValueError, and then so does a token weight
        (weights: the call's token_weights, or None) not finite or below 0. after: a mark; the
        selection then waits for the work queued before it, not for the work queued since (a
        head's products), and so does wait()."""

    def mark_rows(self, target, vocab, ignore_index, num_valid_tokens) -> Rows:
        """Every row, masked where ignored, with no host wait (a capturable call); a bad target
        makes 1/N NaN."""

    def take_rows(self, rows, a, b):
        """The given rows of a and of b."""

    def scale_cast(self, a, scale, dtype, out=None):
        """a * scale (scale None for 1) in dtype (into out, where given)."""

    def model_gradient(self, work, G, model, target, label_terms):
        """After the row work: G, the gradient in the student's logits as its model's (model: its
        (scale, cap)), to the gradient in its raw logits (times the scale and the cap's
        derivative), in place, with the rows' label terms at their labels."""

    def zero_masked_rows(self, G, target):
        """G's rows whose target is -1 zeroed (masked rows)."""

    def add_label_terms(self, work, label_terms, target, xs, inv_n, grads):
        """The label terms the row kernel kept out of G, added exactly."""

    def grad_products(self, work, G, xs, inv_n, grads, start, stop, input_made=False):
        """grad_input rows [start, stop), and the chunk's part of the grad_weight and grad_bias
        sums (the first chunk writes them, the others add); G's rows times grads.g_scale's, where
        it is stored scaled. input_made: those rows of grad_input hold input_product's G @ Ws,
        which is scaled here."""

    def input_product(self, work, G, out):
        """out = G @ Ws, unscaled (grad_products(input_made=True) scales it)."""

    def hold_g(self, work, G, xs, inv_n, label_terms, target, g_scale=None) -> HeldG:
        """What weight_product needs of G held for all rows (g_scale: Gradients.g_scale)."""

    def weight_product(self, held, scale, dtype, out=None):
        """grad_weight from held G, times scale (None for 1), in dtype (into out, where given)."""


class OnlineRowWork(Protocol):
    """The online loss's row work (jsdgpu.online): both models' logits a chunk, and the row
    kernels over them, fused or in three phases."""

    def bytes_per_row(self, vs, vt, dtype, compute_grad, fused):
        """(logits, G held for all rows, G per chunk) bytes per row."""

    def prepare(self, ws, wt, bs, bt, rows, fused, logits_s=None, models=None) -> Work:
        """The buffers for chunks of `rows` rows; logits_s: the student logits' buffer, where
        logits_ahead made it; models: LossOptions.models, where the logits are taken as the
        models' (by fused_rows, or by model_logits before the phases)."""

    def gradient_rows(self, work, g_rows, own_g):
        """G's memory for g_rows rows (own_g: apart from the logits, as G held for all rows)."""

    def g_row_layout(self, vs, dtype):
        """(columns, dtype) of a row of G of its own (gradient_rows' own_g) for weights of Vs rows
        in dtype."""

    def logits(self, work, xs, xt, at=0, student=True):
        """The student and teacher logits of the chunk's rows [at, at + len(xs)) into work (the
        teacher's alone where not student: the student's were queued ahead)."""

    def model_logits(self, work, rows, models):
        """The chunk's first `rows` rows of both logits as the models' (LossOptions.models: each
        model's scale times its biased logits, then soft-capped), in place, before the phases'
        row work (fused_rows makes them itself)."""

    def fused_rows(self, work, target, opts, ce, jsd, G, label_terms):
        """The whole row work in one kernel (where work.fused), on the models' logits where
        opts.models is not None (G then the gradient in the raw logits)."""

    def row_stats(self, work, target, opts):
        """Phase 1: stats [7, rows] (maxima and sums of exponentials of s, z and t; the label's
        logit)."""

    def row_kl(self, work, target, stats, opts):
        """Phase 2: kl [2, rows], the KL sums."""

    def row_finish(self, work, target, stats, kl, opts, ce, jsd, G, label_terms):
        """Phase 3: the rows' results and G."""


class TopKRowWork(Protocol):
    """The top-k loss's row work (jsdgpu.topk) and teacher_topk's: the top-k's checks, one head's
    logits, and the top-k row kernels."""

    def topk_check(self, ids, lq, vocab, bucket, capturable, after=None):
        """The checks of the teacher's top-k (checks.topk_problem's), started (after: as
        select_rows'); its wait(), after the selection's, raises checks.topk_error's ValueError
        for the first bad row."""

    def topk_own_product(self, opts, xs, ws, k, compute_grad):
        """Whether the top-k loss (k slots a row) takes the logits product of the backend's own,
        whose epilogue does the row kernel's streaming work (no [rows, V] float32 logits:
        topk_prepare's own)."""

    def topk_bytes_per_row(self, vs, dtype, compute_grad, own=False, k=None):
        """(logits, G held for all rows, G per chunk) bytes per row of the top-k loss (logits: the
        own product's per-row buffers for k slots where own)."""

    def topk_chunk_rows(self, own):
        """The most rows a chunk of the top-k loss takes (None: as many as the budget allows)."""

    def topk_prepare(self, ws, bs, rows, logits_s=None, own=False, k=None, model=None):
        """The buffers for chunks of `rows` rows of one head (the student's, or teacher_topk's
        teacher's): ws, and what the gradient steps above need of it (logits_s as prepare's); own:
        the own product's for k slots a row instead of the logits; model: its (scale, cap) where
        the logits are taken as the model's (topk_model_logits)."""

    def topk_model_logits(self, work, rows, model):
        """The chunk's first `rows` rows of the head's logits as its model's, in place."""

    def topk_gradient_rows(self, work, g_rows):
        """G's memory for g_rows rows, apart from the logits."""

    def head_logits(self, work, xs, at=0):
        """The logits of rows [at, at + len(xs)) of the chunk, of the head of topk_prepare (none
        with the own product: topk_own_logits makes what stands for them)."""

    def topk_own_logits(self, work, x, ids, lq, G):
        """With the own product only: the chunk's rows x through it, G~ into G and what topk_rows
        then needs into work's own buffers (ids and lq: the rows' slots; an id outside the
        vocabulary is left out)."""

    def topk_scales_g(self, opts, dtype):
        """Whether topk_rows takes g_scale for G in dtype under these LossOptions."""

    def topk_rows(self, work, ids, lq, target, opts, missing_mass, ce, soft, G, label_terms, g_scale=None, x=None):
        """The top-k row work: the rows' CE and soft part and, where G is not None, G (with
        g_scale, as its rows' scales times what is stored, into g_scale: topk_scales_g). x: the
        rows of the student's input (the own product's finishing kernel takes it, after
        topk_own_logits)."""

    def topk_rows_sharded(self, work, ids, lq, target, opts, missing_mass, shard, ce, soft, G, label_terms):
        """topk_rows under vocab parallelism (shard: this rank's parallel.Shard): the rows' CE and
        soft part, and this rank's columns of G (target: the labels as its columns, -1 where on
        another rank; jsdgpu.topk_shards)."""

    def teacher_topk_rows(self, work, rows, k, temperature, ids, logprobs):
        """The k largest logits of each of the chunk's first `rows` rows, by descending value, and
        their log-softmax at temperature, into ids and logprobs."""


class Backend(CallSteps, OnlineRowWork, TopKRowWork, Protocol):
    """A backend: its three parts (jsdgpu.cpu.backend.CpuBackend, jsdgpu.cuda.backend.CudaBackend)."""
