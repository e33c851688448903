"""Replay a synthetic owner-activity trace against the real harvest tick; print the share of
idle GPU-time harvested and the reclaim latencies.

    .venv/bin/python benchmarks/harvest_trace.py [--hours 8] [--scale 0.25] [--hosts 8] [--deadline 5]

The seam is the Transport, given through the pool's factory: each host is a
FakeHost (tests/fakes/hosts.py) that answers nvidia-smi (from the trace at the current time, plus our workers' own
processes), `ps`, the hostops process operations (spawn, status, signal, stop) and the
control sockets of a simulated coordinator and workers. Above it everything is the real
code: nvidia-smi parsing, verdicts and idle streaks, the SQLite DB, JobService.refresh
(reconcile, place), the pure plan, scaling.grow/retire/requeue, the reclaim watch with its
SIGKILL escalation, and the "reclaim" events. No SSH, no torch.

Time: one trace minute lasts --scale wall seconds and a tick starts every trace minute (a
cron tick a minute). Simulated processes run in real seconds: a newcomer warms up for
WARMUP_S, a retired worker leaves after LEAVE_S (uniform), and --hang of them ignore the
shrink until SIGKILLed. The reclaim deadline is in real seconds too. "Harvested" is the
time our workers held an owner's GPU while the trace says it was idle (from spawn to exit,
as `gpuflex report` counts it), over all idle GPU-time of the trace. Figures, no asserts.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuflex.config import parse_config  # noqa: E402
from gpuflex.control.harvest import run_tick  # noqa: E402
from gpuflex.control.pool import Pool  # noqa: E402
from gpuflex.control.requests import SubmitRequest  # noqa: E402
from gpuflex.control.service import JobService  # noqa: E402
from gpuflex.db import queries  # noqa: E402
from tests.fakes.hosts import FakeHost, World  # noqa: E402

WARMUP_S = 2.0           # a newcomer's warm-up (import, build the model)
LEAVE_S = (0.3, 1.5)     # a retired worker leaves this long after the switch (uniform)
GPUS_PER_HOST = 2


# ---- the trace ------------------------------------------------------------------------
def make_trace(rng: random.Random, gpus: list[tuple[str, int]], minutes: float) -> dict:
    """Per GPU: alternating busy/idle periods (minutes). Idle: short breaks, meetings,
    nights; busy: owners' runs and sessions."""
    trace = {}
    for ref in gpus:
        periods, t, busy = [], 0.0, rng.random() < 0.5
        while t < minutes:
            if busy:
                d = rng.uniform(10, 120)
            else:
                d = rng.choice([rng.uniform(10, 30), rng.uniform(60, 180), rng.uniform(300, 600)])
            periods.append((t, min(t + d, minutes), busy))
            t, busy = t + d, not busy
        trace[ref] = periods
    return trace


def idle_intervals(periods, t0: float, scale: float) -> list[tuple[float, float]]:
    return [(t0 + a * scale, t0 + b * scale) for a, b, busy in periods if not busy]


# ---- the run ----------------------------------------------------------------------------
def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=8, help="trace length (trace hours)")
    ap.add_argument("--scale", type=float, default=0.25, help="wall seconds per trace minute (= one tick)")
    ap.add_argument("--hosts", type=int, default=8, help="owned hosts, 2 GPUs each")
    ap.add_argument("--deadline", type=float, default=5, help="reclaim_deadline_s (real seconds)")
    ap.add_argument("--hang", type=float, default=0.1, help="share of leavers that ignore the shrink")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="gpuflex-harvest-trace-"))
    owners = {f"own{i}": f"owner{i}" for i in range(args.hosts)}
    hosts = [{"name": n, "address": f"10.9.0.{i + 1}", "owner": o, "workdir": "/w"}
             for i, (n, o) in enumerate(owners.items())]
    hosts.append({"name": "pool", "address": "10.9.1.1", "workdir": "/w"})
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp}/g.db"},
                        "harvest": {"interval_s": 1, "idle_samples": 3, "reclaim_deadline_s": args.deadline},
                        "jobs": {"cancel_grace_s": 2}, "hosts": hosts}, "<benchmark>")
    minutes = args.hours * 60
    owned = [(h, i) for h in owners for i in range(GPUS_PER_HOST)]
    trace = make_trace(rng, owned, minutes)
    world = World(trace, time.time() + 1e9, args.scale, owners, rng, args.hang,  # trace not started yet
                  warmup_s=WARMUP_S, leave_s=LEAVE_S, gpus_per_host=GPUS_PER_HOST)
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    req = dict(argv=["python3", "train.py"], min_workers=1, max_workers=8, harvest=True, workdir=str(tmp))
    world.blocked = set(owned) | {("pool", 1)}      # one pool GPU per job to start with;
    svc.submit(SubmitRequest(name="a", **req))     # owned GPUs count as busy until the trace starts
    world.blocked = set(owned)
    svc.submit(SubmitRequest(name="b", **req))
    world.blocked = set()
    print(f"trace: {len(owned)} owned GPUs on {args.hosts} hosts, {args.hours:g} h, 1 min = {args.scale:g} s, "
          f"tick every trace minute, idle_samples 3, deadline {args.deadline:g} s, {args.hang:.0%} hanging leavers")
    t0 = world.t0 = time.time()
    end = t0 + minutes * args.scale
    ticks: list[float] = []
    while time.time() < end:
        began = time.time()
        run_tick(svc)
        ticks.append(time.time() - began)
        time.sleep(max(0.0, began + args.scale - time.time()))
    with svc.sessions() as s:
        held = [(w.host, list(w.gpus), w.started_at, w.ended_at or end)
                for w, _ in queries.workers_on(s, owners)]
        reclaims = [e.data for e, _ in queries.events_of_kind(s, "reclaim", 0, time.time())]
    idle_total = harvested = 0.0
    for ref, periods in trace.items():
        for iv in idle_intervals(periods, t0, args.scale):
            idle_total += iv[1] - iv[0]
            harvested += sum(overlap(iv, (a, b)) for h, gpus, a, b in held if h == ref[0] and ref[1] in gpus)
    returns = sum(1 for p in trace.values() for a, _, busy in p if busy and a > 0)
    lat = sorted(d["latency_s"] for d in reclaims if d.get("latency_s") is not None)
    methods: dict[str, int] = {}
    for d in reclaims:
        methods[d["method"]] = methods.get(d["method"], 0) + 1
    print(f"ticks: {len(ticks)}, duration median {statistics.median(ticks):.3f} s, max {max(ticks):.3f} s")
    print(f"idle GPU-time in the trace: {idle_total / args.scale / 60:.1f} GPU-hours (trace time)")
    print(f"harvested: {harvested / args.scale / 60:.1f} GPU-hours = {harvested / idle_total:.1%} of the idle GPU-time")
    print(f"owner returns: {returns}; reclaims: {len(reclaims)} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(methods.items()))})")
    if lat:
        within = sum(1 for x in lat if x <= args.deadline)
        print(f"reclaim latency: median {statistics.median(lat):.2f} s, max {max(lat):.2f} s, "
              f"{within}/{len(reclaims)} within the {args.deadline:g} s deadline")
    svc.close()


if __name__ == "__main__":
    main()
