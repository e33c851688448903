"""examples/cnn_bn/ddp.py converted to gpuflex.elastic: diff the two.

BatchNorm normalizes each rank's share with that share's statistics, so the math depends on
the split: a resized run is close to a standalone one, not equal (docs/converting.md gives
the tolerance). The running statistics follow DDP's rule: rank 0's are broadcast each step.
With GPUFLEX_EXACT=bitwise (GPUFLEX_UNIT: samples per unit, default the global batch / 8)
each unit normalizes with its own statistics, and a resized run has the standalone's bits.

    python examples/cnn_bn/elastic.py --epochs 2 --report /tmp/ref.json      # standalone
    gpuflex submit --workers 2:3 -- python examples/cnn_bn/elastic.py --step-sleep 0.05
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from gpuflex.elastic import ElasticRun

CLASSES, SIDE = 10, 16


class SyntheticImages(Dataset):
    """Deterministic RGB images (no download): one smooth pattern per class plus noise.
    Odd indices are read mirrored, the way an augmentation would be, without any RNG."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(1234)
        self.patterns = torch.randn(CLASSES, 3, SIDE // 4, SIDE // 4, generator=g)
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        self.noise = 0.8 * torch.randn(n, 3, SIDE, SIDE, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        label = int(self.labels[i])
        img = F.interpolate(self.patterns[label][None], size=(SIDE, SIDE), mode="bilinear")[0] + self.noise[i]
        return (img.flip(-1) if i % 2 else img), label


def make_model(dropout):
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(32, CLASSES))


def flat(tensors):
    t = torch.cat([x.detach().reshape(-1).float() for x in tensors])
    return hashlib.sha256(bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())).hexdigest(), t.tolist()


def maybe_raise(args, step, rank):
    """--raise-at-step K --raise-rank R: a bug on one rank (the crash tests)."""
    if step == args.raise_at_step and rank == args.raise_rank:
        raise RuntimeError(f"injected failure at step {step} on rank {rank}")


def write_report(path, rank, model, opt, args, steps, loss, step_log, samples):
    """Every rank writes PATH.rank<r> (its state's checksums); rank 0 also writes PATH."""
    params_sha, params = flat(model.parameters())
    buffers_sha, buffers = flat(b for b in model.buffers() if b.is_floating_point())
    opt_sha = flat(s["momentum_buffer"] for s in opt.state.values())[0]   # SGD's momentum
    with open(f"{path}.rank{rank}", "w") as f:
        json.dump({"params_sha256": params_sha, "buffers_sha256": buffers_sha, "optimizer_sha256": opt_sha}, f)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"steps": steps, "epochs": args.epochs, "global_batch_size": args.global_batch_size,
                       "loss": loss, "params_sha256": params_sha, "params": params, "optimizer_sha256": opt_sha,
                       "buffers_sha256": buffers_sha, "buffers": buffers, "step_log": step_log,
                       "samples": {str(e): v for e, v in samples.items()}}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1536)
    ap.add_argument("--global-batch-size", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH",
                    help="sleep --step-sleep after a step only while PATH exists (a test holds the pace)")
    ap.add_argument("--raise-at-step", type=int, default=-1)
    ap.add_argument("--raise-rank", type=int, default=0)
    ap.add_argument("--report")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    ds = SyntheticImages(args.samples)
    model = make_model(args.dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)
    run = ElasticRun(model=model, optimizer=opt, scheduler=sched, num_samples=len(ds), epochs=args.epochs,
                     global_batch_size=args.global_batch_size, seed=args.seed, track_samples=args.report is not None)
    loader = run.loader(ds, num_workers=2)
    logged = None
    for epoch in run.epochs():
        model.train()
        for x, y in loader:
            maybe_raise(args, run.step, run.rank)
            opt.zero_grad()
            for xb, yb in run.accumulate(x, y):   # the share; its units under GPUFLEX_EXACT=bitwise
                loss = F.cross_entropy(model(xb), yb)
                run.backward(loss)
            opt.step()
            sched.step()
            logged = run.global_mean(loss)
            if args.step_sleep and (args.sleep_while is None or os.path.exists(args.sleep_while)):
                time.sleep(args.step_sleep)
        if run.is_primary:
            print(f"epoch {epoch}: loss {logged:.4f}", flush=True)
    if args.report:
        write_report(args.report, run.rank, model, opt, args, run.step, logged, run.step_log, run.samples)


if __name__ == "__main__":
    main()
