"""The multi-host chaos soak (`benchmarks/soak.py --hosts`): the lab of soak_lab.py (three
sshd hosts and the local pool, PostgreSQL, three unix users, gpu03's clock 10 min ahead),
the seeded schedule of soak_plan.py (users submitting in-place, restart, gang and array
jobs; scales; every fault of soak_faults.py), harvest ticks every --tick-s by each user in
turn, as their crontabs would run them, for --minutes; then every job is let finish (bounded) and checked.

A recovery is timed from the fault's injection to the job training again (for a job fault,
a new generation or restart and then a step after it; for a host fault, the same for every
in-place job that had a worker there) or, for a database fault, to `gpuflex status`
answering again. Times are printed beside their bounds, never asserted.

Exit 0 only if: nothing hung (no poll for --hang-s, nothing left running --drain-s after
the schedule), every job ended in a final state with a reason, every in-place job that
succeeded equals its fixed-size reference (cached per distinct argv), no process, socket
directory or live worker row is left, PostgreSQL's amcheck and the consistency queries are
clean, and every command hit by a database fault completed or failed with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import soak_lab   # first: it puts the checkout on sys.path for the beds
import soak_faults as faults
import soak_plan
from soak_lab import Lab
from soak_plan import Plan, Planned

EXAMPLE = soak_lab.EXAMPLE
FINAL = ("succeeded", "failed", "cancelled", "timeout")
MAX_TRAINING_JOBS = 2          # in-place + restart jobs not final at once: 2 cores carry this


def kind_of(job: dict) -> str:
    """A job's kind, from the name its submit gave it."""
    name = job.get("name") or ""
    for prefix, kind in (("mlp", "inplace"), ("ddp", "restart"), ("gang", "gang"), ("arr", "array")):
        if name.startswith(prefix):
            return kind
    return "other"


class Chaos:
    def __init__(self, lab: Lab, args: argparse.Namespace) -> None:
        self.lab, self.args = lab, args
        self.t0 = time.monotonic()
        self.jobs: list[dict] = []
        self.reports: dict[int, tuple[Path, list[str]]] = {}
        self.bg: list[tuple[str, Any, Path, float]] = []   # (what, Popen, out, started)
        self.injected: Counter = Counter()           # faults that hit something
        self.skipped: Counter = Counter()            # planned, but nothing there to hit
        self.recoveries: dict[str, list[soak_plan.Recovered]] = defaultdict(list)
        self.unrecovered: Counter = Counter()
        self.watch: list[dict] = []                   # recoveries being timed
        self.timers: list[tuple[float, str, Any]] = []  # (monotonic, what, arg): heals, sshd back
        self.problems: list[str] = []
        self.subs = 0
        self.n_submits = 0
        self.ticks = 0
        self.poller: tuple[Any, Path, float, str] | None = None
        self.polls = 0
        self.views: dict[str, dict[int, dict]] = {}   # user -> their last `status`, by job id
        self.pending_reports: dict[str, tuple[Path, list[str]]] = {}
        self.last_answer = time.monotonic()
        self.db_name = lab.url.rsplit("/", 1)[1]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, what: str, text: str) -> None:
        print(f"{self.now():8.1f}  {what:<16} {text}", flush=True)

    # -- watching --
    def poll(self) -> None:
        """Start a `status --json` in the background, or take in the one that ended: the loop
        never waits on it (under load it takes seconds). Each user's in turn, as their
        watching would be: a job's step (its coordinator's progress) is in its owner's
        status only (the others, the admin included, do not reach its processes), so each
        job's step is its owner's last view of it (soak_plan.with_step)."""
        if self.poller is None:
            out = self.lab.root / "cli" / "status.out"
            out.parent.mkdir(exist_ok=True)
            user = self.lab.users[self.polls % len(self.lab.users)]
            self.polls += 1
            self.poller = (self.lab.popen(user, ["status", "--json", "--limit", "0"], out), out, time.monotonic(),
                           user)
            return
        p, out, started, user = self.poller
        if p.poll() is None:
            if time.monotonic() - started > soak_lab.CLI_TIMEOUT_S:
                p.kill()
                p.wait()
                self.poller = None
            return
        self.poller = None
        try:
            js = json.loads(out.read_text()) if p.returncode == 0 else None
        except json.JSONDecodeError:
            js = None
        if js is None:
            return
        js = js if isinstance(js, list) else [js]
        self.views[user] = {j["id"]: j for j in js}
        self.jobs, self.last_answer = [soak_plan.with_step(j, self.views) for j in js], time.monotonic()
        by_id = {j["id"]: j for j in self.jobs}
        for w in list(self.watch):
            if w["kind"] in soak_plan.DB_FAULTS:
                continue
            j = by_id.get(w["job"])
            if j is None or j["state"] in FINAL:
                self.watch.remove(w)
                self.unrecovered[w["kind"]] += 1
                continue
            step = j.get("step")
            if not isinstance(step, int):
                continue   # no owner's status has shown this generation's step yet
            if w["after"] is None:
                if (j["generation"], j["restarts"]) != w["gen"]:
                    w["after"], w["relaunched"] = step, j["restarts"] != w["gen"][1]
            elif step > w["after"]:
                self.recoveries[w["kind"]].append(soak_plan.Recovered(time.monotonic() - w["at"], w["job"],
                                                                      w["relaunched"]))
                self.watch.remove(w)

    def watch_job(self, kind: str, j: dict) -> None:
        self.watch.append({"kind": kind, "job": j["id"], "gen": (j["generation"], j["restarts"]),
                           "after": None, "relaunched": False, "at": time.monotonic()})

    def training(self, min_live: int = 1) -> list[dict]:
        return [j for j in self.jobs if kind_of(j) == "inplace" and j["state"] == "running"
                and isinstance(j.get("step"), int)
                and sum(w["state"] == "running" for w in j["workers"]) >= min_live]

    def start_bg(self, what: str, user: str | None, cli_args: list[str]) -> Any:
        self.subs += 1
        out = self.lab.root / "cli" / f"{self.subs}.out"
        out.parent.mkdir(exist_ok=True)
        p = self.lab.popen(user, cli_args, out)
        self.bg.append((what, p, out, time.monotonic()))
        return p

    def reap(self, final: bool = False) -> None:
        for item in list(self.bg):
            what, p, out, started = item
            if p.poll() is None and time.monotonic() - started < soak_lab.CLI_TIMEOUT_S and not final:
                continue
            if p.poll() is None:
                soak_lab.dump_and_kill(p)
                self.problems.append(f"{what}: did not return in {soak_lab.CLI_TIMEOUT_S} s; where it was: "
                                     + soak_lab.where_stuck(out.with_suffix(".err").read_text()))
            self.bg.remove(item)
            text = out.read_text() + out.with_suffix(".err").read_text()
            if "Traceback" in text and "Fatal Python error: Aborted" not in text:
                self.problems.append(f"{what}: a traceback: {text[-800:]}")
            elif p.returncode != 0:
                lines = faults.error_lines(out.with_suffix(".err").read_text())
                if len(lines) != 1:
                    self.problems.append(f"{what}: exit {p.returncode} without one line: {text[-400:]}")
                self.note("  done", f"{what}: exit {p.returncode}: {lines[-1][:150] if lines else ''}")
            if what.startswith("submit:") and p.returncode == 0:
                self.adopt(what, out)

    def adopt(self, what: str, out: Path) -> None:
        text = out.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return   # an array prints a line, not JSON; its jobs are found by name below
        kind, key = what.split(":")[1], what.split(":", 2)[2]
        for j in data if isinstance(data, list) else [data]:
            if kind == "inplace":
                self.reports[j["id"]] = self.pending_reports.pop(key)

    # -- actions --
    def submit(self, user_i: int, kind: str) -> None:
        user = self.lab.users[user_i]
        busy = sum(1 for j in self.jobs if j["state"] not in FINAL and kind_of(j) in ("inplace", "restart"))
        busy += sum(1 for what, p, *_ in self.bg if what.startswith(("submit:inplace", "submit:restart"))
                    and p.poll() is None)     # submitted, not yet in a status reply
        if kind in ("inplace", "restart") and busy >= MAX_TRAINING_JOBS:
            kind = "gang"     # the pool stays busy without a third trainer on 2 cores
        self.n_submits += 1
        n = self.n_submits
        cmd, report, job_args = soak_lab.job_command(kind, n, self.lab.shared)
        if report is not None:
            self.pending_reports[str(n)] = (report, job_args)
        self.start_bg(f"submit:{kind}:{n}", user, ["submit", *cmd])
        self.note("submit", f"{user} {kind} ({'#' + str(n)})")

    def scale(self, p: Planned) -> None:
        cands = [j for j in self.jobs if j["state"] == "running" and j.get("elastic") in ("inplace", "restart")]
        j = soak_plan.pick(cands, p.args["u"])
        if j is None:
            self.note("scale", "no running elastic job")
            return
        self.start_bg(f"scale {j['id']} {p.args['n']}", j["owner"], ["scale", str(j["id"]), str(p.args["n"])])
        self.note("scale", f"job {j['id']} ({j['owner']}) to {p.args['n']}")

    def tick(self) -> None:
        if any(w == "tick" for w, *_ in self.bg):
            return      # cron's overlapping tick skips (flock in the shipped crontab)
        self.ticks += 1   # each user's cron in turn (examples/cron/gpuflex.crontab: as the jobs' owner)
        self.start_bg("tick", self.lab.users[self.ticks % len(self.lab.users)], ["harvest", "--json"])

    def retry(self, p: Planned, why: str) -> bool:
        """A job fault with no victim yet (the in-place jobs still starting) is tried again in
        10 s, three times at most; True when it was put back."""
        tries = p.args.get("tries", 0)
        if tries >= 3:
            return False
        self.todo.append(Planned(round(self.now() + 10.0, 3), p.action, {**p.args, "tries": tries + 1}))
        self.todo.sort(key=lambda x: x.at)
        self.note(p.action, f"{why}: tried again in 10 s")
        return True

    def fault(self, p: Planned) -> None:
        kind, a = p.action, p.args
        done = True
        if kind in ("partition", "reboot"):
            busy = sorted({w["host"] for j in self.training() for w in j["workers"]
                           if w["state"] == "running" and w["host"] != "local"})
            if a["host"] not in busy and busy:   # the planned host trains nothing now: one that does
                a = {**a, "host": busy[sum(map(ord, a["host"])) % len(busy)]}
            hit = [j for j in self.training() if any(w["host"] == a["host"] and w["state"] == "running"
                                                     for w in j["workers"])]
            if kind == "partition":
                part, text = faults.partition(self.jobs, a["host"], f"{int(self.now())}")
                if part is not None:
                    self.timers.append((time.monotonic() + a["hold_s"], "heal", part))
                else:
                    done, hit = False, []
            else:
                text = faults.reboot_down(self.lab.bed, self.jobs, a["host"],
                                          [d / a["host"] for d in (self.lab.shared / "work").iterdir()])
                self.timers.append((time.monotonic() + a["hold_s"], "up", a["host"]))
            for j in hit:
                self.watch_job(kind, j)
            self.note(kind, f"{text}; {len(hit)} training job(s) hit; back in {a['hold_s']:.0f} s")
        elif kind == "kill_worker":
            j = soak_plan.pick(self.training(min_live=2), a["u"])
            if j is None:
                if self.retry(p, "no in-place job with 2 running workers"):
                    return
                self.note(kind, "no in-place job with 2 running workers")
                done = False
            else:
                w = soak_plan.pick([w for w in j["workers"] if w["state"] == "running"], a["u"])
                done = faults.kill_pid(w["pid"], str(self.lab.root))
                sent = done
                if done:
                    self.watch_job(kind, j)
                self.note(kind, f"kill -9 job {j['id']} wid {w['wid']} on {w['host']}: {'sent' if sent else 'gone'}")
        elif kind == "kill_newcomer":
            j = soak_plan.pick([j for j in self.training() if j["world_size"] < 3], a["u"])
            if j is None:
                full = soak_plan.pick(self.training(min_live=3), a["u"])
                if full is not None and not a.get("tries"):     # make room for a newcomer first
                    self.start_bg(f"scale {full['id']} 2", full["owner"], ["scale", str(full["id"]), "2"])
                if self.retry(p, "no in-place job below 3 workers to grow"):
                    return
                self.note(kind, "no in-place job below 3 workers to grow")
                done = False
            else:
                before = {w["wid"] for w in j["workers"]}
                self.start_bg(f"scale {j['id']} {j['world_size'] + 1}", j["owner"],
                              ["scale", str(j["id"]), str(j["world_size"] + 1)])
                self.timers.append((time.monotonic() + a["delay_s"], "newcomer",
                                    (j, before, time.monotonic() + a["delay_s"] + 15.0)))
                self.note(kind, f"job {j['id']} scaled to {j['world_size'] + 1}; newcomer killed in {a['delay_s']} s")
                return     # counted when the newcomer is killed (fire_timers)
        elif kind == "kill_coordinator":
            j = soak_plan.pick(self.training(), a["u"])
            pgid = None
            if j is not None:
                out = self.lab.pg.sql(f"SELECT store_pgid FROM jobs WHERE id = {int(j['id'])}", self.db_name).strip()
                pgid = int(out) if out.isdigit() else None
            pid = faults.coordinator_pid(pgid)
            if pid is None:
                if self.retry(p, "no coordinator of a training job found"):
                    return
                self.note(kind, "no coordinator of a training job found")
                done = False
            else:
                os.kill(pid, signal.SIGKILL)
                self.watch_job(kind, j)
                self.note(kind, f"kill -9 coordinator pid {pid} of job {j['id']}")
        else:
            self.db_fault(kind, a)
        (self.injected if done else self.skipped)[kind] += 1

    def db_fault(self, kind: str, a: dict) -> None:
        during = a["during"]
        if during == "submit":
            self.submit(random.Random(self.subs).randrange(len(self.lab.users)), "gang")
        elif during == "scale":
            self.scale(Planned(0, "scale", {"u": 0.5, "n": 2}))
        else:
            self.bg = [x for x in self.bg if x[0] != "tick" or x[1].poll() is None]
            self.tick()
        at = time.monotonic()
        if kind == "pg_restart":
            time.sleep(a["delay_s"])
            self.lab.pg.restart()
            text = f"PostgreSQL restarted {a['delay_s']} s into a {during}"
        else:
            wrote = faults.fill(self.lab.pg_disk)
            time.sleep(a["hold_s"])
            (self.lab.pg_disk / "fill").unlink()
            text = f"the database's disk filled ({wrote >> 20} MiB) for {a['hold_s']} s during a {during}"
            if soak_lab.wait_until(self.lab.pg_answers, 15.0) is None:
                self.lab.pg.restart()
                text += "; PostgreSQL had stopped on it (a WAL write PANICs): started again"
        # the heals and sshd restarts due meanwhile are not held up by a slow answer (a
        # partition would last as long as the wait)
        took = soak_lab.wait_until(lambda: (self.fire_timers(), self.lab.jobs(timeout_s=20.0) is not None)[1], 60.0,
                                   every_s=0.2)
        if took is None:
            self.problems.append(f"{kind}: gpuflex status did not answer within 60 s")
            self.unrecovered[kind] += 1
        else:
            self.recoveries[kind].append(soak_plan.Recovered(time.monotonic() - at))
        self.note(kind, text + (f"; status answered {time.monotonic() - at:.1f} s after" if took is not None else ""))

    def fire_timers(self) -> None:
        for item in [t for t in self.timers if t[0] <= time.monotonic()]:
            self.timers.remove(item)
            _, what, arg = item
            if what == "heal":
                arg.heal()
                self.note("heal", "partition removed")
            elif what == "up":
                self.note("reboot", faults.reboot_up(self.lab.bed, arg))
            elif what == "newcomer":
                grown, before, until = arg
                job_id = grown["id"]
                new = self.newcomers(job_id, before)
                if not new and time.monotonic() < until:   # the scale has not spawned them yet
                    self.timers.append((time.monotonic() + 0.5, what, arg))
                    continue
                sent = [faults.kill_pid(pid, str(self.lab.root)) for _, pid in new]
                if any(sent):
                    self.watch_job("kill_newcomer", grown)
                (self.injected if any(sent) else self.skipped)["kill_newcomer"] += 1
                self.note("kill_newcomer", f"job {job_id}: newcomers {[wid for wid, _ in new]}, killed {sum(sent)}")

    def newcomers(self, job_id: int, before: set[int]) -> list[tuple[int, int]]:
        """(wid, pid) of the job's workers started since `before`, straight from the database
        (a status reply is seconds old; the newcomer lives a few seconds before it joins)."""
        try:
            out = self.lab.pg.sql(f"SELECT wid, pid FROM workers WHERE job_id = {int(job_id)} AND pid IS NOT NULL "
                                  "AND state IN ('starting', 'running')", self.db_name)
        except (RuntimeError, subprocess.TimeoutExpired):   # the server restarting: none seen
            return []
        return [(wid, pid) for wid, pid in soak_plan.int_rows(out, 2) if wid not in before]

    # -- the loop --
    def run(self, schedule: list[Planned]) -> str | None:
        self.todo = todo = list(schedule)
        end = self.args.minutes * 60.0
        next_poll = next_tick = 0.0
        while True:
            now = self.now()
            if now >= next_poll or self.poller is not None:
                if self.poller is None:
                    next_poll = now + self.args.poll_s
                self.poll()
                if time.monotonic() - self.last_answer > self.args.hang_s:
                    return f"HANG: gpuflex status has not answered for {self.args.hang_s:.0f} s"
            if now >= next_tick:
                self.tick()
                next_tick = now + self.args.tick_s
            self.reap()
            self.fire_timers()
            if todo and todo[0].at <= now:
                p = todo.pop(0)
                if p.action == "submit":
                    self.submit(p.args["user"], p.args["kind"])
                elif p.action == "scale":
                    self.scale(p)
                else:
                    self.fault(p)
                continue
            if now >= end and not todo and not self.timers:
                open_jobs = [j for j in self.jobs if j["state"] not in FINAL]
                if not open_jobs and not self.bg:
                    return None
                if now - end > self.args.drain_s:
                    return (f"HANG: {len(open_jobs)} job(s) not final {self.args.drain_s:.0f} s after the "
                            f"schedule: " + ", ".join(f"{j['id']} {j['state']}" for j in open_jobs[:8]))
            time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--poll-s", type=float, default=3.0)
    ap.add_argument("--tick-s", type=float, default=20.0, help="seconds between harvest ticks (cron's period)")
    ap.add_argument("--hang-s", type=float, default=180.0)
    ap.add_argument("--drain-s", type=float, default=300.0)
    ap.add_argument("--partition-s", type=float, default=30.0)
    ap.add_argument("--reboot-s", type=float, default=60.0)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    why = soak_lab.missing()
    if why:
        print(f"cannot soak here: {why}")
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    schedule = soak_plan.make_schedule(seed, args.minutes, Plan(args.partition_s, args.reboot_s))
    print(f"seed {seed}: {len(schedule)} planned entries over {args.minutes} min", flush=True)
    lab = Lab(Path(tempfile.mkdtemp(prefix="gpuflex-soak-hosts-")))
    ok = False
    try:
        lab.start()
        print(f"lab up: users {lab.users}, hosts local + {[h.name for h in lab.bed.hosts]} "
              f"({soak_lab.SKEWED_HOST} {soak_lab.SKEW_S} s ahead), {lab.url}", flush=True)
        chaos = Chaos(lab, args)
        stopped = chaos.run(schedule)
        for _, what, arg in chaos.timers:     # a stopped run still heals and boots what it broke
            arg.heal() if what == "heal" else faults.reboot_up(lab.bed, arg) if what == "up" else None
        chaos.reap(final=True)
        import soak_checks
        ok = soak_checks.summary(chaos, seed, stopped)
        return 0 if ok else 1
    finally:
        lab.close()
        if ok and not args.keep:
            shutil.rmtree(lab.root, ignore_errors=True)
        else:
            print(f"kept {lab.root}")


if __name__ == "__main__":
    sys.exit(main())
