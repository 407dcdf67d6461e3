"""CPU backend: NumPy float32 matrix products and a Numba row kernel, parallel over rows.

The row kernel keeps its sums in float64 (cheap on a CPU); it follows the same three passes as
the CUDA kernel in rows.cu: the row statistics, the JSD sums, then the gradient row.
"""

import contextlib
import math

import numba
import numpy as np

from ._driver import FORWARD_KL, JSD


@numba.njit(parallel=True, cache=True)
def _rows_kernel(s, t, target, mode, beta, inv_temp, w_hard, w_soft_t, ce, jsd, G, label_terms,
                 write_grad):
    n, vs = s.shape
    vt = t.shape[1]
    for i in numba.prange(n):
        # 1. statistics: the logsumexp of s, of z = s / temperature padded with zeros to vt,
        #    and of t / temperature
        ms = -np.inf
        for j in range(vs):
            ms = max(ms, s[i, j])
        mt = -np.inf
        for j in range(vt):
            mt = max(mt, t[i, j])
        mz = ms * inv_temp
        if vt > vs:
            mz = max(mz, 0.0)
        mt = mt * inv_temp
        sum_s = 0.0
        sum_z = (vt - vs) * math.exp(-mz)
        for j in range(vs):
            x = np.float64(s[i, j])
            sum_s += math.exp(x - ms)
            sum_z += math.exp(x * inv_temp - mz)
        sum_t = 0.0
        for j in range(vt):
            sum_t += math.exp(t[i, j] * inv_temp - mt)
        lse_s = ms + math.log(sum_s)
        lse_z = mz + math.log(sum_z)
        lse_t = mt + math.log(sum_t)
        ce[i] = lse_s - s[i, target[i]]

        # 2. a = sum p (log p - log m), b = sum q (log q - log m), with m = p (beta = 1) or
        #    m = p (beta = 0, then a stays 0) or the mixture
        a = 0.0
        b = 0.0
        for j in range(vt):
            lp = (s[i, j] * inv_temp if j < vs else 0.0) - lse_z
            lq = t[i, j] * inv_temp - lse_t
            p = math.exp(lp)
            q = math.exp(lq)
            if mode == FORWARD_KL:
                lm = lp
            elif mode == JSD:
                lm = math.log((1.0 - beta) * p + beta * q)
            else:
                lm = lq
            if p != 0.0:  # 0 log 0 = 0; "!= 0" so that a NaN reaches the loss
                a += p * (lp - lm)
            if q != 0.0:
                b += q * (lq - lm)
        if mode == FORWARD_KL:
            jsd[i] = b
        elif mode == JSD:
            jsd[i] = beta * b + (1.0 - beta) * a
        else:
            jsd[i] = a

        # 3. the gradient row, without the 1/N of the mean; the label's one-hot term apart where
        #    it dominates (as rows.cu does, where G is 16-bit)
        if write_grad:
            label_apart = math.exp(s[i, target[i]] - lse_s) < 0.5
            label_terms[i] = -w_hard if label_apart else 0.0
            for j in range(vs):
                x = np.float64(s[i, j])
                lp = x * inv_temp - lse_z
                lq = t[i, j] * inv_temp - lse_t
                p = math.exp(lp)
                q = math.exp(lq)
                if mode == FORWARD_KL:
                    dz = p - q
                elif mode == JSD:
                    lm = math.log((1.0 - beta) * p + beta * q)
                    dz = (1.0 - beta) * p * (lp - lm - a)
                else:
                    dz = p * (lp - lq - a)
                hard = math.exp(x - lse_s) - (1.0 if j == target[i] and not label_apart else 0.0)
                G[i, j] = w_hard * hard + w_soft_t * dz


class NumpyBackend:
    xp = np
    default_memory_budget = 256 * 2**20

    @staticmethod
    def on_device(device):
        return contextlib.nullcontext()

    @staticmethod
    def scale_cast(a, scale, dtype):
        """a * scale (a float32 array of ours, scale None for 1) as dtype."""
        if scale is not None:
            a *= scale
        return a.astype(dtype, copy=False)

    @staticmethod
    def bytes_per_row(vs, vt, dtype, compute_grad):
        return 4 * (vs + vt) + (4 * vs if compute_grad else 0)

    @staticmethod
    def prepare(ws, wt, bs, bt, rows, compute_grad):
        f32 = lambda a: None if a is None else a.astype(np.float32, copy=False)
        return dict(ws=f32(ws), wt=f32(wt), bs=f32(bs), bt=f32(bt))

    @staticmethod
    def chunk(work, xs, xt, target, opts, ce, jsd, label_terms):
        s = xs.astype(np.float32) @ work["ws"].T
        t = xt.astype(np.float32) @ work["wt"].T
        if work["bs"] is not None:
            s += work["bs"]
        if work["bt"] is not None:
            t += work["bt"]
        compute_grad = label_terms is not None
        # without gradients, G and label_terms are placeholders of the types Numba compiled
        # for (one compiled kernel); the kernel does not touch them
        G = np.empty(s.shape if compute_grad else (0, 0), np.float32)
        _rows_kernel(s, t, target, opts.mode, opts.beta, 1.0 / opts.temperature,
                     opts.weight_hard_loss, opts.weight_soft_loss / opts.temperature,
                     ce, jsd, G, label_terms if compute_grad else ce, compute_grad)
        return G

    @staticmethod
    def grad_products(work, G, xs, norm, grads, start, stop):
        norm = np.float32(norm)
        grads.grad_input[start:stop] = (G @ work["ws"]) * norm
        parts = [(grads.grad_weight, G.T @ xs.astype(np.float32))]
        if grads.grad_bias is not None:
            parts.append((grads.grad_bias, G.sum(axis=0)))
        for total, part in parts:  # the first chunk writes, the others add
            if start == 0:
                np.multiply(part, norm, out=total)
            else:
                total += part * norm

    @staticmethod
    def add_label_terms(work, label_terms, target, xs, norm, grads, label_groups):
        """The label terms the row kernel left out of G, added exactly (np.add.at adds in row
        order, so the result does not vary)."""
        terms = label_terms * np.float32(norm)
        grads.grad_input += terms[:, None] * work["ws"][target]
        np.add.at(grads.grad_weight, target, terms[:, None] * xs.astype(np.float32))
        if grads.grad_bias is not None:
            np.add.at(grads.grad_bias, target, terms)
