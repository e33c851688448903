"""Resizing running jobs: grow onto given devices, retire given workers, requeue.

`gpuflex scale` (a count) and `gpuflex harvest` (specific GPUs) both end here: newcomers
are spawned and warm up, the coordinator gets the desired membership, and the workers
switch at their next step boundary.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from gpuflex.control.lifecycle import (_record, _set_state, coordinator_request, members,
                                       spawn_worker, stop_processes)
from gpuflex.db.models import Job, Worker
from gpuflex.errors import JobError, TransportError, UsageError
from gpuflex.policy.placement import Assignment, place
from gpuflex.states import JobState, WorkerState

if TYPE_CHECKING:
    from gpuflex.control.service import JobService

POKE_TIMEOUT_S = 2.0


def scale(svc: "JobService", session: Session, job: Job, n: int) -> Job:
    """Ask a running job for `n` workers: start newcomers on free devices, or retire the
    newest workers."""
    if not JobState(job.state).active:
        raise UsageError(f"job {job.id} is {job.state}; only running jobs can be scaled.")
    if not job.min_workers <= n <= job.max_workers:
        raise UsageError(f"job {job.id} takes {job.min_workers}..{job.max_workers} workers; {n} is outside.",
                         hint=f"Submit with --workers MIN:MAX to allow {n}.")
    current = members(job)
    if n > len(current):
        p = place(svc.pool.free(session), n - len(current), n - len(current), job.gpus_per_worker)
        if not p.ok:
            raise JobError(f"job {job.id}: cannot grow to {n}: {p.reason}.")
        grow(svc, session, job, list(p.assignments))
    elif n < len(current):
        newest_first = sorted(current, key=lambda w: w.wid, reverse=True)
        retire(svc, session, job, [w.wid for w in newest_first[:len(current) - n]])
    return job


def grow(svc: "JobService", session: Session, job: Job, assignments: list[Assignment],
         why: str = "") -> list[Worker]:
    """Start one newcomer per assignment and ask for the larger membership."""
    current = members(job)
    n = len(current) + len(assignments)
    next_wid = max(w.wid for w in job.workers) + 1
    new = [spawn_worker(svc, session, job, next_wid + i, a, len(current) + i, n)
           for i, a in enumerate(assignments)]
    _request(svc, session, job, f"grow to {n} worker(s)" + (f": {why}" if why else ""))
    return new


def retire(svc: "JobService", session: Session, job: Job, wids: list[int], why: str = "",
           wait_s: float = 30) -> None:
    """Ask these workers to leave at the next step boundary (they exit 0). `wait_s` bounds
    the wait for a coordinator that is still starting (a reclaim has a deadline)."""
    gone = [w for w in members(job) if w.wid in wids]
    if len(members(job)) - len(gone) < 1:
        raise JobError(f"job {job.id}: cannot retire every worker; cancel or requeue it instead.")
    for w in gone:
        WorkerState(w.state).check_transition(WorkerState.LEAVING)
        w.state = WorkerState.LEAVING.value
    _request(svc, session, job, f"shrink to {len(members(job))} worker(s)" + (f": {why}" if why else ""),
             wait_s=wait_s)


def requeue(svc: "JobService", session: Session, job: Job, why: str) -> None:
    """Stop the job gracefully (the workers checkpoint at their step boundary) and queue it;
    it restarts from that checkpoint when it fits again."""
    stop_processes(svc, session, job)
    job.restarts += 1
    _set_state(session, job, JobState.QUEUED, why, restarts=job.restarts)


def _request(svc: "JobService", session: Session, job: Job, message: str, wait_s: float = 30) -> None:
    desired = sorted(w.wid for w in members(job))
    session.flush()
    coordinator_request(svc, job, {"op": "resize", "members": desired}, wait_s=wait_s)
    poke_workers(svc, job)
    job.target_workers = len(desired)
    if job.state != JobState.SCALING.value:
        _set_state(session, job, JobState.SCALING, f"{message} requested", target_workers=len(desired))
    else:
        _record(session, job, "scale-request", f"{message} requested", target_workers=len(desired))


def poke_workers(svc: "JobService", job: Job) -> None:
    """Tell running workers to look at the store now instead of at their next poll.

    All hosts at once, each host's workers in turn; the first failure on a host skips the
    rest there (a poke only hastens what the workers' 0.1 s store poll finds anyway)."""
    by_host: dict[str, list[str]] = collections.defaultdict(list)
    for w in members(job):
        if w.state == WorkerState.RUNNING.value and w.control_path:
            by_host[w.host].append(w.control_path)
    hosts = [svc.config.host(h) for h in by_host]

    def poke(t) -> None:
        for path in by_host[t.host.name]:
            try:
                t.control_request(path, {"op": "resize"}, timeout=POKE_TIMEOUT_S)
            except (TransportError, ValueError):
                return

    limit = max((h.connect_timeout_s + len(by_host[h.name]) * (POKE_TIMEOUT_S + h.connect_timeout_s)
                 for h in hosts), default=0) + 1
    svc.pool.fan_out(hosts, poke, limit)
