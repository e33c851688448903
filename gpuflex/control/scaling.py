"""Resizing running jobs: grow onto given devices, retire given workers.

`gpuflex scale` (a count) and `gpuflex harvest` (specific GPUs) both end here: newcomers
are spawned and warm up, the coordinator gets the desired membership, and the workers
switch at their next step boundary. (Requeueing a job is `executor.requeue`.)
"""

from __future__ import annotations

from gpuflex.control import executor, journal
from gpuflex.control.executor import Ops
from gpuflex.db.models import Job, Worker
from gpuflex.errors import JobError, UsageError
from gpuflex.policy.placement import Assignment, place


def scale(ops: Ops, job: Job, n: int) -> Job:
    """Ask a running job for `n` workers: start newcomers on free devices, or retire the
    newest workers."""
    if not job.state.active:
        raise UsageError(f"job {job.id} is {job.state}; only running jobs can be scaled.")
    if not job.min_workers <= n <= job.max_workers:
        raise UsageError(f"job {job.id} takes {job.min_workers}..{job.max_workers} workers; {n} is outside.",
                         hint=f"Submit with --workers MIN:MAX to allow {n}.")
    current = job.members
    if n > len(current):
        p = place(ops.pool.free(ops.session), n - len(current), n - len(current), job.gpus_per_worker)
        if not p.ok:
            raise JobError(f"job {job.id}: cannot grow to {n}: {p.reason}.")
        grow(ops, job, list(p.assignments))
    elif n < len(current):
        newest_first = sorted(current, key=lambda w: w.wid, reverse=True)
        retire(ops, job, [w.wid for w in newest_first[:len(current) - n]])
    return job


def grow(ops: Ops, job: Job, assignments: list[Assignment], why: str = "") -> list[Worker]:
    """Start one newcomer per assignment and ask for the larger membership."""
    current = job.members
    n = len(current) + len(assignments)
    next_wid = max(w.wid for w in job.workers) + 1
    new = [executor.spawn_worker(ops, job, next_wid + i, a, len(current) + i, n)
           for i, a in enumerate(assignments)]
    executor.ask_membership(ops, job, f"grow to {n} worker(s)" + (f": {why}" if why else ""))
    return new


def retire(ops: Ops, job: Job, wids: list[int], why: str = "", wait_s: float = 30) -> None:
    """Ask these workers to leave at the next step boundary (they exit 0). `wait_s` bounds
    the wait for a coordinator that is still starting (a reclaim has a deadline)."""
    gone = [w for w in job.members if w.wid in wids]
    if len(job.members) - len(gone) < 1:
        raise JobError(f"job {job.id}: cannot retire every worker; cancel or requeue it instead.")
    for w in gone:
        journal.retiring(w)
    executor.ask_membership(ops, job, f"shrink to {len(job.members)} worker(s)" + (f": {why}" if why else ""),
                            wait_s=wait_s)
