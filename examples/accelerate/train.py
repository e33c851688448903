"""An Accelerate training loop run as a gpuflex gang, launched by `accelerate launch`
with one process per worker:

    gpuflex submit --workers 2 -- accelerate launch --num_processes 1 examples/accelerate/train.py --out /shared/run1
    gpuflex submit --workers 2 -- accelerate launch --num_processes 1 --cpu examples/accelerate/train.py ...  # CPU pool

gpuflex starts the processes, one per worker, with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `Accelerator()` reads it. So
`accelerate launch` must start no more processes of its own: `--num_processes 1` (without
it, a host that shows it several GPUs makes it start torchrun with one process per GPU,
a second world on top of gpuflex's), and no config file that names several processes or
machines. It then runs the script with its settings (`--mixed_precision`, ...) in the
environment. On CPU hosts `--cpu` is needed (ACCELERATE_USE_CPU; `Accelerator(cpu=True)`
in code does the same): without it Accelerate starts the process group but each worker
trains alone, as under torchrun. `python train.py` with the same settings in code is the
same run.

The global batch is held fixed (--global-batch-size over the world size), so the run
follows a 1-process run's steps, up to float summation order. The model is a tiny GPT-2
built from its config and the data are generated token sequences: nothing is downloaded.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, gather_object
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the report (rank 0)")
    ap.add_argument("--global-batch-size", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    # the seedable sampler: the same sample order at any world size, one per epoch
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    world = accelerator.num_processes
    if args.global_batch_size % world:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} does not divide over {world} workers")
    torch.manual_seed(args.seed)   # the same initial model on every rank
    model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.width,
                                       n_layer=args.layers, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = torch.utils.data.DataLoader(Sequences(args.samples, args.seq_len, args.vocab, 1),
                                         batch_size=args.global_batch_size // world, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    seen, losses = [], []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.extend(batch["index"].tolist())
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

    seen = gather_object([seen])   # every rank's list, in rank order
    if accelerator.is_main_process:
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in accelerator.unwrap_model(model).parameters()])
        report = {"world_size": world, "distributed_type": str(accelerator.distributed_type),
                  "steps": len(losses), "losses": losses, "params": flat.tolist(), "seen": seen}
        os.makedirs(args.out, exist_ok=True)
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
