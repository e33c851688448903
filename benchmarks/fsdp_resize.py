"""Resharding FSDP2 state in place against a distributed-checkpoint restart (issue 13), side by
side in one run, for a model whose parameters + AdamW state take each of --sizes bytes.

Both start from 2 processes that trained a few steps with FSDP2 (fully_shard per layer) on
gloo, and end with 3 processes holding the same state, sharded 3 ways:
- in place (gpuflex.elastic.sharding.fsdp): the newcomer is already running (gpuflex warms
  newcomers up beside the job) and has reserved the memory its shards will fill
  (gpuflex.elastic.sharding.pages, as `Sharding.prepare` does when it learns its generation); the
  survivors' stall is from the moment they stop training to the moment all three hold their
  new shards: a new process group, fully_shard undone and reapplied, every shard moved point
  to point, the checksum agreed. Side by side, the same without the reservation ("cold":
  the newcomer's new pages fault as the move first writes them);
- restart (what torchrun, DeepSpeed and torchtitan do): a DCP save by the 2, the 2 exit,
  3 fresh interpreters start (import torch, the process group, the model on the meta
  device, fully_shard), then the DCP load; the stall is from the save's start to the end
  of the load. torchrun's own rendezvous is not counted: the restart here is a lower bound.

Peak extra memory per rank during the reshard: the tensors it holds for it (its old shards
until the move ends, plus its new ones: gpuflex.elastic.sharding.fsdp.Stats) and how far its
resident set's peak rose during the reshard (ru_maxrss; 0 when the training peak, with a
layer gathered, was higher).
Run: .venv/bin/python benchmarks/fsdp_resize.py [--sizes 100e6,1e9] [--hidden 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2
BYTES_PER_PARAM = 12   # fp32 parameter + AdamW's two fp32 moments


def layers_for(size: float, hidden: int) -> int:
    return max(1, round(size / BYTES_PER_PARAM / (hidden * hidden + hidden)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the processes ------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from gpuflex.elastic.sharding import pages, fsdp as sharded

    torch.set_num_threads(1)
    rank, out = args.rank, Path(args.out)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])

    def group(prefix: str, ranks: list[int]) -> None:
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=ranks.index(rank),
                                world_size=len(ranks), timeout=dt.timedelta(seconds=600))

    def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
            model(torch.randn(4, args.hidden, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    def record(**fields: object) -> None:
        with open(out / f"{args.mode}-{args.phase}-{rank}.json", "w") as f:
            json.dump({"rank": rank, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, **fields}, f)

    store = dist.TCPStore("127.0.0.1", args.port, None, rank == 0, timeout=dt.timedelta(seconds=600),
                          wait_for_workers=False)
    make_opt = lambda params: torch.optim.AdamW(params, lr=1e-3)   # noqa: E731
    if args.mode == "restart" and args.phase == "after":
        t_start = time.time()
        group("after", [0, 1, 2])
        with torch.device("meta"):
            model = build()
        sharded.apply(model, nn.Linear, DeviceMesh("cpu", [0, 1, 2]))
        model.to_empty(device="cpu")
        opt = make_opt(list(model.parameters()))
        sharded.load(model, opt, str(out / "ckpt"))
        dist.barrier()
        record(loaded=time.time(), started=t_start, checksum=checksum(model))
        dist.destroy_process_group()
        return
    if rank < 2:
        group("before", [0, 1])
        model = build()
        sharded.apply(model, nn.Linear, DeviceMesh("cpu", [0, 1]))
        opt = make_opt(list(model.parameters()))
        train(model, opt)
        dist.barrier()
        stop = time.time()
        if args.mode == "restart":
            sharded.save(model, opt, str(out / "ckpt"))
            record(stopped=stop)
            dist.destroy_process_group()
            return
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        held = sharded.hold(model, opt, rank, 2)
        dist.destroy_process_group()
    else:   # the newcomer, warmed up: its model on the meta device
        with torch.device("meta"):
            model = build()
        if args.phase != "cold":   # its share of the state (Sharding.prepare), while the others train
            pages.reserve(args.layers * (args.hidden * args.hidden + args.hidden) * BYTES_PER_PARAM // 3)
        opt, held, stop, rss0 = None, None, None, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    group("resize", [0, 1, 2])
    opt, stats = sharded.reshard_in_place(model, opt, make_opt, held, old=[0, 1], new=[0, 1, 2], rank=rank,
                                          mesh=DeviceMesh("cpu", [0, 1, 2]), shard=nn.Linear)
    del held
    dist.barrier()
    done = time.time()
    pages.settle()
    record(stopped=stop, done=done, held_bytes=stats.held_bytes, new_bytes=stats.new_bytes,
           rss_rise_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0, checksum=checksum(model))
    dist.destroy_process_group()


def checksum(model) -> float:
    import torch
    import torch.distributed as dist
    total = torch.tensor([sum(float(p.to_local().detach().double().sum()) for p in model.parameters())], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total)


# ---- the driver -------------------------------------------------------------------------------
def launch(tmp: Path, mode: str, phase: str, ranks: list[int], layers: int, hidden: int) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--mode", mode, "--phase", phase,
                               "--rank", str(r), "--port", str(port), "--out", str(tmp), "--layers", str(layers),
                               "--hidden", str(hidden)], env=env) for r in ranks]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"{mode}/{phase} rank {procs.index(p)} exited {p.returncode}")


def one_size(size: float, hidden: int, cold_first: bool) -> dict:
    layers = layers_for(size, hidden)
    state = layers * (hidden * hidden + hidden) * BYTES_PER_PARAM
    with tempfile.TemporaryDirectory(prefix="fsdp-resize-") as d:
        tmp = Path(d)
        stalls = {}
        for phase in (["cold", "resize"] if cold_first else ["resize", "cold"]):
            launch(tmp, "inplace", phase, [0, 1, 2], layers, hidden)
            rows = [json.loads((tmp / f"inplace-{phase}-{r}.json").read_text()) for r in range(3)]
            stalls[phase] = max(r["done"] for r in rows) - max(r["stopped"] for r in rows if r["stopped"])
        rows = [json.loads((tmp / f"inplace-resize-{r}.json").read_text()) for r in range(3)]
        peak = max(r["held_bytes"] + r["new_bytes"] for r in rows)
        rss = max(r["rss_rise_kib"] for r in rows) * 1024
        launch(tmp, "restart", "before", [0, 1], layers, hidden)
        stop = max(json.loads((tmp / f"restart-before-{r}.json").read_text())["stopped"] for r in range(2))
        launch(tmp, "restart", "after", [0, 1, 2], layers, hidden)
        after = [json.loads((tmp / f"restart-after-{r}.json").read_text()) for r in range(3)]
        stall_restart = max(r["loaded"] for r in after) - stop
        same = abs(rows[0]["checksum"] - after[0]["checksum"]) <= 1e-6 * max(1.0, abs(rows[0]["checksum"]))
    return {"state_bytes": state, "layers": layers, "inplace_s": stalls["resize"], "cold_s": stalls["cold"],
            "restart_s": stall_restart,
            "peak_extra_bytes": peak, "rss_rise_bytes": rss, "shard_bytes_after": state / 3, "same_state": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100e6,1e9")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5, help="pairs (in place, restart) per size; medians printed")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode"), ap.add_argument("--phase"), ap.add_argument("--out")
    ap.add_argument("--rank", type=int), ap.add_argument("--port", type=int), ap.add_argument("--layers", type=int)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        os._exit(0)   # torch 2.13's gloo exit race (examples/torchrun/ddp_tutorial.py): no teardown
        return
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    print(f"FSDP2 state resharded 2 -> 3 processes (gloo, CPU, {os.cpu_count()} cores): in place vs "
          f"DCP save + restart + load; medians of {args.repeat} pairs (min-max)")
    print(f"{'state':>8} {'in place s':>18} {'restart s':>18} {'ratio':>6} {'cold in place s':>18} {'ratio':>6} "
          f"{'peak extra/rank':>16} {'RSS rise':>9} {'new shard':>10} {'same':>5}")
    for size in (float(s) for s in args.sizes.split(",")):
        runs = [one_size(size, args.hidden, cold_first=i % 2 == 0) for i in range(args.repeat)]
        r = runs[0]
        inplace = sorted(x["inplace_s"] for x in runs)
        cold = sorted(x["cold_s"] for x in runs)
        restart = sorted(x["restart_s"] for x in runs)
        mid_in, mid_cold, mid_re = statistics.median(inplace), statistics.median(cold), statistics.median(restart)
        print(f"{r['state_bytes'] / 1e6:>6.0f}MB {mid_in:>6.2f} ({inplace[0]:.2f}-{inplace[-1]:.2f}) "
              f"{mid_re:>6.2f} ({restart[0]:.2f}-{restart[-1]:.2f}) {mid_re / mid_in:>5.1f}x "
              f"{mid_cold:>6.2f} ({cold[0]:.2f}-{cold[-1]:.2f}) {mid_re / mid_cold:>5.1f}x "
              f"{max(x['peak_extra_bytes'] for x in runs) / 1e6:>14.0f}MB "
              f"{max(x['rss_rise_bytes'] for x in runs) / 1e6:>7.0f}MB {r['shard_bytes_after'] / 1e6:>8.0f}MB "
              f"{str(all(x['same_state'] for x in runs)):>5}")


if __name__ == "__main__":
    main()
