"""Where a bitwise step's time goes, and one implementation of the exact sum against another,
side by side: two gloo processes (world size 2, one intra-op thread each, as the steady-state
benchmark's jobs), examples/elastic_mlp.py's model at --hidden (3535: 100 MB of state), a
member's share of 32 samples. Each round times, in a rotating order, the default mode's
step (one forward and backward of 32 samples, then the gradients all-reduced in fp32) and a
bitwise step per implementation and unit (the unit's passes, each unit's gradient kept, then
the exact sum: the scale's MAX all-reduce, quantization, the int64 all-reduce, back to
floats), and an all-reduce of the gradients' size alone in fp32 and in int64 (the bytes
the two modes put on the wire). Medians over the rounds (the first, warming up, left out), rank 0's clock, the load
average beside them; each implementation's gradients are checked to be the same bits as the
first's at the same unit.

An implementation is gpuflex's own (`gpuflex.elastic.data.exact_sum`, named "now") or the
module file of another commit that defines `UnitGrads`, e.g.:

    git show e27b278:gpuflex/elastic/data/exact.py > /tmp/exact_e27b278.py
    .venv/bin/python benchmarks/bitwise_parts.py --rounds 8 --units 8,32 before=/tmp/exact_e27b278.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

D_IN, D_OUT, SHARE, GLOBAL = 16, 4, 32, 64   # examples/elastic_mlp.py's sizes, world size 2


class Group:
    """Enough of gpuflex's Collectives for UnitGrads.reduce, on the default process group."""

    backend, device = "gloo", torch.device("cpu")

    def __init__(self) -> None:
        self.pg = dist.group.WORLD
        self.opts = dist.AllreduceOptions()
        self.opts.reduceOp = dist.ReduceOp.SUM

    def all_reduce_async(self, t: torch.Tensor):
        return self.pg.allreduce([t], self.opts)

    def call(self, fn, *args, **kwargs) -> bool:
        fn(*args, **kwargs)
        return True


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"bitwise_parts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(rank: int, port: int, args: argparse.Namespace, impls: list[tuple[str, str | None]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    h = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, h), torch.nn.Tanh(), torch.nn.Linear(h, h), torch.nn.Tanh(),
                                torch.nn.Linear(h, D_OUT))
    params = list(model.parameters())
    x, y = torch.randn(SHARE, D_IN), torch.randn(SHARE, D_OUT)
    from gpuflex.elastic.data import exact_sum
    modules = {name: (exact_sum if path is None else load(name, path)) for name, path in impls}
    confs = [("default", None, SHARE)] + [(f"{name} u{u}", name, u) for name, _ in impls for u in args.units]
    n = sum(p.numel() for p in params)
    wires = {f"all-reduce {t}": torch.zeros(n, dtype=d) for t, d in (("fp32", torch.float32), ("int64", torch.int64))}
    confs += [(w, "", 0) for w in wires]
    accs = {c: modules[name].UnitGrads(params) for c, name, _ in confs if name}
    times: dict[str, dict[str, list[float]]] = {c: {"step": [], "passes": []} for c, _, _ in confs}
    last: dict[str, list[torch.Tensor]] = {}
    for r in range(args.rounds + 1):
        for conf, name, u in confs[r % len(confs):] + confs[:r % len(confs)]:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "":   # the wire alone
                dist.all_reduce(wires[conf])
                t1 = time.perf_counter()
            elif name is None:
                (torch.nn.functional.mse_loss(model(x), y) * (SHARE / GLOBAL)).backward()
                t1 = time.perf_counter()
                for p in params:
                    dist.all_reduce(p.grad)
            else:
                for a in range(0, SHARE, u):
                    (torch.nn.functional.mse_loss(model(x[a:a + u]), y[a:a + u]) * (u / GLOBAL)).backward()
                    accs[conf].take()
                t1 = time.perf_counter()
                accs[conf].reduce(Group(), GLOBAL // u, torch.zeros(3, dtype=torch.int64))   # 3: a vote's size
            t2 = time.perf_counter()
            if name != "":
                last[conf] = [p.grad.clone() for p in params]
                for p in params:
                    p.grad = None
            if r:   # round 0 warms up
                times[conf]["step"].append(t2 - t0)
                times[conf]["passes"].append(t1 - t0)
    if rank == 0:
        print(f"hidden {h}, {args.rounds} rounds, medians in s (rank 0); load average at the end: "
              + " ".join(f"{v:.2f}" for v in os.getloadavg()))
        print(f"{'':16} {'step':>7} {'passes':>7} {'sum':>7}   (sum: the step less its passes)")
        for conf, _, _ in confs:
            step, passes = (statistics.median(times[conf][k]) for k in ("step", "passes"))
            sums = statistics.median(a - b for a, b in zip(times[conf]["step"], times[conf]["passes"]))
            print(f"{conf:16} {step:7.3f} {passes:7.3f} {sums:7.3f}")
        for u in args.units:
            first = f"{impls[0][0]} u{u}"
            for name, _ in impls[1:]:
                same = all(torch.equal(a, b) for a, b in zip(last[first], last[f"{name} u{u}"]))
                print(f"unit {u}: {name} has the bits of {impls[0][0]}: {same}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=3535)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--units", default="8,32", help="samples per unit (a member's share is 32)")
    ap.add_argument("impls", nargs="*", metavar="NAME=PATH", help="other implementations (module files)")
    args = ap.parse_args()
    args.units = [int(u) for u in args.units.split(",")]
    impls = [("now", None)] + [tuple(a.split("=", 1)) for a in args.impls]
    print("load average at the start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    with socket.socket() as s:   # a free port for the two processes' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args, impls), nprocs=2)


if __name__ == "__main__":
    main()
