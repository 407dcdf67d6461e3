"""Sharded heads in jsdgpu.torch (jsdgpu.torch_sharding), in two or three processes over gloo on
the CPU. FSDP2: a student whose head is fully_shard'ed and read outside its own forward, trained
one step with the fused loss; the loss and every gradient (the head's DTensor gradient gathered)
equal those of one process on the whole batch, for the online and the top-k loss. Tensor
parallelism: both heads DTensors sharded over the vocabulary on a 1-D mesh passed as
vocab_parallel, the same hidden states on every rank (the top-k loss: the student's head alone);
the loss and gradients equal one process's.
A head sharded any other way raises, naming its placement."""

import numpy as np
import pytest
from conftest import process_group, run_processes

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

H, V, T_RANK, K = 16, 523, 24, 7


def _models(seed, bias):
    """(student, teacher head weight): the student a body (its forward gives the hidden states) and
    a head, the same on every rank."""
    torch.manual_seed(seed)

    class Student(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(H, H)
            self.head = torch.nn.Linear(H, V, bias=bias)

        def forward(self, x):
            return torch.tanh(self.body(x))
    return Student(), torch.randn(V, H) / H**0.5


def _batch(seed, n):
    g = torch.Generator().manual_seed(seed + 1)
    x, xt = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
    labels = torch.randint(0, V, (n,), generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)]).int()
    lq = torch.log_softmax(torch.randn(n, K + 1, generator=g), dim=1)[:, :K]
    return x, xt, labels, ids, lq


def _step(student, teacher_w, batch, loss_kind, compiled=False, **options):
    """One loss and backward (the loss's call under torch.compile where compiled); the loss."""
    from jsdgpu.torch import FusedLinearJSDLoss, FusedLinearTopKJSDLoss
    x, xt, labels, ids, lq = batch
    if loss_kind == "online":
        loss_fn, teacher = FusedLinearJSDLoss(**options), (xt, teacher_w)
    else:
        loss_fn, teacher = FusedLinearTopKJSDLoss(**options), (ids, lq)

    def loss_of(h, weight, bias):
        return loss_fn(h, weight, *teacher, labels, bias)
    loss = (torch.compile(loss_of) if compiled else loss_of)(student(x), student.head.weight, student.head.bias)
    loss.backward()
    return loss.detach()


def _grads(student):
    from torch.distributed.tensor import DTensor
    full = lambda g: g.full_tensor() if isinstance(g, DTensor) else g  # noqa: E731
    return {name: full(p.grad).detach().clone() for name, p in student.named_parameters()}


def _report(results, rank, world, loss, whole_loss, student, whole, weight):
    """Put (rank, the ranks' mean loss, the whole batch's, each gradient's relative error against
    the whole batch's, what weight says of the head's weight, its gradient's type)."""
    import torch.distributed as dist
    mean_loss = loss.clone()
    dist.all_reduce(mean_loss)
    got, want = _grads(student), _grads(whole)
    errors = {k: float((got[k] - want[k]).norm() / want[k].norm()) for k in want}
    results.put((rank, float(mean_loss) / world, float(whole_loss), errors, weight,
                 type(student.head.weight.grad).__name__))


def _rank(rank, world, rendezvous, seed, loss_kind, bias, compiled, device, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    with process_group(rendezvous, rank, world, "gloo" if device == "cpu" else "nccl"):
        options = dict(beta=0.4, temperature=2.0)
        batch = tuple(a.to(device) for a in _batch(seed, world * T_RANK))
        whole, teacher_w = (m.to(device) for m in _models(seed, bias))  # one process on the whole batch
        whole_loss = _step(whole, teacher_w, batch, loss_kind, **options)
        student = _models(seed, bias)[0].to(device)
        # world 4: HSDP, two replicas of a shard over two ranks (the head placed (Replicate, Shard(0)))
        mesh = (init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard")) if world == 4
                else init_device_mesh(device, (world,)))
        fully_shard(student.head, mesh=mesh)
        fully_shard(student, mesh=mesh)
        mine = tuple(a[rank * T_RANK:(rank + 1) * T_RANK] for a in batch)
        loss = _step(student, teacher_w, mine, loss_kind, compiled, **options)
        _report(results, rank, world, loss, whole_loss, student, whole, type(student.head.weight).__name__)


def _run(target, world, tmp_path, *args):
    return run_processes(target, world, f"file://{tmp_path / 'rendezvous'}", *args)


@pytest.mark.parametrize("loss_kind", ["online", "topk"])
@pytest.mark.parametrize("world,bias,compiled", [(2, True, False), (3, False, False), (2, True, True),
                                                  (4, True, False)])
def test_fsdp2_head_equals_one_process(tmp_path, rng, loss_kind, world, bias, compiled):
    seed = int(rng.integers(2**31))
    out = _run(_rank, world, tmp_path, seed, loss_kind, bias, compiled, "cpu")
    for rank, loss, whole_loss, errors, weight_type, grad_type in out:
        assert (weight_type, grad_type) == ("DTensor", "DTensor"), (rank, weight_type, grad_type)
        assert abs(loss - whole_loss) <= 1e-5 * abs(whole_loss), (seed, rank, loss, whole_loss)
        for name, err in errors.items():
            assert err <= 1e-5, (seed, rank, name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_kind", ["online", "topk"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fsdp2_head_on_one_gpu(tmp_path, rng, loss_kind, compiled):
    """FSDP2 over a one-rank mesh on the GPU (NCCL): its head a DTensor all the same, gathered by
    the loss; the loss and gradients those of the unsharded model."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    seed = int(rng.integers(2**31))
    for rank, loss, whole_loss, errors, weight_type, grad_type in _run(_rank, 1, tmp_path, seed, loss_kind, True,
                                                                      compiled, "cuda"):
        assert (weight_type, grad_type) == ("DTensor", "DTensor")
        assert abs(loss - whole_loss) <= 1e-5 * abs(whole_loss), (seed, loss, whole_loss)
        for name, err in errors.items():
            assert err <= 1e-5, (seed, name, err)


def _placement_rank(rank, world, rendezvous, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from jsdgpu.torch import FusedLinearJSDLoss
    with process_group(rendezvous, rank, world):
        mesh = init_device_mesh("cpu", (world,))
        x, xt, labels, _, _ = _batch(0, T_RANK)
        w = distribute_tensor(torch.randn(V, H), mesh, [Shard(1)])  # along the hidden dimension
        w_rows = distribute_tensor(torch.randn(V, H), mesh, [Shard(0)])
        messages = []
        for call in (lambda: FusedLinearJSDLoss()(x, w, xt, torch.randn(V, H), labels),  # FSDP2's path
                     # tensor parallel: the teacher's head a plain tensor, not a shard on the mesh
                     lambda: FusedLinearJSDLoss(vocab_parallel=mesh)(x, w_rows, xt, torch.randn(V, H), labels)):
            try:
                call()
                messages.append("no error")
            except ValueError as e:
                messages.append(str(e))
        results.put((rank, messages))


def test_a_head_sharded_otherwise_raises_naming_its_placement(tmp_path):
    for rank, (fsdp, tensor_parallel) in _run(_placement_rank, 2, tmp_path):
        assert "student_weight" in fsdp and "Shard(dim=1)" in fsdp, fsdp
        assert "teacher_weight" in tensor_parallel and "plain Tensor" in tensor_parallel, tensor_parallel


def _tp_rank(rank, world, rendezvous, seed, bias, loss_kind, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from jsdgpu.torch import FusedLinearJSDLoss, FusedLinearTopKJSDLoss
    with process_group(rendezvous, rank, world):
        mesh = init_device_mesh("cpu", (world,))
        options = dict(beta=0.7, temperature=1.5)
        x, xt, labels, ids, lq = _batch(seed, T_RANK)
        labels[::5] = -100
        torch.manual_seed(seed)
        heads = {"ws": torch.randn(V, H) / H**0.5, "wt": torch.randn(V, H) / H**0.5}
        if bias:
            heads.update(bs=torch.randn(V) * 0.1, bt=torch.randn(V) * 0.1)
        if loss_kind == "topk":  # the student's head alone
            heads = {k: v for k, v in heads.items() if k in ("ws", "bs")}

        def step(heads, **more):
            xs = x.clone().requires_grad_()
            if loss_kind == "online":
                loss = FusedLinearJSDLoss(**options, **more)(xs, heads["ws"], xt, heads["wt"], labels,
                                                             heads.get("bs"), heads.get("bt"))
            else:
                loss = FusedLinearTopKJSDLoss(**options, **more)(xs, heads["ws"], ids, lq, labels, heads.get("bs"))
            loss.backward()
            return loss.detach(), xs.grad
        whole = {k: v.clone().requires_grad_(k in ("ws", "bs")) for k, v in heads.items()}
        whole_loss, whole_gi = step(whole)
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]).requires_grad_(k in ("ws", "bs"))
                   for k, v in heads.items()}
        loss, gi = step(sharded, vocab_parallel=mesh)
        errors = {"grad_input": float((gi - whole_gi).norm() / whole_gi.norm())}
        for k in ("ws", "bs"):
            if k in sharded:
                errors[k] = float((sharded[k].grad.full_tensor() - whole[k].grad).norm() / whole[k].grad.norm())
        results.put((rank, float(loss), float(whole_loss), errors, type(sharded["ws"].grad).__name__, ""))


@pytest.mark.parametrize("loss_kind", ["online", "topk"])
@pytest.mark.parametrize("world,bias", [(2, True), (3, False)])
def test_tensor_parallel_heads_equal_one_process(tmp_path, rng, world, bias, loss_kind):
    seed = int(rng.integers(2**31))
    out = _run(_tp_rank, world, tmp_path, seed, bias, loss_kind)
    for rank, loss, whole_loss, errors, grad_type, _ in out:
        assert grad_type == "DTensor"
        assert abs(loss - whole_loss) <= 1e-5 * abs(whole_loss), (seed, rank, loss, whole_loss)
        for name, err in errors.items():
            assert err <= 1e-5, (seed, rank, name, err)


def _fsdp_tp_rank(rank, world, rendezvous, seed, loss_kind, results):
    """A 2 x 2 mesh (data parallel, tensor parallel): the student's head ColwiseParallel over the
    vocabulary on the tensor-parallel dimension and fully_shard'ed over the data-parallel one, the
    teacher's head sharded over the vocabulary (the top-k loss: the stored top-k instead); each
    data-parallel pair its own part of the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from jsdgpu.torch import FusedLinearJSDLoss, FusedLinearTopKJSDLoss
    with process_group(rendezvous, rank, world):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"].get_local_rank()
        x, xt, labels, ids, lq = _batch(seed, 2 * T_RANK)
        labels[::8] = -100  # three rows of each half: the halves' means, averaged, are the whole's
        whole, teacher_w = _models(seed, True)
        options = dict(beta=0.6, temperature=1.5)

        def step(student, rows, teacher, **more):
            h = student(x[rows])
            if loss_kind == "online":
                loss = FusedLinearJSDLoss(**options, **more)(h, student.head.weight, xt[rows], teacher, labels[rows],
                                                             student.head.bias)
            else:
                loss = FusedLinearTopKJSDLoss(**options, **more)(h, student.head.weight, ids[rows], lq[rows],
                                                                 labels[rows], student.head.bias)
            loss.backward()
            return loss.detach()
        whole_loss = step(whole, slice(None), teacher_w)
        student = _models(seed, True)[0]
        parallelize_module(student.head, mesh["tp"], ColwiseParallel())
        fully_shard(student.head, mesh=mesh["dp"])
        fully_shard(student, mesh=mesh["dp"])
        teacher = distribute_tensor(teacher_w, mesh["tp"], [Shard(0)])
        loss = step(student, slice(dp * T_RANK, (dp + 1) * T_RANK), teacher, vocab_parallel=mesh["tp"])
        _report(results, rank, world, loss, whole_loss, student, whole, str(student.head.weight.placements))


@pytest.mark.parametrize("loss_kind", ["online", "topk"])
def test_fsdp2_and_tensor_parallel_on_a_2x2_mesh(tmp_path, rng, loss_kind):
    seed = int(rng.integers(2**31))
    for rank, loss, whole_loss, errors, placements, grad_type in _run(_fsdp_tp_rank, 4, tmp_path, seed, loss_kind):
        assert "Shard(dim=0)" in placements and grad_type == "DTensor", (placements, grad_type)
        assert abs(loss - whole_loss) <= 1e-5 * abs(whole_loss), (seed, rank, loss, whole_loss)
        for name, err in errors.items():
            assert err <= 1e-5, (seed, rank, name, err)


def test_gathered_leaves_plain_tensors_alone():
    from jsdgpu.torch_sharding import plain_inputs
    t = torch.ones(3)
    assert plain_inputs(student_weight=t, student_bias=None)[0]["student_weight"] is t
    assert np.array_equal(plain_inputs(student_input=t)[0]["student_input"].numpy(), np.ones(3))
