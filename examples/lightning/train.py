"""A Lightning script that runs unchanged as a gpuflex gang, through torchrun, and as a
restart-elastic job, at a global batch that does not change with the world size.

    gpuflex submit --workers 2 -- python examples/lightning/train.py --out /shared/run1
    gpuflex submit --workers 2 -- torchrun --nproc-per-node 1 examples/lightning/train.py --out /shared/run2
    gpuflex submit --elastic restart --workers 1:3 -- python examples/lightning/train.py --out /shared/run3

Lightning counts its world as nodes x devices per node and checks the product against
WORLD_SIZE; a worker's device is `devices[LOCAL_RANK]`. Both numbers come from torchrun's
environment, which gpuflex gives every worker (LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE; with
TORCHELASTIC_RUN_ID set Lightning takes the rest from it, as under torchrun), so the
Trainer is given them rather than constants: two workers of a gang on one host are
`devices=2, num_nodes=1` (with `devices=1, num_nodes=2` worker 1 has no device and fails,
under torchrun too), and under `torchrun --nproc-per-node 1` each worker is its own node,
`devices=1, num_nodes=2`, wherever the workers are placed.

For a restart-elastic job (Lightning 2.6 needs three things of it):
- The global batch is held fixed: per-device batch x world size x accumulate_grad_batches
  = --global-batch-size. The accumulation stays the same at every size and the per-device
  batch changes (`per_device_batch`): Lightning counts an epoch's progress in each rank's
  batches, so a checkpoint restored where an epoch holds more of them resumes that epoch
  at the wrong batch.
- It checkpoints on the last step of each epoch (`every_n_train_steps` = the steps of an
  epoch; `last.ckpt`, written atomically) and resumes with `ckpt_path="last"`: the next
  epoch starts at its first batch. A resize mid-epoch redoes the epoch's steps. Not
  `every_n_epochs=1`: that checkpoint (taken in on_train_epoch_end) resumes one step late
  (Lightning's issue 19403), every epoch after it shifted by a step. Nor one taken
  mid-epoch: a plain DataLoader cannot resume, so the epoch's data would start over
  (Lightning warns), some samples seen twice and others not at all.
- The sampler's epoch comes from the steps done (`StepEpochSampler`), not from
  Lightning's epoch count, which a resumed run records one short in its next checkpoint.
  Global batch k is then the same samples at any world size, and the run follows the
  fixed-size run's steps, up to float summation order.

The model is a tiny GPT-2 built from its config and the data are generated token
sequences, so it runs anywhere with nothing downloaded; put your model and data there.
"""

import argparse
import json
import os
import sys
import time

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from transformers import GPT2Config, GPT2LMHeadModel


class Sequences(torch.utils.data.Dataset):
    """`n` sequences of `length` tokens, each a start and a stride modulo `vocab`."""

    def __init__(self, n: int, length: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(length)) % vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "index": i}


class StepEpochSampler(torch.utils.data.DistributedSampler):
    """A DistributedSampler whose epoch is the optimizer steps done over the steps of an
    epoch, read as each epoch's iteration starts, in place of the epoch Lightning sets: a
    run resumed from a checkpoint takes its next one with the epoch counted one short
    (Lightning 2.6), and resumed from that, it would repeat an epoch's sample order."""

    def __init__(self, dataset, steps_done, steps_per_epoch: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self.steps_done, self.steps_per_epoch = steps_done, steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        pass   # Lightning's count; ours comes from the steps done

    def __iter__(self):
        self.epoch = self.steps_done() // self.steps_per_epoch
        return super().__iter__()


def per_device_batch(global_batch: int, world: int, accumulation: int) -> int:
    """The per-device batch whose product with `world` and `accumulation` is `global_batch`."""
    if global_batch % (world * accumulation):
        raise SystemExit(f"--global-batch-size {global_batch} does not divide over {world} workers x "
                         f"{accumulation} accumulation steps; pick one that every world size the job may take divides")
    return global_batch // (world * accumulation)


class TinyLM(L.LightningModule):
    def __init__(self, vocab: int, length: int, width: int, layers: int, lr: float):
        super().__init__()
        self.lr = lr
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=length, n_embd=width, n_layer=layers,
                                                n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                bos_token_id=None, eos_token_id=None))
        self.seen: list[int] = []   # the sample indices this rank trained on, in order

    def training_step(self, batch, batch_idx):
        self.seen.extend(batch["index"].tolist())
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class RunLog(Callback):
    """Rank 0 appends this run's world size and the step it starts from to runs.jsonl,
    and sleeps --step-sleep after each step while --sleep-while exists (a demo or a test
    holds the pace to resize the job mid-run)."""

    def __init__(self, out: str, plan: tuple[int, int], sleep_s: float, sleep_while: str | None):
        self.out, self.plan, self.sleep_s, self.sleep_while = out, plan, sleep_s, sleep_while

    def on_train_start(self, trainer, pl_module):   # after the checkpoint is restored
        if trainer.is_global_zero:
            with open(os.path.join(self.out, "runs.jsonl"), "a") as f:
                f.write(json.dumps({"restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                    "world_size": trainer.world_size, "per_device": self.plan[0],
                                    "accumulation": self.plan[1], "from_step": trainer.global_step}) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.sleep_s and (self.sleep_while is None or os.path.exists(self.sleep_while)):
            time.sleep(self.sleep_s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="checkpoints, runs.jsonl and the report; shared by every host")
    ap.add_argument("--global-batch-size", type=int, default=12)
    ap.add_argument("--accumulation", type=int, default=1, help="accumulate_grad_batches, the same at every size")
    ap.add_argument("--max-steps", type=int, default=32)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH")
    args = ap.parse_args()

    # torchrun's layout, from gpuflex or from torchrun itself (1 and 1: a single process)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    num_nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    plan = (per_device_batch(args.global_batch_size, devices * num_nodes, args.accumulation), args.accumulation)
    os.makedirs(args.out, exist_ok=True)

    L.seed_everything(args.seed, verbose=False)   # the same initial model on every rank
    lm = TinyLM(args.vocab, args.seq_len, args.width, args.layers, args.lr)
    data = Sequences(args.samples, args.seq_len, args.vocab, 1)
    steps_per_epoch = len(data) // args.global_batch_size   # a data set the global batch divides
    checkpoints = ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), filename="{step}",
                                  every_n_train_steps=steps_per_epoch, save_last=True)
    trainer = L.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=devices,
                        num_nodes=num_nodes, strategy="ddp", max_steps=args.max_steps,
                        accumulate_grad_batches=plan[1], use_distributed_sampler=False,
                        callbacks=[checkpoints, RunLog(args.out, plan, args.step_sleep, args.sleep_while)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    # each rank's share of every global batch, the order seeded by --seed and the epoch
    sampler = StepEpochSampler(data, lambda: trainer.global_step, steps_per_epoch, shuffle=True, seed=args.seed,
                               num_replicas=int(os.environ.get("WORLD_SIZE", "1")),
                               rank=int(os.environ.get("RANK", "0")))
    loader = torch.utils.data.DataLoader(data, batch_size=plan[0], sampler=sampler)
    trainer.fit(lm, loader, ckpt_path="last")

    seen = [None] * trainer.world_size
    if dist.is_initialized():
        dist.all_gather_object(seen, lm.seen)
    else:
        seen = [lm.seen]
    if trainer.is_global_zero:
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in lm.parameters()])
        report = {"global_step": trainer.global_step, "world_size": trainer.world_size,
                  "params": flat.tolist(), "seen": seen}
        path = os.path.join(args.out, "report.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)
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
