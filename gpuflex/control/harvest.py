"""One harvest tick (`gpuflex harvest`, `gpuflex watch`): probe, reconcile, yield to owners,
place, grow. The decisions come from gpuflex.policy.harvest (pure); this module carries
them out through the pool's transports and records what happened.

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
   job by a restart at the larger size; a fixed gang is never grown: it is at its MAX).

Ticks never overlap: a second one finds the tick lock (beside the DB) held and skips.
A tick's run time is bounded: probes by the hosts' timeouts, reclaims by the deadline;
growth is left to the next tick once a tick has used `budget_s`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import signal
import time
import logging
from typing import Any, Iterator

from gpuflex.config import Config
from gpuflex.control import executor, journal, lifecycle, restarts, scaling
from gpuflex.control.executor import Ops
from gpuflex.control.pool import Pool
from gpuflex.control.harvest_inputs import current_plan
from gpuflex.control.service import JobService
from gpuflex.db import queries
from gpuflex.db.locks import database_lock
from gpuflex.db.models import Job
from gpuflex.errors import GpuflexError
from gpuflex.hosts.fanout import Result
from gpuflex.hosts.probe import HostProbe
from gpuflex.policy.harvest import Grow, Plan, Requeue, Yield
from gpuflex.policy.placement import Assignment
from gpuflex.states import JobState, WorkerState

log = logging.getLogger(__name__)

SHRINK_SHARE = 0.6     # of the deadline: the in-place shrink's window before SIGKILL
KILL_MARGIN_S = 10     # after the deadline: how long a kill is still watched (to record it)
POLL_S = 0.2


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
    pending: list[_Reclaim] = []
    with svc.locked() as session:
        ops = svc.ops(session)
        t.plan = current_plan(ops, errors)
        for a in t.plan.of(Requeue):
            t.actions += _requeue(ops, a)
        for a in t.plan.of(Yield):
            if restarts.is_restart(queries.job(session, a.job)):
                t.actions += _restart_yield(ops, a)
            else:
                pending.append(_start_yield(ops, a, t))
    outcomes = _watch_exits(svc.config, svc.pool, [x for p in pending for x in p.leavers])
    with database_lock(svc.config.database_url, "ops").held():   # one lock, several commits
        with svc.sessions.begin() as session:
            ops = svc.ops(session)
            for p in pending:
                t.actions += _record(ops, p, outcomes)
            t.actions += _place(ops)
            late = time.time() - t.started_at > budget_s(svc.config)
            grows = [] if late else current_plan(ops, errors).of(Grow)
        if late:
            t.actions.append({"action": "grow", "ok": None, "skipped": "the tick ran out of time; "
                              "growth is left to the next tick"})
        t.actions += _grow(svc, grows)
    return _done(t)


def dated(results: dict[str, Result[HostProbe]], when: float) -> dict[str, Result[HostProbe]]:
    """The probes as seen at `when` (the tick's start): a foreign process they find is
    the owner's from that moment."""
    return {name: dataclasses.replace(r, value=dataclasses.replace(r.value, time=when)) if r.ok else r
            for name, r in results.items()}


def _done(t: TickResult) -> TickResult:
    t.duration_s = time.time() - t.started_at
    return t


# ---- yielding --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Leaver:
    job: int
    wid: int
    host: str
    gpus: tuple[int, ...]
    pgid: int | None
    exit_path: str
    kill_at: float
    give_up_at: float


@dataclasses.dataclass(frozen=True)
class _Exit:
    gone_at: float | None         # None: still alive when we gave up
    returncode: int | None
    killed: bool
    killed_at: float | None = None  # when the SIGKILL was sent


@dataclasses.dataclass
class _Reclaim:
    action: Yield | Requeue
    leavers: list[_Leaver]
    method: str                   # shrink | requeue


def _leavers(config: Config, job: Job, a: Yield | Requeue, kill_at: float | None = None) -> list[_Leaver]:
    d = config.harvest.reclaim_deadline_s
    kill_at = a.since + SHRINK_SHARE * d if kill_at is None else kill_at
    return [_Leaver(job.id, w.wid, w.host, tuple(w.gpus), w.pgid, w.exit_path, kill_at,
                    a.since + d + KILL_MARGIN_S)
            for w in job.live_workers if w.wid in a.wids]


def _start_yield(ops: Ops, a: Yield, t: TickResult) -> _Reclaim:
    """Ask the job to retire the workers on the owner's GPUs (in place)."""
    job = queries.job(ops.session, a.job)
    leavers = _leavers(ops.config, job, a)
    retire = [w.wid for w in job.live_workers if w.wid in a.wids and w.state is not WorkerState.LEAVING]
    if retire:
        try:
            wait = max(0.5, leavers[0].kill_at - time.time()) if leavers else 0.5
            scaling.retire(ops, job, retire, why=a.reason, wait_s=wait)
        except GpuflexError as e:
            # the coordinator cannot take the shrink: the deadline still holds, kill now
            journal.record(ops.session, job, "reclaim-escalated", f"in-place shrink refused ({e}); "
                           f"killing the worker(s) on the owner's GPUs", wids=list(a.wids))
            leavers = _leavers(ops.config, job, a, kill_at=time.time())
            t.actions.append({"action": "retire", "job": job.id, "wids": list(a.wids), "ok": False,
                              "error": str(e)})
    return _Reclaim(a, leavers, "shrink")


def _requeue(ops: Ops, a: Requeue) -> list[dict[str, Any]]:
    """Stop the job gracefully (SIGTERM: the workers checkpoint at their step boundary),
    kill its workers on the owner's GPUs if that takes past the shrink window, and queue
    it. Runs under the lock, so no other command sees the job half stopped."""
    job = queries.job(ops.session, a.job)
    _sigterm(ops, job)
    p = _Reclaim(a, _leavers(ops.config, job, a), "requeue")
    done = _record(ops, p, _watch_exits(ops.config, ops.pool, p.leavers))
    try:
        executor.requeue(ops, job, a.reason)   # stops the others (grace, then SIGKILL)
    except GpuflexError as e:
        journal.record(ops.session, job, "requeue-failed", str(e))
    return done + [{"action": "requeue", "job": job.id, "ok": job.state is JobState.QUEUED,
                    "reason": a.reason}]


def _restart_yield(ops: Ops, a: Yield) -> list[dict[str, Any]]:
    """A restart job gives the owner's GPUs back by a restart without them: SIGTERM to
    every worker, each killed if still alive at cancel_grace_s after it or at the shrink
    window, whichever comes first (the whole gang must be gone before it starts again,
    and the owner's GPUs within the deadline), then the gang relaunched on the rest."""
    job = queries.job(ops.session, a.job)
    keep, old = restarts.without(job, a.wids), len(job.members)
    sigterm_at = _sigterm(ops, job)
    kill_at = min(sigterm_at + ops.config.jobs.cancel_grace_s,
                  a.since + SHRINK_SHARE * ops.config.harvest.reclaim_deadline_s)
    everyone = dataclasses.replace(a, wids=tuple(w.wid for w in job.live_workers))
    p = _Reclaim(a, _leavers(ops.config, job, everyone, kill_at=kill_at), "restart")
    done = _record(ops, p, _watch_exits(ops.config, ops.pool, p.leavers))
    try:
        ok = restarts.restart(ops, job, keep, f"reclaim: {a.reason}", grace_s=0, sigterm_at=sigterm_at,
                              old=old)
    except GpuflexError as e:
        journal.record(ops.session, job, "restart-failed", str(e))
        ok = False
    return done + [{"action": "restart", "job": job.id, "ok": ok, "workers": len(keep), "reason": a.reason}]


def _sigterm(ops: Ops, job: Job) -> float:
    """SIGTERM every live worker of the job (all hosts); when it was sent."""
    sent = time.time()
    by_host: dict[str, list[int]] = collections.defaultdict(list)
    for w in job.live_workers:
        if w.pgid:
            by_host[w.host].append(w.pgid)
    for host, pgids in by_host.items():
        try:
            ops.pool.transport(host).signal(pgids, signal.SIGTERM)
        except GpuflexError as e:
            log.debug("job %s: SIGTERM on %s failed (the watch kills or records it): %s", job.id, host, e)
    return sent


def _watch_exits(config: Config, pool: Pool, leavers: list[_Leaver]) -> dict[tuple[int, int], _Exit]:
    """Wait (all hosts at once) until each leaver's process group is gone; SIGKILL the ones
    still alive at their `kill_at`; give up at their `give_up_at`."""
    by_host: dict[str, list[_Leaver]] = collections.defaultdict(list)
    for x in leavers:
        by_host[x.host].append(x)
    if not by_host:
        return {}
    cfgs = [config.host(h) for h in by_host]

    def watch(t) -> dict[tuple[int, int], _Exit]:
        pending, out, killed = list(by_host[t.host.name]), {}, {}
        while pending:
            try:
                states = t.status([(x.pgid, x.exit_path) for x in pending])
            except GpuflexError as e:
                log.debug("%s: status of leavers failed (asked again): %s", t.host.name, e)
                states = None
            now = time.time()
            for x, st in zip(pending, states or []):
                if not st.alive:
                    k = killed.get((x.job, x.wid))
                    out[(x.job, x.wid)] = _Exit(now, st.returncode, k is not None, k)
            pending = [x for x in pending if (x.job, x.wid) not in out]
            due = [x for x in pending if now >= x.kill_at and (x.job, x.wid) not in killed]
            if due:
                try:
                    t.signal([x.pgid for x in due], signal.SIGKILL)
                except GpuflexError as e:
                    log.debug("%s: SIGKILL of leavers failed: %s", t.host.name, e)
                killed.update({(x.job, x.wid): now for x in due})
                continue
            if not pending or now >= max(x.give_up_at for x in pending):
                break
            time.sleep(POLL_S)
        for x in pending:
            k = killed.get((x.job, x.wid))
            out[(x.job, x.wid)] = _Exit(None, None, k is not None, k)
        return out

    limit = max(x.give_up_at for x in leavers) - time.time() + 10
    outcomes: dict[tuple[int, int], _Exit] = {}
    for name, r in pool.fan_out(cfgs, watch, max(limit, 1)).items():
        if r.ok:
            outcomes.update(r.value)
        else:
            outcomes.update({(x.job, x.wid): _Exit(None, None, False) for x in by_host[name]})
    return outcomes


def _record(ops: Ops, p: _Reclaim, outcomes: dict[tuple[int, int], _Exit]) -> list[dict[str, Any]]:
    """End the leavers in the DB (at the moment they were seen gone) and write one
    "reclaim" event per reclaimed GPU."""
    job = queries.job(ops.session, p.action.job)
    workers = {w.wid: w for w in job.workers}
    for x in p.leavers:
        o, w = outcomes.get((x.job, x.wid)), workers[x.wid]
        if o is None or o.gone_at is None or w.state.final:
            continue
        if o.killed and o.returncode is None:
            state = WorkerState.STOPPED
        else:
            state = {0: WorkerState.EXITED, None: WorkerState.LOST}.get(o.returncode, WorkerState.FAILED)
        journal.end_worker(ops.session, job, w, state, o.returncode)
        w.ended_at = o.gone_at
    deadline = ops.config.harvest.reclaim_deadline_s
    out = []
    for host, gpu in p.action.gpus:
        mine = [outcomes.get((x.job, x.wid), _Exit(None, None, False)) for x in p.leavers
                if x.host == host and gpu in x.gpus]
        ok = all(o.gone_at is not None for o in mine)
        latency = round(max((o.gone_at for o in mine), default=time.time()) - p.action.since, 3) if ok else None
        method = "sigkill" if any(o.killed for o in mine) else p.method
        if not ok:
            method = "failed"
        killed_at = min((o.killed_at for o in mine if o.killed_at is not None), default=None)
        data = {"host": host, "gpu": gpu, "latency_s": latency, "deadline_s": deadline, "method": method,
                "clock_from": p.action.since, "killed_at": killed_at,
                "wids": [x.wid for x in p.leavers if x.host == host and gpu in x.gpus],
                "within_deadline": ok and latency <= deadline}
        took = f"in {latency:.2f} s" if ok else "FAILED: a worker is still alive"
        journal.record(ops.session, job, "reclaim", f"{host}:{gpu} given back to its owner {took} "
                                                    f"({method}; deadline {deadline:g} s)", **data)
        out.append({"action": "reclaim", "job": job.id, "ok": ok, **data})
    return out


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
