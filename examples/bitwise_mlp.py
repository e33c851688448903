"""examples/elastic_mlp.py in bitwise mode (`exact="bitwise"`, docs/converting.md): the same
model, data and schedule, each unit of the global batch its own forward and backward
(`run.accumulate` yields the units), so whatever resizes, kills and re-splits the job goes
through, it ends with the bits of a standalone run.

    python examples/bitwise_mlp.py --epochs 2 --report /tmp/ref.json      # standalone
    gpuflex submit --workers 1:4 -- python examples/bitwise_mlp.py --step-sleep 0.05
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from elastic_mlp import D_IN, N, make_data, make_model, write_report
from gpuflex.elastic import ElasticRun
from gpuflex.testbed import add_device_args, device_work


def sha256(tensors):
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    return hashlib.sha256(bytes(flat.contiguous().view(torch.uint8).reshape(-1).tolist())).hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--unit", type=int, help="samples per unit (default: the global batch / 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH",
                    help="sleep --step-sleep after a step only while PATH exists (a test holds the pace)")
    ap.add_argument("--report")
    add_device_args(ap)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    x, y = make_data()
    model = make_model(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    run = ElasticRun(model=model, optimizer=opt, scheduler=sched, num_samples=N, seed=args.seed, epochs=args.epochs,
                     global_batch_size=args.global_batch_size, track_samples=args.report is not None,
                     exact="bitwise", unit=args.unit)
    loader = run.loader(TensorDataset(x, y))
    for epoch in run.epochs():
        for xb, yb in loader:
            noise = 0.01 * torch.randn(run.batch.global_size, D_IN)[run.batch.slice]  # one draw per global batch
            opt.zero_grad()
            for xu, yu, nu in run.accumulate(xb, yb, noise):   # unit by unit, each under its own RNG stream
                loss = F.mse_loss(model(xu + nu), yu)
                device_work(args, len(xu))   # the unit's simulated device time, after its forward
                run.backward(loss)
            opt.step()
            sched.step()
            if args.step_sleep and (args.sleep_while is None or os.path.exists(args.sleep_while)):
                time.sleep(args.step_sleep)
    if run.is_primary and args.report:
        write_report(args.report, model, args, run.step, run.step_log, run.samples)
        with open(args.report) as f:
            report = json.load(f)
        report["optimizer_sha256"] = sha256(s["momentum_buffer"] for s in opt.state.values())
        with open(args.report, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
