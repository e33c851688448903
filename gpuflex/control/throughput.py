"""Each elastic job's measured throughput by world size and host mix (issue 32): kept as
the job's "throughput" events, one per (world size, host count) it ran at, the model
fitted on them in gpuflex.policy.throughput (pure).

After each look at a running job (lifecycle.reconcile), the coordinator's progress
record (rank 0's samples/s over its last steps) becomes a reading when it is of the
generation the coordinator has now, that generation is settled, and its world size is
that of the members: a rate of a generation that is still forming, or that mixes steps
of the sizes before and after a resize, would blur the point. A reading is counted once
(the record's own `time` is kept), and folds into its point's mean, the event's data:
{world, hosts, samples_per_s, readings, generation, time}. No new table: the points are
the job's history and go with it.

The first reading of each generation is left out (kept as the point's generation, with
no samples/s when the point is new: 0 readings, not a point yet): it is taken within a
second or two of the generation's start, where the steps are a start's or a newcomer's
first ones (seen 2x slower on a loaded machine), and one such reading alone would decide
the job's size. Rank 0's rate is over the steps at the world size now only
(gpuflex.elastic.membership.worker_control.Progress), never the resize's pause.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from sqlalchemy.orm import Session

from gpuflex.control import journal
from gpuflex.control.executor import Ops
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.elastic.protocol.wire import CoordinatorStatus
from gpuflex.policy import throughput as T

KIND = "throughput"
DECIDED = "allocation"   # the throughput policy's decisions (data: resized true when it moved the job)


def reading(job: Job, status: CoordinatorStatus | None) -> tuple[int, int, float, float] | None:
    """(world, hosts, samples/s, the record's time) when the status carries a usable reading."""
    if status is None or not status.settled or not isinstance(status.progress, Mapping):
        return None
    p = status.progress
    rate, when = p.get("samples_per_s"), p.get("time")
    if not _number(rate) or rate <= 0 or not _number(when):
        return None
    members = set(status.members)
    world = len(members)
    if world < 1 or p.get("generation") != status.generation or p.get("world_size") != world:
        return None
    hosts = {w.host for w in job.workers if w.wid in members}
    return world, max(1, len(hosts)), float(rate), float(when)


def note(ops: Ops, job: Job, status: CoordinatorStatus | None) -> bool:
    """Fold the status's reading (if any) into the job's point for its size; whether it did."""
    got = reading(job, status)
    if got is None:
        return False
    world, hosts, rate, when = got
    events = queries.events_of_jobs(ops.session, [job.id], [KIND]).get(job.id, [])
    same = next((e for e in events if (e.data or {}).get("world") == world and e.data.get("hosts") == hosts), None)
    if same is None:   # this size's first reading: left out (see the module docstring), its generation kept
        journal.record(ops.session, job, KIND, _message(world, hosts, 0.0, 0), world=world, hosts=hosts,
                       samples_per_s=0.0, readings=0, generation=status.generation, time=when)
        return False
    d = dict(same.data)
    if _number(d.get("time")) and when <= d["time"]:
        return False   # the same record read again
    if d.get("generation") != status.generation:   # back at this size: again the first reading left out
        d.update(generation=status.generation, time=when)
        same.data = d
        return False
    n = int(d.get("readings") or 0)
    mean = (float(d.get("samples_per_s") or 0.0) * n + rate) / (n + 1)
    d.update(samples_per_s=mean, readings=n + 1, generation=status.generation, time=when)
    same.data, same.message = d, _message(world, hosts, mean, n + 1)   # a new dict: the JSON column sees it
    return True


def points(session: Session, job_id: int) -> list[T.Point]:
    """The job's measured points (from its "throughput" events)."""
    return points_of(queries.events_of_jobs(session, [job_id], [KIND]).get(job_id, []))


def points_of(events) -> list[T.Point]:
    out = []
    for e in (e for e in events if e.kind == KIND):
        d = e.data or {}
        w, h, r, n = d.get("world"), d.get("hosts"), d.get("samples_per_s"), d.get("readings")
        if isinstance(w, int) and isinstance(h, int) and _number(r) and isinstance(n, int) and w >= 1 and n >= 1:
            out.append(T.Point(w, h, float(r), n))
    return T.merge(out)


def resized_at(events) -> float | None:
    """When the throughput policy last resized the job (its newest "allocation" event
    that moved it): the hysteresis' clock."""
    times = [e.last_time or e.time for e in events if e.kind == DECIDED and (e.data or {}).get("resized")]
    return max(times, default=None)


def scaling(sessions, job_id: int, min_workers: int, max_workers: int, world: int,
            hosts: int) -> dict[str, Any]:
    """The job's "scaling" view (gpuflex.policy.throughput.summary) for `status JOB`."""
    with sessions() as session:
        pts = points(session, job_id)
    return T.summary(pts, min_workers, max_workers, world, hosts)


def scaling_text(view: Mapping[str, Any]) -> str:
    """Three lines at most for `status JOB`: the points, the prediction, the margins."""
    pts = view.get("points") or []
    if not pts:
        return ""
    lines = ["scaling: measured " + ", ".join(f"{p['world']}w/{p['hosts']}h {p['samples_per_s']:.0f}/s"
                                             for p in pts)]
    if view.get("model") is None:
        lines.append(f"scaling: {view.get('why_not')}; the throughput policy leaves it at its size")
        return "\n".join(lines)
    lines.append("scaling: predicted " + ", ".join(f"{p['world']}w {p['samples_per_s']:.0f}/s"
                                                  for p in view.get("predicted") or []))
    margins = []
    for key, what in (("one_more", "one more worker"), ("one_fewer", "one fewer")):
        m = view.get(key)
        if m:
            margins.append(f"{what} {m['gain']:+.0%} (efficiency {m['efficiency']:.2f})")
    if margins:
        lines.append("scaling: " + "; ".join(margins))
    return "\n".join(lines)


def _message(world: int, hosts: int, rate: float, readings: int) -> str:
    return f"measured {rate:.1f} samples/s at {world} worker(s) on {hosts} host(s) ({readings} reading(s))"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
