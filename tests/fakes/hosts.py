"""Simulated hosts behind the Transport seam: no SSH, no processes, no torch.

A `World` holds the simulated processes of every host: coordinators that form
generations (resize when the newcomers are ready, recover when a member died) and
workers that warm up, leave after a switch, or stop on SIGTERM. `FakeHost` is the
Transport of one host in it: it answers nvidia-smi (owner activity from a trace or
`World.blocked`, plus our workers' own processes), `ps`, the hostops process operations
(spawn, status, signal, stop) and the coordinator's and workers' control sockets.

Give it to the control side through the pool's factory:

    world = World(gpus_per_host=2)
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))

Simulated processes run in real seconds (`warmup_s`, `leave_s`); owner activity follows
the trace in trace minutes of `scale` wall seconds from `t0` (benchmarks/harvest_trace.py).
A host's GPUs are all of one model, `World.models[host]` (else MODEL), as nvidia-smi names
it; a job's coordinator reports `World.progress[token]` as its progress (else none).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from typing import Any

from gpuflex.errors import TransportError
from gpuflex.hosts.transport import CommandResult, Transport

OWNER_PID = 900_000   # pids from here on are the owners' processes
MODEL = "NVIDIA H100 80GB HBM3"


class Proc:
    """One simulated process group: a coordinator or a worker, read from its spawn spec."""

    def __init__(self, pid: int, host: str, spec: dict, now: float, warmup_s: float) -> None:
        env, argv = spec.get("env") or {}, spec["argv"]
        self.pid, self.pgid, self.host, self.exit_path = pid + 1, pid, host, spec["exit_path"]
        self.coordinator = "gpuflex.elastic.coordinator" in argv
        self.token, self.socket_dir = env["GPUFLEX_JOB_TOKEN"], spec.get("socket_dir")
        self.wid = None if self.coordinator else int(env["GPUFLEX_WORKER_ID"])
        self.gpus = [int(d) for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        self.env = env
        self.ready_at = now + warmup_s
        self.alive, self.exit, self.leave_at, self.hang = True, None, None, False
        self.initial = [int(w) for w in argv[argv.index("--members") + 1].split(",")] if self.coordinator else []


class SimJob:
    """The coordinator's view: desired set, members, generation."""

    def __init__(self, initial: list[int]) -> None:
        self.desired, self.members, self.generation = list(initial), [], 0


class World:
    """Every simulated host's processes and owners. `hang`: the share of leavers that
    ignore a shrink until SIGKILLed; `blocked`: (host, gpu) an owner holds regardless of
    the trace."""

    def __init__(self, trace: dict | None = None, t0: float = 0.0, scale: float = 1.0,
                 owners: dict[str, str] | None = None, rng: random.Random | None = None,
                 hang: float = 0.0, *, warmup_s: float = 2.0, leave_s: tuple[float, float] = (0.3, 1.5),
                 gpus_per_host: int = 2) -> None:
        self.trace, self.t0, self.scale, self.owners = trace or {}, t0, scale, owners or {}
        self.rng, self.hang = rng or random.Random(0), hang
        self.warmup_s, self.leave_s, self.gpus_per_host = warmup_s, leave_s, gpus_per_host
        self.lock = threading.RLock()
        self.procs: dict[int, Proc] = {}
        self.jobs: dict[str, SimJob] = {}
        self.next_pid = 100_000
        self.blocked: set[tuple[str, int]] = set()
        self.models: dict[str, str] = {}           # host -> its GPUs' model (else MODEL)
        self.progress: dict[str, dict] = {}        # job token -> its coordinator's progress record
        self.down: set[str] = set()                # hosts that do not answer (their processes run on)

    def owner_busy(self, ref: tuple[str, int], now: float) -> bool:
        if ref in self.blocked:
            return True
        m = (now - self.t0) / self.scale
        return any(a <= m < b and busy for a, b, busy in self.trace.get(ref, ()))

    def end(self, p: Proc, rc: int | None, now: float | None = None) -> None:
        """The process ends: with an exit record of `rc`, or none (None: killed, lost)."""
        p.alive = False
        p.exit = None if rc is None else {"returncode": rc, "ended_at": now or time.time()}

    def coordinator(self, token: str) -> Proc:
        """The job's newest coordinator process."""
        return [p for p in self.procs.values() if p.coordinator and p.token == token][-1]

    def workers(self, token: str | None = None) -> dict[int, Proc]:
        """Worker processes by worker id (of one job, by its token)."""
        return {p.wid: p for p in self.procs.values()
                if not p.coordinator and (token is None or p.token == token)}

    def advance(self, now: float) -> None:
        for p in self.procs.values():
            if p.alive and p.leave_at is not None and now >= p.leave_at:
                self.end(p, 0, now)
        for token, job in self.jobs.items():
            workers = self.workers(token)
            want = [w for w in job.desired if w in workers and workers[w].alive]
            if any(not workers[w].alive for w in job.members):   # recover without the dead
                job.members = [w for w in want if w in job.members or workers[w].ready_at <= now]
                job.desired, job.generation = want, job.generation + 1
            elif sorted(want) != sorted(job.members) and all(workers[w].ready_at <= now for w in want):
                for w in job.members:
                    p = workers[w]
                    if p.alive and w not in want:  # a leaver: exits after the switch, unless it hangs
                        p.hang = self.rng.random() < self.hang
                        p.leave_at = None if p.hang else now + self.rng.uniform(*self.leave_s)
                job.members, job.desired, job.generation = want, want, job.generation + 1

    def spawn(self, host: str, spec: dict) -> dict:
        now = time.time()
        self.next_pid += 2
        p = Proc(self.next_pid, host, spec, now, self.warmup_s)
        self.procs[p.pgid] = p
        if p.coordinator:
            self.jobs[p.token] = SimJob(p.initial)
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
    """One host of a World, as a Transport."""

    def __init__(self, cfg, world: World) -> None:
        super().__init__(cfg)
        self.w = world

    def _answers(self) -> None:
        if self.host.name in self.w.down:
            raise TransportError(self.host.name, "connection refused (simulated: the host does not answer)")

    def run(self, argv: list[str], *, input: str | None = None, timeout: float | None = None) -> CommandResult:
        self._answers()
        with self.w.lock:
            now = time.time()
            self.w.advance(now)
            name, n = self.host.name, self.w.gpus_per_host
            ours = [p for p in self.w.procs.values() if p.host == name and p.alive and p.gpus]
            if argv[0] == "nvidia-smi" and argv[1].startswith("--query-gpu"):
                rows = []
                for i in range(n):
                    owner, mine = self.w.owner_busy((name, i), now), any(i in p.gpus for p in ours)
                    util, mem = (90 if owner else 0) + (5 if mine else 0), (20000 if owner else 0) + (4000 if mine else 0)
                    model = self.w.models.get(name, MODEL)
                    rows.append(f"{i}, GPU-{name}-{i}, {model}, {min(util, 100)}, {mem}, 81559")
                return CommandResult(0, "\n".join(rows) + "\n", "")
            if argv[0] == "nvidia-smi":
                rows = [f"GPU-{name}-{i}, {OWNER_PID + i}, 20000" for i in range(n)
                        if self.w.owner_busy((name, i), now)]
                rows += [f"GPU-{name}-{d}, {p.pid}, 4000" for p in ours for d in p.gpus]
                return CommandResult(0, "\n".join(rows) + "\n", "")
            if argv[0] == "ps":
                out = []
                for pid in map(int, argv[-1].split(",")):
                    if pid >= OWNER_PID:
                        out.append(f"{pid} {pid} {self.w.owners.get(name, 'someone')}")
                    elif pid - 1 in self.w.procs and self.w.procs[pid - 1].alive:
                        out.append(f"{pid} {pid - 1} train")
                return CommandResult(0 if out else 1, "\n".join(out) + "\n", "")
            return CommandResult(0, "29500\n", "")   # the free-port probe

    def hostop(self, op: str, request: dict[str, Any], extra_timeout_s: float = 0.0) -> Any:
        self._answers()
        if op == "end-run":   # the groups marked in a run's socket directory, killed
            with self.w.lock:
                ended = [p for p in self.w.procs.values()
                         if p.host == self.host.name and p.alive and p.socket_dir == request["socket_dir"]]
                for p in ended:
                    self.w.end(p, None)
                return [p.pgid for p in ended]
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
            coord = [p for p in self.w.procs.values()
                     if p.coordinator and p.alive and p.socket_dir == path.rsplit("/", 1)[0]]
            if not coord:
                raise TransportError(self.host.name, f"control socket {path}: connection refused")
            token = coord[0].token
            job = self.w.jobs[token]
            if message.get("op") == "resize":
                job.desired = list(message["members"])
                return {"ok": True}
            return {"ok": True, "generation": job.generation, "members": list(job.members), "history": [],
                    "settled": sorted(job.members) == sorted(job.desired),
                    "progress": self.w.progress.get(token)}


def two_hosts(tmp_path) -> tuple[World, Any]:
    """Simulated hosts a and b with one device each, and a JobService over a fresh SQLite
    database in `tmp_path` (a cancel's grace 0.2 s); the caller closes the service."""
    from gpuflex.config import parse_config
    from gpuflex.control.pool import Pool
    from gpuflex.control.service import JobService

    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=1)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 0.2},
                        "hosts": [{"name": "a", "address": "10.9.1.1", "workdir": "/w"},
                                  {"name": "b", "address": "10.9.1.2", "workdir": "/w"}]}, "<test>")
    return world, JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
