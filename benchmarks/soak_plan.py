"""The multi-host soak's plan and figures, without processes: the seeded schedule
(`make_schedule`), the arithmetic of its summary (`percentile`, `recovery_rows`) and how it
reads the pool's state (`with_step`, `int_rows`).

The schedule is drawn whole before anything runs, so a seed names a run. Three kinds of
entries: `submit` (a user and a job kind), `scale` (a fraction naming one of the live
elastic jobs when it runs) and one of FAULTS. Faults come in rounds, each a shuffled list
of every kind, so every kind is injected once the run holds one round (about
ROUND_S seconds); a host-level fault (partition, reboot) is never planned while another
one's host is still cut off or down, and the database faults (restart, disk full) never
overlap each other.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

USERS = 3
KINDS = ("inplace", "restart", "gang", "array")
KIND_WEIGHTS = (4, 1, 2, 1)
# the faults of issue 28 item 5 (clock skew lasts the whole soak on one host, so it is no
# schedule entry) and the kills of the single-job soak
FAULTS = ("partition", "reboot", "pg_restart", "disk_full", "kill_worker", "kill_newcomer", "kill_coordinator")
DB_FAULTS = ("pg_restart", "disk_full")
HOST_FAULTS = ("partition", "reboot")
SUBMIT_GAP_S = (6.0, 20.0)
FAULT_GAP_S = (12.0, 30.0)
SCALE_GAP_S = (20.0, 50.0)
DISK_FULL_S = (3.0, 8.0)
ROUND_S = len(FAULTS) * FAULT_GAP_S[1]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Durations of the host faults (the issue's 30 s partition and 60 s reboot; the short
    form may shorten them) and the number of bed hosts a host fault may pick."""
    partition_s: float = 30.0
    reboot_s: float = 60.0
    hosts: tuple[str, ...] = ("gpu01", "gpu02", "gpu03")


@dataclasses.dataclass(frozen=True)
class Planned:
    at: float                  # seconds from the start
    action: str
    args: dict[str, Any]


def make_schedule(seed: int, minutes: float, plan: Plan = Plan()) -> list[Planned]:
    """Every entry for `seed` over `minutes`, sorted by time; the same arguments give the
    same list. Raises ValueError for a run shorter than a minute or a plan without hosts."""
    if minutes < 1:
        raise ValueError(f"minutes must be at least 1, not {minutes!r}")
    if not plan.hosts:
        raise ValueError("the plan names no host for the host faults")
    rng = random.Random(seed)
    end = minutes * 60.0
    out: list[Planned] = []
    t = 1.0
    while t < end:
        out.append(Planned(round(t, 3), "submit", {
            "user": rng.randrange(USERS), "kind": rng.choices(KINDS, weights=KIND_WEIGHTS)[0]}))
        t += rng.uniform(*SUBMIT_GAP_S)
    t = rng.uniform(*SCALE_GAP_S)
    while t < end:
        out.append(Planned(round(t, 3), "scale", {"u": round(rng.random(), 4), "n": rng.randint(1, 3)}))
        t += rng.uniform(*SCALE_GAP_S)
    out += _faults(rng, end, plan)
    return sorted(out, key=lambda p: (p.at, p.action))


def _faults(rng: random.Random, end: float, plan: Plan) -> list[Planned]:
    out: list[Planned] = []
    host_busy_until = 0.0      # the last host fault's end (cut off or down until then)
    db_busy_until = 0.0
    t = rng.uniform(*FAULT_GAP_S)
    queue: list[str] = []
    while t < end:
        if not queue:
            queue = list(FAULTS)
            rng.shuffle(queue)
        kind = queue[0]
        if kind in HOST_FAULTS and t < host_busy_until or kind in DB_FAULTS and t < db_busy_until:
            # a fault that would overlap its like waits in the queue; a later kind goes first
            ready = [k for k in queue if not (k in HOST_FAULTS and t < host_busy_until
                                              or k in DB_FAULTS and t < db_busy_until)]
            if not ready:
                t = min(x for x in (host_busy_until, db_busy_until) if x > t) + 1.0
                continue
            kind = ready[0]
        queue.remove(kind)
        args: dict[str, Any] = {}
        if kind in HOST_FAULTS:
            lasts = plan.partition_s if kind == "partition" else plan.reboot_s
            args = {"host": rng.choice(plan.hosts), "hold_s": lasts}
            host_busy_until = t + lasts + 15.0
        elif kind == "pg_restart":
            args = {"during": rng.choice(["submit", "scale", "tick"]), "delay_s": round(rng.uniform(0.2, 2.5), 3)}
            db_busy_until = t + 20.0
        elif kind == "disk_full":
            args = {"during": rng.choice(["submit", "tick"]), "hold_s": round(rng.uniform(*DISK_FULL_S), 3)}
            db_busy_until = t + args["hold_s"] + 20.0
        elif kind == "kill_worker":
            args = {"u": round(rng.random(), 4)}
        elif kind == "kill_newcomer":
            args = {"u": round(rng.random(), 4), "delay_s": round(rng.uniform(1.0, 6.0), 3)}
        elif kind == "kill_coordinator":
            args = {"u": round(rng.random(), 4)}
        out.append(Planned(round(t, 3), kind, args))
        t += rng.uniform(*FAULT_GAP_S)
    return out


def pick(items: list, u: float):
    """The item a planned fraction `u` in [0, 1) names among the items present when it runs."""
    if not items:
        return None
    return items[min(len(items) - 1, int(u * len(items)))]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0..100) of `values`; None for none."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, math.ceil(q / 100.0 * len(xs)) - 1)]


# What each recovery should be under: a bound printed beside p50/p99, never asserted.
# A job fault: a new generation formed (heartbeat_timeout_s + formation) and a step done;
# a host fault: the host's workers written off (the fault's own duration is not counted:
# the job goes on without the host); a database fault: the next command answering.
BOUNDS_S = {"kill_worker": 60.0, "kill_newcomer": 60.0, "kill_coordinator": 90.0, "partition": 90.0,
            "reboot": 90.0, "pg_restart": 30.0, "disk_full": 30.0}
# A job fault whose bound is for the job going on in place, recovered through a relaunch
# instead (it fell below its MIN, or it was a gang: requeued, and every process started
# anew, each importing torch on the loaded machine): allowed RELAUNCH_S more. A killed
# coordinator always means a relaunch; its bound holds one already.
RELAUNCH_S = 60.0
IN_PLACE_BOUNDS = ("kill_worker", "kill_newcomer", "partition", "reboot")


@dataclasses.dataclass(frozen=True)
class Recovered:
    """One timed recovery: fault injected -> training again (the command answering again)."""

    seconds: float
    job: int | None = None       # None: a database fault
    relaunched: bool = False     # the job's restarts changed on the way: a requeue and a new run


def bound(kind: str, r: Recovered) -> float:
    return BOUNDS_S[kind] + (RELAUNCH_S if r.relaunched and kind in IN_PLACE_BOUNDS else 0.0)


def _bound_text(kind: str) -> str:
    extra = f", {BOUNDS_S[kind] + RELAUNCH_S:.0f} s through a relaunch" if kind in IN_PLACE_BOUNDS else ""
    return f"bound {BOUNDS_S[kind]:.0f} s{extra}"


def recovery_rows(recoveries: dict[str, list[Recovered]], unrecovered: dict[str, int]) -> list[str]:
    """One line per fault kind: count, p50, p99, the bound and how many passed theirs; then
    one line per recovery that passed its bound (which job, in place or through a relaunch);
    kinds with none say so."""
    rows, over_rows = [], []
    for kind in FAULTS:
        rs = recoveries.get(kind, [])
        missed = unrecovered.get(kind, 0)
        not_measured = f"; {missed} not measured (the job ended first)" if missed else ""
        if rs:
            xs = [r.seconds for r in rs]
            over = [r for r in rs if r.seconds > bound(kind, r)]
            relaunched = sum(r.relaunched for r in rs)
            rows.append(f"{kind:<17} {len(rs):3d} recovered  p50 {percentile(xs, 50):6.1f} s  "
                        f"p99 {percentile(xs, 99):6.1f} s  ({_bound_text(kind)}; {len(over)} over"
                        + (f"; {relaunched} through a relaunch" if relaunched else "") + ")" + not_measured)
            over_rows += [f"  over: {kind}" + (f" of job {r.job}" if r.job is not None else "")
                          + f": {r.seconds:.1f} s" + ("" if r.job is None else " through a relaunch" if r.relaunched
                                                      else " in place") + f" (bound {bound(kind, r):.0f} s)"
                          for r in over]
        else:
            rows.append(f"{kind:<17}   0 recovered{not_measured}  ({_bound_text(kind)})")
    return rows + over_rows


def with_step(job: dict, views: dict[str, dict[int, dict]]) -> dict:
    """`job` (a record of `gpuflex status --json`) with its step from its owner's last status
    (`views`: user -> their last status, by job id): a job's step is its coordinator's
    progress, which only the owner's commands read (the others, the admin included, do not
    reach its processes). Only when the owner saw it in the same state, generation and
    restart; else the record as it is (its step unknown)."""
    mine = views.get(job["owner"], {}).get(job["id"])
    if mine is None or mine is job or not isinstance(mine.get("step"), int):
        return job
    same = all(mine.get(k) == job.get(k) for k in ("state", "generation", "restarts"))
    return {**job, "step": mine["step"]} if same else job


def int_rows(psql_out: str, width: int) -> list[tuple[int, ...]]:
    """The rows of `psql -At` output whose `width` fields are all integers."""
    rows = []
    for line in psql_out.splitlines():
        cells = line.strip().split("|")
        if len(cells) == width and all(c.isdigit() for c in cells):
            rows.append(tuple(int(c) for c in cells))
    return rows
