"""Reading reality: what the hosts say about a job's processes and what its coordinator says.

Nothing here writes, to the database or to the coordinator (its requests that change
something are the executor's: gpuflex.control.coordinator_link); `observe` gathers the inputs of the lifecycle policy
(gpuflex.policy.lifecycle) for one job.
"""

from __future__ import annotations

import collections
import json
import logging
import posixpath
from typing import Any

from sqlalchemy.orm import object_session

from gpuflex.config import Config
from gpuflex.control import launch as L
from gpuflex.control.coordinator_link import coordinator_process, request
from gpuflex.control.pool import Pool
from gpuflex.db import queries
from gpuflex.db.models import Job, Worker
from gpuflex.elastic.protocol import run_dir
from gpuflex.elastic.protocol.wire import CoordinatorStatus, parse_status, status_request
from gpuflex.errors import JobError, TransportError
from gpuflex.policy import split as split_policy
from gpuflex.policy.lifecycle import (CHECKPOINT_FAILED_KIND, CRASH_DEFERRED_KIND, FAULT_RELAUNCHES, FORGED_KIND,
                                      FORMED_KIND, HISTORY_KINDS, LEFT_OUT_KIND, RETRY_CAUSES, STOP_CAUSE, STUCK_RUNS,
                                      WAITING_KIND, JobFacts, Observation, ProcSeen, WorkerFacts, is_crash_exit)
from gpuflex.states import WorkerState

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 10          # of a crashed worker's log, when it left no crashed record
LOG_TAIL_BYTES = 8192
LAST_STATUS_BYTES = 1 << 20   # a status reply holds at most HISTORY_KEPT generations
ABORT_RECORD_BYTES = 8192


def coordinator_status(config: Config, pool: Pool, job: Job) -> CoordinatorStatus | None:
    """The coordinator's status reply (generation, members, history, settled, progress),
    parsed (gpuflex.elastic.protocol.wire); None when it does not answer, or answers with a
    reply of the wrong shape (a WireError, logged like no answer)."""
    try:
        return parse_status(request(config, pool, job, status_request()))
    except (TransportError, JobError, ValueError) as e:
        log.debug("job %s: no status from the coordinator: %s", job.id, e)
        return None


def observe(config: Config, pool: Pool, job: Job) -> Observation:
    """Every live worker's process group (all hosts at once), then the coordinator, then
    the tail of the log of each worker that ended with a crash's exit code and left no
    crashed record (sys.exit(3), a C-level abort: its log is all there is)."""
    procs, unreachable = groups(config, pool, job.live_workers)
    coord = coordinator_status(config, pool, job)
    alive, coord_exit = (True, None) if coord is not None else coordinator_process(config, pool, job)
    abort_left = recorded_abort(pool, job) if coord is None else None   # it ended itself after ending the job
    last_status = recorded_status(pool, job) if coord is None and not alive else None
    recorded = {r.get("wid") for r in (coord.crashed if coord is not None else ())}
    crashed = [w for w in job.live_workers if w.wid in procs and not procs[w.wid].alive
               and procs[w.wid].exited and is_crash_exit(procs[w.wid].returncode) and w.wid not in recorded]
    tails = {w.wid: log_tail(pool, w) for w in crashed}
    return Observation(procs, unreachable, coord, alive, coord_exit,
                       log_tails={k: v for k, v in tails.items() if v}, recorded_abort=abort_left,
                       recorded_status=last_status)


def groups(config: Config, pool: Pool, workers: list[Worker]) -> tuple[dict[int, ProcSeen], dict[str, str]]:
    """These workers' process groups (all hosts at once, each bounded by its timeouts): wid
    -> what its host saw, and host -> error for the hosts that did not answer."""
    by_host: dict[str, list[Worker]] = collections.defaultdict(list)
    for w in workers:
        by_host[w.host].append(w)
    hosts = [config.host(h) for h in by_host]
    limit = max((h.connect_timeout_s + h.command_timeout_s for h in hosts), default=0) + 5
    results = pool.fan_out(hosts, lambda t: t.status(
        [(w.pgid, w.exit_path) for w in by_host[t.host.name]]), limit)
    procs: dict[int, ProcSeen] = {}
    unreachable: dict[str, str] = {}
    for host, res in results.items():
        if not res.ok:
            unreachable[host] = str(res.error)
            continue
        for w, st in zip(by_host[host], res.value):
            procs[w.wid] = ProcSeen(st.alive, st.returncode, (st.exit or {}).get("ended_at"),
                                    exited=st.exit is not None)
    return procs, unreachable


def run_record(pool: Pool, job: Job, name: str, limit: int) -> str | None:
    """The text of the file `name` the coordinator left in the run's directory on its host
    (gpuflex.elastic.protocol.run_dir), at most `limit` bytes; None when there is none or it
    cannot be read."""
    if job.socket_dir is None or job.store_host is None:
        return None
    try:
        got = pool.transport(job.store_host).read(posixpath.join(job.socket_dir, name), 0, limit)
    except (TransportError, ValueError, OSError, KeyError) as e:
        log.debug("job %s: cannot read %s from the run's directory: %s", job.id, name, e)
        return None
    return None if got.get("missing") else got.get("data") or ""


def recorded_status(pool: Pool, job: Job) -> CoordinatorStatus | None:
    """The last status reply the coordinator left in the run's directory as it ended itself
    (run_dir.LAST_STATUS), parsed as a live reply is; None when there is none, or it cannot
    be read or parsed."""
    text = run_record(pool, job, run_dir.LAST_STATUS, LAST_STATUS_BYTES)
    if text is None:
        return None
    try:
        return parse_status(json.loads(text))
    except ValueError as e:   # not JSON, or a WireError (a ValueError): the wrong shape
        log.debug("job %s: the coordinator's last status does not parse: %s", job.id, e)
        return None


def recorded_abort(pool: Pool, job: Job) -> dict[str, Any] | None:
    """The abort record the coordinator left in the run's directory on its host when it ended
    the job (gpuflex.elastic.protocol.run_dir), parsed; None when there is none or it cannot be read."""
    text = run_record(pool, job, run_dir.ABORT_RECORD, ABORT_RECORD_BYTES)
    return None if text is None else run_dir.parse_abort(text)


def log_tail(pool: Pool, w: Worker, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    """The last `lines` lines of a worker's log, read through its host's transport as
    `gpuflex logs` reads it; () when it cannot be read."""
    try:
        t = pool.transport(w.host)
        size = t.read(w.log_path, 0, 0).get("size") or 0   # a seek far past the end is EINVAL on ext4
        text = t.read(w.log_path, max(0, size - LOG_TAIL_BYTES), LOG_TAIL_BYTES).get("data") or ""
    except (TransportError, ValueError, OSError) as e:
        log.debug("worker %s: cannot read the tail of its log: %s", w.wid, e)
        return ()
    return tuple(text.splitlines()[-lines:])


def facts(job: Job) -> JobFacts:
    """The policy's view of a job's record. Bounded reads, whatever the job's history
    holds: the newest event of a kind or an aggregate, never every event."""
    session = object_session(job)
    since = job.started_at or 0.0
    newest_history = queries.last_event_of(session, job.id, HISTORY_KINDS, since)
    forged = queries.last_event_of(session, job.id, [FORGED_KIND], since)
    waiting = queries.last_event_of(session, job.id, [WAITING_KIND], since)
    left_out = queries.last_event_of(session, job.id, [LEFT_OUT_KIND], since)
    deferred = queries.last_event_of(session, job.id, [CRASH_DEFERRED_KIND], since)
    restarts = queries.events_by_cause(session, job.id, "state", [*RETRY_CAUSES, STOP_CAUSE])
    run_starts = queries.recent_events(session, job.id, [FORMED_KIND], STUCK_RUNS) if job.restarts else []
    causes = queries.recent_causes(session, job.id, "state", max(STUCK_RUNS - 1, FAULT_RELAUNCHES)) \
        if job.restarts else []
    return JobFacts(
        id=job.id, state=job.state, min_workers=job.min_workers,
        workers=tuple(WorkerFacts(w.wid, w.host, w.state, w.generation, w.started_at, w.exit_code, w.ended_at,
                                  w.pgid, w.retired_at is not None) for w in job.workers),
        generation=job.generation, world_size=job.world_size, started_at=job.started_at,
        recorded=frozenset(_ints([(newest_history.data if newest_history else {}).get("generation")])),
        forged_recorded=_ints([(forged.data if forged else {}).get("count")], default=0)[0],
        checkpoint_failures_recorded=queries.max_count_by_wid(session, job.id, CHECKPOINT_FAILED_KIND, since),
        retries=job.retries or 0, restarts=job.restarts or 0,
        crash_restarts=sum(restarts[c] for c in RETRY_CAUSES), stop_restarts=restarts[STOP_CAUSE],
        elastic=job.elastic,
        left_out_recorded=_ints([(left_out.data if left_out else {}).get("n")], default=0)[0],
        store_host=job.store_host, deadline=L.run_deadline(job), resize_asked_at=resize_asked_at(job),
        run_start_steps=tuple(_start_step(e.data) for e in run_starts), restart_causes=tuple(causes),
        crash_deferred_at=deferred.time if deferred is not None else None,
        waiting=frozenset((e["wid"], tuple(e["for"]), e.get("phase") or "")
                          for e in ((waiting.data if waiting else {}).get("waiting") or ())))


def _start_step(data: Any) -> int | None:
    """The step a "formed" event's generation started at (its timings name it)."""
    timings = data.get("timings") if isinstance(data, dict) else None
    step = timings.get("step") if isinstance(timings, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def resize_asked_at(job: Job) -> float | None:
    """When the job's newest resize (or state change) was asked: one row read, only while a
    LEAVING worker lives (gpuflex.policy.reconcile.strays asks it of no other); None otherwise."""
    if not any(w.state is WorkerState.LEAVING for w in job.live_workers):
        return None
    asked = queries.last_event_of(object_session(job), job.id, ["scale-request", "state"])
    return None if asked is None else (asked.last_time or asked.time)


def last_replan(job: Job) -> tuple[int | None, float | None]:
    """The seq and time (the runtime's) of the newest re-plan recorded for the job (one
    row, whatever its history holds): where gpuflex.policy.split.new_replans starts."""
    last = queries.last_event_of(object_session(job), job.id, [split_policy.REPLAN_KIND])
    data = last.data if last is not None and isinstance(last.data, dict) else {}
    return split_policy.count(data.get("seq")), split_policy.number(data.get("time"))


def _ints(values: list, default: int | None = None) -> list[int]:
    out = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return out or ([] if default is None else [default])
