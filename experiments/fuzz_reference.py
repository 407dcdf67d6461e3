"""Does any combination of the options and shapes take the CPU backend away from the float64
reference, in the online loss or the top-k loss?

Draws --cases random calls (seeds from --seed on): T, the two vocabularies, the hidden sizes, the
logits' std (0.5-8), a bias, ignored rows (none, some, all), a converging student (the teacher's
hidden state sharing the student's), beta (0, 1, 1/2, 1e-6, 1 - 1e-6, any), temperature (0.05-50,
log-uniform, or 1), the two weights (the soft one alone included), the models' scales and soft
caps, token weights, each reduction with a random upstream gradient for "none", chunk sizes and
num_valid_tokens; and prints each draw whose loss or gradients (grad_input, grad_weight,
grad_bias) are more than --tolerance off, relatively (a norm), with its seed and options. A flag
is a lead, not a verdict: a sharp row's float32 logits alone can leave that much (the tests'
floors, tests/conftest.py's assert_near_float64, say how much). --topk draws top-k calls
(draw_topk): the teacher's top k (1-300) of the student's logits plus noise or of independent
ones, at its temperature 0.05, 1 or 5, in order or shuffled, some slots unused, either
missing_mass, the student's options alone.

    python experiments/fuzz_reference.py --seed 0 --cases 400
    python experiments/fuzz_reference.py --gpu --seed 0 --cases 400     # the GPU backend
    python experiments/fuzz_reference.py --topk --seed 0 --cases 2000    # the top-k loss
    python experiments/fuzz_reference.py --torch compiled --seed 0 --cases 80   # through jsdgpu.torch

Answer (the Zen 4 EPYC, 2026-12-05; docs/design.md, "Small divergences" and "Numerics"): the code
before b84755b, 18 of seeds 0-599 off by more than 1e-3, every one beta 1e-6 with the soft part's
gradient alone (up to 0.12: seed 432). With the JSD's h relative to the reference column (and the
reference's own gradient taken about it), 4 of seeds 0-1999 where 7 of 600-1999 were: a student
deep in a soft cap of 1 (894, 1436: the cap's derivative is right absolutely, not relatively, as
the contract says), and the JSD's gradient alone where p's mass is on columns at which q is far
below it, right to float32's rounding of those columns' h absolutely (1131: 1.3e-3; 1487: a
gradient of 1e-29 that comes out 2e-6); the saturated rows that were 200 times off (1471, 1876)
and the sharp rows of 769 are right. Seeds 2000-2999 (2026-12-06): 2077, the JSD's gradient of
7e-14 where p's mass is on two columns at which q is far below it (it came out 1.5e-4: 4e-8 of
the row's scale, weight 206 over temperature 0.05), and 2494, a student deep in a cap of 1. The
top-k loss (--topk, seeds 0-1999, 2026-12-06): 3 flagged (214, 608, 894), each a student deep
in a cap of 1 (scale x / c up to 33-127), each within 1.4e-6 with a cap of 30 in its place.
A top-k teacher whose slots hold all of its mass in reverse KL gives an infinite divergence, as
the reference does; such draws count as right, their gradients wherever both sides are
non-finite (NaN where an inf meets a capped student's derivative that float32 rounds to 0, inf
in float64). On the GPU (one H100, 2026-12-06): the online
loss's seeds 2000-2599 flag 2494 alone (2077 is right there: every such column's h the same); the
top-k loss's seeds 0-599 flag 214 (the cap), and 326 and 460, the hard part alone on rows whose
label holds all but 7e-9 of the mass: their CE of 7e-9 came out -1.6e-7 before the kernels wrote
0 below 0 (now 0), and their gradient, p - 1 at the label, is right to float32's rounding of p,
6e-8, absolutely (docs/contract.md, "Numerics"). Through jsdgpu.torch's modules on the CPU
(--torch, 2026-12-06): eagerly seeds 0-599 of each loss, compiled (fullgraph) 0-79 of each, flag
only the top-k's 214 (the cap); after the operators' outputs became tensors of torch's own
(9801c5a), compiled seeds 0-59 of each flag none on the GPU (one H100), and 0-79 of each none on
the CPU (the code of e4dde53). Seeds 7000-7599 of the online loss (2026-12-06, CI's kind of
machine) flag 7146, one sharp row (T = 1, Vs = 2, its label 25 nats ahead, the hard part alone,
weight 228: its CE of 3e-9 came out 0, right to a few ulps of its largest logit absolutely, as the
contract says), and 7331, the JSD at its ln 2 ceiling (p and q on disjoint columns), whose
gradients of 2e-7 and less are right to 3e-9, as 1131's; the top-k loss's 7000-7999 flag 7779 and
7833, each a student deep in a cap of 1 (within 5e-7 with a cap of 30 in its place). Through
jsdgpu.torch eagerly on the CPU, seeds 7000-7199 of each loss flag only 7146, as above; compiled,
seeds 7000-7059 of each, none. Seeds 7600-7899 of the online loss flag 7816, a sharp row as 7146
(T = 3, Vs = 2, scale 5, the hard part alone: a CE of 1.6e-6 at logits of -6 and -20 came out
5e-9 off, and its gradient, p - 1 at the label, 3e-8 off, each right absolutely as the contract
says); the top-k loss's 8000-8399 flag none. Seeds 7900-8199 of the online loss flag none, and the
top-k loss's 8400-8699 none; through jsdgpu.torch eagerly, the online loss's 7200-7349 flag only
7331, as above. On the GPU (one H100, 2026-12-06, with the label's softmax over its own sum:
docs/design.md, "Numerics"), seeds 9000-9399 of the online loss flag 9291 alone, a student deep in
a cap of 1 (scale 40), flagged alike on the CPU. On the CPU since (the code of c9ff5ad): the
online loss's seeds 8200-8499 flag none, the top-k loss's 8700-8999 none, and through
jsdgpu.torch compiled, seeds 7060-7119 of each loss none, and eagerly 7350-7499 of each none; on
the GPU (one H100), the online loss's seeds 9400-9799 none. On the CPU (the code of 50bfb31): the
online loss's seeds 8500-8799 none, the top-k loss's 9000-9299 none, and through jsdgpu.torch
eagerly, seeds 7500-7559 of each loss none; compiled, seeds 7120-7149 of each flag only 7146, as
above. On the GPU (one H100, the code of 86987ad), the online loss's seeds 9800-10199 flag 10117
alone, flagged alike on the CPU: a sharp row (T = 3, one row weighted 0.87 and two 0, its label 14
nats ahead, beta 1), whose gradient of 1e-5 came out 1e-8 off, right absolutely as 7146. On the
CPU (the code of 50bfb31), the online loss's seeds 10200-10499 flag none; the top-k loss's
9300-9599 flag 9527, a student deep in a cap of 5 at scale 5 (x / c up to 7), and flagged 9382,
an infinite reverse KL whose gradient was NaN at two columns deep in the student's cap where
the reference's is inf, before such gradients counted as right (above). On the GPU (one H100,
the code of bd52bf5): the top-k loss's seeds 10200-10599 flag none; through jsdgpu.torch eagerly,
seeds 7600-7749 of the online loss none and of the top-k loss 7747 alone, a label that holds all
but 1e-39 of its row at a logit of 72, whose p - 1 the top-k kernel took 7.6e-7 off (its
logsumexp's round trip through nats, mended since: docs/design.md, "Numerics"; right on the
CPU); compiled,
seeds 7150-7169 of each none. On the CPU through jsdgpu.torch eagerly, seeds 7560-7659 of each
loss none. On the CPU's Xeon kind with the row functions at 512 bits (the code of fb3c8cd,
2026-12-07): the online loss's seeds 9500-10099 flag 9523 alone, a sharp row as 7146 (Vs = 2, a
student scale of 10, beta 1e-6: a label's CE of 7.6e-5 came out 8e-8 off, right absolutely to
its logits' float32 rounding), flagged alike by the code before (43ca3c2); the top-k loss's
9800-10099 none; through jsdgpu.torch eagerly, the online loss's 7660-7759 none. With the column
pass leaving the student's exps (the code of ce9c84b, the Xeon kind): the online loss's seeds
9500-9799 flag 9523 alone, as before; 10100-10499 flag 10104, the JSD's soft gradient alone
(temperature 0.055, token weights up to 968) on rows whose p and q sit near one-hot on different
columns, right absolutely as 2077 (each row's logits' gradient within 1.1e-8 of its weight times
ln(1 / (1 - beta)) / temperature, where the contract says 1e-7; flagged alike by the code before,
9c9cc0d); 10500-10799 flag 10556, a student deep in a cap of 1 at scale 40; 10800-10999 flag
10937 alone, a sharp row (Vs = 2, a student scale of 40, its label 25 nats ahead), flagged alike
by the code before; through jsdgpu.torch
eagerly, the online loss's 7760-7859 flag 7816 alone, the hard part alone (Vs = 2, a student
scale of 5), whose row CE of 1.6e-6, its label ahead by 13 nats at a largest logit of -6.3, came
out 5e-9 off: right absolutely to a few ulps of that logit, as the contract says (the same off
NumPy arrays, and with the code before).
"""

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jsdgpu  # noqa: E402
from jsdgpu.reference import reference, reference_topk  # noqa: E402


def draw(seed):
    """(arrays, token_weights, options, run options, upstream gradient or None) of one call."""
    rng = np.random.default_rng(seed)
    T, vs = _rows_and_vocabulary(rng)
    vt = vs if rng.random() < 0.7 else vs + int(rng.integers(0, 50))
    hs, ht = int(rng.integers(1, 33)), int(rng.integers(1, 33))
    std = float(rng.choice([0.5, 1, 4, 8]))
    bias = rng.random() < 0.3
    f = _normals(rng)
    target = _target(rng, T, vs)
    arrays = dict(student_input=f((T, hs)), student_weight=f((vs, hs), std / np.sqrt(hs)), teacher_input=f((T, ht)),
                  teacher_weight=f((vt, ht), std / np.sqrt(ht)), target=target,
                  student_bias=f(vs, 0.5) if bias else None, teacher_bias=f(vt, 0.5) if bias else None)
    if rng.random() < 0.3:  # a converging student: the teacher's hidden state shares the student's
        shared = min(hs, ht)
        arrays["teacher_input"][:, :shared] = arrays["student_input"][:, :shared]
    return (arrays, *_run(rng, T, _loss_options(rng, std, teacher=True)))


def draw_topk(seed):
    """draw's, of a top-k call: the teacher's log-softmax (of the student's logits plus noise of std
    0.01-2, or independent ones; at temperature 0.05, 1 or 5) at its k largest ids, in order or
    shuffled, some slots unused (-inf); the options with missing_mass."""
    rng = np.random.default_rng(seed)
    T, vs = _rows_and_vocabulary(rng)
    hs, std, f = int(rng.integers(1, 33)), float(rng.choice([0.5, 1, 4, 8])), _normals(rng)
    k = min(vs, int(rng.choice([1, 2, 5, 8, 64, 300])))
    arrays = dict(student_input=f((T, hs)), student_weight=f((vs, hs), std / np.sqrt(hs)), target=_target(rng, T, vs),
                  student_bias=f(vs, 0.5) if rng.random() < 0.3 else None)
    s = arrays["student_input"].astype(np.float64) @ arrays["student_weight"].T.astype(np.float64)
    if rng.random() < 0.5:
        t = s + rng.standard_normal(s.shape) * float(rng.choice([0.01, 0.3, 2.0]))
    else:
        t = rng.standard_normal(s.shape) * std
    t /= float(rng.choice([0.05, 1.0, 5.0]))
    logq = t - np.logaddexp.reduce(t, axis=1, keepdims=True)
    ids = np.argsort(-logq, axis=1)[:, :k]
    if rng.random() < 0.3:
        ids = rng.permuted(ids, axis=1)
    logprobs = np.take_along_axis(logq, ids, 1).astype(np.float32)
    if rng.random() < 0.2 and k > 1:
        logprobs[rng.random(logprobs.shape) < 0.3] = -np.inf
    arrays.update(teacher_indices=ids, teacher_logprobs=logprobs)
    opts = dict(_loss_options(rng, std, teacher=False), missing_mass=str(rng.choice(["bucket", "renormalize"])))
    return (arrays, *_run(rng, T, opts))


def _rows_and_vocabulary(rng):
    """(T, the student's vocabulary): odd sizes, T = 1 and vocabularies of 2 among them."""
    return int(rng.choice([1, 2, 3, 7, 13, 31, 40])), int(rng.choice([2, 3, 17, 130, 1031, 2999]))


def _normals(rng):
    """f(shape, scale): float32 normals of that std."""
    def f(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    return f


def _target(rng, T, vs):
    """Labels in [0, vs), none, some or all of them ignored (-100)."""
    target = rng.integers(0, vs, T)
    target[rng.random(T) < float(rng.choice([0, 0.3, 1.0]))] = -100
    return target


def _loss_options(rng, std, teacher):
    """The loss options: beta, temperature, the two weights, the models' scales and caps (the
    teacher's only where it is a model: teacher)."""
    opts = dict(beta=float(rng.choice([0.0, 1.0, 0.5, 1e-6, 1 - 1e-6, rng.random()])),
                temperature=float(np.exp(rng.uniform(np.log(0.05), np.log(50)))) if rng.random() < 0.5 else 1.0,
                weight_hard_loss=float(rng.choice([0.0, 0.5, 1.0])),
                weight_soft_loss=float(rng.choice([0.0, 0.5, 1.0, 2.0])))
    if opts["weight_hard_loss"] == 0 and opts["weight_soft_loss"] == 0:
        opts["weight_soft_loss"] = 1.0
    if rng.random() < 0.3:
        opts["student_logit_scale"] = float(rng.choice([0.5, 2.0, 40.0 / max(std, 1)]))
    if teacher and rng.random() < 0.3:
        opts["teacher_logit_scale"] = float(rng.choice([0.5, 2.0]))
    if rng.random() < 0.3:
        opts["student_logit_softcap"] = float(rng.choice([1.0, 5.0, 30.0]))
    if teacher and rng.random() < 0.3:
        opts["teacher_logit_softcap"] = float(rng.choice([1.0, 5.0, 30.0]))
    return opts


def _run(rng, T, opts):
    """(token_weights, options, run options, upstream gradient or None): the reduction, weights,
    chunk size and num_valid_tokens."""
    reduction = str(rng.choice(["mean", "sum", "none"]))
    weights = None
    if rng.random() < 0.4:
        weights = (rng.choice([0.0, 1.0, 3.0, 1e3], T) * rng.random(T)).astype(np.float32)
    run = dict(reduction=reduction)
    if rng.random() < 0.4:
        run["chunk_size"] = int(rng.choice([1, 2, 5, 8]))
    if reduction == "mean" and rng.random() < 0.2:
        run["num_valid_tokens"] = float(rng.uniform(0.5, 50))
    upstream = rng.standard_normal(T).astype(np.float32) if reduction == "none" else None
    return weights, opts, run, upstream


def errors(arrays, weights, opts, run, upstream, call):
    """Relative errors (norms) of the loss and the gradients against the float64 reference; the
    call by call(arrays, weights, opts, run, upstream) -> (loss, [grad_input, grad_weight,
    grad_bias]) in NumPy (library_call's or torch_call's); a top-k call where the arrays hold
    teacher_indices."""
    topk = "teacher_indices" in arrays
    loss, grads = call(arrays, weights, opts, run, upstream)
    want = list((reference_topk if topk else reference)(**arrays, token_weights=weights, reduction=run["reduction"],
                                                        grad_output=upstream, **opts))
    if "num_valid_tokens" in run:  # the reference divides by the valid rows' count
        factor = max(1, int((arrays["target"] != -100).sum())) / run["num_valid_tokens"]
        want = [None if w is None else w * factor for w in want]

    def rel(got, w, any_non_finite=False):
        got, w = np.asarray(got, np.float64), np.asarray(w, np.float64)
        # an infinite divergence (a teacher's top-k that holds all of its mass, in reverse KL) is
        # right where it is the reference's infinity, or its NaN (times a weight of 0); its
        # gradients, where non-finite on both sides (any_non_finite): an inf times a cap's
        # derivative that float32 rounds to 0 is NaN where float64's is inf
        finite = np.isfinite(got) & np.isfinite(w)
        same = np.isfinite(got) == np.isfinite(w) if any_non_finite else (got == w) | (np.isnan(got) & np.isnan(w))
        if not same[~finite].all():
            return np.inf
        got, w = got[finite], w[finite]
        return float(np.linalg.norm(got - w) / max(np.linalg.norm(w), 1e-6))
    infinite = bool(np.isinf(np.asarray(want[0], np.float64)).any())
    found = dict(loss=rel(loss, want[0]), grad_input=rel(grads[0], want[3], infinite),
                 grad_weight=rel(grads[1], want[4], infinite))
    if grads[2] is not None:
        found["grad_bias"] = rel(grads[2], want[5], infinite)
    return found


def library_call(xp):
    """errors' call through jsdgpu.forward (forward_topk) and backward on xp's arrays (NumPy: the
    CPU backend; CuPy: the GPU's)."""
    def call(arrays, weights, opts, run, upstream):
        on = lambda a: None if a is None else xp.asarray(a)  # noqa: E731
        loss, ctx = (jsdgpu.forward_topk if "teacher_indices" in arrays else jsdgpu.forward)(
            **{k: on(v) for k, v in arrays.items()}, token_weights=on(weights), **opts, **run)
        grads = jsdgpu.backward(ctx, on(upstream)) if upstream is not None else jsdgpu.backward(ctx)
        return _numpy(loss), [_numpy(g) for g in grads]
    return call


def torch_call(device, compiled):
    """errors' call through jsdgpu.torch's module (FusedLinearJSDLoss or FusedLinearTopKJSDLoss,
    the options its constructor's, chunk_size too), eagerly or under torch.compile(fullgraph=True),
    backward through the upstream gradient (a sum of the rows' losses with "none")."""
    import torch
    from jsdgpu.torch import FusedLinearJSDLoss, FusedLinearTopKJSDLoss

    def call(arrays, weights, opts, run, upstream):
        topk = "teacher_indices" in arrays
        module = (FusedLinearTopKJSDLoss if topk else FusedLinearJSDLoss)(
            reduction=run["reduction"], chunk_size=run.get("chunk_size"), **opts)
        names = ("student_input", "student_weight", *(("teacher_indices", "teacher_logprobs") if topk else
                 ("teacher_input", "teacher_weight")), "target", "student_bias", *(() if topk else ("teacher_bias",)))
        ts = [None if arrays[n] is None else torch.from_numpy(np.asarray(arrays[n])).to(device) for n in names]
        student = [t for t, n in zip(ts, names) if n in ("student_input", "student_weight", "student_bias")]
        for t in student:
            if t is not None:
                t.requires_grad_(True)
        step = lambda *a, w: module(*a, token_weights=w, num_valid_tokens=run.get("num_valid_tokens"))  # noqa: E731
        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, fullgraph=True)
        loss = step(*ts, w=None if weights is None else torch.from_numpy(weights).to(device))
        (loss if upstream is None else loss * torch.from_numpy(upstream).to(device)).sum().backward()
        return loss.detach().cpu().numpy(), [None if t is None else t.grad.cpu().numpy() for t in student]
    return call


def _numpy(a):
    return a.get() if hasattr(a, "get") else a


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="CuPy arrays: the GPU backend")
    p.add_argument("--topk", action="store_true", help="the top-k loss (forward_topk) in place of the online one")
    p.add_argument("--torch", choices=["eager", "compiled"], help="through jsdgpu.torch's module (on the GPU with --gpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--tolerance", type=float, default=1e-3)
    a = p.parse_args()
    if a.torch:
        call = torch_call("cuda" if a.gpu else "cpu", a.torch == "compiled")
    elif a.gpu:
        import cupy
        call = library_call(cupy)
    else:
        call = library_call(np)
    flagged = 0
    for seed in range(a.seed, a.seed + a.cases):
        arrays, weights, opts, run, upstream = (draw_topk if a.topk else draw)(seed)
        found = errors(arrays, weights, opts, run, upstream, call)
        if not max(found.values()) <= a.tolerance:  # (a NaN flags too)
            flagged += 1
            shape = dict(T=len(arrays["target"]), vs=len(arrays["student_weight"]))
            if a.topk:
                shape["k"] = arrays["teacher_indices"].shape[1]
            else:
                shape["vt"] = len(arrays["teacher_weight"])
            print(f"seed {seed}: {shape} {opts} {run} token_weights={weights is not None}: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in found.items()), flush=True)
    print(f"{flagged} of {a.cases} draws off by more than {a.tolerance}")


if __name__ == "__main__":
    main()
