"""Summing a buffer over ranks on gloo: its all-reduce against the exchange gradients.py
uses for small packed buffers (send it to every peer, add the copies in rank order).

Each size runs the two methods in alternating rounds on the same process group and
prints the time per sum and the ratio. On few busy cores gloo's all-reduce pays for
several rounds through its worker thread; the point-to-point sends run on its I/O thread.

Run: .venv/bin/python benchmarks/gloo_sum.py [--world 2] [--sizes-kib 8,64,256,1024,4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpuflex.elastic.data.gradients import exchange as launch_exchange, sum_exchanged

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port  # noqa: E402

ROUNDS = 7


def per_op(fn, n: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def worker(rank: int, world: int, port: int, sizes: list[int], out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pg = dist.group.WORLD
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    for kib in sizes:
        buf = torch.ones(kib * 256)
        rows = torch.empty(world, buf.numel())

        def allreduce():
            pg.allreduce([buf], opts).wait()

        def exchange():   # as gradients.GradPlan.reduce runs it
            for w in launch_exchange(pg, rank, buf, rows):
                w.wait()
            sum_exchanged(buf, rows, rank)
            buf.fill_(1.0)

        n = max(10, min(500, int(2e4 / kib)))
        a, e = [], []
        for i in range(ROUNDS):
            first, second = (allreduce, exchange) if i % 2 == 0 else (exchange, allreduce)
            t1, t2 = per_op(first, n), per_op(second, n)
            a.append(t1 if first is allreduce else t2)
            e.append(t2 if first is allreduce else t1)
        if rank == 0:
            out[kib] = (statistics.median(a), statistics.median(e))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes-kib", default="8,64,256,1024,4096")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(worker, args=(args.world, free_port(), sizes, out), nprocs=args.world)
        print(f"world size {args.world}, gloo on CPU, median of {ROUNDS} alternating rounds")
        print("   KiB  all-reduce ms  exchange ms  exchange/all-reduce")
        for kib in sizes:
            a, e = out[kib]
            print(f"{kib:6d}  {a * 1e3:13.3f}  {e * 1e3:11.3f}  {e / a:8.2f}")


if __name__ == "__main__":
    main()
