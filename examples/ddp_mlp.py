"""A plain DDP training script: the "before" of examples/elastic_mlp.py (diff the two).

    torchrun --nproc-per-node 2 examples/ddp_mlp.py --epochs 2
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

D_IN, D_OUT, N = 16, 4, 2048


def make_data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, D_IN, generator=g)
    w = torch.randn(D_IN, D_OUT, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(N, D_OUT, generator=g)


def make_model(hidden):
    return torch.nn.Sequential(torch.nn.Linear(D_IN, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, D_OUT))


def write_report(path, model, args, steps, step_log, samples):
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    report = {"steps": steps, "epochs": args.epochs, "global_batch_size": args.global_batch_size,
              "params_sha256": hashlib.sha256(bytes(flat.contiguous().view(torch.uint8).reshape(-1).tolist())).hexdigest(),
              "params": flat.tolist(), "samples": {str(e): v for e, v in samples.items()},
              "step_log": step_log}
    with open(path, "w") as f:
        json.dump(report, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH",
                    help="sleep --step-sleep after a step only while PATH exists (a demo holds the pace)")
    ap.add_argument("--report")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    x, y = make_data()
    model = DDP(make_model(args.hidden))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    sampler = DistributedSampler(TensorDataset(x, y), seed=args.seed)
    loader = DataLoader(TensorDataset(x, y), args.global_batch_size // dist.get_world_size(), sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            noise = 0.01 * torch.randn(xb.shape)
            loss = F.mse_loss(model(xb + noise), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if args.step_sleep and (args.sleep_while is None or os.path.exists(args.sleep_while)):
                time.sleep(args.step_sleep)
    if dist.get_rank() == 0 and args.report:
        write_report(args.report, model.module, args, len(loader) * args.epochs, [], {})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
