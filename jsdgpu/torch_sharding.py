"""PyTorch's sharded heads for jsdgpu.torch: a head's weight or bias that FSDP2 shards (a DTensor,
read outside the head's own forward) gathered for the loss's call, its gradient given back as
FSDP2 reduces the gradients it manages; and heads that tensor parallelism shards over the
vocabulary, taken as this rank's shards for vocab parallelism (docs/design.md, "The front ends")."""

import functools

import torch


@functools.lru_cache(maxsize=None)  # three times a call: the import machinery's lookups each time
def _dtensor_type():
    """DTensor's class, or None where this torch has no torch.distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


# the types of a call's tensors that are plain: no DTensor, nor any other subclass
_PLAIN = (torch.Tensor, torch.nn.Parameter, type(None))


def are_plain(*tensors):
    """Whether every one of the tensors is a plain tensor or parameter (or None)."""
    return all(type(t) in _PLAIN for t in tensors)


def _over_rows(placement):
    """Whether a placement splits a head by the vocabulary's rows, or not at all: Shard(0),
    Replicate, or the strided Shard(0) that FSDP2 puts over tensor parallelism's (which DTensor
    does not count as a Shard)."""
    return placement.is_replicate() or getattr(placement, "dim", None) == 0 and (
        placement.is_shard() or type(placement).__name__ == "_StridedShard")


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
    placements = tuple(t.placements)
    if not all(map(_over_rows, placements)):
        raise ValueError(f"{name} is a DTensor placed as {placements}: only Shard(0) (the vocabulary's rows, as "
                         "FSDP2 shards a head) and Replicate are gathered for the loss")
    return _local(t)


def _local(t, tp_dim=None):
    """This rank's plain tensor of the DTensor t: every mesh dimension but tp_dim gathered, its
    gradient averaged over that dimension and scattered back to t's placement (as FSDP2 reduces
    the gradients it manages: the local gradient taken as Partial("avg")); on tp_dim, t's rows
    stay sharded (Shard(0)), this rank's rows' gradient its own."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    dims = range(t.device_mesh.ndim)
    return t.redistribute(t.device_mesh, [Shard(0) if d == tp_dim else Replicate() for d in dims]).to_local(
        grad_placements=[Shard(0) if d == tp_dim else Partial("avg") for d in dims])


def _local_shard(name, t, mesh):
    """A tensor-parallel head's shard on this rank: t a DTensor sharded over the vocabulary's rows
    (Shard(0)) on the 1-D mesh, or on a mesh of which that one is a named dimension (FSDP2 over
    data parallelism beside it, its dimensions Shard(0) or Replicate). Those other dimensions are
    gathered, their gradient averaged and scattered back as FSDP2 does (_gathered); the
    tensor-parallel rows stay this rank's."""
    from torch.distributed.tensor import Shard
    dtensor = _dtensor_type()
    tp_dim = None
    if isinstance(t, dtensor):
        parent, tp = t.device_mesh, (mesh.mesh_dim_names or (None,))[0]
        if parent == mesh:
            tp_dim = 0
        elif tp is not None and tp in (parent.mesh_dim_names or ()) and parent[tp] == mesh:
            tp_dim = parent.mesh_dim_names.index(tp)
    placements = tuple(t.placements) if tp_dim is not None else ()
    if tp_dim is None or placements[tp_dim] != Shard(0) or not all(map(_over_rows, placements)):
        where = (f"a DTensor placed as {tuple(t.placements)} on {t.device_mesh}" if isinstance(t, dtensor)
                 else f"a plain {type(t).__name__}")
        raise ValueError(f"{name} is {where}: with vocab_parallel a DeviceMesh, each head's weight and bias must be "
                         f"a DTensor sharded over the vocabulary's rows, Shard(dim=0), on that mesh ({mesh}) or on "
                         "a mesh with it as a named dimension")
    return _local(t, tp_dim)


def plain_inputs(vocab_parallel=None, **tensors):
    """(the call's tensors as plain tensors, the process group of vocab parallelism or None).

    vocab_parallel None: heads that FSDP2 shards are gathered (_gathered). vocab_parallel a 1-D
    DeviceMesh (tensor parallelism over the vocabulary): every head's weight and bias a DTensor
    sharded over the vocabulary's rows on that mesh (or on a 2-D mesh of data and tensor
    parallelism, _local_shard), each rank computing on its own shard with no gather over the
    vocabulary (jsdgpu.parallel, over the mesh's process group), the hidden states the same on
    every rank of the tensor-parallel mesh. Hidden states, labels and a stored top-k that are
    DTensors are not taken."""
    if vocab_parallel is None and are_plain(*tensors.values()):
        return tensors, None  # the common call, at once: host time before the step's first product
    dtensor = _dtensor_type()
    for name in ("student_input", "teacher_input", "true_labels", "teacher_indices", "teacher_logprobs"):
        if dtensor is not None and isinstance(tensors.get(name), dtensor):
            raise NotImplementedError(f"{name} is a DTensor: the loss takes hidden states, labels and a stored "
                                      "top-k as plain tensors (the same on every rank of a tensor-parallel mesh)")
    heads = [k for k, v in tensors.items() if k.endswith(("weight", "bias")) and v is not None]
    if dtensor is not None and type(vocab_parallel).__name__ == "DeviceMesh":
        if vocab_parallel.ndim != 1:
            raise NotImplementedError(f"vocab_parallel is a {vocab_parallel.ndim}-D mesh: one dimension, the "
                                      "tensor-parallel one, is taken")
        local = {k: _local_shard(k, tensors[k], vocab_parallel) for k in heads}
        return {**tensors, **local}, vocab_parallel.get_group()
    return {**tensors, **{k: _gathered(k, tensors[k]) for k in heads}}, vocab_parallel
