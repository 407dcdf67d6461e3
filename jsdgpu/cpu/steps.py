"""The CPU backend's steps that every loss takes (jsdgpu.backend.CallSteps) over NumPy arrays:
the selection of the valid rows, and the gradient's float32 products and sums. The CPU's work is
done as it is called: nothing is queued ahead."""

import numpy as np

from .. import checks
from ..backend import HeldG, Rows
from ..options import divisor
from .fastmath import LINE
from .products import add_product, matmul, own_threads
from .rows import model_derivative


def row_buffer(rows, columns):
    """An empty float32 [rows, columns] array for a chunk's logits, its first value at a multiple
    of 64 bytes (and each row's where columns is a multiple of 16): NumPy puts a large array 16
    bytes past one, and there half or more of the kernels' 512-bit loads and stores cross two
    cache lines: the fused row kernel took 1-5% longer so (`python experiments/cpu_row_kernel.py
    --placements`; docs/design.md, "The CPU backend")."""
    buffer = np.empty(rows * columns + LINE, np.float32)
    start = -(buffer.ctypes.data // 4) % LINE
    return buffer[start:start + rows * columns].reshape(rows, columns)


def f32(a):
    """a as float32 (no copy where it is), None for None."""
    return None if a is None else a.astype(np.float32, copy=False)


class Selection:
    """The valid rows, selected on the host at once (nothing to overlap, and no head queued ahead
    of it: CpuBackend.queues_ahead)."""

    def __init__(self, target, vocab, ignore_index, weights):
        self._valid = checks.check_target(target, vocab, ignore_index)
        self._target = target
        self._weights = None if weights is None else np.ascontiguousarray(weights, dtype=np.float32)
        if self._weights is not None:
            bad = np.flatnonzero(~checks.good_weights(np, self._weights))
            if len(bad):
                raise checks.weight_error(int(bad[0]), float(self._weights[bad[0]]))

    def wait(self, normalizer):
        n, valid = len(self._target), self._valid
        count = len(valid)
        return Rows(None if count == n else valid, self._target[valid].astype(np.int32), 1.0 / normalizer(count),
                    count, weights=self._weights)


# bytes of the block a chunk's part of grad_weight is formed in, some rows of the vocabulary at a
# time (CpuSteps.grad_products): 4096 rows at H = 256, a few percent of the step's memory at
# V = 128256, where 16384 rows (16 MiB) were a tenth of it, at no cost beyond the runs' noise
# (docs/design.md, "The CPU backend")
PART_BYTES = 4 << 20
# the default memory budget's bounds (CpuSteps.default_budget)
BUDGET_LEAST, BUDGET_MOST = 32 << 20, 192 << 20


class CpuSteps:
    """The steps of a call that every loss takes; static methods, as every part of the backend."""
    xp = np
    # No head ahead of the selection: nothing runs meanwhile, and NumPy's float32 products give a
    # row different last bits in products of different row counts, so a head sized by the last
    # call would make a call's bits depend on the calls before it
    queues_ahead = False

    @staticmethod
    def default_budget(call_bytes):
        """A sixteenth of the call's chunk buffers for all of its rows, from 32 to 192 MiB: the
        memory grows with the call as the logits it replaces do, so that at every shape of
        bench/bench_cpu.py it is under a tenth of compiled PyTorch's, whose float32 grad_weight
        alone takes three quarters of that tenth at T = 512, V = 128256, H = 256; 192 MiB, where
        the speed is, from T = 3140 there (docs/design.md, "The CPU backend"). call_bytes None
        (a call of the rows' own losses: options.RunOptions.budget): 192 MiB."""
        return BUDGET_MOST if call_bytes is None else min(BUDGET_MOST, max(BUDGET_LEAST, call_bytes // 16))

    @staticmethod
    def on_device(device):
        """A call's work: where its row kernels run in parallel, its products on threads of our
        own, not OpenBLAS's (products.own_threads)."""
        return own_threads()

    @staticmethod
    def select_rows(target, vocab, ignore_index, after=None, weights=None):
        """The rows whose target is not ignore_index; checks.target_error's ValueError for a bad
        target, then checks.weight_error's for a bad token weight."""
        return Selection(target, vocab, ignore_index, weights)

    @staticmethod
    def mark():
        """Nothing to wait for: the CPU's work is done as it is called."""
        return None

    @staticmethod
    def ahead_key(xs, ws):
        """None: nothing is queued ahead here (queues_ahead)."""
        return None

    @staticmethod
    def logits_ahead(xs, ws, rows, head):
        raise NotImplementedError("the CPU backend queues nothing ahead (its ahead_key is None)")

    @staticmethod
    def mark_rows(target, vocab, ignore_index, num_valid_tokens):
        """Every row, the ignored ones (and any bad one) masked with target -1, as a capturable
        call on the GPU computes them: a bad target makes 1/N NaN (status: the count, the first
        bad row, len(target) where none)."""
        valid, bad = checks.target_masks(target, vocab, ignore_index)
        first_bad = int(np.flatnonzero(bad)[0]) if bad.any() else len(target)
        count = int(valid.sum())
        inv_n = float("nan") if bad.any() else 1.0 / divisor(num_valid_tokens, count)
        row_target = np.where(valid, np.asarray(target, np.int64), -1).astype(np.int32)
        return Rows(None, row_target, inv_n, None, masked=True, status=np.array([count, first_bad], np.int32))

    @staticmethod
    def take_rows(rows, a, b):
        """The given rows of a and of b."""
        return a[rows], b[rows]

    @staticmethod
    def scale_cast(a, scale, dtype, out=None):
        """a * scale (a float32 array of ours, scale None for 1) as dtype (into out, where given)."""
        if scale is not None:
            a *= scale
        if out is None:
            return a.astype(dtype, copy=False)
        if out.ctypes.data != a.ctypes.data:  # (a in out's memory: api.forward_with's weight_memory)
            out[...] = a
        return out

    @staticmethod
    def model_gradient(work, G, model, target, label_terms):
        """G, the chunk's gradient in the student's logits as its model's (model: its (scale, cap);
        model_logits' logits there), to the gradient in its raw logits, in place, with the rows'
        label terms (None: none) at their labels (target >= 0)."""
        scale, cap = model
        if cap is None:  # the scale alone: one factor for every column
            G *= np.float32(scale)
            if label_terms is not None:
                label_terms *= np.float32(scale)
            return
        factor = model_derivative(work.s[:len(G)], np.float32(scale), np.float32(1.0 / cap))
        G *= factor
        if label_terms is not None:
            owned = np.flatnonzero(target >= 0)
            label_terms[owned] *= factor[owned, target[owned]]

    @staticmethod
    def zero_masked_rows(G, target):
        G[target < 0] = 0.0

    @staticmethod
    def grad_products(work, G, xs, inv_n, grads, start, stop, input_made=False):
        """The chunk's rows of grad_input, and its parts of grad_weight (where G is not held) and
        grad_bias, 1/N applied, into the sums and one block buffer made once a call: a fresh
        [V, H] product a chunk (its pages faulted in anew) and its scaled copy took 0.5 s of a
        1.4 s step at T = 512, V = 128256, and held the sum's memory twice (docs/design.md, "The
        CPU backend")."""
        inv_n = np.float32(inv_n)
        grad_input = grads.grad_input[start:stop]
        if not input_made:
            matmul(G, work.ws, grad_input)
        # G's row scales (the token weights) go with the rows of grad_input and of Xs
        rows = inv_n if grads.g_scale is None else grads.g_scale[start:stop, None] * inv_n
        grad_input *= rows
        if grads.grad_weight is not None:  # else weight_product makes it
            # 1/N on the chunk's inputs, which are small ([rows, H]): the first chunk writes, the
            # others add their product, by sgemm's beta 1 where NumPy's BLAS runs the call's
            # products (add_product), else PARTs of the vocabulary's rows at a time (a [V, H]
            # product would hold the sum's memory twice)
            xs_n = xs.astype(np.float32) * rows
            if start == 0:
                matmul(G.T, xs_n, grads.grad_weight)
            elif not add_product(G.T, xs_n, grads.grad_weight):
                if work.part is None:
                    block = max(1, PART_BYTES // (4 * xs.shape[1]))
                    work.part = np.empty((min(block, G.shape[1]), xs.shape[1]), np.float32)
                block = len(work.part)
                for v0 in range(0, G.shape[1], block):
                    part = work.part[:min(block, G.shape[1] - v0)]
                    matmul(G[:, v0:v0 + len(part)].T, xs_n, part)
                    grads.grad_weight[v0:v0 + len(part)] += part
        if grads.grad_bias is not None:
            part = G.sum(axis=0) if grads.g_scale is None else grads.g_scale[start:stop] @ G
            if start == 0:
                np.multiply(part, inv_n, out=grads.grad_bias)
            else:
                grads.grad_bias += part * inv_n

    @staticmethod
    def input_product(work, G, out):
        matmul(G, work.ws, out)

    @staticmethod
    def add_label_terms(work, label_terms, target, xs, inv_n, grads):
        """The label terms the row kernel left out of G, added exactly, for the rows whose label
        this rank owns (target >= 0; np.add.at adds in row order, so the result does not vary)."""
        owned, labels, terms = _owned_label_terms(label_terms, target, np.float32(inv_n))
        grads.grad_input[owned] += terms[:, None] * work.ws[labels]
        if grads.grad_weight is not None:
            _add_label_rows(grads.grad_weight, owned, labels, terms, xs)
        if grads.grad_bias is not None:
            np.add.at(grads.grad_bias, labels, terms)

    @staticmethod
    def hold_g(work, G, xs, inv_n, label_terms, target, g_scale=None):
        return HeldG(G, work.ws.shape[0], xs, inv_n, label_terms, target, g_scale)

    @staticmethod
    def weight_product(held, scale, dtype, out=None):
        """grad_weight = inv_n scale (G.T @ Xs + the label terms) in dtype, from G over all rows
        (scale None for 1): summed in float32, rounded once."""
        xs = held.xs
        xs_g = xs.astype(np.float32) if held.g_scale is None else xs.astype(np.float32) * held.g_scale[:, None]
        product = matmul(held.G.T, xs_g, np.empty((held.G.shape[1], xs_g.shape[1]), np.float32))
        _add_label_rows(product, *_owned_label_terms(held.label_terms, held.target, np.float32(1.0)), xs)
        product *= np.float32(held.inv_n) if scale is None else np.float32(held.inv_n) * scale
        if out is None:
            return product.astype(dtype, copy=False)
        out[...] = product
        return out


def as_model_logits(z, scale, cap):
    """z (float32 logits) as a model's, in place: scale z, then cap tanh(z / cap) where cap is not
    None."""
    if cap is None:
        z *= np.float32(scale)
        return
    z *= np.float32(scale / cap)  # in place, no copy of the chunk's logits
    np.tanh(z, out=z)
    z *= np.float32(cap)


def _owned_label_terms(label_terms, target, k):
    """(rows, labels, terms): the rows whose label this rank owns (target >= 0), their labels,
    and k times their label terms."""
    owned = np.flatnonzero(target >= 0)
    return owned, target[owned], label_terms[owned] * k


def _add_label_rows(grad_weight, owned, labels, terms, xs):
    """grad_weight[labels[j]] += terms[j] xs[owned[j]]; np.add.at adds in row order, so the
    result does not vary."""
    np.add.at(grad_weight, labels, terms[:, None] * xs[owned].astype(np.float32))
