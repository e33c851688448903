"""The baseline for a sharded job: examples/elastic_fsdp.py's training step with plain FSDP2
under torchrun (fully_shard on each Block, then the root; gloo on CPU).

Same model, optimizer, LR schedule, data and sample order (the elastic sampler's index
arithmetic) as the example run with an even split and one micro-batch per rank; only the
distribution layer differs (FSDP2 over a fixed world, its default mean reduction: every
rank takes an equal share). Rank 0 appends `step time world` to --steps-file after each step.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from elastic_fsdp import VOCAB, N, LM, Block, make_data  # noqa: E402

from gpuflex.elastic.data.sampler import ElasticSampler  # noqa: E402  (index arithmetic only)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--global-batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10000)
    ap.add_argument("--steps-file", required=True)
    ap.add_argument("--flush-every", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = make_data()
    model = LM(args.hidden)
    for block in model.blocks:
        if isinstance(block, Block):
            fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)
    sampler = ElasticSampler(N, args.global_batch_size, epochs=args.epochs, seed=0)
    log = open(args.steps_file, "a") if rank == 0 else None
    for step in range(sampler.total_steps):
        batch = sampler.batch(step, rank, world)
        logits = model(x[batch.indices])
        F.cross_entropy(logits.reshape(-1, VOCAB), y[batch.indices].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if log:
            log.write(f"{step + 1} {time.time()} {world}\n")
            if args.flush_every and (step + 1) % args.flush_every == 0:   # watched while it runs
                log.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
