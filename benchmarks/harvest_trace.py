"""Replay a synthetic owner-activity trace against the real harvest tick; print the share of
idle GPU-time harvested and the reclaim latencies.

    .venv/bin/python benchmarks/harvest_trace.py [--hours 8] [--scale 0.25] [--hosts 8] [--deadline 5]

The seam is the Transport (gpuflex.control.pool.make_transport is replaced): each host is a
FakeHost that answers nvidia-smi (from the trace at the current time, plus our workers' own
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
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import select  # noqa: E402

import gpuflex.control.pool as pool_module  # noqa: E402
from gpuflex.config import parse_config  # noqa: E402
from gpuflex.control.harvest import run_tick  # noqa: E402
from gpuflex.control.service import JobService, SubmitRequest  # noqa: E402
from gpuflex.db.models import Event, Worker  # noqa: E402
from gpuflex.hosts.transport import CommandResult, Transport  # noqa: E402

WARMUP_S = 2.0
LEAVE_S = (0.3, 1.5)
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


# ---- the simulated hosts -----------------------------------------------------------------
class Proc:
    def __init__(self, pid: int, host: str, spec: dict, now: float) -> None:
        env, argv = spec.get("env") or {}, spec["argv"]
        self.pid, self.pgid, self.host, self.exit_path = pid + 1, pid, host, spec["exit_path"]
        self.coordinator = "gpuflex.elastic.coordinator" in argv
        self.token = argv[argv.index("--control") + 1].split("gpuflex-")[1].split("/")[0] \
            if self.coordinator else env["GPUFLEX_JOB_TOKEN"]
        self.wid = None if self.coordinator else int(env["GPUFLEX_WORKER_ID"])
        self.gpus = [int(d) for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        self.ready_at = now + WARMUP_S
        self.alive, self.exit, self.leave_at, self.hang = True, None, None, False
        self.initial = [int(w) for w in argv[argv.index("--members") + 1].split(",")] if self.coordinator else []


class Job:
    """The coordinator's view: desired set, members, generation (resize when newcomers are
    ready, recover when a member died)."""

    def __init__(self, initial: list[int]) -> None:
        self.desired, self.members, self.generation = list(initial), [], 0


class World:
    def __init__(self, trace: dict, t0: float, scale: float, owners: dict[str, str], rng: random.Random,
                 hang: float) -> None:
        self.trace, self.t0, self.scale, self.owners, self.rng, self.hang = trace, t0, scale, owners, rng, hang
        self.lock = threading.RLock()
        self.procs: dict[int, Proc] = {}
        self.jobs: dict[str, Job] = {}
        self.next_pid = 100_000
        self.blocked: set[tuple[str, int]] = set()

    def owner_busy(self, ref: tuple[str, int], now: float) -> bool:
        if ref in self.blocked:
            return True
        m = (now - self.t0) / self.scale
        return any(a <= m < b and busy for a, b, busy in self.trace.get(ref, ()))

    def end(self, p: Proc, rc: int | None, now: float) -> None:
        p.alive = False
        p.exit = None if rc is None else {"returncode": rc, "ended_at": now}

    def advance(self, now: float) -> None:
        for p in self.procs.values():
            if p.alive and p.leave_at is not None and now >= p.leave_at:
                self.end(p, 0, now)
        for token, job in self.jobs.items():
            workers = {p.wid: p for p in self.procs.values() if p.token == token and not p.coordinator}
            want = [w for w in job.desired if w in workers and workers[w].alive]
            if any(not workers[w].alive for w in job.members):   # recover without the dead
                job.members = [w for w in want if w in job.members or workers[w].ready_at <= now]
                job.desired, job.generation = want, job.generation + 1
            elif sorted(want) != sorted(job.members) and all(workers[w].ready_at <= now for w in want):
                for w in job.members:
                    p = workers[w]
                    if p.alive and w not in want:  # a leaver: exits after the switch, unless it hangs
                        p.hang = self.rng.random() < self.hang
                        p.leave_at = None if p.hang else now + self.rng.uniform(*LEAVE_S)
                job.members, job.desired, job.generation = want, want, job.generation + 1

    def spawn(self, host: str, spec: dict) -> dict:
        now = time.time()
        self.next_pid += 2
        p = Proc(self.next_pid, host, spec, now)
        self.procs[p.pgid] = p
        if p.coordinator:
            self.jobs[p.token] = Job(p.initial)
        return {"pid": p.pid, "pgid": p.pgid}

    def signal(self, pgids: list[int], signum: int) -> list[bool]:
        now, out = time.time(), []
        for g in pgids:
            p = self.procs.get(g)
            out.append(bool(p and p.alive))
            if not (p and p.alive):
                continue
            if signum == signal.SIGKILL or p.coordinator:
                self.end(p, None if signum == signal.SIGKILL else 0, now)
            else:  # the runtime's SIGTERM: the whole job stops at its next step boundary
                for q in self.procs.values():
                    if q.token == p.token and not q.coordinator and q.alive and not q.hang:
                        q.leave_at = min(q.leave_at or now + 0.2, now + 0.2)
        return out


class FakeHost(Transport):
    def __init__(self, cfg, world: World) -> None:
        super().__init__(cfg)
        self.w = world

    def run(self, argv: list[str], *, input: str | None = None, timeout: float | None = None) -> CommandResult:
        with self.w.lock:
            now = time.time()
            self.w.advance(now)
            name = self.host.name
            ours = [p for p in self.w.procs.values() if p.host == name and p.alive and p.gpus]
            if argv[0] == "nvidia-smi" and argv[1].startswith("--query-gpu"):
                rows = []
                for i in range(GPUS_PER_HOST):
                    owner, mine = self.w.owner_busy((name, i), now), any(i in p.gpus for p in ours)
                    util, mem = (90 if owner else 0) + (5 if mine else 0), (20000 if owner else 0) + (4000 if mine else 0)
                    rows.append(f"{i}, GPU-{name}-{i}, NVIDIA H100 80GB HBM3, {min(util, 100)}, {mem}, 81559")
                return CommandResult(0, "\n".join(rows) + "\n", "")
            if argv[0] == "nvidia-smi":
                rows = [f"GPU-{name}-{i}, {900_000 + i}, 20000" for i in range(GPUS_PER_HOST)
                        if self.w.owner_busy((name, i), now)]
                rows += [f"GPU-{name}-{d}, {p.pid}, 4000" for p in ours for d in p.gpus]
                return CommandResult(0, "\n".join(rows) + "\n", "")
            if argv[0] == "ps":
                out = []
                for pid in map(int, argv[-1].split(",")):
                    if pid >= 900_000:
                        out.append(f"{pid} {pid} {self.w.owners.get(name, 'someone')}")
                    elif pid - 1 in self.w.procs and self.w.procs[pid - 1].alive:
                        out.append(f"{pid} {pid - 1} train")
                return CommandResult(0 if out else 1, "\n".join(out) + "\n", "")
            return CommandResult(0, "29500\n", "")   # the free-port probe

    def hostop(self, op: str, request: dict[str, Any], extra_timeout_s: float = 0.0) -> Any:
        if op == "stop":
            self.hostop("signal", {"pgids": request["pgids"], "signal": signal.SIGTERM})
            end = time.time() + request["grace_s"]
            while time.time() < end and any(s["alive"] for s in self.hostop("status", {"items": [
                    {"pgid": g, "exit_path": ""} for g in request["pgids"]]})):
                time.sleep(0.05)
            self.hostop("signal", {"pgids": request["pgids"], "signal": signal.SIGKILL})
            return ["terminated"] * len(request["pgids"])
        with self.w.lock:
            self.w.advance(time.time())
            if op == "spawn":
                return self.w.spawn(self.host.name, request)
            if op == "signal":
                return self.w.signal(request["pgids"], request["signal"])
            if op == "status":
                out = []
                for item in request["items"]:
                    p = self.w.procs.get(item["pgid"]) if item["pgid"] else None
                    out.append({"alive": bool(p and p.alive), "exit": p.exit if p else None})
                return out
        raise ValueError(op)

    def control_request(self, path: str, message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        with self.w.lock:
            self.w.advance(time.time())
            if not path.endswith("coord.sock"):
                return {"ok": True}
            job = self.w.jobs[path.split("gpuflex-")[1].split("/")[0]]
            if message.get("op") == "resize":
                job.desired = list(message["members"])
                return {"ok": True}
            return {"ok": True, "generation": job.generation, "members": list(job.members), "history": [],
                    "settled": sorted(job.members) == sorted(job.desired), "progress": None}


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
    world = World(trace, time.time() + 1e9, args.scale, owners, rng, args.hang)  # trace not started yet
    pool_module.make_transport = lambda host: FakeHost(host, world)
    svc = JobService(cfg)
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
                for w in s.scalars(select(Worker)) if w.host in owners]
        reclaims = [e.data for e in s.scalars(select(Event).where(Event.kind == "reclaim"))]
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
