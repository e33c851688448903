"""The baseline: the example's training step with plain DDP under torchrun.

Same model, optimizer, LR schedule, data, sample order (the elastic sampler's pure index
arithmetic), noise and loss as examples/elastic_mlp.py; only the distribution layer differs (DDP, fixed world).
On a membership change torchrun restarts every worker; this script then reloads its last
checkpoint (rank 0 writes one every --ckpt-every steps), as an elastic torchrun job must.
Rank 0 appends `step time world` to --steps-file after each step.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from ddp_mlp import D_IN, D_OUT, N, make_data, make_model  # noqa: E402

from gpuflex.elastic.data.sampler import ElasticSampler  # noqa: E402  (index arithmetic only)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10000)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--ckpt")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--steps-file", required=True)
    ap.add_argument("--flush-every", type=int, default=0, help="flush the step log every N steps (0: at exit)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = make_data()
    model = make_model(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    sampler = ElasticSampler(N, args.global_batch_size, epochs=args.epochs, seed=0)
    step = 0
    if args.ckpt and os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
    model = DDP(model)
    log = open(args.steps_file, "a") if rank == 0 else None
    while step < sampler.total_steps:
        batch = sampler.batch(step, rank, world)
        xb, yb = x[batch.indices], y[batch.indices]
        noise = 0.01 * torch.randn(batch.global_size, D_IN)[batch.slice]
        # DDP averages over ranks: scale the per-rank sum so the result is the batch mean
        loss = F.mse_loss(model(xb + noise), yb, reduction="sum") * world / (batch.global_size * D_OUT)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if log:
            log.write(f"{step} {time.time()} {world}\n")
            if args.ckpt or (args.flush_every and step % args.flush_every == 0):   # watched while it runs
                log.flush()
            if args.ckpt and step % args.ckpt_every == 0:
                tmp = args.ckpt + ".tmp"
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step}, tmp)
                os.replace(tmp, args.ckpt)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if log:
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
