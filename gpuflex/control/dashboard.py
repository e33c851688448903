"""What `gpuflex web` shows, read from the database: the pool now and over a range, the
queue, one job, accounting over a range (issue 30). Plain dicts and records for
gpuflex.web to draw; nothing here writes.

Each function reads inside the caller's session (one short read transaction per page:
gpuflex.web opens it and closes it before it draws), and reuses what the CLI's commands
compute: the devices now are `hosts`' (views.pool_view), the queue `status`'s
(views.listing), a job `status JOB`'s and `events JOB`'s (views.job_info; its world sizes
as `acct` counts them, acct.world_sizes), accounting `acct --totals`' (acct.totals of
acct.every_row, so a chart's bar is the sum of the jobs' own rows).

What a viewer sees of another user's job is what `status` shows them: the queue's fields
and workers (views.without_output), never its logs, environment, events or crash
traceback. `may_read(owner)` decides, the same check `logs` and `events` make
(gpuflex.control.access.may_change of the viewer).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control import access, acct, views
from gpuflex.control.observe import coordinator_status
from gpuflex.control.pool import Pool
from gpuflex.control.report import moment_since_1970
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.errors import UsageError
from gpuflex.policy.lifecycle import CRASH_KIND

BUCKETS = 48        # columns of the pool's timeline, whatever the range
ENDED_SHOWN = 20    # ended jobs on the queue page (status' table shows as many)
# marked on a job's world-size plot: each generation formed (a resize the coordinator
# made on its own, a start) and each scale, fault, rollback and crash
MARKED_KINDS = ("formed", "scale", "fault", "rollback", CRASH_KIND)
RANGES = {"1d": 86400.0, "7d": 7 * 86400.0, "30d": 30 * 86400.0}


@dataclasses.dataclass(frozen=True)
class Window:
    since: float
    until: float
    label: str


def window(params: dict[str, str], now: float | None = None, default: str = "1d") -> Window:
    """The range a page asks for: ?range=1d|7d|30d, or ?since=&until= (a duration back
    from now or an ISO date/time, as `acct --since` reads them); UsageError otherwise."""
    now = time.time() if now is None else now
    unknown = set(params) - {"range", "since", "until"}
    if unknown:
        raise UsageError(f"unknown parameter {sorted(unknown)[0]!r}: give range=1d|7d|30d, or since= and until=.")
    if "range" in params and ({"since", "until"} & set(params)):
        raise UsageError("range= and since=/until=: choose one.")
    if "since" in params or "until" in params:
        since = moment_since_1970(params["since"], "since", now) if "since" in params else now - RANGES[default]
        until = moment_since_1970(params["until"], "until", now) if "until" in params else now
        if until <= since:
            raise UsageError("until= is not after since=: give a window that ends after it starts.")
        return Window(since, until, f"{_iso(since)} .. {_iso(until)}")
    label = params.get("range", default)
    if label not in RANGES:
        raise UsageError(f"range={label!r}: give one of {', '.join(RANGES)} (or since= and until=).")
    return Window(now - RANGES[label], now, label)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def pool(session: Session, config: Config, w: Window, buckets: int = BUCKETS) -> dict[str, Any]:
    """The hosts and devices now (views.pool_view), and the timeline of `w` in `buckets`
    columns: per column, the device-seconds held by gpuflex workers on hosts without an
    owner (busy) and on owned hosts (harvested), the rest of the configured devices
    (idle), and the reclaims (the harvest tick's "reclaim" events) in it. The devices
    counted are the configured hosts' now (the DB keeps no history of the pool's size)."""
    hosts = views.pool_view(config, session)
    names = {h["name"] for h in hosts}
    owned = {h["name"] for h in hosts if h["owner"]}
    capacity = sum(len(h["devices"]) for h in hosts)
    step = (w.until - w.since) / buckets
    cols = [{"start": w.since + i * step, "end": w.since + (i + 1) * step,
             "busy": 0.0, "harvested": 0.0, "idle": 0.0, "reclaimed": 0} for i in range(buckets)]
    for _user, start, end, devices, host in queries.holds_since(session, w.since):
        if host not in names or start is None or start >= w.until:
            continue
        stop = min(end if end is not None else w.until, w.until)
        first = max(0, int((start - w.since) // step))
        for c in cols[first:]:
            if c["start"] >= stop:
                break
            secs = max(0.0, min(stop, c["end"]) - max(start, c["start"])) * devices
            c["harvested" if host in owned else "busy"] += secs
    for e, _job in queries.events_of_kind(session, "reclaim", w.since, w.until):
        cols[min(buckets - 1, int((e.time - w.since) // step))]["reclaimed"] += 1
    for c in cols:
        total = capacity * step
        # fractions of the pool's device time: a column adds up to 1 (idle is the rest)
        c["busy"] = min(1.0, c["busy"] / total) if total else 0.0
        c["harvested"] = min(1.0 - c["busy"], c["harvested"] / total) if total else 0.0
        c["idle"] = max(0.0, 1.0 - c["busy"] - c["harvested"]) if total else 0.0
    return {"hosts": hosts, "capacity": capacity, "timeline": cols, "window": w}


def queue(session: Session, may_read: Callable[[str], bool], ended: int = ENDED_SHOWN) -> views.Listing:
    """What `status` lists (views.listing): every job not ended and the `ended` newest
    ended ones, each as the viewer may see it."""
    shown = views.listing(session, None, None, ended)
    return dataclasses.replace(shown, jobs=[j if may_read(j.user) else views.without_output(j) for j in shown.jobs])


def job(session: Session, job_id: int, may_read: Callable[[str], bool],
        progress: Callable[[Job], Mapping[str, Any] | None] = lambda _job: None) -> dict[str, Any] | None:
    """One job as `status JOB` shows it and, for its owner and the admins, what `events
    JOB` does: its world size over time (acct.world_sizes), the formed, scale, fault,
    rollback and crash events to mark on it, and each resize's per-phase timings; its workers' shares
    and speeds from `progress(job)` (the coordinator's record: `live_progress`). None: no
    such job."""
    model = queries.job(session, job_id)
    if model is None:
        return None
    split = {}
    if not may_read(model.user):
        info = views.without_output(views.job_info(model))
        return {"info": info, "readable": False, "world": [], "marks": [], "timings": [], "split": split}
    prog = progress(model)
    split = {w.wid: views.worker_split(prog, w.wid) for w in model.workers} if prog else {}
    info = views.job_info(model, events=True)
    history = [e for e in model.events if e.kind in acct.WORLD_KINDS]
    world = acct.world_sizes(history)
    end = model.ended_at or time.time()
    if world and world[-1][0] < end:
        world.append((end, world[-1][1]))   # the last size holds until the end (or now)
    marks = [e for e in info.events if e.kind in MARKED_KINDS]
    timings = [{"time": e.time, "kind": e.kind, "message": e.message, "timings": e.data.get("timings")}
               for e in info.events if isinstance((e.data or {}).get("timings"), dict)]
    return {"info": info, "readable": True, "world": world, "marks": marks, "timings": timings, "split": split}


def live_progress(config: Config, pool: Pool, job: Job) -> Mapping[str, Any] | None:
    """The coordinator's progress record of a running job (what `status JOB` reads in its
    refresh: each worker's share, samples/s and relative speed), asked of the coordinator
    itself, which is a read: the database is not written, no lock is taken. None when the
    job is not running, its processes are another account's (access.reaches), or its
    coordinator does not answer."""
    if not job.state.active or not access.reaches(config, job):
        return None
    status = coordinator_status(config, pool, job)
    return status.progress if status is not None else None


def accounting(session: Session, w: Window) -> dict[str, Any]:
    """`acct --totals` over `w`: per user and per host, summed from the jobs' own rows."""
    return {**acct.totals(acct.every_row(session, acct.Filter(since=w.since, until=w.until), world=False)), "window": w}
