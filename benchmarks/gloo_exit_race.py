"""How often torch 2.13's gloo exit race aborts a finished 2-rank FSDP2 run, with and without
the pause gpuflex's workers take at exit (`collectives._let_gloo_threads_finish`).

A gloo work that holds a Python object in its thread-local state must take the GIL to be
freed on gloo's worker thread. If the interpreter has begun finalizing, the thread is ended
inside a C++ destructor and the process aborts (SIGABRT). Each run here is a pair of
processes: FSDP2 over gloo, 20 steps whose backward goes through torch's own
`loss.backward()` (which stashes such an object), then a normal exit. The "pause" runs
register the same atexit pause as the runtime. Runs alternate between the two modes so
that machine load affects both alike.

    .venv/bin/python benchmarks/gloo_exit_race.py --runs 40
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import os
import socket
import subprocess
import sys
import time

WORKER_TIMEOUT_S = 120


def worker(rank: int, port: int, pause: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if pause:
        from gpuflex.elastic.membership.collectives import _let_gloo_threads_finish
        atexit.register(_let_gloo_threads_finish)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mesh = DeviceMesh("cpu", [0, 1])
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    for _ in range(20):
        model(torch.randn(16, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(pause: bool) -> tuple[bool, list[int]]:
    """(aborted, the two exit codes)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port), str(int(pause))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in (0, 1)]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(WORKER_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return any(c == -6 for c in codes), codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40, help="runs of each mode (default 40)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(int(a.worker[0]), int(a.worker[1]), a.worker[2] == "1")
        return
    aborted = {False: 0, True: 0}
    other = {False: 0, True: 0}
    started = time.monotonic()
    for _ in range(a.runs):
        for pause in (False, True):
            abort, codes = one_run(pause)
            aborted[pause] += abort
            other[pause] += not abort and any(codes)
    print(f"{'exit':>22}  {'runs':>4}  {'aborted (SIGABRT)':>17}  {'other failures':>14}")
    for pause, name in ((False, "interpreter teardown"), (True, "gpuflex's exit pause")):
        print(f"{name:>22}  {a.runs:>4}  {aborted[pause]:>17}  {other[pause]:>14}")
    print(f"({2 * a.runs} runs in {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
