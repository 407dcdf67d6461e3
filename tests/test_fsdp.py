"""Heads that FSDP2 shards (jsdgpu.torch_sharding): two processes over gloo on the CPU, a student
whose head is fully_shard'ed and read outside its own forward, trained one step with the fused
loss. The loss and every gradient (the head's DTensor gradient gathered) equal those of one
process on the whole batch, for the online and the top-k loss; a head sharded any other way
raises, naming its placement."""

import multiprocessing
import traceback

import numpy as np
import pytest

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


def _rank(rank, world, rendezvous, seed, loss_kind, bias, compiled, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    try:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        options = dict(beta=0.4, temperature=2.0)
        batch = _batch(seed, world * T_RANK)
        whole, teacher_w = _models(seed, bias)  # one process on the whole batch
        whole_loss = _step(whole, teacher_w, batch, loss_kind, **options)
        student, _ = _models(seed, bias)
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(student.head, mesh=mesh)
        fully_shard(student, mesh=mesh)
        mine = tuple(a[rank * T_RANK:(rank + 1) * T_RANK] for a in batch)
        loss = _step(student, teacher_w, mine, loss_kind, compiled, **options)
        mean_loss = loss.clone()
        dist.all_reduce(mean_loss)
        got, want = _grads(student), _grads(whole)
        errors = {k: float((got[k] - want[k]).norm() / want[k].norm()) for k in want}
        results.put((rank, float(mean_loss) / world, float(whole_loss), errors, type(student.head.weight).__name__,
                     type(student.head.weight.grad).__name__))
    except BaseException:  # noqa: BLE001 - handed to the parent, which fails the test
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(world, tmp_path, *args):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, world, rendezvous, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = []
        for _ in range(world):
            out.append(results.get(timeout=180))
            if out[-1][0] == "error":
                pytest.fail(f"rank {out[-1][1]} failed:\n{out[-1][2]}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # its partner failed and left it waiting in a collective
                p.kill()
    return out


@pytest.mark.parametrize("loss_kind", ["online", "topk"])
@pytest.mark.parametrize("world,bias,compiled", [(2, True, False), (3, False, False), (2, True, True)])
def test_fsdp2_head_equals_one_process(tmp_path, rng, loss_kind, world, bias, compiled):
    seed = int(rng.integers(2**31))
    out = _run(world, tmp_path, seed, loss_kind, bias, compiled)
    for rank, loss, whole_loss, errors, weight_type, grad_type in out:
        assert (weight_type, grad_type) == ("DTensor", "DTensor"), (rank, weight_type, grad_type)
        assert abs(loss - whole_loss) <= 1e-5 * abs(whole_loss), (seed, rank, loss, whole_loss)
        for name, err in errors.items():
            assert err <= 1e-5, (seed, rank, name, err)


def _placement_rank(rank, world, rendezvous, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from jsdgpu.torch import FusedLinearJSDLoss
    try:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        x, xt, labels, _, _ = _batch(0, T_RANK)
        w = distribute_tensor(torch.randn(V, H), mesh, [Shard(1)])  # along the hidden dimension
        try:
            FusedLinearJSDLoss()(x, w, xt, torch.randn(V, H), labels)
            results.put((rank, "no error"))
        except ValueError as e:
            results.put((rank, str(e)))
    except BaseException:  # noqa: BLE001
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_head_sharded_otherwise_raises_naming_its_placement(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_placement_rank, args=(r, 2, rendezvous, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = [results.get(timeout=120) for _ in range(2)]
    for p in procs:
        p.join(timeout=30)
    for rank, message, *rest in out:
        assert rank != "error", rest
        assert "student_weight" in message and "Shard(dim=1)" in message, message


def test_gathered_leaves_plain_tensors_alone():
    from jsdgpu.torch_sharding import plain_inputs
    t = torch.ones(3)
    assert plain_inputs(student_weight=t, student_bias=None)["student_weight"] is t
    assert np.array_equal(plain_inputs(student_input=t)["student_input"].numpy(), np.ones(3))
