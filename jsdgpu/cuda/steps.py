"""The GPU backend's steps that every loss takes (jsdgpu.backend.CallSteps) over CuPy arrays:
the selection of the valid rows, the student's logits queued ahead, and the gradient's products
and sums (products.py's products, kernels.py's small kernels). Everything is queued on CuPy's
current stream; nothing in the chunk loop waits for the GPU, but the first product of each shape
class in a process, which times cuBLASLt's candidate algorithms (products.py)."""

import cupy
import numpy as np

from .. import checks
from ..backend import HeldG, Rows
from . import kernels, products


def leading_dim(n):
    """Row pitch in elements: a multiple of 32, so every row starts 128-byte aligned."""
    return -(-n // 32) * 32


class Selection:
    """The valid rows of a default call: select_rows launched (kernels.PendingSelection); rows:
    their indices, and row_target their targets, any prefix of which can be read on the device
    before wait(), the call's one wait for the GPU, gives the Rows."""

    def __init__(self, target, vocab, ignore_index, after, weights):
        self._target, self._vocab, self._ignore_index = target, vocab, ignore_index
        self._pending = kernels.PendingSelection(target, vocab, ignore_index, after, weights)
        self.rows, self.row_target = self._pending.rows, self._pending.row_target

    def wait(self, normalizer):
        """The Rows (normalizer(count): N); raises checks.target_error's ValueError for a bad
        target, then checks.weight_error's for a bad token weight."""
        n, weights = len(self._target), self._pending.weights
        count, first_bad, first_ignored, first_bad_weight = self._pending.wait()
        if first_bad < n:
            raise checks.target_error(first_bad, int(self._target[first_bad]), self._vocab, self._ignore_index)
        if first_bad_weight < n:
            raise checks.weight_error(first_bad_weight, float(weights[first_bad_weight]))
        valid_rows = None if count == n else self.rows[:count]
        return Rows(valid_rows, self._pending.row_target[:count], 1.0 / normalizer(count), count,
                    leading=first_ignored, weights=weights)


def _device_scalar(x):
    """x (a float, or a 0-d float32 device array) as a 0-d float32 device array."""
    return x if isinstance(x, cupy.ndarray) else cupy.full((), x, np.float32)


def padded_bias(b, v):
    """A bias as float32, padded with zeros to leading_dim(v) (None without one)."""
    if b is None:
        return None
    out = cupy.zeros(leading_dim(v), np.float32)
    out[:v] = b
    return out


class CudaSteps:
    """The steps of a call that every loss takes (the products and sums of the gradient, the
    selection); static methods, as every part of the backend."""
    xp = cupy
    queues_ahead = True

    @staticmethod
    def default_budget(call_bytes):
        return 5 * 2**29  # 2.5 GiB, whatever the call: T = 8192 at V = 128256 in 4 chunks

    @staticmethod
    def on_device(device):
        return cupy.cuda.Device(device)

    @staticmethod
    def select_rows(target, vocab, ignore_index, after=None, weights=None):
        """The valid rows, by one kernel whose results the host reads once it has run (Selection);
        with `after` (mark's), beside the stream's work since (kernels.beside). (Reading all the
        targets, checking and selecting them on the host, copying the selection back and gathering
        the rows by CuPy took 0.15-0.25 ms more a step at T = 1024 with half of the rows ignored:
        docs/design.md, "Ignored rows".)"""
        return Selection(target, vocab, ignore_index, after, weights)

    mark = staticmethod(kernels.mark)

    @staticmethod
    def mark_rows(target, vocab, ignore_index, num_valid_tokens):
        """Every row, the ignored ones masked, with nothing read by the host (a capturable call):
        the Rows, with 1/N on the device (NaN where a target is bad) and the status of
        kernels.mark_rows."""
        row_target, status, inv_n = kernels.mark_rows(target, vocab, ignore_index, num_valid_tokens)
        return Rows(None, row_target, inv_n, None, masked=True, status=status)

    take_rows = staticmethod(kernels.gather_rows)

    @staticmethod
    def scale_cast(a, scale, dtype, out=None):
        """a * scale (a float32 array of ours, scale None for 1) as dtype, in one pass (into out,
        where given)."""
        if np.dtype(dtype) != np.float32:
            return kernels.scale_cast(a, scale, dtype, out)
        if scale is not None:
            a *= scale
        if out is None:
            return a
        if out.data.ptr != a.data.ptr:  # (a in out's memory: api.forward_with's weight_memory)
            cupy.copyto(out, a)
        return out

    @staticmethod
    def ahead_key(xs, ws):
        """What queueing xs @ ws.T ahead of a call's checks depends on (ahead.FirstProduct): both
        CuPy arrays, C-contiguous (the product reads them as they are), their shapes, dtypes and
        strides, on the current device, with the current stream not capturing (a capture takes
        the capturable path, which queues nothing ahead); None where that is not so."""
        if (type(xs) is not cupy.ndarray or type(ws) is not cupy.ndarray or not xs.flags.c_contiguous
                or not ws.flags.c_contiguous):
            return None
        device = xs.data.device_id
        if device != cupy.cuda.runtime.getDevice() or cupy.cuda.get_current_stream().is_capturing():
            return None
        return xs.shape, xs.dtype, xs.strides, ws.shape, ws.dtype, ws.strides, ws.data.device_id, device

    @staticmethod
    def logits_ahead(xs, ws, rows, head):
        """The student logits' buffer for chunks of `rows` rows, with the products of xs's first
        head rows queued into it."""
        logits = cupy.empty((rows, leading_dim(ws.shape[0])), np.float32)
        # no slice where the head is all of an array: each took 2-4 µs of this host time
        products.logits(xs if head == len(xs) else xs[:head], ws, logits if head == rows else logits[:head])
        return logits

    @staticmethod
    def model_gradient(work, G, model, target, label_terms):
        """G, the chunk's gradient in the student's logits as its model's (model: its (scale, cap);
        model_logits' logits there), to the gradient in its raw logits, in place, with the rows'
        label terms (None: none) at their labels (target >= 0)."""
        kernels.model_gradient(G, work.logits_s, work.ws.shape[0], *model, target, label_terms)

    @staticmethod
    def zero_masked_rows(G, target):
        """G's rows whose target is -1 zeroed (a capturable call's ignored rows)."""
        kernels.zero_rows(target, G)

    @staticmethod
    def add_label_terms(work, label_terms, target, xs, inv_n, grads):
        """The label terms the row kernel left out of G, added exactly in float32 for the rows
        whose label this rank owns (target >= 0; label_terms is 0 elsewhere): to grad_input, and
        to the grad_weight sums (where there are) and grad_bias."""
        inv_n = _device_scalar(inv_n)
        kernels.label_rows(label_terms, target, work.ws, inv_n, grads.grad_input)
        if grads.grad_weight is not None or grads.grad_bias is not None:
            kernels.label_scatter(label_terms, target, xs, inv_n, None, grads.grad_weight, grads.grad_bias)

    @staticmethod
    def grad_products(work, G, xs, inv_n, grads, start, stop, input_made=False):
        """grad_input rows, and the chunk's part of the grad_weight and grad_bias sums (where
        grad_weight is None, weight_product makes it later)."""
        vs = work.ws.shape[0]
        accumulate = 0.0 if start == 0 else 1.0
        grad_input = grads.grad_input[start:stop]
        if not input_made:
            products.input_gradient(G, work.ws, inv_n, grad_input)
        ones = work.ones[:stop - start] if grads.grad_bias is not None else None
        if grads.g_scale is not None:  # G's rows are scaled: grad_input's rows, and the rows G's sums take
            scale = grads.g_scale[start:stop]
            grad_input *= (scale * inv_n if input_made else scale)[:, None]
            if grads.grad_weight is not None:
                xs = kernels.scale_rows(xs, scale)
            if ones is not None:  # (not scale_cast: a chunk's slice of the scales need not be 16-byte aligned)
                ones = scale.astype(ones.dtype)
        elif input_made:
            grad_input *= inv_n
        if grads.grad_weight is not None:
            products.weight_gradient(G, vs, xs, inv_n, accumulate, grads.grad_weight)
        if ones is not None:
            products.bias_gradient(G, vs, ones, inv_n, accumulate, grads.grad_bias)

    @staticmethod
    def input_product(work, G, out):
        products.input_gradient(G, work.ws, 1.0, out)

    @staticmethod
    def hold_g(work, G, xs, inv_n, label_terms, target, g_scale=None):
        """What weight_product needs of G held for all rows (work's logits are not kept)."""
        return HeldG(G, work.ws.shape[0], xs, inv_n, label_terms, target, g_scale)

    @staticmethod
    def weight_product(held, scale, dtype, out=None):
        """grad_weight = inv_n scale (G.T @ Xs + the label terms), G over all rows; scale: a 0-d
        float32 device array, or None for 1. The product is written in dtype by cuBLAS; in 16
        bits, the rows of labels kept out of G are rounded twice (the product, then with the
        label terms added), the others once. Into out, where given."""
        out = cupy.empty((held.vocab, held.xs.shape[1]), dtype) if out is None else out
        inv_n = _device_scalar(held.inv_n)
        alpha = held.inv_n if scale is None else scale * inv_n
        # G's row scales go with the rows of Xs here, not in forward: a forward may never be backpropagated
        xs_g = held.xs if held.g_scale is None else kernels.scale_rows(held.xs, held.g_scale)
        products.weight_gradient(held.G, held.vocab, xs_g, alpha, 0.0, out)
        kernels.label_scatter(held.label_terms, held.target, held.xs, inv_n, scale, out, None)
        return out
