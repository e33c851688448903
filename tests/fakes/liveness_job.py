"""A small elastic job for the liveness tests (tests/e2e/test_liveness_jobs.py): the MLP of
examples/elastic_mlp.py, whose rank 0 can be busy between two steps and one of whose
workers can raise, with the same JSON report.

    python tests/fakes/liveness_job.py --epochs 2 --report r.json                 # standalone
    ... --busy-at 5 --busy-s 8     # rank 0 sleeps 8 s before step 5 (an evaluation), once a process
    ... --raise-at 12 --raise-wid 1   # worker 1 raises ZeroDivisionError at step 12

Neither changes the math: a standalone run without them is the reference.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from elastic_mlp import N, D_IN, make_data, make_model, write_report  # noqa: E402

from gpuflex.elastic import ElasticRun  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH",
                    help="sleep --step-sleep after a step only while PATH exists (a test holds the pace)")
    ap.add_argument("--busy-at", type=int, default=-1)
    ap.add_argument("--busy-s", type=float, default=0.0)
    ap.add_argument("--raise-at", type=int, default=-1)
    ap.add_argument("--raise-wid", type=int, default=-1)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (eager backend)")
    ap.add_argument("--warm-up", type=int, default=None, help="ElasticRun(warm_up=...)")
    ap.add_argument("--warm-log", help="each warm-up pass appends a JSON line to WARM_LOG.w<wid>")
    ap.add_argument("--report")
    args = ap.parse_args()
    wid = int(os.environ.get("GPUFLEX_WORKER_ID", "0"))
    torch.manual_seed(args.seed)
    x, y = make_data()
    model = make_model(args.hidden)
    if args.compile:   # a compiled model: the runtime gives a newcomer one warm-up pass by default
        model = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    run = ElasticRun(model=model, optimizer=opt, scheduler=sched, num_samples=N, seed=args.seed, epochs=args.epochs,
                     global_batch_size=args.global_batch_size, track_samples=args.report is not None,
                     warm_up=args.warm_up)
    loader = run.loader(TensorDataset(x, y))
    busy_done = False
    for epoch in run.epochs():
        for xb, yb in loader:
            if run.is_primary and run.step == args.busy_at and not busy_done and run.world_size > 1:
                busy_done = True
                print(f"busy from step {run.step} for {args.busy_s}s", flush=True)
                time.sleep(args.busy_s)
            if wid == args.raise_wid and run.step == args.raise_at:
                print(1 / 0)
            if run.warming_up and args.warm_log:
                with open(f"{args.warm_log}.w{wid}", "a") as f:
                    f.write(json.dumps({"is_primary": run.is_primary, "step": run.step, "rank": run.batch.rank,
                                        "world_size": run.batch.world_size, "time": time.time()}) + "\n")
            noise = 0.01 * torch.randn(run.batch.global_size, D_IN)[run.batch.slice]
            loss = F.mse_loss(model(xb + noise), yb)
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
