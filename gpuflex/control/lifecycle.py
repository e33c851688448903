"""A job's life on the control side: placing queued jobs, and reconciling running ones.

Reconciling is read, decide, write: gpuflex.control.observe reads what the hosts and the
coordinator say, gpuflex.policy.lifecycle decides (pure), gpuflex.control.executor writes
the decision and acts on it.

Before the policy, reconcile makes the database match the processes where a command died
half-way (gpuflex.control.scaling writes a newcomer's row before its process and asks the
coordinator last, all under the ops lock, so no reconcile runs between): a STARTING
worker that the coordinator neither counts nor wants was never asked for, and is stopped;
a LEAVING worker still alive LEAVE_BOUND_S after the shrink was asked, that the
coordinator no longer wants, never left, and is stopped too (it held its devices from
every later grow); so is a newcomer the coordinator left out of a resize (it never became
ready: one stuck before it ever beat would otherwise hold its devices for the job's life).
"""

from __future__ import annotations

import logging
import time

from gpuflex.control import access, executor, interactive, journal, queueing, split, throughput
from gpuflex.control import launch as L
from gpuflex.control.executor import Ops
from gpuflex.control.observe import facts, observe
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.elastic.protocol.wire import CoordinatorStatus
from gpuflex.errors import TransportError
from gpuflex.hosts import hostops
from gpuflex.jobspec import format_time
from gpuflex.policy.lifecycle import Observation, decide
from gpuflex.policy.reconcile import first_look
from gpuflex.states import JobState

log = logging.getLogger(__name__)

LAUNCH_RETRY_S = 30   # wait this long before launching a job again after a host failed it
SWEEP_MIN_AGE_S = 600  # a socket directory changed more recently than this may be a run starting
LEAVE_BOUND_S = 120    # after the shrink's request: a leaver still alive then never left


def reconcile(ops: Ops, job: Job) -> CoordinatorStatus | None:
    """Bring one running job's record in line with its processes and coordinator: observe,
    decide (gpuflex.policy.reconcile, then gpuflex.policy.lifecycle: pure), apply. Returns
    the coordinator's status (None when it did not answer). An interactive session has no
    coordinator: gpuflex.control.interactive reconciles it."""
    if job.kind is not None:
        interactive.reconcile(ops, job)
        return None
    seen = observe(ops.config, ops.pool, job)
    known = facts(job)
    first = first_look(known, seen, time.time(), LEAVE_BOUND_S)
    if first.time_out:
        time_out(ops, job, seen)
        return seen.coordinator
    for stop in first.stops:
        executor.stop_workers(ops, job, [w for w in job.live_workers if w.wid in stop.wids], stop.why)
    if first.stops:   # read again: a stopped worker is STOPPED, or LOST when its host did not answer
        known, seen = facts(job), first.without_stopped(seen)
    executor.apply(ops, job, decide(known, seen, time.time()))
    if job.state == JobState.RUNNING:
        split.follow(ops, job, seen.coordinator)   # re-plan events, a straggler's release
        throughput.note(ops, job, seen.coordinator)   # issue 32: its samples/s at this size
    return seen.coordinator


def time_out(ops: Ops, job: Job, seen: Observation) -> None:
    """End a run at its time limit: what still runs gets SIGTERM, the grace, SIGKILL (the
    supervisors did it at the deadline, unless this command came first); state TIMEOUT."""
    limit = format_time(job.time_limit_s or 0)
    by_supervisors = all(p.exited and not p.alive for p in seen.procs.values()) and bool(seen.procs)
    reason = f"time limit {limit} reached"
    journal.record(ops.session, job, "time-limit", reason, time_limit_s=job.time_limit_s,
                   deadline=L.run_deadline(job), stopped_by="supervisors" if by_supervisors else "reconcile")
    job.exit_reason = reason
    executor.stop_job(ops, job, JobState.TIMEOUT, reason)


def sweep_socket_dirs(ops: Ops, active: list[Job]) -> None:
    """Remove this machine's stale control-socket directories of ours (see
    gpuflex.hosts.hostops.sweep_socket_dirs), never one of `active`'s runs; only where
    this machine is one of the pool's hosts."""
    if not any(h.is_local for h in ops.config.hosts):
        return
    keep = [j.socket_dir for j in active if j.socket_dir]
    for path in hostops.sweep_socket_dirs(L.SOCKET_ROOT, L.SOCKET_NAME, keep, SWEEP_MIN_AGE_S):
        log.debug("removed the stale socket directory %s", path)


def place_queued(ops: Ops) -> None:
    """Start queued jobs that fit, by priority, then their owner's decayed usage (fair
    share), then age, once their dependencies succeeded, their array has room and their
    owner's quota allows (gpuflex.control.queueing), unless held; a job that does not fit may preempt
    lower-priority ones; record why the others wait."""
    queueing.settle_dependencies(ops)
    # a held job (`gpuflex hold`) waits, with the reason its hold gave, until released
    queued = [j for j in queries.queued_jobs(ops.session) if not j.held]
    # a host failed these a moment ago: do not hammer it on every command
    failed = queries.with_event_since(ops.session, [j.id for j in queued], "launch-failed",
                                      time.time() - LAUNCH_RETRY_S)
    room = queueing.room(ops) if queued else None
    for job in queueing.placing_order(ops, queued, room):
        if job.id in failed:
            continue
        gate = queueing.gate(ops, job)
        if not gate.open:
            wait(ops, job, gate.wait or gate.cancel or "")
            continue
        over = queueing.over_quota(ops, job)
        if over is not None:
            wait(ops, job, over)
            continue
        room = room or queueing.room(ops)
        p = queueing.placement(ops, job, room.free, room.starts)
        reason = None
        if not p.ok and access.may_start(ops.config, job):   # preempting for a job it cannot start: no
            reason = queueing.make_room(ops, job, p.reason or "", room)
            if reason is not None:   # it preempted: what is free changed
                room = queueing.room(ops)
                p = queueing.placement(ops, job, room.free, room.starts)
        if not p.ok:
            wait(ops, job, reason or p.reason or "")
            continue
        if not access.may_start(ops.config, job, [a.host for a in p.assignments]):
            room = queueing.holding(room, p.assignments)   # its place in the queue is kept
            wait(ops, job, f"it fits now and starts at {job.user}'s next gpuflex command: {job.user}'s "
                           f"processes run as {job.user} on {', '.join(sorted({a.host for a in p.assignments}))}")
            continue
        below = queueing.started_below_max(job, room.starts, len(p.assignments))
        room = None
        try:
            executor.start_job(ops, job, list(p.assignments))
            if below is not None:
                journal.record(ops.session, job, throughput.DECIDED, below, resized=False)
        except TransportError as e:
            log.debug("job %s: launch failed: %s", job.id, e)
            executor.stop_processes(ops, job)
            if "cannot start" in str(e):   # the job's own command cannot run: retrying won't help
                job.exit_reason = str(e)
                journal.set_state(ops.session, job, JobState.FAILED, f"launch failed: {e}")
            else:
                job.queue_reason = f"launch failed (retrying in {LAUNCH_RETRY_S:.0f} s): {e}"
                journal.record(ops.session, job, "launch-failed", str(e))
        ops.session.flush()


def wait(ops: Ops, job: Job, reason: str) -> None:
    """The job stays queued: its reason, and an event when the reason changed."""
    if job.queue_reason != reason:
        job.queue_reason = reason
        journal.record(ops.session, job, "queued", reason)
