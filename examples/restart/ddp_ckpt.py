"""A plain DDP script in torchrun's restart style: it resumes from its own checkpoint at
whatever world size it is started with. Run it as a restart-elastic gpuflex job:

    gpuflex submit --elastic restart --workers 1:4 -- \\
        python examples/restart/ddp_ckpt.py --ckpt-dir /shared/ckpt --epochs 4
    gpuflex scale JOB 3          # SIGTERM (it checkpoints), then the gang again at 3

or under torchrun (`torchrun --nnodes 1:4 --max-restarts 10 ...`). Nothing here knows
gpuflex: it uses torch.distributed's env:// contract (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE) and reads TORCHELASTIC_RESTART_COUNT only to report it.

Deterministic at any world size, so a run resized 2 -> 3 -> 1 ends with the parameters of
a fixed-size run (up to float summation order):
- a fixed GLOBAL batch, split over the world size (the first ranks take one more sample
  when it does not divide); the loss is scaled so that DDP's gradient average is the mean
  over the global batch whatever the split;
- the sample order is a pure function of (seed, epoch, step): a restart continues the
  epoch at the step the checkpoint holds, so every sample is seen once per epoch;
- the input noise is one draw per global batch from the global RNG, whose state the
  checkpoint keeps.
Rank 0 writes a checkpoint (to a temporary file, then renamed: a reader never sees half
of one) every --ckpt-every steps and when SIGTERM arrives; the ranks agree on stopping at
the same step boundary (one MAX all-reduce of a flag per step), so no rank is left in a
collective. The checkpoint's directory must be one every host of the job sees.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

D_IN, D_OUT, N = 16, 4, 2048
KEEP = 2   # checkpoints kept: the newest, and the one before in case the newest is cut short


def make_data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, D_IN, generator=g)
    w = torch.randn(D_IN, D_OUT, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(N, D_OUT, generator=g)


def make_model(hidden):
    return torch.nn.Sequential(torch.nn.Linear(D_IN, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, D_OUT))


class GlobalBatches:
    """Step `s` of the run -> this rank's sample indices: epoch s // steps_per_epoch, a
    fresh permutation per epoch (seeded by seed and epoch), the global batch cut into
    `world` contiguous shares."""

    def __init__(self, n: int, global_batch: int, seed: int):
        if global_batch > n:
            raise SystemExit(f"--global-batch-size {global_batch} is larger than the {n} samples")
        self.n, self.batch, self.seed = n, global_batch, seed
        self.steps_per_epoch = n // global_batch
        self._perm = (None, None)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_indices(self, step: int) -> torch.Tensor:
        epoch = self.epoch_of(step)
        if self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)))
        start = (step % self.steps_per_epoch) * self.batch
        return self._perm[1][start:start + self.batch]

    def share(self, rank: int, world: int) -> slice:
        base, extra = divmod(self.batch, world)
        lo = rank * base + min(rank, extra)
        return slice(lo, lo + base + (1 if rank < extra else 0))


def newest_checkpoint(directory: str):
    """The newest checkpoint that loads (a file cut short by a kill is skipped), or None."""
    names = sorted((f for f in os.listdir(directory) if f.startswith("step-") and f.endswith(".pt")),
                   reverse=True) if os.path.isdir(directory) else []
    for name in names:
        try:
            return torch.load(os.path.join(directory, name), weights_only=False)
        except Exception as e:   # noqa: BLE001 - any unreadable file: try the one before
            print(f"skipping checkpoint {name}: {e}", flush=True)
    return None


def save_checkpoint(directory: str, state: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step-{state['step']:08d}.pt")
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    old = sorted(f for f in os.listdir(directory) if f.startswith("step-") and f.endswith(".pt"))
    for name in old[:-KEEP]:
        os.remove(os.path.join(directory, name))


def write_report(path, model, args, steps, runs):
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    report = {"steps": steps, "epochs": args.epochs, "global_batch_size": args.global_batch_size,
              "params_sha256": hashlib.sha256(bytes(flat.contiguous().view(torch.uint8).reshape(-1).tolist())).hexdigest(),
              "params": flat.tolist(), "runs": runs}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--sleep-while", metavar="PATH",
                    help="sleep --step-sleep after a step only while PATH exists (a demo or test holds the pace)")
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--steps-file", help="rank 0 appends 'step time world' after each step")
    ap.add_argument("--report")
    args = ap.parse_args()

    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(asked=True))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    x, y = make_data()
    model = make_model(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    batches = GlobalBatches(N, args.global_batch_size, args.seed)
    step, runs = 0, []
    ck = newest_checkpoint(args.ckpt_dir)
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        torch.set_rng_state(ck["rng"])
        step, runs = ck["step"], ck["runs"]
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    runs = runs + [{"restart_count": restart_count, "world_size": world, "from_step": step}]
    ddp = DDP(model)
    total = batches.steps_per_epoch * args.epochs
    log = open(args.steps_file, "a") if rank == 0 and args.steps_file else None

    def checkpoint():
        if rank == 0:
            save_checkpoint(args.ckpt_dir, {"model": model.state_dict(), "opt": opt.state_dict(),
                                            "sched": sched.state_dict(), "rng": torch.get_rng_state(),
                                            "step": step, "runs": runs})

    flag = torch.zeros(1)
    while step < total:
        idx = batches.global_indices(step)
        share = batches.share(rank, world)
        noise = 0.01 * torch.randn(len(idx), D_IN)[share]   # one draw per global batch, on every rank
        xb, yb = x[idx[share]], y[idx[share]]
        # DDP averages over ranks: scale this rank's sum so the result is the global mean
        loss = F.mse_loss(ddp(xb + noise), yb, reduction="sum") * world / (len(idx) * D_OUT)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if log:
            log.write(f"{step} {time.time()} {world}\n")
            log.flush()
        if step % args.ckpt_every == 0:
            checkpoint()
        flag[0] = 1.0 if stop["asked"] else 0.0
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)   # every rank stops at the same step
        if flag[0] > 0:
            if step % args.ckpt_every:
                checkpoint()
            print(f"rank {rank}: SIGTERM, checkpointed at step {step}; exiting", flush=True)
            finish()
        if args.step_sleep and (args.sleep_while is None or os.path.exists(args.sleep_while)):
            time.sleep(args.step_sleep)
    if rank == 0 and args.report:
        write_report(args.report, model, args, step, runs)
    finish()


def finish():
    """Leave the process group and exit 0 without the interpreter's finalization: torch's
    known exit race (an all-reduce DDP launched inside backward leaves a Python object in
    gloo's worker thread, freed after the interpreter began finalizing) aborts a few
    percent of DDP processes at exit under load (see tests/e2e/test_examples.py)."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
