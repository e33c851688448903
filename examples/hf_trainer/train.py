"""A Hugging Face `Trainer` script that runs unchanged as a gpuflex gang and as a
restart-elastic job, at a global batch that does not change with the world size.

    gpuflex submit --workers 2 -- python examples/hf_trainer/train.py --output-dir /shared/run1
    gpuflex submit --elastic restart --workers 1:3 -- \\
        python examples/hf_trainer/train.py --output-dir /shared/run2
    gpuflex scale JOB 3       # the gang is stopped and started again at 3; it resumes

Nothing here knows gpuflex. The Trainer reads torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which every gpuflex worker has, and trains with
DDP: NCCL on GPUs, gloo on CPUs (`use_cpu=True` there, or each worker trains alone). A
restart-elastic job needs two things more:

- The global batch is held fixed: per-device batch x world size x gradient accumulation
  = --global-batch-size, the split chosen from WORLD_SIZE at each start (`batch_plan`).
  A resize then changes how each optimizer step is computed, not what it computes: the
  Trainer's sampler gives global batch k the same samples at any world size, so the run
  follows the fixed-size run's steps, up to float summation order.
- It resumes from its own newest complete checkpoint (`--save-steps`, `output_dir` on a
  file system every host sees). A resize stops the gang with SIGTERM: the steps since the
  last checkpoint are done again, and a checkpoint cut short by the stop is skipped
  (`last_complete_checkpoint`; Trainer's own `resume_from_checkpoint=True` would take it).

The model is a tiny GPT-2 built from its config and the data are generated token
sequences, so it runs anywhere with nothing downloaded; put your model and data there.
"""

import argparse
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class Sequences(torch.utils.data.Dataset):
    """`n` sequences of `length` tokens, each a start and a stride modulo `vocab`: a
    pattern a small model learns in a few steps."""

    def __init__(self, n: int, length: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(length)) % vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def batch_plan(global_batch: int, world: int, max_per_device: int) -> tuple[int, int]:
    """(per-device batch, gradient accumulation steps) whose product with `world` is
    `global_batch`: the fewest accumulation steps that keep the per-device batch within
    `max_per_device` (your device's memory)."""
    if global_batch % world:
        raise SystemExit(f"--global-batch-size {global_batch} does not divide over {world} workers; "
                         "pick one that every world size the job may take divides")
    share = global_batch // world
    accumulation = next(a for a in range(1, share + 1) if share % a == 0 and share // a <= max_per_device)
    return share // accumulation, accumulation


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest checkpoint-N in `output_dir` whose trainer_state.json (written last)
    reads; None when there is none. All ranks see the same files: the gang starts only
    once the one before it has stopped."""
    steps = sorted((int(m.group(1)) for m in map(CHECKPOINT.match, os.listdir(output_dir)) if m),
                   reverse=True) if os.path.isdir(output_dir) else []
    for step in steps:
        path = os.path.join(output_dir, f"checkpoint-{step}")
        try:
            with open(os.path.join(path, "trainer_state.json")) as f:
                json.load(f)
            return path
        except (OSError, ValueError):
            print(f"skipping {path}: cut short", flush=True)
    return None


class Pace(TrainerCallback):
    """Sleep after each step while a file exists (a demo or a test holds the pace to
    resize the job mid-run)."""

    def __init__(self, seconds: float, path: str | None):
        self.seconds, self.path = seconds, path

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds and (self.path is None or os.path.exists(self.path)):
            time.sleep(self.seconds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir", required=True, help="checkpoints and runs.jsonl; shared by every host")
    ap.add_argument("--global-batch-size", type=int, default=12)
    ap.add_argument("--max-per-device", type=int, default=4, help="the largest per-device batch")
    ap.add_argument("--max-steps", type=int, default=32)
    ap.add_argument("--save-steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", help="rank 0 writes the final step, losses and parameters here (JSON)")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH", help="sleep --step-sleep after a step only while PATH exists")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device, accumulation = batch_plan(args.global_batch_size, world, args.max_per_device)
    resume = last_complete_checkpoint(args.output_dir)

    torch.manual_seed(args.seed)   # the same initial model on every rank
    model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.width,
                                       n_layer=args.layers, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=args.lr,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=2,
        seed=args.seed, data_seed=args.seed, logging_steps=1, report_to="none", disable_tqdm=True,
        ddp_find_unused_parameters=False,
        # CPU workers (a cpu:N pool) must say so: without it the Trainer starts the process
        # group but trains each worker alone, as under torchrun
        use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=training, train_dataset=Sequences(args.samples, args.seq_len, args.vocab, 1),
                      callbacks=[Pace(args.step_sleep, args.sleep_while)])
    rank = training.process_index
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "runs.jsonl"), "a") as f:
            f.write(json.dumps({"restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                "world_size": world, "per_device": per_device, "accumulation": accumulation,
                                "from_step": int(resume.rsplit("-", 1)[1]) if resume else 0}) + "\n")
    trainer.train(resume_from_checkpoint=resume)

    if rank == 0 and args.report:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        report = {"global_step": trainer.state.global_step, "world_size": training.world_size,
                  "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
                  "params": flat.tolist()}
        with open(args.report + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(args.report + ".tmp", args.report)
    finish()


def finish():
    """Leave the process group and exit 0 without the interpreter's finalization: torch
    2.13's known exit race on gloo aborts a few percent of DDP processes after their work
    is done (README, "Bring your torchrun script")."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
