"""Resizing running jobs: grow onto given devices, retire given workers.

`gpuflex scale` (a count) and `gpuflex harvest` (specific GPUs) both end here: newcomers
are spawned and warm up, the coordinator gets the desired membership, and the workers
switch at their next step boundary. (Requeueing a job is `executor.requeue`.) A
restart-elastic job is resized by a restart instead (gpuflex.control.restarts), and a
fixed gang not at all: `scale_in_steps` checks and plans both kinds of job once, the
same way (`check_target`, `check_grow`, `plan_scale`), and only then goes its own way. A
`scale` up stays within the owner's [quota] and never grows a job whose training has
finished (`check_grow`: exit 2, nothing changed).

The database must match the processes: a newcomer's row and id are written before its
process starts, and a resize the coordinator refuses stops its newcomers and ends their
rows. `grow` does it all in the caller's one transaction: a refusal leaves no process, but
a command killed mid-grow takes its rows with it. `grow_in_steps` (so `scale_in_steps`)
commits the rows first, then each process's group, then asks, all under the ops lock the
caller holds: a command killed at any point leaves rows that the next reconcile matches
with their processes (gpuflex.control.lifecycle stops newcomers the coordinator was never
asked for).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, ContextManager

from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control import access, executor, journal, quotas, restarts
from gpuflex.control.harvest_inputs import has_finished
from gpuflex.control.executor import Ops
from gpuflex.control.observe import groups
from gpuflex.control.pool import Pool
from gpuflex.db import queries
from gpuflex.db.models import Job, Worker
from gpuflex.elastic.protocol import failpoints
from gpuflex.errors import GpuflexError, JobError, UsageError
from gpuflex.policy.leavers import LeaverSeen, watch_step
from gpuflex.policy.placement import Assignment, place
from gpuflex.states import WorkerState

# a new transaction per call, committed when its block ends without error; the caller
# holds the ops lock over all of them (gpuflex.db.locks)
Transactions = Callable[[], ContextManager[Session]]


def check_target(job: Job, n: int) -> None:
    """UsageError unless the job runs and `n` is within its MIN..MAX: the first check of
    every scale, in place or by a restart."""
    if not job.state.active:
        raise UsageError(f"job {job.id} is {job.state}; only running jobs can be scaled.")
    check_range(job, n)


def check_range(job: Job, n: int) -> None:
    """UsageError unless `n` is within the job's MIN..MAX."""
    if not job.min_workers <= n <= job.max_workers:
        raise UsageError(f"job {job.id} takes {job.min_workers}..{job.max_workers} workers; {n} is outside.",
                         hint=f"Submit with --workers MIN:MAX to allow {n}.")


def check_grow(ops: Ops, job: Job, n: int) -> None:
    """UsageError when the workers a grow to `n` (a valid target: `check_target`) adds
    would take the owner past their quota, or when the job's training has finished (its
    newcomers would exit at once)."""
    extra = n - len(job.members)
    if extra <= 0:
        return
    quotas.refuse_over_quota(ops, job, extra)
    if has_finished(ops, job):
        raise UsageError(f"job {job.id} has finished training; it is not grown.")


@dataclasses.dataclass(frozen=True)
class ScalePlan:
    """What a scale to `n` comes to, for either kind of job: the newest members to drop (a
    shrink) or the free devices to add (a grow); neither when the job has `n` already."""

    drop: tuple[int, ...] = ()
    add: tuple[Assignment, ...] = ()


def plan_scale(ops: Ops, job: Job, n: int) -> ScalePlan:
    """The shrink drops the newest workers; a grow takes free devices (JobError when there
    are too few). `n` is checked already (check_target)."""
    current = job.members
    if n < len(current):
        newest_first = sorted(current, key=lambda w: w.wid, reverse=True)
        return ScalePlan(drop=tuple(w.wid for w in newest_first[:len(current) - n]))
    if n > len(current):
        p = place(ops.pool.free(ops.session), n - len(current), n - len(current), job.gpus_per_worker)
        if not p.ok:
            raise JobError(f"job {job.id}: cannot grow to {n}: {p.reason}.")
        return ScalePlan(add=tuple(p.assignments))
    return ScalePlan()


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


def ask_for_newcomers(ops: Ops, job: Job, new: list[Worker], why: str = "", by_caller: bool = False) -> None:
    """Ask the coordinator for the membership with the newcomers; if it refuses or cannot
    be asked, stop them and end their rows, then raise."""
    n = len(job.members)
    try:
        executor.ask_membership(ops, job, f"grow to {n} worker(s)" + (f": {why}" if why else ""),
                                by_caller=by_caller)
    except GpuflexError as e:
        executor.stop_workers(ops, job, new, f"the resize was not taken: {e}")
        raise


def grow_in_steps(tx: Transactions, config: Config, pool: Pool, job_id: int,
                  assignments: list[Assignment], why: str = "", by_caller: bool = False) -> list[int]:
    """`grow` as committed steps (see the module docstring); the newcomers' ids. The
    caller holds the ops lock over the call. `by_caller`: see executor.ask_membership."""
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
                ask_for_newcomers(ops, job, new, why, by_caller)
            except GpuflexError as e:
                failure = e
    if failure is not None:
        raise failure
    if failpoints.ARMED: failpoints.hit("scale.requested", job=job_id, wids=wids)
    return wids


def scale_in_steps(tx: Transactions, config: Config, pool: Pool, job_id: int, n: int) -> None:
    """`gpuflex scale`: checked and planned in one transaction (a bad `n` changes nothing),
    then carried out in committed steps. In place: a shrink retires the newest workers
    there, a grow is `grow_in_steps`. A restart job: a restart at `n`
    (restarts.restart_in_steps). A fixed gang: UsageError."""
    with tx() as session:
        ops, job = Ops(config, pool, session), queries.job(session, job_id)
        restarts.refuse_fixed_gang(job)
        check_target(job, n)
        check_grow(ops, job, n)
        plan = plan_scale(ops, job, n)
        if not restarts.is_restart(job) and plan.drop:
            retire(ops, job, list(plan.drop), by_caller=True)
            return
        gang = None
        if restarts.is_restart(job) and (plan.drop or plan.add):
            gang = restarts.without(job, plan.drop) if plan.drop else restarts.with_more(job, list(plan.add))
        cause = f"scale {len(job.members)} -> {n}"
        if gang is not None:   # the restart's own events name only the cause; this names who asked
            journal.record(session, job, "scale-request", f"restart at {n} worker(s) requested by "
                           f"{access.changed_by(job)}", target_workers=n, by=access.caller())
    if gang is not None:
        restarts.restart_in_steps(tx, config, pool, job_id, gang, cause)
    elif plan.add:
        grow_in_steps(tx, config, pool, job_id, list(plan.add), by_caller=True)


def retire(ops: Ops, job: Job, wids: list[int], why: str = "", wait_s: float = 30, by_caller: bool = False) -> None:
    """Ask these workers to leave at the next step boundary (they exit 0). `wait_s` bounds
    the wait for a coordinator that is still starting (a reclaim has a deadline)."""
    gone = [w for w in job.members if w.wid in wids]
    if len(job.members) - len(gone) < 1:
        raise JobError(f"job {job.id}: cannot retire every worker; cancel or requeue it instead.")
    for w in gone:
        journal.retiring(w)
    executor.ask_membership(ops, job, f"shrink to {len(job.members)} worker(s)" + (f": {why}" if why else ""),
                            wait_s=wait_s, by_caller=by_caller)


def watch_leavers(sessions: Callable[[], ContextManager[Session]], config: Config, pool: Pool, job_id: int,
                  refresh: Callable[[], None], deadline: float) -> tuple[int, ...]:
    """Watch the job's `leaving` workers until `deadline` (time.monotonic()) at most, and
    refresh as soon as one's process group is seen gone, so its row ends while the command
    that shrank the job still runs (gpuflex.policy.leavers). The leavers not seen gone (the
    next command's refresh records them). Reads without the ops lock; only `refresh` writes."""
    while True:
        with sessions() as session:
            job = queries.job(session, job_id)
            leaving = [w for w in job.live_workers if w.state is WorkerState.LEAVING]
            procs, _ = groups(config, pool, leaving) if leaving else ({}, {})
            seen = tuple(LeaverSeen(w.wid, procs[w.wid].alive if w.wid in procs else None) for w in leaving)
        step = watch_step(seen, time.monotonic(), deadline)
        if step.record:
            refresh()
        if step.done:
            return step.still
        time.sleep(step.wait_s)   # also after a refresh: one that could not end the row is not repeated at once
