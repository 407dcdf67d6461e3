"""examples/distill_hf.py, as a user runs it: a Hugging Face causal LM distilled into a smaller one
by the fused loss, in a plain loop and through transformers.Trainer, tiny configs on the CPU."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer's

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--steps", "8", "--vocab", "1000", "--teacher-hidden", "64", "--student-hidden", "32", "--layers", "2",
        "--seq", "32", "--batch", "4", "--prompt", "8"]


def _example():
    spec = importlib.util.spec_from_file_location("distill_hf", ROOT / "examples" / "distill_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("driver", [[], ["--trainer"]], ids=["loop", "trainer"])
def test_the_student_learns(tmp_path, driver):
    """Eight steps over two batches seen in turn: the last two steps' losses below the first two's."""
    losses = _example().main(TINY + driver + ["--output-dir", str(tmp_path)])
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.02, losses


def _fsdp_losses():
    """The --fsdp loop's losses, in a process of its own (its process group, one rank; the example
    asserts that the student's head weight is a DTensor there)."""
    code = ("import sys; sys.argv[1:] = {args!r}; import runpy; "
            "ns = runpy.run_path({path!r}, run_name='distill'); "
            "a = ns['main'](sys.argv[1:])").format(args=[*TINY, "--fsdp"],
                                                   path=str(ROOT / "examples" / "distill_hf.py"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return [float(x) for x in out.stdout.split()]


def test_fsdp2_student_trains_as_the_plain_one():
    """--fsdp: the student sharded by FSDP2 over one rank (its head's weight a DTensor, gathered by
    the loss) takes the plain loop's steps."""
    plain = _example().main(TINY)
    assert _fsdp_losses() == pytest.approx(plain, abs=1e-4)  # (printed to four decimals)


def test_the_loss_takes_what_the_lm_head_takes():
    """The hidden states the example passes are the LM head's inputs: the model's own logits are
    them times the head's weight, and the fused loss equals the plain loss on those logits."""
    example = _example()
    teacher, student = example.make_models(500, 64, 32, 2)
    input_ids, labels = example.make_batch(500, 2, 24, 6, torch.Generator().manual_seed(3))
    hidden = student.model(input_ids=input_ids).last_hidden_state
    torch.testing.assert_close(hidden @ student.lm_head.weight.T, student(input_ids=input_ids).logits)
    loss = example.distillation_loss(example.FusedLinearJSDLoss(beta=0.5), student, teacher, input_ids, labels)
    s, t = student(input_ids=input_ids).logits[:, :-1], teacher(input_ids=input_ids).logits[:, :-1]
    y = labels[:, 1:]
    valid = y != -100
    logp, logq = torch.log_softmax(s[valid].double(), -1), torch.log_softmax(t[valid].double(), -1)
    m = torch.logsumexp(torch.stack([logp, logq]) + torch.log(torch.tensor(0.5, dtype=torch.float64)), 0)
    jsd = 0.5 * ((logp.exp() * (logp - m)).sum(-1) + (logq.exp() * (logq - m)).sum(-1))
    ce = torch.nn.functional.cross_entropy(s[valid].double(), y[valid], reduction="none")
    plain = 0.5 * ce.mean() + 0.5 * jsd.mean()
    assert abs(float(loss) - float(plain)) <= 1e-5 * float(plain)


def test_the_readme_trainer(tmp_path):
    """The README's DistillationTrainer, as written there, trains the example's student."""
    import transformers

    from test_readme import readme_block
    example = _example()
    teacher, student = example.make_models(500, 64, 32, 2)
    namespace = dict(transformers=transformers, torch=torch, FusedLinearJSDLoss=example.FusedLinearJSDLoss,
                     teacher=teacher)
    exec(compile(readme_block("hf-trainer"), "README.md (hf-trainer)", "exec"), namespace)
    generator = torch.Generator().manual_seed(5)
    batches = [example.make_batch(500, 2, 24, 6, generator) for _ in range(2)]
    rows = [dict(input_ids=i, labels=l) for ids, labels in batches for i, l in zip(ids, labels)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                          logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    trainer = namespace["DistillationTrainer"](model=student, args=args, train_dataset=rows)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses


@pytest.mark.gpu
def test_the_student_learns_on_the_gpu():
    """The plain loop on the GPU (bf16 under autocast, fp32 master weights), and with the student
    sharded by FSDP2 over one GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    losses = _example().main(TINY)
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.02, losses
    assert _fsdp_losses() == pytest.approx(losses, abs=1e-2)  # FSDP2 over one GPU: bf16 products
