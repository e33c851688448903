"""`gpuflex acct`: the ended jobs, one row each (Slurm's sacct), a page at a time.

A row is a job that ended (succeeded, failed, cancelled, timeout) inside the window, by
its end time: owner, name, state, exit code and reason, when it was submitted, first
started and ended, the time it waited and ran, its world size over time and the device
time its workers held. Device time counts as `report` counts it (gpuflex.control.report):
per worker, its devices x [started_at, ended_at], GPUs as GPU-hours, the CPU slots of a
slot host as slot-hours (never called GPU-hours), and the GPU-hours on hosts with an
`owner` again as harvested. A row holds its job's whole device time (an accounting row
is the job's bill, not the part of it inside the window).

Pages run newest job first (by id) and a cursor is the last id shown: the next page is
the jobs below it. The database filters, orders and limits, so a listing of 100,000 jobs
reads one page of jobs and their workers at a time; the totals (per user and per host)
walk every page the same way and are, by construction, the sums of the rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from sqlalchemy.orm import Session

from gpuflex.db import listings, queries
from gpuflex.db.models import Event, Job
from gpuflex.errors import UsageError
from gpuflex.states import JobState

WORLD_KINDS = ("state", "formed", "scale", "fault", "rollback")   # the events that set a world size
FINAL_VALUES = {s.value for s in JobState if s.final}
PAGE = 500   # jobs read at a time when a caller walks every page (totals, --limit 0)
MAX_LIMIT = 10_000   # a page larger than this is a listing: --limit 0 streams it instead
FIELDS = ["id", "user", "name", "state", "exit_code", "exit_reason", "submitted_at", "started_at",
          "ended_at", "wait_s", "elapsed_s", "restarts", "world_size_min", "world_size_max", "device",
          "gpu_hours", "harvested_gpu_hours", "slot_hours"]   # a CSV row (the JSON row has more)


@dataclasses.dataclass(frozen=True)
class Filter:
    """Which ended jobs: owners (None: everyone), end time in [since, until], states (None:
    every final one), an exact name."""
    users: tuple[str, ...] | None = None
    since: float | None = None
    until: float | None = None
    states: tuple[JobState, ...] | None = None
    name: str | None = None


def check_filter(f: Filter) -> Filter:
    """UsageError for a window that ends before it starts or a state that is not final."""
    if f.since is not None and f.until is not None and f.until < f.since:
        raise UsageError("--until is before --since: give a window that ends after it starts.")
    for s in f.states or ():
        if not s.final:
            raise UsageError(f"--state {s.value!r}: acct lists ended jobs; give one of "
                             + ", ".join(x.value for x in JobState if x.final) + " (status lists the others).")
    return f


# the job's fields a row reads (`row`): only these are loaded, not its JSON columns
COLUMNS = (Job.id, Job.user, Job.name, Job.state, Job.exit_code, Job.exit_reason, Job.created_at, Job.ended_at,
           Job.restarts, Job.array_id, Job.array_index)


def page(session: Session, f: Filter, limit: int, cursor: int | None = None,
         world: bool = True) -> tuple[list[dict[str, Any]], int | None]:
    """The rows of the `limit` newest matching jobs below `cursor`, and the cursor of the
    next page (None: this was the last). `world=False`: without the world sizes over time
    (their events are a third of the reading; `totals` does not use them)."""
    jobs = listings.ended_jobs_page(session, users=f.users, since=f.since, until=f.until, states=f.states,
                                   name=f.name, below=cursor, limit=limit + 1, columns=COLUMNS)
    more = len(jobs) > limit
    jobs = jobs[:limit]
    ids = [j.id for j in jobs]
    spans = queries.worker_spans(session, ids)
    events = queries.events_of_jobs(session, ids, WORLD_KINDS) if world else {}
    slot_hosts = queries.slot_host_names(session)
    owned = {h.name for h in queries.hosts(session) if h.owner}
    rows = [row(j, spans.get(j.id, []), events.get(j.id, []), slot_hosts, owned) for j in jobs]
    return rows, (jobs[-1].id if more and jobs else None)


def every_row(session: Session, f: Filter, cursor: int | None = None, world: bool = True) -> Iterator[dict[str, Any]]:
    """Every matching row from `cursor` down, read a PAGE at a time (`world`: see `page`)."""
    while True:
        rows, cursor = page(session, f, PAGE, cursor, world)
        yield from rows
        if cursor is None:
            return


def row(job: Job, spans: list[tuple[float, float | None, int, str]], events: list[Event], slot_hosts: set[str],
        owned: set[str]) -> dict[str, Any]:
    """One job's accounting row from its workers' (started_at, ended_at, devices, host) and
    its events of WORLD_KINDS."""
    gpu = slot = harvested = 0.0
    hosts: dict[str, float] = {}
    end_of = job.ended_at or job.created_at
    for start, end, devices, host in spans:
        hours = max(0.0, (end if end is not None else end_of) - start) * devices / 3600
        hosts[host] = hosts.get(host, 0.0) + hours
        if host in slot_hosts:
            slot += hours
        else:
            gpu += hours
            harvested += hours if host in owned else 0.0
    first = min((s[0] for s in spans), default=None)
    # the run ends when its last worker does (the job's end is when a command noticed)
    last = max((s[1] if s[1] is not None else end_of for s in spans), default=None)
    timeline = world_sizes(events)
    sizes = [n for _, n in timeline if n] or [0]
    device = "gpu" if gpu else "cpu-slot" if slot else None
    return {
        "id": job.id, "user": job.user, "name": job.name, "state": job.state.value,
        "exit_code": job.exit_code, "exit_reason": job.exit_reason,
        "submitted_at": job.created_at, "started_at": first, "ended_at": job.ended_at,
        "wait_s": round(first - job.created_at, 3) if first is not None else None,
        "elapsed_s": round(last - first, 3) if first is not None and last is not None else 0.0,
        "restarts": job.restarts or 0, "world_size_min": min(sizes), "world_size_max": max(sizes),
        "world_sizes": [[round(t, 3), n] for t, n in timeline], "device": device,
        "gpu_hours": round(gpu, 6), "harvested_gpu_hours": round(harvested, 6), "slot_hours": round(slot, 6),
        "hosts": [{"host": h, "device": "cpu-slot" if h in slot_hosts else "gpu", "device_hours": round(v, 6)}
                  for h, v in sorted(hosts.items())],
        "array_id": job.array_id, "array_index": job.array_index,
    }


def world_sizes(events: list[Event]) -> list[tuple[float, int]]:
    """[(time, world size from then)]: each run's start (its "running" state event), each
    generation the coordinator formed (its members), 0 when the job was queued again or
    ended. Repeats of the same size are left out."""
    out: list[tuple[float, int]] = []
    for e in events:
        d = e.data or {}
        if e.kind == "state":
            state = d.get("state")
            if state == JobState.RUNNING.value and isinstance(d.get("world_size"), int):
                size = d["world_size"]
            elif state in FINAL_VALUES or state == JobState.QUEUED.value:
                size = 0
            else:
                continue
        elif isinstance(d.get("members"), list) and d.get("ok") is not False:
            size = len(d["members"])
        else:
            continue
        if not out or out[-1][1] != size:
            out.append((e.time, size))
    return out


def totals(rows: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """Per user and per host: jobs, GPU-hours, harvested GPU-hours and slot-hours, summed
    from the rows themselves (and their elapsed time per user)."""
    users: dict[str, dict[str, Any]] = {}
    hosts: dict[str, dict[str, Any]] = {}
    count = 0
    for r in rows:
        count += 1
        u = users.setdefault(r["user"], {"user": r["user"], "jobs": 0, "elapsed_s": 0.0, "gpu_hours": 0.0,
                                         "harvested_gpu_hours": 0.0, "slot_hours": 0.0})
        u["jobs"] += 1
        u["elapsed_s"] += r["elapsed_s"] or 0.0
        for k in ("gpu_hours", "harvested_gpu_hours", "slot_hours"):
            u[k] += r[k]
        for h in r["hosts"]:
            t = hosts.setdefault(h["host"], {"host": h["host"], "device": h["device"], "jobs": 0, "device_hours": 0.0})
            t["jobs"] += 1
            t["device_hours"] += h["device_hours"]
    for u in users.values():
        for k in ("elapsed_s", "gpu_hours", "harvested_gpu_hours", "slot_hours"):
            u[k] = round(u[k], 6)
    for t in hosts.values():
        t["device_hours"] = round(t["device_hours"], 6)
    return {"jobs": count,
            "by_user": sorted(users.values(), key=lambda u: (-u["gpu_hours"], -u["slot_hours"], u["user"])),
            "by_host": sorted(hosts.values(), key=lambda t: (-t["device_hours"], t["host"]))}
