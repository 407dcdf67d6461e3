"""Vocab parallelism: one loss over LM heads sharded across ranks by vocabulary.

Rank r of P holds rows [v0_r, v1_r) of the teacher weight, the ranks' ranges in rank order and
together the whole teacher vocabulary, and the student weight's rows of that range (the student
vocabulary Vs <= Vt ends inside some rank's range; every rank needs at least one student row).
Every rank passes the same inputs, targets (global vocabulary ids) and options. Each gets the
whole loss, the whole grad_input, and the grad_weight / grad_bias of its own shard.

    loss, ctx = jsdgpu.forward(xs, ws_shard, xt, wt_shard, target, vocab_parallel=comm)

comm is one of:
  - a cupy.cuda.nccl.NcclCommunicator (standalone use, CuPy arrays);
  - a torch.distributed ProcessGroup with the NCCL backend (from jsdgpu.torch, or with CuPy
    arrays); each all-reduce then waits on the host for the GPU, before and after; or with the
    gloo backend, on the CPU (NumPy arrays);
  - any object with `rank`, `size` and `allreduce(array, op)` (op "sum" or "max", in place, on
    the backend's arrays), such as the tests' simulated ranks.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shard:
    """This rank's place in the vocabulary, from every rank's shard sizes."""
    comm: object
    v0: int        # the first vocabulary id of this rank's rows
    vs_total: int  # Vs of the whole vocabulary
    max_vs: int    # the largest shards, which size every rank's chunks alike
    max_vt: int


class _NcclCommunicator:
    """CuPy's NCCL bindings, the collectives queued on CuPy's current stream."""

    def __init__(self, comm):
        self._comm = comm
        self.rank, self.size = comm.rank_id(), comm.size()

    def allreduce(self, a, op):
        import cupy
        from cupy.cuda import nccl
        dtypes = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                  np.dtype(np.int64): nccl.NCCL_INT64}
        ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}
        self._comm.allReduce(a.data.ptr, a.data.ptr, a.size, dtypes[a.dtype], ops[op],
                             cupy.cuda.get_current_stream().ptr)


class _TorchProcessGroup:
    """A torch.distributed process group; the arrays cross to torch through DLPack, zero-copy.

    Each all-reduce waits on the host for the GPU before and after it: run on torch's NCCL
    stream, ordered by events on a torch stream wrapping CuPy's, it read inputs that CuPy's
    queued work had not yet written (seen on two H200s with torch 2.11). The CuPy NCCL
    communicator, which queues everything on one stream, needs no such wait."""

    def __init__(self, group):
        import torch.distributed as dist
        self._group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def allreduce(self, a, op):
        import torch
        import torch.distributed as dist
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if isinstance(a, np.ndarray):  # the CPU backend's arrays (a gloo group): nothing queued
            dist.all_reduce(torch.from_numpy(a), op=ops[op], group=self._group)
            return
        import cupy
        cupy.cuda.get_current_stream().synchronize()
        dist.all_reduce(torch.from_dlpack(a), op=ops[op], group=self._group)
        torch.cuda.synchronize(cupy.cuda.Device().id)


def communicator(comm):
    """The communicator the driver calls for a vocab_parallel argument; None for None or for a
    single rank (the whole vocabulary is here)."""
    if comm is None:
        return None
    kind = type(comm)
    if kind.__name__ == "NcclCommunicator" and kind.__module__.startswith("cupy"):
        comm = _NcclCommunicator(comm)
    elif kind.__module__.startswith("torch"):
        comm = _TorchProcessGroup(comm)
    elif not all(hasattr(comm, k) for k in ("rank", "size", "allreduce")):
        raise TypeError("vocab_parallel must be a cupy.cuda.nccl.NcclCommunicator, a "
                        "torch.distributed ProcessGroup or an object with rank, size and "
                        f"allreduce(array, op), got {kind.__module__}.{kind.__name__}")
    return None if comm.size == 1 else comm


def call_shard(vocab_parallel, capturable, xp, vs, vt):
    """A call's Shard (shard_layout's, vs and vt this rank's student and teacher rows), or None
    without vocab parallelism; NotImplementedError where the call is capturable, which vocab
    parallelism is not (the shard layout is read on the host). The shard sizes cross the ranks
    before any other work: the targets (and the top-k's ids) index the whole vocabulary."""
    comm = communicator(vocab_parallel)
    if comm is None:
        return None
    if capturable:
        raise NotImplementedError("vocab_parallel in a capturable call: the shard layout is read on the "
                                  "host; run vocab parallel with capturable=False, outside a capture")
    return shard_layout(comm, xp, vs, vt)


def shard_layout(comm, xp, vs, vt):
    """This rank's Shard, from one all-reduce of every rank's shard sizes (vs student rows, vt
    teacher rows). Every rank sees the same sizes, so a bad layout raises on every rank."""
    sizes = xp.zeros(2 * comm.size, dtype=np.int64)
    sizes[comm.rank], sizes[comm.size + comm.rank] = vs, vt
    comm.allreduce(sizes, "sum")
    sizes = np.asarray(sizes.get() if hasattr(sizes, "get") else sizes)
    student, teacher = sizes[:comm.size], sizes[comm.size:]
    starts = np.r_[0, np.cumsum(teacher)[:-1]]
    vs_total = int(student.sum())
    # each rank's student rows are the student vocabulary's part of its teacher range
    expected = np.clip(vs_total - starts, 0, teacher)
    if (student != expected).any() or (student == 0).any():
        raise ValueError(
            "vocab_parallel: student_weight's shards must be the student vocabulary's rows of "
            "each rank's teacher range, in rank order, at least one per rank; got student rows "
            f"{student.tolist()} for teacher rows {teacher.tolist()}")
    return Shard(comm, int(starts[comm.rank]), vs_total, int(student.max()), int(teacher.max()))


def combine_stats(xp, comm, stats):
    """The row statistics of every rank's shard merged in place: stats [7 or 8, rows] as the row
    kernels write them (three maxima: of s, z and t, or the top-k's s, z and z over its rest,
    jsdgpu.topk_shards; the sums of exp(x - max) of each; the target logit; the online loss's,
    the t of the column of the largest s, which becomes the t of the rank that holds the row's
    largest s)."""
    maxima, sums = stats[:3], stats[3:6]
    local = maxima.copy()
    comm.allreduce(maxima, "max")
    # each rank's sums rescaled to the global max; a rank's empty part (max -inf: the top-k's rest
    # where each of its columns is a used slot's) is a sum of 0, and stays 0 (not 0 times NaN)
    sums *= xp.exp(local - xp.where(local == -np.inf, xp.zeros_like(maxima), maxima))
    comm.allreduce(stats[3:7], "sum")
    if len(stats) > 7:  # the reference column's t: the largest of those of the ranks that hold
        # the largest s (the kernels' own choice among columns that tie)
        stats[7] = xp.where(local[0] == maxima[0], stats[7], -np.inf)
        comm.allreduce(stats[7], "max")
