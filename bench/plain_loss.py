"""The loss of docs/contract.md in plain PyTorch with full logits (default options): what a user
would write without jsdgpu, timed by the benchmarks (eager, and under torch.compile)."""

import numpy as np


def torch_loss(xs, ws, xt, wt, target, beta=0.5, ignore_index=-100):
    import torch
    s = (xs @ ws.T).float()
    t = (xt @ wt.T).float()
    valid = target != ignore_index
    n = valid.sum().clamp(min=1)
    ce = torch.nn.functional.cross_entropy(s, target, ignore_index=ignore_index, reduction="sum") / n
    logp, logq = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    logm = torch.logsumexp(torch.stack([logp + np.log(1 - beta), logq + np.log(beta)]), 0)
    jsd = beta * (logq.exp() * (logq - logm)).sum(-1) + (1 - beta) * (logp.exp() * (logp - logm)).sum(-1)
    return 0.5 * ce + 0.5 * (jsd * valid).sum() / n
