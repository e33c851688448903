"""A small transformer language model on synthetic tokens, sharded with FSDP2 by gpuflex.elastic
(issue 13): `shard=Block` gives each block its own fully_shard (the root gets one too), the
optimizer is a function of the parameters (the runtime builds it on them before they are
sharded, and keeps it as they are resharded), and a resize moves shards in place.

    python examples/elastic_fsdp.py --epochs 2 --report /tmp/ref.json               # standalone (one shard)
    python examples/elastic_fsdp.py --epochs 2 --no-shard --report /tmp/plain.json  # the unsharded reference
    gpuflex submit --workers 2:4 -- python examples/elastic_fsdp.py --step-sleep 0.05

Options and `--report` are examples/elastic_mlp.py's (`--untracked`: a report without the
samples, so the step's vote carries no sample ids); the report's `params` are the full
parameters, gathered by every member in the last step (`run.full_parameters()`, an
all-gather: under FSDP every forward and that gather are collectives, so no rank runs one
alone, e.g. an evaluation on rank 0 only).
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gpuflex.elastic import ElasticRun
from gpuflex.testbed import add_device_args, device_work

VOCAB, BLOCK, N = 32, 16, 384


def make_data():
    """Windows of a token stream from a fixed random Markov chain (no download): each
    token's successor is one of 3 likely ones, so there is something to learn."""
    g = torch.Generator().manual_seed(1234)
    likely = torch.randint(0, VOCAB, (VOCAB, 3), generator=g)
    stream = [0]
    for _ in range(N + BLOCK):
        row = likely[stream[-1]]
        stream.append(int(row[torch.randint(0, 3, (1,), generator=g)]) if torch.rand(1, generator=g) < 0.9
                      else int(torch.randint(0, VOCAB, (1,), generator=g)))
    tokens = torch.tensor(stream)
    x = torch.stack([tokens[i:i + BLOCK] for i in range(N)])
    return x, torch.stack([tokens[i + 1:i + BLOCK + 1] for i in range(N)])


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # no bias on q, k, v: the key bias's true gradient is 0 (softmax ignores a shift), so
        # its gradient is rounding noise, which AdamW scales into lr-sized steps: runs that
        # sum in another order would differ there by ~lr, hiding real differences
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class LM(nn.Module):
    def __init__(self, d, layers=2, heads=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(BLOCK, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def write_report(path, params, args, steps, step_log, samples):
    flat = torch.cat([p.reshape(-1).float() for p in params.values()])
    report = {"steps": steps, "epochs": args.epochs, "global_batch_size": args.global_batch_size,
              "params_sha256": hashlib.sha256(bytes(flat.contiguous().view(torch.uint8).reshape(-1).tolist())).hexdigest(),
              "params": flat.tolist(), "samples": {str(e): v for e, v in samples.items()},
              "step_log": step_log}
    with open(path, "w") as f:
        json.dump(report, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH",
                    help="sleep --step-sleep after a step only while PATH exists (a test holds the pace)")
    ap.add_argument("--busy-at", type=int, nargs="*", default=[],
                    help="steps after whose optimizer step rank 0 is busy (--busy-s), e.g. an evaluation")
    ap.add_argument("--busy-s", type=float, default=0.0)
    ap.add_argument("--no-shard", action="store_true", help="data parallel, unsharded (the reference)")
    ap.add_argument("--report")
    ap.add_argument("--untracked", action="store_true",
                    help="no sample tracking (the report's samples empty): the step's vote carries no sample ids")
    add_device_args(ap)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    x, y = make_data()
    model = LM(args.hidden)
    make_opt = lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)  # noqa: E731
    make_sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)  # noqa: E731
    if args.no_shard:
        opt = make_opt(model.parameters())
        shard, sched = {}, make_sched(opt)
    else:
        opt, shard, sched = make_opt, {"shard": Block}, make_sched
    run = ElasticRun(model=model, optimizer=opt, scheduler=sched, num_samples=N, seed=args.seed, epochs=args.epochs,
                     global_batch_size=args.global_batch_size, track_samples=args.report is not None and not args.untracked, **shard)
    opt, sched = run.optimizer, run.scheduler
    loader, params = run.loader(TensorDataset(x, y)), None
    for epoch in run.epochs():
        for xb, yb in loader:
            for mx, my in run.accumulate(xb, yb, micro_batch_size=args.micro_batch_size):
                logits = model(mx)
                device_work(args, len(mx))   # simulated device time, after the forward: in the step's compute
                run.backward(F.cross_entropy(logits.reshape(-1, VOCAB), my.reshape(-1)))
            opt.step()
            opt.zero_grad()
            sched.step()
            if args.report and run.step == args.epochs * run.sampler.steps_per_epoch - 1:
                params = run.full_parameters()   # every member: an all-gather under FSDP
            if run.is_primary and run.step in args.busy_at:
                time.sleep(args.busy_s)
            if args.step_sleep and (args.sleep_while is None or os.path.exists(args.sleep_while)):
                time.sleep(args.step_sleep)
    if run.is_primary and args.report:
        write_report(args.report, params, args, run.step, run.step_log, {} if args.untracked else run.samples)


if __name__ == "__main__":
    main()
