"""The README's code blocks run as they are: the CPU ones here, the GPU ones (CuPy, a CUDA graph,
a PyTorch training step) where there is a GPU. Each block is read from the README by its marker
(<!-- name -->), so what a reader pastes is what runs."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_block(marker):
    """The python block after <!-- marker --> in the README."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```python\n(.*?)```", text, re.S)
    assert match, marker
    return match.group(1)


def run_block(marker, namespace=None):
    namespace = {} if namespace is None else namespace
    exec(compile(readme_block(marker), f"README.md ({marker})", "exec"), namespace)
    return namespace


def printed_losses(capsys):
    return [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()]


def test_every_python_block_is_marked():
    """A python block without a marker would run in no test (<!-- sketch --> marks the one that
    needs several GPUs, said so in the README, and run by tests/test_parallel.py's own code)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"(<!-- [\w-]+ -->\s*)?```python\n", text)
    assert blocks and all(blocks), "a python block of the README has no <!-- marker --> (tests/test_readme.py)"


def test_numpy_example(capsys):
    ns = run_block("numpy-example")
    loss, hard, soft = (float(x) for x in capsys.readouterr().out.split())
    assert abs(loss - 0.5 * hard - 0.5 * soft) <= 1e-5 * loss
    assert ns["grad_xs"].shape == ns["xs"].shape and ns["grad_bias"] is None


def test_offline_distillation_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # it saves its top-k in the working directory
    run_block("offline-example")
    losses = printed_losses(capsys)
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_jax_example(capsys):
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    run_block("jax-example")
    losses = printed_losses(capsys)
    assert len(losses) == 5 and all(x == x for x in losses) and losses[-1] < losses[0], losses


@pytest.mark.gpu
def test_cupy_and_cuda_graph_examples(capsys):
    pytest.importorskip("cupy")
    ns = run_block("cupy-example")
    assert ns["grad_ws"].dtype == ns["ws"].dtype
    first = printed_losses(capsys)[0]
    run_block("cuda-graph-example", ns)  # the graph block goes on from the CuPy block's arrays
    replays = printed_losses(capsys)
    assert len(replays) == 3 and len(set(replays)) == 3, replays  # new inputs, new losses
    assert all(abs(x - first) <= 0.2 * first for x in replays), (first, replays)


@pytest.mark.gpu
def test_torch_example(capsys):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    run_block("torch-example")
    losses = printed_losses(capsys)
    assert len(losses) == 5 and all(x == x for x in losses) and losses[-1] < losses[0], losses
