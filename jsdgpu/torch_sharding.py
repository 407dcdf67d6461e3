"""PyTorch's sharded heads for jsdgpu.torch: a head's weight or bias that FSDP2 shards (a DTensor,
read outside the head's own forward) gathered for the loss's call, its gradient given back as
FSDP2 reduces the gradients it manages (docs/design.md, "The front ends")."""

import torch


def _dtensor_type():
    """DTensor's class, or None where this torch has no torch.distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def _gathered(name, t):
    """t as a plain tensor for the call. A DTensor (a head's weight or bias that FSDP2 shards, read
    outside the head's own forward) is gathered, as FSDP2's forward would gather it: allowed where
    each of its placements is Shard(0) (the vocabulary's rows: fully_shard's) or Replicate (HSDP's
    replica dimension). Its gradient goes back as FSDP2 reduces the gradients it manages: averaged
    over the mesh, then scattered to the parameter's shard (the local gradient taken as
    Partial("avg")). The gathered tensor lives as long as the autograd graph that holds it."""
    dtensor = _dtensor_type()
    if t is None or dtensor is None or not isinstance(t, dtensor):
        return t
    from torch.distributed.tensor import Partial, Replicate
    placements = tuple(t.placements)
    if not all(p.is_replicate() or (p.is_shard() and p.dim == 0) for p in placements):
        raise ValueError(f"{name} is a DTensor placed as {placements}: only Shard(0) (the vocabulary's rows, as "
                         "FSDP2 shards a head) and Replicate are gathered for the loss")
    n = t.device_mesh.ndim
    return t.redistribute(t.device_mesh, [Replicate()] * n).to_local(grad_placements=[Partial("avg")] * n)


def plain_inputs(**tensors):
    """The call's tensors with its FSDP2-sharded heads gathered (_gathered); hidden states and labels
    that are DTensors are not taken (tensor-parallel heads are not built)."""
    dtensor = _dtensor_type()
    for name in ("student_input", "teacher_input", "true_labels", "teacher_indices", "teacher_logprobs"):
        if dtensor is not None and isinstance(tensors.get(name), dtensor):
            raise NotImplementedError(f"{name} is a DTensor: the loss takes hidden states, labels and a stored "
                                      "top-k as plain tensors (tensor-parallel heads over DTensors are not built)")
    return {k: _gathered(k, v) if k.endswith(("weight", "bias")) else v for k, v in tensors.items()}
