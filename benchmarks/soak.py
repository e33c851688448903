"""The long soak: one elastic job trained through a seeded random schedule of resizes,
harvest ticks, owner arrivals and faults, then checked against a fixed-size run.

Unit tests put one fault in one phase; a soak finds what only a sequence finds (a requeue
while a scale is half done, a coordinator killed while a worker is stopped). The pool is
this machine: two "local" GPU hosts whose `nvidia-smi` is tests/fakes/nvidia-smi reading a
state file the soak edits, so harvest ticks and owner arrivals are the real commands.
Host `fa` has no owner (anybody's process there is foreign); `fb` belongs to `alice`, so
harvest grows the job onto its GPUs once they are idle. Every command is the real CLI
(`gpuflex` subprocesses, a throw-away config, database and HOME under a temp dir).

Every wait is bounded. The job not training (its step not advancing) for `--hang-s` is a
hang: reported, the run ends with exit 1. At most 3 of the 4 GPUs are held by owners at
once, and owners leave within 75 s, so the job always has a GPU to go to.

Run: .venv/bin/python benchmarks/soak.py [--minutes 30] [--seed N] [--keep]
(`--hosts`: the multi-host chaos soak instead; see benchmarks/soak_pool.py)
Exit 0 only if the job succeeded, nothing hung and its final model equals the standalone
run's (allclose rtol 1e-5, atol 1e-6; same steps; every sample once per epoch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "elastic_mlp.py"
FAKE_SMI = ROOT / "tests" / "fakes" / "nvidia-smi"
GPUFLEX = str(Path(sys.executable).parent / "gpuflex")
GPUS = (("fa", 0), ("fa", 1), ("fb", 0), ("fb", 1))
MIN_WORKERS, MAX_WORKERS = 1, 4
MAX_OWNED = 3
OWNER_STAY_S = (15.0, 75.0)
GAP_S = (4.0, 20.0)
STEPS_PER_EPOCH = 32                 # the example: 2048 samples, global batch 64
JOB_ARGS = ["--hidden", "32", "--global-batch-size", "64", "--seed", "3"]
JOBS = {"checkpoint_interval_s": 5, "heartbeat_timeout_s": 3, "pg_timeout_s": 10,
        "cancel_grace_s": 10, "formation_timeout_s": 60, "orphan_timeout_s": 120}
# action -> weight; an owner visit is two entries (arrive, leave)
WEIGHTS = {"tick": 5, "scale": 3, "owner": 2, "kill_worker": 2, "kill_newcomer": 1,
           "stop_worker": 1, "kill_coordinator": 1, "kill_scale": 1}
CLI_TIMEOUT_S = 150
END_LAG_S = JOBS["pg_timeout_s"] + JOBS["heartbeat_timeout_s"] + 30   # last step -> job ended


@dataclasses.dataclass(frozen=True)
class Planned:
    at: float                  # seconds from the start of the schedule
    action: str
    args: dict[str, Any]


@dataclasses.dataclass
class Bg:
    """A gpuflex command running in the background."""
    started: float
    what: str
    proc: subprocess.Popen
    out: Path
    kill_at: float | None = None      # SIGKILL it then (a scale killed mid-resize)

    def output(self) -> tuple[str, str]:
        return self.out.read_text(), self.out.with_suffix(".err").read_text()


def make_schedule(seed: int, minutes: float) -> list[Planned]:
    """The whole schedule for `seed`, before anything runs: the same seed gives the same
    list. Every draw is made here (targets, victims as a fraction of the live workers,
    durations), so a run repeats given the same job behaviour."""
    rng = random.Random(seed)
    end = minutes * 60.0
    out: list[Planned] = []
    owned: dict[tuple[str, int], float] = {}        # GPU -> when its owner leaves
    t = rng.uniform(*GAP_S)
    while t < end:
        action = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        args: dict[str, Any] = {}
        if action == "owner":
            busy = {g for g, until in owned.items() if until > t}
            free = [g for g in GPUS if g not in busy]
            if len(busy) >= MAX_OWNED or not free:
                action, args = "tick", {}
            else:
                gpu = rng.choice(free)
                leave = min(t + rng.uniform(*OWNER_STAY_S), end)
                owned[gpu] = leave
                out.append(Planned(round(leave, 3), "owner_leave", {"host": gpu[0], "gpu": gpu[1]}))
                action, args = "owner_arrive", {"host": gpu[0], "gpu": gpu[1]}
        elif action == "scale":
            args = {"n": rng.randint(MIN_WORKERS, MAX_WORKERS)}
        elif action == "kill_worker":
            args = {"which": rng.choice(["rank0", "last", "any"]), "u": round(rng.random(), 4)}
        elif action == "kill_newcomer":
            args = {"delay_s": round(rng.uniform(0.5, 8.0), 3)}
        elif action == "stop_worker":
            args = {"u": round(rng.random(), 4), "extra_s": round(rng.uniform(2.0, 10.0), 3)}
        elif action == "kill_scale":
            args = {"n": rng.randint(MIN_WORKERS, MAX_WORKERS), "delay_s": round(rng.uniform(0.3, 4.0), 3),
                    "via": rng.choice(["timer", "failpoint"])}
        out.append(Planned(round(t, 3), action, args))
        t += rng.uniform(*GAP_S)
    return sorted(out, key=lambda p: p.at)


def not_training(step_log: list[list[float]], started: float) -> dict[str, Any]:
    """Time the job was not training, from the final step log ([step, time, world size]
    per step that counts; steps redone after a rollback appear once, at their last time):
    the wait before the first step, plus every gap between consecutive steps longer than
    max(1 s, 4 x the median gap), less one median gap each (the step itself)."""
    if not step_log:
        return {"total_s": None, "gaps": [], "median_step_s": None}
    times = [row[1] for row in step_log]
    gaps = [b - a for a, b in zip(times, times[1:])]
    med = statistics.median(gaps) if gaps else 0.0
    cut = max(1.0, 4 * med)
    long = [(times[i], g - med) for i, g in enumerate(gaps) if g > cut]
    first = max(0.0, times[0] - started)
    return {"total_s": first + sum(g for _, g in long), "first_step_s": first, "median_step_s": med,
            "gaps": sorted(long, key=lambda x: -x[1]), "span_s": times[-1] - started}


# ---- the pool and the CLI ----------------------------------------------------------------
class Pool:
    """The temp dir: config, DB, HOME, the fake nvidia-smi state of each host, owners."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"
        self.home.mkdir(parents=True)
        self.config = root / "gpuflex.toml"
        self.owners: dict[tuple[str, int], subprocess.Popen] = {}
        self.runs = 0
        tables = []
        for host in ("fa", "fb"):
            smi = root / f"{host}-nvidia-smi"
            smi.write_text("#!/bin/sh\nexec " + " ".join(
                f"'{a}'" for a in (sys.executable, "-I", "-S", str(FAKE_SMI), "--state", str(self.state(host))))
                + ' "$@"\n')
            smi.chmod(0o755)
            tables.append(f'[[hosts]]\nname = "{host}"\naddress = "local"\nnvidia_smi = "{smi}"\n'
                          f'workdir = "{root / "work" / host}"\n' + ('owner = "alice"\n' if host == "fb" else ""))
            self.write_smi(host)
        jobs = "".join(f"{k} = {v}\n" for k, v in JOBS.items())
        self.config.write_text(f'[database]\nurl = "sqlite:///{root / "g.db"}"\n\n'
                               "[harvest]\ninterval_s = 5\nidle_samples = 1\nreclaim_deadline_s = 20\n\n"
                               f"[jobs]\n{jobs}\n" + "\n".join(tables))

    def state(self, host: str) -> Path:
        return self.root / f"{host}.smi.json"

    def write_smi(self, host: str) -> None:
        gpus, procs = [], []
        for h, i in GPUS:
            if h != host:
                continue
            owner = self.owners.get((h, i))
            uuid = f"GPU-{h}-{i:04d}-fake"
            gpus.append({"index": i, "uuid": uuid, "name": "NVIDIA H100 80GB HBM3", "memory_total": 81559,
                         "utilization": 97 if owner else 0, "memory_used": 12000 if owner else 0})
            if owner:
                procs.append({"gpu_uuid": uuid, "pid": owner.pid, "used_memory": 12000})
        tmp = self.state(host).with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": gpus, "processes": procs}))
        os.replace(tmp, self.state(host))

    def arrive(self, host: str, gpu: int) -> str:
        self.owners[(host, gpu)] = subprocess.Popen(["sleep", "3600"])
        self.write_smi(host)
        return f"owner pid {self.owners[(host, gpu)].pid} on {host}:{gpu}"

    def leave(self, host: str, gpu: int) -> str:
        p = self.owners.pop((host, gpu), None)
        if p is not None:
            p.kill()
            p.wait()
        self.write_smi(host)
        return f"{host}:{gpu} quiet"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
        return {**env, "HOME": str(self.home), "GPUFLEX_CONFIG": str(self.config), "COLUMNS": "200", **extra}

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run([GPUFLEX, *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env(), cwd=self.home)

    def popen(self, *args: str, **extra: str) -> Bg:
        """`gpuflex ARGS` in the background, its stdout and stderr to files (read once it ends)."""
        self.runs += 1
        out = self.root / "cli" / f"{self.runs}.out"
        out.parent.mkdir(exist_ok=True)
        with open(out, "w") as o, open(out.with_suffix(".err"), "w") as e:
            proc = subprocess.Popen([GPUFLEX, *args], stdout=o, stderr=e, env=self.env(**extra), cwd=self.home)
        return Bg(time.monotonic(), args[0], proc, out)

    def db(self, sql: str, *params) -> list[tuple]:
        con = sqlite3.connect(str(self.root / "g.db"), timeout=30)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()

    def close(self) -> None:
        for host, gpu in list(self.owners):
            self.leave(host, gpu)


def one_line(p: subprocess.CompletedProcess | str) -> str:
    text = p if isinstance(p, str) else (p.stdout + p.stderr)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:160]


def tick_text(rc: int, out: str, err: str) -> str:
    """A harvest tick's actions in a few words."""
    try:
        data = json.loads(out)
    except json.JSONDecodeError:
        return f"exit {rc}: {one_line(out + err)}"
    acts = [f"{x['action']}{'' if x.get('ok', True) else '(failed)'}"
            + (f"[{x['method']}]" if x.get("method") else "") for x in data.get("actions", [])]
    return f"exit {rc}: " + (", ".join(acts) or "nothing to do") + (" (skipped)" if data.get("skipped") else "")


def failpoint_placed(name: str) -> bool:
    """Whether the control side calls failpoint `name` (FP1 places the call sites)."""
    return any(f'"{name}"' in p.read_text() for p in (ROOT / "gpuflex" / "control").glob("*.py"))


def signal_pid(pid: int | None, sig: int, mark: str = "") -> bool:
    """Signal `pid` if it lives and its command line holds `mark` (this soak's temp dir,
    in every worker's --report path): a pid read from a status a moment ago may have been
    reused by then, and the soak must never signal a process it did not start."""
    if not pid:
        return False
    try:
        if mark and mark.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
    except OSError:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


# ---- the run -----------------------------------------------------------------------------
class Soak:
    """Carries out a schedule against one job and keeps what happened."""

    def __init__(self, pool: Pool, job: int, hang_s: float) -> None:
        self.pool, self.job, self.hang_s = pool, job, hang_s
        self.t0 = time.monotonic()
        self.executed: list[tuple[float, str, str, str]] = []    # (t, action, args, result)
        self.background: list[Bg] = []
        self.poller: Bg | None = None
        self.pending: list[tuple[float, str, Any]] = []          # (t, what, argument): SIGCONTs, newcomer kills
        self.view: dict[str, Any] = {}
        self.last_step: int | None = None
        self.last_progress = time.monotonic()
        self.problems: list[str] = []
        self.loads: list[float] = []
        self.stopped: set[int] = set()
        self.last_line = 0.0
        self.mark = str(pool.root)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, action: str, args: dict | str, result: str) -> None:
        text = args if isinstance(args, str) else " ".join(f"{k}={v}" for k, v in args.items())
        self.executed.append((self.now(), action, text, result))
        print(f"{self.now():8.1f}  {action:<16} {text:<36} {result}", flush=True)

    # -- watching --
    def absorb(self, rc: int, out: str, err: str) -> dict[str, Any]:
        """Take a status reply in; the step advancing is what counts as training."""
        if rc != 0:
            self.problems.append(f"{self.now():.0f}s status failed: {one_line(out + err)}")
            return self.view
        self.view = json.loads(out)
        step = self.view.get("step")
        if isinstance(step, int) and (self.last_step is None or step > self.last_step):
            self.last_progress = time.monotonic()
        if isinstance(step, int):
            self.last_step = step
        self.loads.append(os.getloadavg()[0])
        if time.monotonic() - self.last_line >= 60:
            self.last_line = time.monotonic()
            live = self.live(("starting", "running", "leaving"))
            print(f"{self.now():8.1f}  -- {self.view.get('state')}, step {step}, world size "
                  f"{self.view.get('world_size')}, workers {[w['wid'] for w in live]}, "
                  f"load {self.loads[-1]:.1f}", flush=True)
        return self.view

    def poll_in_background(self) -> None:
        """Start a status call, or take in the one that ended: the loop never waits on it."""
        bg = self.poller
        if bg is None:
            self.poller = self.pool.popen("status", str(self.job), "--json")
        elif bg.proc.poll() is not None:
            self.poller = None
            self.absorb(bg.proc.returncode, *bg.output())
        elif time.monotonic() - bg.started > CLI_TIMEOUT_S:
            bg.proc.kill()
            bg.proc.wait()
            self.poller = None
            self.problems.append(f"{self.now():.0f}s gpuflex status did not return in {CLI_TIMEOUT_S} s")

    def final(self) -> bool:
        return self.view.get("state") in ("succeeded", "failed", "cancelled")

    def hung(self) -> str | None:
        idle = time.monotonic() - self.last_progress
        if idle <= self.hang_s or self.final():
            return None
        forming = self.view.get("forming")
        return (f"not training for {idle:.0f} s (> {self.hang_s:.0f} s): state {self.view.get('state')}, "
                f"step {self.view.get('step')}, generation {self.view.get('generation')}, forming {forming}")

    def live(self, states: tuple[str, ...] = ("running",)) -> list[dict]:
        return sorted((w for w in self.view.get("workers", []) if w["state"] in states and w.get("pid")),
                      key=lambda w: (w["rank"] if w["rank"] is not None else 99, w["wid"]))

    # -- background commands and pending signals --
    def reap(self) -> None:
        for bg in list(self.background):
            if bg.kill_at is not None and time.monotonic() >= bg.kill_at and bg.proc.poll() is None:
                bg.proc.kill()
                bg.proc.wait()
                self.background.remove(bg)
                self.note(bg.what, "", f"SIGKILL sent to gpuflex scale pid {bg.proc.pid} "
                          f"after {time.monotonic() - bg.started:.1f} s")
                continue
            if bg.proc.poll() is None and time.monotonic() - bg.started > CLI_TIMEOUT_S:
                bg.proc.kill()
                bg.proc.wait()
                self.problems.append(f"{self.now():.0f}s {bg.what}: gpuflex did not return in {CLI_TIMEOUT_S} s")
            if bg.proc.poll() is not None:
                self.background.remove(bg)
                out, err = bg.output()
                took = time.monotonic() - bg.started
                if bg.what == "tick":
                    self.note("tick", "", f"after {took:.1f} s: {tick_text(bg.proc.returncode, out, err)}")
                else:
                    self.note(bg.what, "", f"exit {bg.proc.returncode} after {took:.1f} s: {one_line(out + err)}")
        for item in list(self.pending):
            at, what, arg = item
            if time.monotonic() < at:
                continue
            self.pending.remove(item)
            if what == "sigcont":
                self.stopped.discard(arg)
                self.note("sigcont", f"pid={arg}", "sent" if signal_pid(arg, signal.SIGCONT, self.mark) else "gone")
            elif what == "kill_newcomer":
                self.kill_newest(*arg)

    def kill_newest(self, known: set[int], tries: int = 4) -> None:
        """kill -9 of the newest worker process the soak's status views had not seen, read
        from /proc (its GPUFLEX_WORKER_ID): a status call under load comes too late."""
        fresh = {wid: pid for wid, pid in self.worker_pids().items() if wid not in known}
        if not fresh:
            if tries > 1:
                self.pending.append((time.monotonic() + 3, "kill_newcomer", (known, tries - 1)))
            else:
                self.note("kill_newcomer", "", "no newcomer process appeared (grow refused or not spawned)")
            return
        wid = max(fresh)
        ok = signal_pid(fresh[wid], signal.SIGKILL, self.mark)
        self.note("kill_newcomer", f"wid={wid}", f"kill -9 pid {fresh[wid]}: " + ("sent" if ok else "gone"))

    def worker_pids(self) -> dict[int, int]:
        """wid -> pid of this soak's worker processes alive now."""
        out = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if self.mark.encode() not in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    continue
                env = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for var in env:
                if var.startswith(b"GPUFLEX_WORKER_ID="):
                    out[int(var.split(b"=", 1)[1])] = int(entry.name)
        return out

    # -- the actions --
    def run_action(self, p: Planned) -> None:
        a = p.action
        if a == "tick":
            self.tick(p.args)
        elif a == "owner_arrive":
            self.note(a, p.args, self.pool.arrive(p.args["host"], p.args["gpu"]))
        elif a == "owner_leave":
            self.note(a, p.args, self.pool.leave(p.args["host"], p.args["gpu"]))
        elif a == "scale":
            self.background.append(self.pool.popen("scale", str(self.job), str(p.args["n"]), "--wait",
                                                   "--timeout", "120"))
            self.note(a, p.args, "started (gpuflex scale --wait)")
        elif a == "kill_scale":
            self.kill_scale(p.args)
        elif a == "kill_newcomer":
            alive = self.worker_pids()
            n = min(MAX_WORKERS, len(alive) + 1)
            known = set(alive) | {w["wid"] for w in self.view.get("workers", [])}
            self.background.append(self.pool.popen("scale", str(self.job), str(n)))
            self.pending.append((time.monotonic() + p.args["delay_s"], "kill_newcomer", (known, 4)))
            self.note(a, p.args, f"gpuflex scale {n} started; newcomer killed in {p.args['delay_s']} s")
        elif a in ("kill_worker", "stop_worker"):
            self.signal_worker(a, p.args)
        elif a == "kill_coordinator":
            self.note(a, p.args, self.kill_coordinator())

    def kill_coordinator(self) -> str:
        """kill -9 of the coordinator process itself (its supervisor lives on and records
        the exit, as when the coordinator alone is OOM-killed)."""
        from gpuflex.hosts.hostops import proc_stats

        rows = self.pool.db("SELECT store_pgid FROM jobs WHERE id = ?", self.job)
        pgid = rows[0][0] if rows else None
        if not pgid:
            return "no coordinator recorded"
        for pid, _, _, pgrp in proc_stats():
            if pgrp != pgid:
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"gpuflex.elastic.coordinator" in cmd:
                sent = signal_pid(pid, signal.SIGKILL, self.mark)
                return f"kill -9 coordinator pid {pid}: " + ("sent" if sent else "gone")
        return f"no coordinator process in group {pgid}"

    def tick(self, args: dict) -> None:
        """`gpuflex harvest --json` in the background (a reclaim may take its deadline);
        one at a time, as cron's overlapping ticks would skip."""
        if any(bg.what == "tick" for bg in self.background):
            self.note("tick", args, "not started: the last tick is still running")
            return
        self.background.append(self.pool.popen("harvest", "--json"))
        self.background[-1].what = "tick"

    def kill_scale(self, args: dict) -> None:
        via = args["via"]
        if via == "failpoint" and not failpoint_placed("scale.spawned"):
            via = "timer (failpoint scale.spawned not placed)"
        if via == "failpoint":
            bg = self.pool.popen("scale", str(self.job), str(args["n"]), "--wait", "--timeout", "120",
                                 GPUFLEX_FAILPOINTS="scale.spawned=kill")
        else:
            bg = self.pool.popen("scale", str(self.job), str(args["n"]), "--wait", "--timeout", "120")
            bg.kill_at = bg.started + args["delay_s"]
        bg.what = f"kill_scale->{args['n']}"
        self.background.append(bg)
        how = "scale.spawned=kill armed (fires once newcomers are spawned)" if via == "failpoint" else via
        self.note("kill_scale", args, f"gpuflex scale {args['n']} --wait started, killed by {how}")

    def signal_worker(self, action: str, args: dict) -> None:
        """The victim is chosen from the last status view (a few seconds old; a fresh call
        under load comes too late) and signalled only if its pid is still this soak's."""
        live = [w for w in self.live() if w["pid"] not in self.stopped]
        if len(live) < 2:
            # the soak keeps a survivor, as when its figures were taken: an in-place job with
            # none left was failed then; it is now requeued from its checkpoint (cause "fault")
            self.note(action, args, f"skipped: {len(live)} running worker(s) not stopped "
                                    f"(state {self.view.get('state')}); the soak keeps one")
            return
        which = args.get("which", "any")
        w = live[0] if which == "rank0" else live[-1] if which == "last" else live[int(args["u"] * len(live))]
        where = f"wid {w['wid']} rank {w['rank']} pid {w['pid']} on {w['host']}"
        if action == "kill_worker":
            sent = signal_pid(w["pid"], signal.SIGKILL, self.mark)
            self.note(action, args, f"kill -9 {where}: " + ("sent" if sent else "gone"))
            return
        hold = JOBS["pg_timeout_s"] + JOBS["heartbeat_timeout_s"] + args["extra_s"]
        ok = signal_pid(w["pid"], signal.SIGSTOP, self.mark)
        if ok:
            self.stopped.add(w["pid"])
            self.pending.append((time.monotonic() + hold, "sigcont", w["pid"]))
        self.note(action, args, f"SIGSTOP {where} for {hold:.1f} s: " + ("sent" if ok else "gone"))

    # -- the loop --
    def run(self, schedule: list[Planned], end_s: float, drain_s: float, poll_s: float) -> str | None:
        """Carry out the schedule, then let the job finish (owners gone, ticks every 15 s).
        Returns why it stopped early (a hang, a bound passed), or None."""
        todo = list(schedule)
        next_poll = 0.0
        drain_from: float | None = None
        last_tick = 0.0
        while True:
            now = self.now()
            if now >= next_poll or self.poller is not None:
                if self.poller is None:
                    next_poll = now + poll_s
                self.poll_in_background()
                why = self.hung()
                if why:
                    return f"HANG at {now:.0f} s: {why}"
            self.reap()
            if self.final() and not self.background:
                return None
            if drain_from is None and (now >= end_s or self.final()):
                drain_from = now
                for host, gpu in list(self.pool.owners):
                    self.note("owner_leave", {"host": host, "gpu": gpu},
                              self.pool.leave(host, gpu) + " (schedule over)")
                todo = []
            if todo and todo[0].at <= now:
                self.run_action(todo.pop(0))
                continue
            if drain_from is not None:
                if now - drain_from > drain_s:
                    return f"job still {self.view.get('state')} {drain_s:.0f} s after the schedule ended"
                if now - last_tick >= 15:
                    last_tick = now
                    self.tick({"drain": True})
            time.sleep(0.25)


# ---- the end -----------------------------------------------------------------------------
def reference(root: Path, epochs: int) -> dict:
    """The standalone run of the same script and options (no --step-sleep: it changes
    only the pace), without gpuflex's services."""
    out = root / "reference.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    subprocess.run([sys.executable, str(EXAMPLE), *JOB_ARGS, "--epochs", str(epochs), "--report", str(out)],
                   check=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=3600)
    return json.loads(out.read_text())


def compare(report: dict, ref: dict) -> tuple[bool, str]:
    """As the tests compare: same steps, allclose(rtol 1e-5, atol 1e-6), every sample once
    per epoch, the step log without a gap or a repeat."""
    got, want = report["params"], ref["params"]
    rel = max((abs(g - w) / abs(w) for g, w in zip(got, want) if abs(w) > 1e-6), default=0.0)
    absd = max((abs(g - w) for g, w in zip(got, want)), default=0.0)
    close = len(got) == len(want) and all(abs(g - w) <= 1e-6 + 1e-5 * abs(w) for g, w in zip(got, want))
    once = all(sorted(ids) == list(range(2048)) for ids in report["samples"].values()) \
        and sorted(report["samples"], key=int) == [str(e) for e in range(report["epochs"])]
    steps = [s for s, _, _ in report["step_log"]] == list(range(ref["steps"]))
    ok = close and once and steps and report["steps"] == ref["steps"]
    return ok, (f"steps {report['steps']} vs {ref['steps']}, max relative difference {rel:.3g}, "
                f"max absolute {absd:.3g}, allclose {close}, every sample once {once}, step log whole {steps}")


def summary(pool: Pool, soak: Soak, seed: int, job: int, started: float, report_path: Path,
            epochs: int, stopped: str | None) -> bool:
    print(f"\n==== soak summary (seed {seed}) ====")
    print(f"seed: {seed}")
    print("\n-- schedule as executed (s from start, action, arguments, result) --")
    for t, action, args, result in soak.executed:
        print(f"{t:8.1f}  {action:<16} {args:<36} {result}")
    counts = Counter(a for _, a, _, _ in soak.executed)
    print("\n-- actions --\n" + ", ".join(f"{a} {n}" for a, n in sorted(counts.items())))
    print("\n-- gpuflex events --")
    print(pool.cli("events", str(job)).stdout.rstrip())
    ev = json.loads(pool.cli("events", str(job), "--json").stdout or "[]")
    kinds = Counter(e["kind"] for e in ev)
    pauses = [((e.get("data") or {}).get("timings") or {}).get("pause") for e in ev if e["kind"] == "scale"]
    pauses = [x for x in pauses if isinstance(x, (int, float))]
    view = soak.view
    print(f"\n-- job --\nstate {view.get('state')}, exit reason {view.get('exit_reason')!r}, "
          f"restarts {view.get('restarts')}, generation {view.get('generation')}")
    print("event kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    requeues = sum(1 for e in ev if e["kind"] == "state" and (e.get("data") or {}).get("state") == "queued")
    print(f"state events to queued: {requeues} (restarts {view.get('restarts')})")
    if soak.loads:
        print(f"load average (1 min) while soaking: mean {statistics.mean(soak.loads):.2f}, "
              f"max {max(soak.loads):.2f} on {os.cpu_count()} cores")
    ok = view.get("state") == "succeeded" and stopped is None and not soak.problems
    if report_path.exists():
        report = json.loads(report_path.read_text())
        nt = not_training(report["step_log"], started)
        print(f"\n-- not training (from the final step log; see not_training) --\n"
              f"total {nt['total_s']:.1f} s of {nt['span_s']:.1f} s from submit to the last step "
              f"(first step after {nt['first_step_s']:.1f} s; median step {nt['median_step_s'] * 1000:.0f} ms; "
              f"{len(nt['gaps'])} gaps longer than max(1 s, 4 x median))")
        for at, gap in nt["gaps"][:8]:
            print(f"   gap of {gap:6.1f} s after the step done at {at - started:8.1f} s")
        lag = (view.get("ended_at") or time.time()) - report["step_log"][-1][1] if report["step_log"] else 0.0
        print(f"the job ended {lag:.1f} s after its last step (bound {END_LAG_S} s: "
              "pg_timeout_s + heartbeat_timeout_s + 30)")
        if lag > END_LAG_S:
            soak.problems.append(f"the job's training was over {lag:.0f} s before the job ended "
                                 f"(state events and workers above)")
            ok = False
        print(f"in-place resizes: {len(pauses)}, their pauses (events' timings.pause) sum "
              f"{sum(pauses):.1f} s, max {max(pauses, default=0):.2f} s")
        print("\n-- final model against a fixed-size run --")
        match, text = compare(report, reference(pool.root, epochs))
        print(f"{text}\n{'PASS' if match else 'FAIL'}")
        ok = ok and match
    else:
        print("\nno report was written (the job did not succeed): FAIL")
        ok = False
    for p in soak.problems:
        print(f"problem: {p}")
    if stopped:
        print(f"STOPPED: {stopped}")
    print(f"\nseed {seed}: {'OK' if ok else 'FAILED'}")
    return ok


def cleanup(pool: Pool, soak: Soak | None) -> None:
    for pid in (soak.stopped if soak else ()):
        signal_pid(pid, signal.SIGCONT, soak.mark)
    for bg in (soak.background + ([soak.poller] if soak.poller else []) if soak else ()):
        bg.proc.kill()
    pool.close()
    if not (pool.root / "g.db").exists():
        return
    for job_id, state in pool.db("SELECT id, state FROM jobs"):
        if state not in ("succeeded", "failed", "cancelled"):
            try:
                pool.cli("cancel", str(job_id), timeout=90)
            except subprocess.TimeoutExpired:
                print(f"cancel of job {job_id} did not return in 90 s")
    from gpuflex.hosts.hostops import group_alive

    pgids = [r[0] for r in pool.db("SELECT pgid FROM workers WHERE pgid IS NOT NULL")]
    pgids += [r[0] for r in pool.db("SELECT store_pgid FROM jobs WHERE store_pgid IS NOT NULL")]
    for pgid in pgids:
        if group_alive(pgid):
            print(f"left over after the job: process group {pgid}, killed")
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> int:
    if "--hosts" in sys.argv[1:]:     # the multi-host chaos soak: its own modules (soak_pool.py)
        from soak_pool import main as hosts_main
        return hosts_main([a for a in sys.argv[1:] if a != "--hosts"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed first)")
    ap.add_argument("--step-sleep", type=float, default=0.25, help="the example's pace (s a step)")
    ap.add_argument("--step-s", type=float, default=0.35,
                    help="expected seconds a step at that pace, to size the job to --minutes")
    ap.add_argument("--hang-s", type=float, default=300.0, help="not training this long is a hang")
    ap.add_argument("--poll-s", type=float, default=5.0, help="seconds between `gpuflex status` calls")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (always kept on failure)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"seed {seed}", flush=True)
    schedule = make_schedule(seed, args.minutes)
    epochs = max(2, int(args.minutes * 60 / (STEPS_PER_EPOCH * args.step_s)) + 1)
    root = Path(tempfile.mkdtemp(prefix="gpuflex-soak-"))
    pool = Pool(root)
    soak: Soak | None = None
    ok = False
    try:
        report = root / "report.json"
        print(f"{len(schedule)} planned actions over {args.minutes} min; job: elastic_mlp.py {' '.join(JOB_ARGS)} "
              f"--epochs {epochs} --step-sleep {args.step_sleep}, workers {MIN_WORKERS}:{MAX_WORKERS} --harvest; "
              f"dir {root}", flush=True)
        pool.cli("harvest")   # a first probe: fa's GPUs free for the submit
        started = time.time()
        p = pool.cli("submit", "--name", "soak", "--harvest", "--workers", f"{MIN_WORKERS}:{MAX_WORKERS}",
                     "--env", "OMP_NUM_THREADS=1", "--json", "--", sys.executable, str(EXAMPLE), *JOB_ARGS,
                     "--epochs", str(epochs), "--step-sleep", str(args.step_sleep), "--report", str(report))
        if p.returncode != 0:
            print(f"submit failed: {p.stdout}{p.stderr}")
            return 1
        job = json.loads(p.stdout)["id"]
        soak = Soak(pool, job, args.hang_s)
        stopped = soak.run(schedule, args.minutes * 60, drain_s=args.minutes * 60 + 300, poll_s=args.poll_s)
        if stopped:
            print(f"\n{stopped}\n-- last status --\n{json.dumps(soak.view, indent=1)[:4000]}")
            print("-- logs (tail) --\n" + pool.cli("logs", str(job)).stdout[-6000:])
        ok = summary(pool, soak, seed, job, started, report, epochs, stopped)
        return 0 if ok else 1
    finally:
        cleanup(pool, soak)
        if ok and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root} (job logs under work/, the DB g.db)")


if __name__ == "__main__":
    sys.exit(main())
