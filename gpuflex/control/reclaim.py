"""Giving GPUs back to their owner (a harvest tick's steps 3-5, gpuflex.control.harvest):
an in-place shrink that retires the workers on the owner's GPUs, a requeue of a job that
cannot shrink above its MIN, a restart without them of a restart job; then the wait for
the leavers to exit (SIGKILL at SHRINK_SHARE x reclaim_deadline_s after the tick that saw
the owner) and one "reclaim" event per GPU given back, with its latency and method.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import signal
import time
from typing import Any

from gpuflex.config import Config
from gpuflex.control import executor, journal, restarts, scaling
from gpuflex.control.executor import Ops
from gpuflex.control.pool import Pool
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.errors import GpuflexError
from gpuflex.policy.harvest_actions import Requeue, Yield
from gpuflex.states import JobState, WorkerState

log = logging.getLogger(__name__)

SHRINK_SHARE = 0.6     # of the deadline: the in-place shrink's window before SIGKILL
KILL_MARGIN_S = 10     # after the deadline: how long a kill is still watched (to record it)
POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Leaver:
    job: int
    wid: int
    host: str
    gpus: tuple[int, ...]
    pgid: int | None
    exit_path: str
    kill_at: float
    give_up_at: float


@dataclasses.dataclass(frozen=True)
class Exit:
    gone_at: float | None         # None: still alive when we gave up
    returncode: int | None
    killed: bool
    killed_at: float | None = None  # when the SIGKILL was sent


@dataclasses.dataclass
class Reclaim:
    action: Yield | Requeue
    leavers: list[Leaver]
    method: str                   # shrink | requeue


def _leavers(config: Config, job: Job, a: Yield | Requeue, kill_at: float | None = None) -> list[Leaver]:
    d = config.harvest.reclaim_deadline_s
    kill_at = a.since + SHRINK_SHARE * d if kill_at is None else kill_at
    return [Leaver(job.id, w.wid, w.host, tuple(w.gpus), w.pgid, w.exit_path, kill_at,
                    a.since + d + KILL_MARGIN_S)
            for w in job.live_workers if w.wid in a.wids]


def start_yield(ops: Ops, a: Yield, actions: list[dict[str, Any]]) -> Reclaim:
    """Ask the job to retire the workers on the owner's GPUs (in place); a refused shrink
    is appended to `actions` and its workers are to be killed at once."""
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
            actions.append({"action": "retire", "job": job.id, "wids": list(a.wids), "ok": False,
                              "error": str(e)})
    return Reclaim(a, leavers, "shrink")


def requeue(ops: Ops, a: Requeue) -> list[dict[str, Any]]:
    """Stop the job gracefully (SIGTERM: the workers checkpoint at their step boundary),
    kill its workers on the owner's GPUs if that takes past the shrink window, and queue
    it. Runs under the lock, so no other command sees the job half stopped."""
    job = queries.job(ops.session, a.job)
    _sigterm(ops, job)
    p = Reclaim(a, _leavers(ops.config, job, a), "requeue")
    done = record(ops, p, watch_exits(ops.config, ops.pool, p.leavers))
    try:
        executor.requeue(ops, job, a.reason)   # stops the others (grace, then SIGKILL)
    except GpuflexError as e:
        journal.record(ops.session, job, "requeue-failed", str(e))
    return done + [{"action": "requeue", "job": job.id, "ok": job.state is JobState.QUEUED,
                    "reason": a.reason}]


def restart_yield(ops: Ops, a: Yield) -> list[dict[str, Any]]:
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
    p = Reclaim(a, _leavers(ops.config, job, everyone, kill_at=kill_at), "restart")
    done = record(ops, p, watch_exits(ops.config, ops.pool, p.leavers))
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


def watch_exits(config: Config, pool: Pool, leavers: list[Leaver]) -> dict[tuple[int, int], Exit]:
    """Wait (all hosts at once) until each leaver's process group is gone; SIGKILL the ones
    still alive at their `kill_at`; give up at their `give_up_at`."""
    by_host: dict[str, list[Leaver]] = collections.defaultdict(list)
    for x in leavers:
        by_host[x.host].append(x)
    if not by_host:
        return {}
    cfgs = [config.host(h) for h in by_host]

    def watch(t) -> dict[tuple[int, int], Exit]:
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
                    out[(x.job, x.wid)] = Exit(now, st.returncode, k is not None, k)
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
            out[(x.job, x.wid)] = Exit(None, None, k is not None, k)
        return out

    limit = max(x.give_up_at for x in leavers) - time.time() + 10
    outcomes: dict[tuple[int, int], Exit] = {}
    for name, r in pool.fan_out(cfgs, watch, max(limit, 1)).items():
        if r.ok:
            outcomes.update(r.value)
        else:
            outcomes.update({(x.job, x.wid): Exit(None, None, False) for x in by_host[name]})
    return outcomes


def record(ops: Ops, p: Reclaim, outcomes: dict[tuple[int, int], Exit]) -> list[dict[str, Any]]:
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
        mine = [outcomes.get((x.job, x.wid), Exit(None, None, False)) for x in p.leavers
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
