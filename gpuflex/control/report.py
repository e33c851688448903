"""`gpuflex report`: GPU-hours harvested per host, owner and job; reclaims and their latencies;
GPU-hours used and harvested per user (`--by user`).

Harvested GPU time is the time gpuflex workers held GPUs of hosts that have an `owner`
(those GPUs are only ever given out while idle): per worker, its devices x the part of
[started_at, ended_at or now] inside the window. The owner is the host's owner as the DB
knows it now. Reclaims are the "reclaim" events written by the harvest tick. A user's
used GPU-hours count the same way on every GPU host; CPU slots are no GPU-hours, and count
apart as slot-hours (a pool of CPU slots is scheduled, shared fairly and held to quotas by
its slots, so `--by user` counts them too); the user is the job's owner (`jobs.user`).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import re
import math
import statistics
import time
from typing import Any

from sqlalchemy.orm import Session

from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.errors import UsageError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(text: str, option: str) -> float:
    """'90' / '90s' / '15m' / '24h' / '7d' / '2w' -> seconds (> 0); UsageError otherwise."""
    m = _DURATION.match(text or "")
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"{option} {text!r}: expected a duration above 0 such as 30s, 15m, 24h or 7d.")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_moment(text: str, option: str, now: float | None = None) -> float:
    """A duration back from now ('24h', '7d') or an ISO date/time ('2026-03-01',
    '2026-03-01T08:00', local time unless it names a zone) -> a unix time; UsageError for
    anything else. OverflowError or OSError for a date past what time_t holds."""
    now = time.time() if now is None else now
    if _DURATION.match(text or ""):
        return now - parse_duration(text, option)
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except (ValueError, AttributeError):
        raise UsageError(f"{option} {text!r}: expected a duration (24h, 7d) or an ISO date/time "
                         "(2026-03-01 or 2026-03-01T08:00).") from None
    return when.timestamp()


def moment_since_1970(text: str, option: str, now: float | None = None) -> float:
    """`parse_moment` from 1970 on (the future allowed): nothing gpuflex recorded is older,
    and a date like 0001-01-01 or a duration like 9999999999999d is past what time_t holds
    (UsageError, not OverflowError)."""
    try:
        ts = parse_moment(text, option, now)
    except (OverflowError, OSError, ValueError):   # ValueError: "year 0 is out of range" (local time)
        ts = -1.0
    if not math.isfinite(ts) or ts < 0:
        raise UsageError(f"{option} {text!r} reaches back before 1970-01-01; give a later date or a "
                         "shorter duration (e.g. 30d).")
    return ts


def parse_since(text: str, now: float | None = None) -> float:
    """--since: `moment_since_1970`, in the past."""
    now = time.time() if now is None else now
    ts = moment_since_1970(text, "--since", now)
    if ts > now:
        raise UsageError(f"--since {text!r} is in the future.")
    return ts


def _overlap(start: float, end: float | None, since: float, until: float) -> float:
    return max(0.0, min(end if end is not None else until, until) - max(start, since))


def build(session: Session, since: float, until: float | None = None) -> dict[str, Any]:
    """The report as a JSON-able dict (see the module docstring for what counts)."""
    until = time.time() if until is None else until
    owners = {h.name: h.owner for h in queries.hosts(session) if h.owner}
    slot_hosts = queries.slot_host_names(session)
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}

    def row(host: str, job: Job) -> dict[str, Any]:
        key = (host, owners.get(host) or "", job.id)
        if key not in rows:
            rows[key] = {"host": host, "owner": owners.get(host), "job": job.id, "job_name": job.name,
                         "gpu_hours": 0.0, "reclaims": 0, "latencies": []}
        return rows[key]

    for w, j in queries.workers_on(session, owners):
        if w.host in slot_hosts:
            continue
        secs = _overlap(w.started_at, w.ended_at, since, until) * len(w.gpus)
        if secs > 0:
            row(w.host, j)["gpu_hours"] += secs / 3600
    reclaims = []
    for e, j in queries.events_of_kind(session, "reclaim", since, until):
        d = e.data or {}
        reclaims.append({"time": e.time, "job": j.id, **{k: d.get(k) for k in
                         ("host", "gpu", "latency_s", "deadline_s", "method", "within_deadline")}})
        r = row(str(d.get("host")), j)
        r["reclaims"] += 1
        if isinstance(d.get("latency_s"), (int, float)):
            r["latencies"].append(float(d["latency_s"]))
    table = []
    for r in sorted(rows.values(), key=lambda r: (r["host"], r["job"])):
        lat = r.pop("latencies")
        r["gpu_hours"] = round(r["gpu_hours"], 4)
        r["reclaim_median_s"] = round(statistics.median(lat), 3) if lat else None
        r["reclaim_max_s"] = round(max(lat), 3) if lat else None
        table.append(r)
    return {"since": since, "until": until,
            "gpu_hours": round(sum(r["gpu_hours"] for r in table), 4),
            "by_user": by_user(session, since, until, set(owners), slot_hosts),
            "by_host": _totals(table, "host", "owner"), "by_owner": _totals(table, "owner"),
            "by_job": _totals(table, "job", "job_name"), "rows": table,
            "reclaims": _reclaim_summary(reclaims)}


def by_user(session: Session, since: float, until: float, owned: set[str],
            slot_hosts: set[str]) -> list[dict[str, Any]]:
    """[{user, gpu_hours, harvested_gpu_hours, slot_hours}], most GPU time first, then most
    slot time: the device time of each user's workers inside the window, GPUs (all of it,
    and the part on owned hosts) and CPU slots apart."""
    used: dict[str, list[float]] = {}
    for user, start, end, devices, host in queries.holds_since(session, since):
        secs = _overlap(start, end, since, until) * devices
        if secs <= 0:
            continue
        u = used.setdefault(user, [0.0, 0.0, 0.0])
        if host in slot_hosts:
            u[2] += secs / 3600
        else:
            u[0] += secs / 3600
            u[1] += secs / 3600 if host in owned else 0.0
    return [{"user": user, "gpu_hours": round(a, 4), "harvested_gpu_hours": round(h, 4), "slot_hours": round(c, 4)}
            for user, (a, h, c) in sorted(used.items(), key=lambda kv: (-kv[1][0], -kv[1][2], kv[0]))]


def _totals(table: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    sums: dict[tuple, float] = {}
    for r in table:
        if r["owner"] is None:
            continue  # reclaims on a host without an owner: listed in rows, no harvest
        k = tuple(r[key] for key in keys)
        sums[k] = sums.get(k, 0.0) + r["gpu_hours"]
    return [{**dict(zip(keys, k)), "gpu_hours": round(v, 4)}
            for k, v in sorted(sums.items(), key=lambda kv: (-kv[1], str(kv[0])))]


def _reclaim_summary(reclaims: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [r["latency_s"] for r in reclaims if isinstance(r["latency_s"], (int, float))]
    methods: dict[str, int] = {}
    for r in reclaims:
        methods[str(r["method"])] = methods.get(str(r["method"]), 0) + 1
    return {"count": len(reclaims), "within_deadline": sum(1 for r in reclaims if r["within_deadline"]),
            "failed": sum(1 for r in reclaims if r["latency_s"] is None),
            "median_s": round(statistics.median(lat), 3) if lat else None,
            "max_s": round(max(lat), 3) if lat else None, "by_method": methods, "events": reclaims}


CSV_FIELDS = ["host", "owner", "job", "job_name", "gpu_hours", "reclaims", "reclaim_median_s", "reclaim_max_s"]


USER_CSV_FIELDS = ["user", "gpu_hours", "harvested_gpu_hours", "slot_hours"]


def to_csv(report: dict[str, Any], by: str = "host") -> str:
    """One line per (host, job): harvested GPU-hours and that job's reclaims there; with
    `by="user"`, one line per user: GPU-hours used and harvested, and slot-hours."""
    fields, rows = (USER_CSV_FIELDS, report["by_user"]) if by == "user" else (CSV_FIELDS, report["rows"])
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r[k] is None else r[k] for k in fields})
    return buf.getvalue()
