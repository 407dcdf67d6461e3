"""Distil a Hugging Face causal LM into a smaller one with jsdgpu's fused loss, end to end.

Both models are built from configs with random weights (no downloads): a teacher and a smaller
student of the same vocabulary. Each step feeds a batch of token ids whose first tokens are a
prompt (label -100: no loss there), takes both models' last hidden states (after their final
norm) and LM heads, and calls the loss on them, shifted so that position i predicts token i + 1;
the full [tokens, vocabulary] logits are never made. Two ways to drive it:

    python examples/distill_hf.py                 # a plain training loop
    python examples/distill_hf.py --trainer       # transformers.Trainer, its compute_loss replaced
    python examples/distill_hf.py --fsdp          # the loop, the student sharded by FSDP2 (this process's ranks)

What a user changes in their own trainer: the loss of a step (distillation_loss below) in place
of the model's own cross-entropy. Runs on the GPU where there is one (bf16 under autocast), else
on the CPU; --steps, --batch, --seq and the sizes are options.
"""

import argparse

import torch

from jsdgpu.torch import FusedLinearJSDLoss


def make_models(vocab, teacher_hidden, student_hidden, layers, seed=0):
    """(teacher, student): Llama-architecture causal LMs of one vocabulary, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)

    def config(hidden, n_layers):
        return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=4,
                           max_position_embeddings=512, tie_word_embeddings=False)
    teacher = LlamaForCausalLM(config(teacher_hidden, layers)).eval().requires_grad_(False)
    student = LlamaForCausalLM(config(student_hidden, max(1, layers // 2)))
    return teacher, student


def make_batch(vocab, batch, seq, prompt, generator):
    """input_ids [batch, seq] and labels: the ids themselves, -100 over the prompt."""
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = input_ids.clone()
    labels[:, :prompt] = -100
    return input_ids, labels


def distillation_loss(loss_fn, student, teacher, input_ids, labels, attention_mask=None):
    """The step's loss: the fused JSD loss on both models' last hidden states and LM heads, each
    position predicting the next token (hidden states [:, :-1] against labels [:, 1:])."""
    student_h = student.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    with torch.no_grad():
        teacher_h = teacher.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return loss_fn(student_h[:, :-1], student.lm_head.weight, teacher_h[:, :-1], teacher.lm_head.weight,
                   labels[:, 1:])


def shard_student(student, device):
    """The student under FSDP2 over a mesh of this process group's ranks (one, where there is no
    group yet): each decoder layer, the body and the LM head sharded apart. The body and the head
    are each FSDP2's root of their own, because the loss calls the body alone and reads the head's
    weight without calling the head: that weight stays sharded, a DTensor, which the loss gathers
    for its call (jsdgpu.torch_sharding)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if not dist.is_initialized():  # one rank: its store in this process (no port that another run may hold)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in student.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(student.model, mesh=mesh)
    fully_shard(student.lm_head, mesh=mesh)
    assert type(student.lm_head.weight).__name__ == "DTensor"  # what the loss then gathers
    return student


def train_loop(teacher, student, batches, lr=1e-3, device="cpu"):
    """A plain loop: the losses of its steps."""
    loss_fn = FusedLinearJSDLoss(beta=0.5, temperature=1.0)
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr)
    losses = []
    for input_ids, labels in batches:
        input_ids, labels = input_ids.to(device), labels.to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = distillation_loss(loss_fn, student, teacher, input_ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def train_with_trainer(teacher, student, batches, output_dir, lr=1e-3):
    """transformers.Trainer with its compute_loss replaced by the distillation loss: the losses it
    logged."""
    from transformers import Trainer, TrainingArguments

    class Batches(torch.utils.data.Dataset):
        def __init__(self, batches):
            self.rows = [dict(input_ids=i, labels=l) for ids, lab in batches for i, l in zip(ids, lab)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    class DistillationTrainer(Trainer):
        loss_fn = FusedLinearJSDLoss(beta=0.5, temperature=1.0)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = distillation_loss(self.loss_fn, model, teacher.to(model.device), inputs["input_ids"],
                                     inputs["labels"], inputs.get("attention_mask"))
            return (loss, None) if return_outputs else loss

    per_device = len(batches[0][0])
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=per_device, learning_rate=lr,
                             max_steps=len(batches), logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
                             dataloader_drop_last=True, disable_tqdm=True)
    trainer = DistillationTrainer(model=student, args=args, train_dataset=Batches(batches))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", action="store_true", help="drive it by transformers.Trainer")
    p.add_argument("--fsdp", action="store_true", help="the plain loop, the student sharded by FSDP2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16, help="tokens of each row without loss (label -100)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--teacher-hidden", type=int, default=256)
    p.add_argument("--student-hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--output-dir", default="/tmp/distill_hf")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    teacher, student = make_models(a.vocab, a.teacher_hidden, a.student_hidden, a.layers)
    generator = torch.Generator().manual_seed(1)
    # a few batches seen again and again, so that the student has something to learn in a short run
    data = [make_batch(a.vocab, a.batch, a.seq, a.prompt, generator) for _ in range(2)]
    batches = [data[i % len(data)] for i in range(a.steps)]
    if a.trainer:
        losses = train_with_trainer(teacher, student, batches, a.output_dir)
    else:
        student = student.to(device)
        if a.fsdp:
            student = shard_student(student, device)
        losses = train_loop(teacher.to(device), student, batches, device=device)
    print(" ".join(f"{x:.4f}" for x in losses))
    return losses


if __name__ == "__main__":
    main()
