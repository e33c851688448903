"""The queue's gates and preemption, carried out: what gpuflex.policy.preemption decides
for a queued job, read from the database and acted on.

gpuflex.control.lifecycle.place_queued asks, per queued job in `placing_order` (priority,
then the owner's decayed usage, then age: gpuflex.policy.fairshare): `settle_dependencies`
first (a dependency that can never be satisfied cancels the job: afterok on a failed,
cancelled or timed-out job, afternotok on one that succeeded; and a chain below it in the
same command), then `gate` (dependencies not done yet, singleton, the array's cap), then
`over_quota` (its MIN would take its owner past their [quota] limit: it waits, and
preempts nothing), `placement` (MIN up to what the quota leaves; under the throughput
policy a --harvest job up to what its owner's fair share leaves, and the user furthest
below their share is placed first: `starting`), and when the job does
not fit, `make_room` (preempt lower-priority jobs). The pool's state (`Room`) is read once
per pass and again only after a start or a preemption. Every decision leaves a trace on both sides: the waiting job's
queue_reason and a "preempting" event name the preempted jobs, and each preempted job's
"preempted" event (and its requeue's reason) names the waiting one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

from gpuflex.control import executor, journal, quotas, scaling
from gpuflex.control.executor import Ops
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.errors import GpuflexError
from gpuflex.policy import fairshare, shares
from gpuflex.policy.placement import Assignment, HostFree, Placement, place
from gpuflex.policy.preemption import (AFTERANY, AFTERNOTOK, AFTEROK, Dependency, Gate, HeldWorker, Shrink,
                                       Stop, Victim, array_gate, could_preempt, dependency_gate, plan_preemption,
                                       singleton_gate)
from gpuflex.states import JobState, WorkerState

log = logging.getLogger(__name__)

PREEMPTED_CAUSE = "preempted"   # a requeue's cause (never counted against --retries)


# ---- fair share and quotas (gpuflex.control.quotas) -------------------------------------
def placing_order(ops: Ops, jobs: Iterable[Job], now: Room | None = None) -> list[Job]:
    """Queued jobs by priority, then their owner's decayed usage (least first), then age.
    The usage is read only when users of one priority compete and, given the pool as `now`
    sees it, some job could start (else the order changes nothing)."""
    jobs = list(jobs)
    idle = now is not None and not now.could_start(max((j.priority for j in jobs), default=0))
    if idle or len({(j.priority, j.user) for j in jobs}) == len({j.priority for j in jobs}):
        return sorted(jobs, key=lambda j: (-j.priority, j.id))
    by_id = {j.id: j for j in jobs}
    queued = [fairshare.Queued(j.id, j.priority, j.user) for j in jobs]
    order = [by_id[i] for i in fairshare.placing_order(queued, quotas.usage(ops))]
    starts = (now or room(ops)).starts if ops.config.harvest.policy == "throughput" else None
    if starts is None:
        return order
    # the throughput policy: within a priority, the user furthest below their share first
    return sorted(order, key=lambda j: (-j.priority, starts.behind(j.user)))


def starting(ops: Ops, free: list[HostFree]) -> shares.Starting | None:
    """Under `[harvest] policy = "throughput"`: each user's fair share of the pool (the
    devices jobs hold and the `free` ones) and the devices they hold (shares.Starting),
    for the start sizes and the order; else None."""
    if ops.config.harvest.policy != "throughput":
        return None
    jobs = queries.jobs(ops.session, (*queries.ACTIVE, JobState.QUEUED))
    return shares.starting((shares.claim(j, j.state is not JobState.QUEUED) for j in jobs),
                           sum(len(h.devices) for h in free))


def over_quota(ops: Ops, job: Job) -> str | None:
    """Why the job's MIN would take its owner past their quota (None: it fits)."""
    return quotas.quota_of(ops, job.user).refusal(job.min_workers, job.gpus_per_worker)


def started_below_max(job: Job, starts: shares.Starting | None, workers: int) -> str | None:
    """Why a --harvest job just started with `workers` is below its MAX under the
    throughput policy (its owner's fair share; the "allocation" event), or None."""
    if starts is None or not job.harvest or job.target_workers or workers >= job.max_workers:
        return None
    most = starts.most(job.user, job.max_workers, job.min_workers, job.gpus_per_worker)
    if most >= job.max_workers:
        return None   # not the share: the free devices or the quota
    return (f"job {job.id} started with {workers} of its MAX {job.max_workers} worker(s): {job.user}'s fair "
            f"share of the pool is {starts.share.get(job.user, 0.0):.1f} device(s), of which they held "
            f"{starts.held.get(job.user, 0)}; the throughput policy grows it as its measurements show gains")


def placement(ops: Ops, job: Job, free: list[HostFree], starts: shares.Starting | None = None) -> Placement:
    """Where the job's workers would go on `free` devices: MIN up to its target (else MAX),
    no more than its owner's quota leaves; under the throughput policy (`starts`: the
    pass's Room.starts) a --harvest job without a target no bigger than what its owner's
    fair share leaves (shares.Starting.most)."""
    most = max(job.target_workers or job.max_workers, job.min_workers)
    if starts is not None and job.harvest and not job.target_workers:
        most = starts.most(job.user, most, job.min_workers, job.gpus_per_worker)
    allowed = quotas.quota_of(ops, job.user).workers_allowed(job.gpus_per_worker)
    if allowed is not None:
        most = max(job.min_workers, min(most, allowed))
    return place(free, job.min_workers, most, job.gpus_per_worker)


@dataclasses.dataclass(frozen=True)
class Room:
    """What a placing pass reads once, and again only after it changed something (a
    start, a preemption): the free devices, the devices leavers are giving back, the
    running jobs as possible victims. A pass over 200 waiting jobs read them 200 times."""

    free: list[HostFree]
    leaving: list[HeldWorker]
    running: list[Victim]
    starts: shares.Starting | None = None   # the throughput policy's shares (`starting`)

    def could_start(self, priority: int) -> bool:
        """Whether a job of `priority` might start: a device is free, a leaver is giving
        one back, or a running job it may preempt (lower priority, and elastic or
        --requeue: gpuflex.policy.preemption) holds some."""
        return (any(h.devices for h in self.free) or bool(self.leaving)
                or could_preempt(self.running, priority))


def holding(now: Room, assignments: Iterable[Assignment]) -> Room:
    """`now` without the devices of `assignments` (a job's place in the queue, held for
    this pass while it waits for its owner's command)."""
    taken = {(a.host, d) for a in assignments for d in a.devices}
    free = []
    for h in now.free:
        keep = [(d, h.model(i)) for i, d in enumerate(h.devices) if (h.name, d) not in taken]
        free.append(dataclasses.replace(h, devices=tuple(d for d, _ in keep),
                                        models=tuple(m for _, m in keep) if h.models else ()))
    return dataclasses.replace(now, free=free)


def room(ops: Ops) -> Room:
    active = queries.jobs(ops.session, queries.ACTIVE)
    free = ops.pool.free(ops.session)
    return Room(free,
                [HeldWorker(w.wid, w.host, tuple(w.gpus)) for j in active for w in j.live_workers
                 if w.state is WorkerState.LEAVING],
                [Victim(j.id, j.priority, j.elastic, bool(j.requeue), j.min_workers,
                        tuple(HeldWorker(w.wid, w.host, tuple(w.gpus)) for w in j.members),
                        can_shrink=j.state is JobState.RUNNING, pinned=j.kind is not None) for j in active],
                starting(ops, free))


# ---- the queue's gates -----------------------------------------------------------------
def dependencies(ops: Ops, job: Job) -> list[Dependency]:
    """The job's `--after` ids with the states of the jobs each stands for, each with its
    kind (afterok from jobs.after, the others from jobs.dependency)."""
    extra = job.dependency or {}
    kinds = [(ref, AFTEROK) for ref in job.after or []] + \
        [(ref, kind) for kind in (AFTERANY, AFTERNOTOK) for ref in extra.get(kind, [])]
    states = queries.job_states(ops.session, [ref for ref, _ in kinds])
    return [Dependency(ref, tuple(states[ref]), array=any(jid != ref for jid, _ in states[ref]), kind=kind)
            for ref, kind in kinds]


def settle_dependencies(ops: Ops) -> None:
    """Cancel every queued job whose dependency can never be satisfied (afterok: it ended
    badly; afternotok: it succeeded), until none is left: a job cancelled here may be the
    dependency of the next (A failed -> B cancelled -> C)."""
    for _ in range(1000):   # each round cancels at least one job; a chain is never this long
        cancelled = False
        for job in queries.dependents(ops.session):
            verdict = dependency_gate(dependencies(ops, job))
            if verdict.cancel:
                job.queue_reason = None
                job.exit_reason = verdict.cancel
                journal.set_state(ops.session, job, JobState.CANCELLED, verdict.cancel)
                cancelled = True
        ops.session.flush()
        if not cancelled:
            return


def gate(ops: Ops, job: Job) -> Gate:
    """Why the job may not start yet (its dependencies, its array's cap), or open."""
    if job.after or job.dependency:
        verdict = dependency_gate(dependencies(ops, job))
        if not verdict.open:
            return verdict
    if (job.dependency or {}).get("singleton"):
        verdict = singleton_gate(job.name, queries.singleton_blockers(ops.session, job))
        if not verdict.open:
            return verdict
    if job.array_id is not None and job.array_limit is not None:
        return array_gate(job.array_id, job.array_limit, queries.active_in_array(ops.session, job.array_id))
    return Gate()


def make_room(ops: Ops, job: Job, waiting: str, now: Room) -> str | None:
    """Preempt lower-priority jobs so that `job` fits (see gpuflex.policy.preemption), from
    the pool as `now` saw it. Returns the job's new queue reason (None: nothing would make
    room; `waiting` stays)."""
    lower = [v for v in now.running if v.priority < job.priority]
    plan = plan_preemption(now.free, now.leaving, job.min_workers, job.gpus_per_worker, job.priority, lower)
    if not plan.ok:
        return None
    if not plan.actions:
        return f"{waiting}; preempted workers are leaving"
    names = []
    by = f"preempted by job {job.id} (priority {job.priority})"
    for action in plan.actions:
        victim = queries.job(ops.session, action.job_id)
        try:
            if isinstance(action, Shrink):
                journal.record(ops.session, victim, "preempted", f"{by}: worker(s) "
                               f"{', '.join(map(str, action.wids))} leave", by=job.id, wids=list(action.wids))
                names.append(f"job {victim.id} (shrinking by {len(action.wids)})")
                shrink(ops, victim, list(action.wids), by)
            elif isinstance(action, Stop):
                journal.record(ops.session, victim, "preempted", f"{by}: stopped and requeued", by=job.id)
                executor.requeue(ops, victim, by, cause=PREEMPTED_CAUSE)
                names.append(f"job {victim.id} (requeued)")
        except GpuflexError as e:
            log.warning("job %s: preempting job %s failed: %s", job.id, action.job_id, e)
            names.append(f"job {victim.id} (failed: {e})")
    message = "preempting " + ", ".join(names)
    journal.record(ops.session, job, "preempting", message, jobs=[a.job_id for a in plan.actions])
    ops.session.flush()
    return message


def shrink(ops: Ops, victim: Job, wids: list[int], why: str) -> None:
    """Retire these workers at their next step boundary; if the coordinator cannot take
    the shrink, SIGKILL them instead (as a reclaim escalates): the job rides out their loss
    as a fault, and rows marked leaving are never left holding devices."""
    try:
        scaling.retire(ops, victim, wids, why=why)
    except GpuflexError as e:
        executor.stop_workers(ops, victim, [w for w in victim.live_workers if w.wid in wids],
                              f"{why}: the shrink was not taken ({e})")
