"""One harvest tick (`gpuflex harvest`, `gpuflex watch`): probe, reconcile, yield to owners,
place, grow. The decisions come from gpuflex.policy.harvest (pure); this module carries
them out through the pool's transports and records what happened (giving GPUs back to
their owner: gpuflex.control.reclaim).

A tick, in order:
1. probe every GPU host in parallel (outside any lock; bounded by the hosts' timeouts) and
   record verdicts and idle streaks, each sample dated by the tick's start: an owner's wait
   for their GPU begins with the tick that saw them, not once its probing is done, so the
   reclaim's clock (SIGKILL budget and the event's latency) starts there too;
2. `JobService.refresh()`: reconcile jobs with reality and start queued jobs that fit;
3. plan; requeue the jobs that cannot yield above MIN (under the lock: SIGTERM = checkpoint
   and stop, the owner's GPUs killed if that takes too long), ask the others to retire the
   workers on reclaimed GPUs (in-place shrink);
4. outside the lock, wait for the leavers to exit; a leaver still alive at
   SHRINK_SHARE x reclaim_deadline_s after that tick's start is SIGKILLed (the
   survivors recover without it, as from any crashed worker). SIGTERM is not used for a
   single leaver: the worker runtime reads SIGTERM as "stop the whole job". A restart job
   (--elastic restart) cannot shrink in place: under the lock, every worker gets SIGTERM
   and is SIGKILLed at cancel_grace_s or at the shrink window, whichever comes first, then
   the gang restarts without the owner's GPUs (gpuflex.control.restarts);
5. record each reclaim (event "reclaim": host, gpu, latency_s from `clock_from`, the start
   of the tick that saw the owner; deadline_s, method, `killed_at` of a SIGKILL), start
   queued jobs that now fit, plan again and grow --harvest jobs onto idle GPUs (a restart
   job by a restart at the larger size; a fixed gang is never grown: it is at its MAX);
   under `[harvest] policy = "throughput"`, also record each decision's reason (event
   "allocation") and retire the workers its Shrinks name, in place (issue 32).

Ticks never overlap: a second one finds the tick lock (beside the DB) held and skips.
A tick's run time is bounded: probes by the hosts' timeouts, reclaims by the deadline;
growth is left to the next tick once a tick has used `budget_s`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
import logging
from typing import Any, Iterator

from gpuflex.config import Config
from gpuflex.control import journal, lifecycle, reclaim, restarts, scaling, throughput
from gpuflex.control.executor import Ops
from gpuflex.control.harvest_inputs import current_plan
from gpuflex.control.service import JobService
from gpuflex.db import queries
from gpuflex.db.locks import database_lock
from gpuflex.errors import GpuflexError
from gpuflex.hosts.fanout import Result
from gpuflex.hosts.probe import HostProbe
from gpuflex.policy.harvest_actions import Grow, Note, Plan, Requeue, Shrink, Yield
from gpuflex.policy.placement import Assignment
from gpuflex.states import JobState

log = logging.getLogger(__name__)



@dataclasses.dataclass
class TickResult:
    started_at: float
    dry_run: bool = False
    skipped: str | None = None                               # why the tick did nothing
    hosts: dict[str, str | None] = dataclasses.field(default_factory=dict)  # host -> error
    plan: Plan = Plan()
    actions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    duration_s: float = 0.0

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [a for a in self.actions if a.get("ok") is False]

    def to_json(self) -> dict[str, Any]:
        return {"time": self.started_at, "dry_run": self.dry_run, "skipped": self.skipped,
                "hosts": [{"host": h, "ok": e is None, "error": e} for h, e in self.hosts.items()],
                "plan": self.plan.to_json(), "actions": self.actions,
                "duration_s": round(self.duration_s, 3)}


def budget_s(config: Config) -> float:
    h = config.harvest
    return max(h.interval_s, h.reclaim_deadline_s + 10)


# ---- the tick lock ---------------------------------------------------------------------
@contextlib.contextmanager
def tick_lock(config: Config) -> Iterator[str | None]:
    """Try the tick lock without waiting: yields None when held by us, else who holds it."""
    lock = database_lock(config.database_url, "harvest")
    if not lock.acquire(blocking=False):
        yield lock.holder()
        return
    try:
        yield None
    finally:
        lock.release()


# ---- the tick --------------------------------------------------------------------------
def run_tick(svc: JobService, *, dry_run: bool = False) -> TickResult:
    """One tick; see the module docstring. A dry run probes and plans, records nothing and
    acts on nothing (it needs no tick lock)."""
    if dry_run:
        return _tick(svc, dry_run=True)
    with tick_lock(svc.config) as holder:
        if holder is not None:
            return TickResult(time.time(), skipped=f"another harvest tick is running ({holder})")
        return _tick(svc, dry_run=False)


def _tick(svc: JobService, dry_run: bool) -> TickResult:
    t = TickResult(time.time(), dry_run=dry_run)
    results = dated(svc.collect_probes(), t.started_at)
    t.hosts = {name: None if r.ok else str(r.error) for name, r in results.items()}
    errors = {h: e for h, e in t.hosts.items() if e}
    if dry_run:
        with svc.sessions() as session:
            svc.pool.sync_hosts(session)
            svc.record_probes(session, results)
            t.plan = current_plan(svc.ops(session), errors)
            session.rollback()
        return _done(t)
    with svc.locked() as session:
        svc.pool.sync_hosts(session)
        svc.record_probes(session, results)
    svc.refresh()
    pending: list[reclaim.Reclaim] = []
    with svc.locked() as session:
        ops = svc.ops(session)
        t.plan = current_plan(ops, errors)
        for a in t.plan.of(Requeue):
            t.actions += reclaim.requeue(ops, a)
        for a in t.plan.of(Yield):
            if restarts.is_restart(queries.job(session, a.job)):
                t.actions += reclaim.restart_yield(ops, a)
            else:
                pending.append(reclaim.start_yield(ops, a, t.actions))
    outcomes = reclaim.watch_exits(svc.config, svc.pool, [x for p in pending for x in p.leavers])
    with database_lock(svc.config.database_url, "ops").held():   # one lock, several commits
        with svc.sessions.begin() as session:
            ops = svc.ops(session)
            for p in pending:
                t.actions += reclaim.record(ops, p, outcomes)
            t.actions += _place(ops)
            late = time.time() - t.started_at > budget_s(svc.config)
            later = Plan() if late else current_plan(ops, errors)
        if late:
            t.actions.append({"action": "grow", "ok": None, "skipped": "the tick ran out of time; "
                              "growth is left to the next tick"})
        t.actions += _grow(svc, later.of(Grow))
        t.actions += _allocate(svc, later)   # the throughput policy's shrinks and reasons
    return _done(t)


def dated(results: dict[str, Result[HostProbe]], when: float) -> dict[str, Result[HostProbe]]:
    """The probes as seen at `when` (the tick's start): a foreign process they find is
    the owner's from that moment."""
    return {name: dataclasses.replace(r, value=dataclasses.replace(r.value, time=when)) if r.ok else r
            for name, r in results.items()}


def _done(t: TickResult) -> TickResult:
    t.duration_s = time.time() - t.started_at
    return t


# ---- placing and growing ---------------------------------------------------------------
def _place(ops: Ops) -> list[dict[str, Any]]:
    queued = queries.jobs(ops.session, [JobState.QUEUED])
    lifecycle.place_queued(ops)
    return [{"action": "place", "job": j.id, "ok": True,
             "gpus": [[w.host, d] for w in j.live_workers for d in w.gpus]}
            for j in queued if j.state is not JobState.QUEUED]


def _grow(svc: JobService, grows: list[Grow]) -> list[dict[str, Any]]:
    """Grow each job in committed steps (scaling.grow_in_steps; a restart job by a restart
    at the larger size, restarts.restart_in_steps); the caller holds the ops lock. A failed
    grow has stopped its newcomers; it is recorded and the others go on."""
    by_job: dict[int, list[Grow]] = collections.defaultdict(list)
    for g in grows:
        by_job[g.job].append(g)
    out = []
    for job_id, gs in by_job.items():
        where = [[g.host, d] for g in gs for d in g.devices]
        text = ", ".join(f"{h}:{d}" for h, d in where)
        added = [Assignment(g.host, g.devices) for g in gs]
        with svc.sessions() as session:
            job = queries.job(session, job_id)
            gang = restarts.with_more(job, added) if restarts.is_restart(job) else None
        try:
            if gang is not None:
                ok = restarts.restart_in_steps(svc.sessions.begin, svc.config, svc.pool, job_id, gang,
                                               f"harvesting idle {text}")
                out.append({"action": "restart", "job": job_id, "ok": ok, "gpus": where, "workers": len(gang)})
                continue
            wids = scaling.grow_in_steps(svc.sessions.begin, svc.config, svc.pool, job_id,
                                         added, why=f"harvesting idle {text}")
            out.append({"action": "grow", "job": job_id, "ok": True, "gpus": where, "wids": wids})
        except GpuflexError as e:
            with svc.sessions.begin() as session:
                journal.record(session, queries.job(session, job_id), "harvest-failed",
                               f"could not grow onto {text}: {e}")
            out.append({"action": "grow", "job": job_id, "ok": False, "gpus": where, "error": str(e)})
    return out


def _allocate(svc: JobService, plan: Plan) -> list[dict[str, Any]]:
    """The throughput policy's decisions (gpuflex.policy.allocation): each reason becomes an
    "allocation" event of its job (resized true when the job was grown or shrunk: the
    hysteresis reads it), each Shrink retires its workers in place, one committed step a
    job (scaling.retire; they leave at their next step boundary and free their GPUs). The
    caller holds the ops lock. A failed shrink is recorded and the others go on."""
    moved = {a.job for a in plan.of(Grow)} | {a.job for a in plan.of(Shrink)}
    out: list[dict[str, Any]] = []
    with svc.sessions.begin() as session:
        for n in plan.of(Note):
            journal.record(session, queries.job(session, n.job), throughput.DECIDED, n.reason, resized=n.job in moved)
    for a in plan.of(Shrink):
        try:
            with svc.sessions.begin() as session:
                scaling.retire(svc.ops(session), queries.job(session, a.job), list(a.wids), why=a.reason)
            out.append({"action": "shrink", "job": a.job, "ok": True, "wids": list(a.wids), "reason": a.reason})
        except GpuflexError as e:
            with svc.sessions.begin() as session:
                journal.record(session, queries.job(session, a.job), "harvest-failed", f"could not shrink: {e}")
            out.append({"action": "shrink", "job": a.job, "ok": False, "wids": list(a.wids), "error": str(e)})
    return out
