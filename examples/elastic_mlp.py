"""examples/ddp_mlp.py converted to gpuflex.elastic: diff the two (15 lines changed; 3 are the mixed-GPU test bed, gpuflex/testbed.py).

    python examples/elastic_mlp.py --epochs 2 --report /tmp/ref.json      # standalone
    gpuflex submit --workers 1:4 -- python examples/elastic_mlp.py --step-sleep 0.05
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from gpuflex.elastic import ElasticRun
from gpuflex.testbed import add_device_args, device_work

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
    add_device_args(ap)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    x, y = make_data()
    model = make_model(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    run = ElasticRun(model=model, optimizer=opt, scheduler=sched, num_samples=N, seed=args.seed, epochs=args.epochs,
                     global_batch_size=args.global_batch_size, track_samples=args.report is not None)
    loader = run.loader(TensorDataset(x, y))
    for epoch in run.epochs():
        for xb, yb in loader:
            noise = 0.01 * torch.randn(run.batch.global_size, D_IN)[run.batch.slice]  # one draw per global batch
            loss = F.mse_loss(model(xb + noise), yb)
            device_work(args, len(xb))
            opt.zero_grad()
            run.backward(loss)
            opt.step()
            sched.step()
            if args.step_sleep and (args.sleep_while is None or os.path.exists(args.sleep_while)):
                time.sleep(args.step_sleep)
    if run.is_primary and args.report:
        write_report(args.report, model, args, run.step, run.step_log, run.samples)


if __name__ == "__main__":
    main()
