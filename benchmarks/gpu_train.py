"""The GPU check's training script (benchmarks/gpu_check.py): the example's MLP, or the
sharded example's small LM, on the worker's device, in three modes side by side.

    python benchmarks/gpu_train.py --mode elastic --report r.json        # gpuflex.elastic (standalone or a job)
    python benchmarks/gpu_train.py --mode plain --steps 300 --hidden 4096 # the same loop, no runtime
    torchrun --nproc-per-node 1 benchmarks/gpu_train.py --mode ddp ...    # DistributedDataParallel

The device is the runtime's (`run.device`: the worker's GPU where it has one, else CPU);
plain and ddp take cuda:LOCAL_RANK where CUDA is available. The data is generated on the
CPU (the same on every rank) and each step's share moves to the device; every step draws
noise from the device's RNG once per global batch (the same on every rank), so a resize
or a restart that loses the CUDA RNG state shows in the parameters. `--step-times FILE`:
one line per step, `step wall_time`, for steps/s.
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import elastic_fsdp  # noqa: E402  (the LM and its data)

D_IN, D_OUT = 16, 4


def mlp_data(n: int, d_in: int):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, D_OUT, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, D_OUT, generator=g)


def mlp(hidden: int, d_in: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, D_OUT))


def loss_of(args, model, xb, yb, noise=None):
    if args.model == "lm":
        return F.cross_entropy(model(xb).reshape(-1, elastic_fsdp.VOCAB), yb.reshape(-1))
    return F.mse_loss(model(xb + noise), yb)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("elastic", "plain", "ddp"), default="elastic")
    ap.add_argument("--model", choices=("mlp", "lm"), default="mlp")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="a step count instead of epochs")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--d-in", type=int, default=D_IN)
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--report")
    ap.add_argument("--step-times")
    ap.add_argument("--profile", help="a file for torch.profiler's tables of steps 100-129 (CPU and CUDA)")
    ap.add_argument("--exact", choices=("bitwise",), default=None,
                    help="the MLP in bitwise mode (each unit its own forward and backward), with torch's "
                         "deterministic algorithms")
    args = ap.parse_args()
    if args.exact and args.model != "mlp":
        ap.error("--exact bitwise: the MLP only")
    if args.exact:   # before CUDA starts: cuBLAS is deterministic only with a fixed workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return args


class Profiler:
    """torch.profiler over steps [start, start + n) of the loop; the tables into `path`:
    the busiest operations, and every host-device synchronization with the Python stack
    that asked for it."""

    def __init__(self, path, start=100, n=30):
        self.path, self.start, self.n, self.prof = path, start, n, None

    def step(self, step):
        if not self.path:
            return
        from torch.profiler import ProfilerActivity, profile
        if step == self.start:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            if torch.cuda.is_available():   # every synchronizing call warns, with where it came from
                import traceback
                import warnings
                self.syncs = {}

                def show(message, category, filename, lineno, file=None, line=None):
                    where = "".join(traceback.format_stack(limit=9)[:-2])
                    self.syncs[where] = self.syncs.get(where, 0) + 1
                warnings.showwarning = show
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
        elif step == self.start + self.n and self.prof is not None:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            ka = self.prof.key_averages()
            text = [f"steps {self.start}..{step - 1}", ka.table(sort_by="self_cpu_time_total", row_limit=40)]
            for where, n in sorted(getattr(self, "syncs", {}).items(), key=lambda kv: -kv[1]):
                text.append(f"--- {n} synchronizing call(s) from:\n{where}")
            open(self.path, "w").write("\n".join(text))
            self.prof = None


def write_report(path, flat, args, steps, step_log, samples, device):
    flat = flat.detach().float().cpu()
    report = {"steps": steps, "device": str(device), "params_sha256": hashlib.sha256(
                  bytes(flat.view(torch.uint8).tolist())).hexdigest() if flat.numel() < 1 << 22 else None,
              "params": flat.tolist(), "samples": {str(e): v for e, v in samples.items()},
              "step_log": step_log, "epochs": args.epochs}
    Path(path).write_text(json.dumps(report))


def elastic(args) -> None:
    from gpuflex.elastic import ElasticRun

    torch.manual_seed(args.seed)
    epochs = None if args.steps else args.epochs
    if args.model == "lm":
        x, y = elastic_fsdp.make_data()
        n = len(x)
        model = elastic_fsdp.LM(args.hidden)
        run = ElasticRun(model=model, shard=elastic_fsdp.Block, num_samples=n, seed=args.seed, epochs=epochs,
                         steps=args.steps, global_batch_size=args.global_batch_size,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
                         scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.7),
                         track_samples=args.report is not None)
    else:
        x, y = mlp_data(args.samples, args.d_in)
        n = len(x)
        model = mlp(args.hidden, args.d_in)
        from gpuflex.elastic.membership.collectives import pick_device
        model.to(pick_device())   # the device ElasticRun will pick: the worker's GPU, else CPU
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
        run = ElasticRun(model=model, optimizer=opt, scheduler=sched, num_samples=n, seed=args.seed,
                         epochs=epochs, steps=args.steps, global_batch_size=args.global_batch_size,
                         track_samples=args.report is not None, exact=args.exact)
    dev = run.device
    opt, sched = run.optimizer, run.scheduler
    loader = run.loader(TensorDataset(x, y))
    times = open(args.step_times, "a") if args.step_times else None
    prof = Profiler(args.profile)
    flat = None
    total = args.steps or args.epochs * run.sampler.steps_per_epoch
    for _ in run.epochs():
        for xb, yb in loader:
            xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
            if args.model == "lm":
                for mx, my in run.accumulate(xb, yb, micro_batch_size=8):
                    run.backward(loss_of(args, model, mx, my))
            else:   # one draw of the device's RNG per global batch: the same on every rank
                noise = 0.01 * torch.randn(run.batch.global_size, args.d_in, device=dev)[run.batch.slice]
                opt.zero_grad()
                if args.exact:   # unit by unit, each under its own RNG stream
                    for xu, yu, nu in run.accumulate(xb, yb, noise):
                        run.backward(loss_of(args, model, xu, yu, nu))
                else:
                    run.backward(loss_of(args, model, xb, yb, noise))
            opt.step()
            if args.model == "lm":
                opt.zero_grad()
            sched.step()
            if args.model == "lm" and args.report and run.step == total - 1:
                flat = torch.cat([p.reshape(-1).float() for p in run.full_parameters().values()])
            if times:
                times.write(f"{run.step} {time.time():.6f}\n")
                times.flush()
            prof.step(run.step)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    if run.is_primary and args.report:
        if flat is None and args.model == "lm":
            sys.exit("the run ended before its last step: no report (the sharded parameters are gathered there)")
        if flat is None:
            flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        write_report(args.report, flat, args, run.step, run.step_log, run.samples, dev)


def plain_or_ddp(args) -> None:
    ddp = args.mode == "ddp"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    rank, world = 0, 1
    if ddp:
        import torch.distributed as dist
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    x, y = mlp_data(args.samples, args.d_in)
    model = mlp(args.hidden, args.d_in).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if dev.type == "cuda" else None) \
        if ddp else model
    b = args.global_batch_size
    share = b // world
    steps = args.steps or args.epochs * (len(x) // b)
    times = open(args.step_times, "a") if args.step_times else None
    prof = Profiler(args.profile)
    for step in range(steps):
        start = (step * b) % (len(x) - b + 1)
        xb = x[start + rank * share:start + (rank + 1) * share].to(dev, non_blocking=True)
        yb = y[start + rank * share:start + (rank + 1) * share].to(dev, non_blocking=True)
        noise = 0.01 * torch.randn(b, args.d_in, device=dev)[rank * share:(rank + 1) * share]
        loss = F.mse_loss(net(xb + noise), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if times:
            times.write(f"{step} {time.time():.6f}\n")
            times.flush()
        prof.step(step + 1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if ddp:
        import torch.distributed as dist
        dist.destroy_process_group()


def main() -> None:
    args = parse()
    if args.mode == "elastic":
        elastic(args)
    else:
        plain_or_ddp(args)


if __name__ == "__main__":
    main()
