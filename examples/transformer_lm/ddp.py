"""A plain DDP script in the shape of nanoGPT's train.py: a small character-level GPT,
trained for a number of steps with gradient accumulation, a warm-up + cosine learning rate,
gradient clipping, and rank 0 estimating the train/val loss at an interval (keeping the
best). The "before" of elastic.py (diff the two).

    torchrun --nproc-per-node 2 examples/transformer_lm/ddp.py --steps 40
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

WORDS = ("the cat dog bird sat ran flew on under over a mat log tree and then quickly slowly "
         "saw heard big small red green house river stone").split()


def make_text(n_chars):
    """A deterministic corpus (no download): sentences from a tiny grammar."""
    rnd, out, size = random.Random(1234), [], 0
    while size < n_chars:
        s = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 9))).capitalize() + ". "
        out.append(s)
        size += len(s)
    return "".join(out)[:n_chars]


class Windows(Dataset):
    """Block-sized windows of a token sequence and the same shifted by one (the targets)."""

    def __init__(self, data, block_size, stride):
        self.data, self.block_size, self.stride = data, block_size, stride

    def __len__(self):
        return (len(self.data) - self.block_size - 1) // self.stride

    def __getitem__(self, i):
        chunk = self.data[i * self.stride:i * self.stride + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))
        self.resid_dropout = nn.Dropout(dropout)

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer=2, n_head=2, n_embd=48, dropout=0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight   # weight tying

    def forward(self, idx, targets=None):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def get_lr(it, args):
    """nanoGPT's schedule: linear warm-up, then cosine decay to a tenth."""
    if it < args.warmup_steps:
        return args.lr * (it + 1) / (args.warmup_steps + 1)
    ratio = min(1.0, (it - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


@torch.no_grad()
def estimate_loss(model, splits, args):
    """The mean loss over the first eval_iters batches of each split (rank 0 only)."""
    model.eval()
    out = {}
    for name, ds in splits.items():
        losses = [model(x, y)[1].item() for (x, y), _ in zip(DataLoader(ds, args.micro_batch_size), range(args.eval_iters))]
        out[name] = sum(losses) / len(losses)
    if args.eval_sleep:
        time.sleep(args.eval_sleep)   # a slower evaluation: a bigger model, more batches
    model.train()
    return out


def maybe_raise(args, step, rank):
    """--raise-at-step K --raise-rank R: a bug on one rank (the crash tests)."""
    if step == args.raise_at_step and rank == args.raise_rank:
        raise RuntimeError(f"injected failure at step {step} on rank {rank}")


def write_report(path, model, args, steps, loss, best_val_loss, evals, step_log, samples):
    t = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    with open(path, "w") as f:
        json.dump({"steps": steps, "loss": loss, "best_val_loss": best_val_loss, "evals": evals,
                   "params_sha256": hashlib.sha256(bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())).hexdigest(), "params": t.tolist(),
                   "step_log": step_log, "samples": {str(e): v for e, v in samples.items()}}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch-size", type=int, default=24)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--eval-interval", type=int, default=20)
    ap.add_argument("--eval-iters", type=int, default=4)
    ap.add_argument("--eval-sleep", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH",
                    help="sleep --step-sleep after a step only while PATH exists (a test holds the pace)")
    ap.add_argument("--raise-at-step", type=int, default=-1)
    ap.add_argument("--raise-rank", type=int, default=0)
    ap.add_argument("--out-dir")
    ap.add_argument("--report")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    text = make_text(24000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    n = int(0.9 * len(data))
    train_ds, val_ds = Windows(data[:n], args.block_size, 8), Windows(data[n:], args.block_size, 8)
    model = DDP(GPT(len(chars), args.block_size, dropout=args.dropout))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    best_val_loss, evals, loss_mean = 1e9, [], None
    sampler = DistributedSampler(train_ds, seed=args.seed)
    loader = DataLoader(train_ds, args.global_batch_size // world, sampler=sampler, drop_last=True)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    for step, (x, y) in zip(range(args.steps), batches()):
        for group in opt.param_groups:
            group["lr"] = get_lr(step, args)
        if step % args.eval_interval == 0 and rank == 0:
            losses = estimate_loss(model.module, {"train": train_ds, "val": val_ds}, args)
            evals.append([step, losses["train"], losses["val"]])
            print(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                if args.out_dir and step > 0:
                    torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(args.out_dir, "ckpt.pt"))
        maybe_raise(args, step, rank)
        micro, step_loss = list(zip(x.split(args.micro_batch_size), y.split(args.micro_batch_size))), 0.0
        for i, (xb, yb) in enumerate(micro):
            with model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                _, loss = model(xb, yb)
                (loss * len(xb) / len(x)).backward()
            step_loss += loss.item() * len(xb) / len(x)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_mean = torch.tensor(step_loss)
        dist.all_reduce(loss_mean)
        loss_mean = loss_mean.item() / world
        if args.step_sleep and (args.sleep_while is None or os.path.exists(args.sleep_while)):
            time.sleep(args.step_sleep)
    if rank == 0 and args.report:
        write_report(args.report, model.module, args, args.steps, loss_mean, best_val_loss, evals, [], {})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)   # torch 2.13 gloo exit race (examples/torchrun/ddp_tutorial.py): no interpreter teardown
