"""Resizing running jobs: grow onto given devices, retire given workers.

`gpuflex scale` (a count) and `gpuflex harvest` (specific GPUs) both end here: newcomers
are spawned and warm up, the coordinator gets the desired membership, and the workers
switch at their next step boundary. (Requeueing a job is `executor.requeue`.) A
restart-elastic job is resized by a restart instead (gpuflex.control.restarts), and a
fixed gang not at all. A `scale` up stays within the owner's [quota] and never grows a job
whose training has finished (`check_grow`: exit 2, nothing changed).

The database must match the processes: a newcomer's row and id are written before its
process starts, and a resize the coordinator refuses stops its newcomers and ends their
rows. `grow` does it all in the caller's one transaction: a refusal leaves no process, but
a command killed mid-grow takes its rows with it. `grow_in_steps` (and `scale_in_steps`)
commits the rows first, then each process's group, then asks, all under the ops lock the
caller holds: a command killed at any point leaves rows that the next reconcile matches
with their processes (gpuflex.control.lifecycle stops newcomers the coordinator was never
asked for).
"""

from __future__ import annotations

from typing import Callable, ContextManager

from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control import executor, journal, quotas, restarts
from gpuflex.control.harvest_inputs import has_finished
from gpuflex.control.executor import Ops
from gpuflex.control.pool import Pool
from gpuflex.db import queries
from gpuflex.db.models import Job, Worker
from gpuflex.elastic.protocol import failpoints
from gpuflex.errors import GpuflexError, JobError, UsageError
from gpuflex.policy.placement import Assignment, place

# a new transaction per call, committed when its block ends without error; the caller
# holds the ops lock over all of them (gpuflex.db.locks)
Transactions = Callable[[], ContextManager[Session]]


def scale(ops: Ops, job: Job, n: int) -> Job:
    """Ask a running job for `n` workers: start newcomers on free devices, or retire the
    newest workers (a restart job: a restart at `n`; a gang: UsageError)."""
    restarts.refuse_gang(job)
    check_grow(ops, job, n)
    if restarts.is_restart(job):
        plan = restarts.plan_scale(ops, job, n)
        if plan is not None:
            restarts.restart(ops, job, plan, f"scale {len(job.members)} -> {n}")
        return job
    grows = plan_scale(ops, job, n)
    if grows:
        grow(ops, job, grows)
    return job


def check_grow(ops: Ops, job: Job, n: int) -> None:
    """UsageError when `n` is no valid target, when the workers a grow to `n` adds would
    take the owner past their quota, or when the job's training has finished (its
    newcomers would exit at once)."""
    restarts.check_target(job, n)
    extra = n - len(job.members)
    if extra <= 0:
        return
    quotas.refuse_over_quota(ops, job, extra)
    if has_finished(ops, job):
        raise UsageError(f"job {job.id} has finished training; it is not grown.")


def plan_scale(ops: Ops, job: Job, n: int) -> list[Assignment]:
    """Check `n` against the job; retire the newest workers for a shrink (done: []), or
    the devices of the newcomers a grow needs (UsageError / JobError when it cannot)."""
    restarts.check_target(job, n)
    current = job.members
    if n > len(current):
        p = place(ops.pool.free(ops.session), n - len(current), n - len(current), job.gpus_per_worker)
        if not p.ok:
            raise JobError(f"job {job.id}: cannot grow to {n}: {p.reason}.")
        return list(p.assignments)
    if n < len(current):
        newest_first = sorted(current, key=lambda w: w.wid, reverse=True)
        retire(ops, job, [w.wid for w in newest_first[:len(current) - n]])
    return []


def grow(ops: Ops, job: Job, assignments: list[Assignment], why: str = "") -> list[Worker]:
    """Start one newcomer per assignment and ask for the larger membership, in the
    caller's transaction. A refused request stops the newcomers (and ends their rows)
    before the error goes on."""
    new = reserve(ops, job, assignments)
    try:
        for w in new:
            launch(ops, job, w)
    except GpuflexError as e:
        executor.stop_workers(ops, job, new, f"a newcomer could not start: {e}")
        raise
    if failpoints.ARMED: failpoints.hit("scale.spawned", job=job.id, wids=[w.wid for w in new])
    ask_for_newcomers(ops, job, new, why)
    if failpoints.ARMED: failpoints.hit("scale.requested", job=job.id, wids=[w.wid for w in new])
    return new


def reserve(ops: Ops, job: Job, assignments: list[Assignment]) -> list[Worker]:
    """The newcomers' rows and ids, no process yet."""
    first = executor.next_wid(ops, job)
    new = [executor.reserve_worker(ops, job, first + i, a, 0) for i, a in enumerate(assignments)]
    ops.session.flush()
    return new


def launch(ops: Ops, job: Job, w: Worker) -> None:
    """Start a reserved newcomer (its launch rank and world: after the current members)."""
    members = job.members
    executor.launch_worker(ops, job, w, members.index(w), len(members))


def ask_for_newcomers(ops: Ops, job: Job, new: list[Worker], why: str = "") -> None:
    """Ask the coordinator for the membership with the newcomers; if it refuses or cannot
    be asked, stop them and end their rows, then raise."""
    n = len(job.members)
    try:
        executor.ask_membership(ops, job, f"grow to {n} worker(s)" + (f": {why}" if why else ""))
    except GpuflexError as e:
        executor.stop_workers(ops, job, new, f"the resize was not taken: {e}")
        raise


def grow_in_steps(tx: Transactions, config: Config, pool: Pool, job_id: int,
                  assignments: list[Assignment], why: str = "") -> list[int]:
    """`grow` as committed steps (see the module docstring); the newcomers' ids. The
    caller holds the ops lock over the call."""
    with tx() as session:
        wids = [w.wid for w in reserve(Ops(config, pool, session), queries.job(session, job_id), assignments)]
    failure: GpuflexError | None = None
    for wid in wids:
        with tx() as session:
            job = queries.job(session, job_id)
            try:
                launch(Ops(config, pool, session), job, next(w for w in job.workers if w.wid == wid))
            except GpuflexError as e:
                failure = e
        if failure is not None:
            break
    if failpoints.ARMED and failure is None: failpoints.hit("scale.spawned", job=job_id, wids=wids)
    with tx() as session:   # the request, or the clean-up of a failure: committed either way
        job, ops = queries.job(session, job_id), Ops(config, pool, session)
        new = [w for w in job.workers if w.wid in wids]
        if failure is not None:
            executor.stop_workers(ops, job, new, f"a newcomer could not start: {failure}")
        else:
            try:
                ask_for_newcomers(ops, job, new, why)
            except GpuflexError as e:
                failure = e
    if failure is not None:
        raise failure
    if failpoints.ARMED: failpoints.hit("scale.requested", job=job_id, wids=wids)
    return wids


def scale_in_steps(tx: Transactions, config: Config, pool: Pool, job_id: int, n: int) -> None:
    """`scale` with a grow's steps committed one by one (see `grow_in_steps`; a restart
    job's stop and launch: restarts.scale_in_steps). A bad `n` changes nothing."""
    with tx() as session:
        job = queries.job(session, job_id)
        restarts.refuse_gang(job)
        check_grow(Ops(config, pool, session), job, n)
        restart = restarts.is_restart(job)
        grows = [] if restart else plan_scale(Ops(config, pool, session), job, n)
    if restart:
        restarts.scale_in_steps(tx, config, pool, job_id, n)
        return
    if grows:
        grow_in_steps(tx, config, pool, job_id, grows)


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
