"""Reading reality: what the hosts say about a job's processes and what its coordinator says.

Nothing here writes to the database; `observe` gathers the inputs of the lifecycle policy
(gpuflex.policy.lifecycle) for one job.
"""

from __future__ import annotations

import collections
import logging
import posixpath
import time
from typing import Any

from gpuflex.config import Config
from gpuflex.control import launch as L
from gpuflex.control.pool import Pool
from gpuflex.db.models import Job, Worker
from gpuflex.errors import JobError, TransportError
from gpuflex.policy.lifecycle import (CHECKPOINT_FAILED_KIND, FORGED_KIND, HISTORY_KINDS, JobFacts, Observation,
                                      ProcSeen, WorkerFacts)

log = logging.getLogger(__name__)


def coordinator_request(config: Config, pool: Pool, job: Job, message: dict[str, Any],
                        wait_s: float = 0.0) -> dict[str, Any]:
    """One request to the job's coordinator; retried for up to `wait_s` while it starts.
    Raises TransportError (no answer) or JobError (it refused)."""
    t = pool.transport(job.store_host)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = t.control_request(L.coordinator_socket(job), message)
            break
        except TransportError:
            if time.monotonic() >= deadline or not coordinator_alive(config, pool, job):
                raise
            time.sleep(0.2)
    if not reply.get("ok"):
        raise JobError(f"job {job.id}: coordinator refused {message.get('op')}: {reply.get('error')}")
    return reply


def coordinator_alive(config: Config, pool: Pool, job: Job) -> bool:
    """Whether the coordinator's process group still runs (False when that cannot be told)."""
    if job.store_pgid is None:
        return False
    try:
        host = config.host(job.store_host)
        d = L.job_dir(host, job)
        st = pool.transport(host).status([(job.store_pgid, posixpath.join(d, "coordinator.exit"))])
        return st[0].alive
    except TransportError as e:
        log.debug("job %s: cannot ask whether the coordinator runs: %s", job.id, e)
        return False


def coordinator_status(config: Config, pool: Pool, job: Job) -> dict[str, Any] | None:
    """The coordinator's status reply (generation, members, history, settled, progress), or
    None when it does not answer."""
    try:
        return coordinator_request(config, pool, job, {"op": "status"})
    except (TransportError, JobError, ValueError) as e:
        log.debug("job %s: no status from the coordinator: %s", job.id, e)
        return None


def observe(config: Config, pool: Pool, job: Job) -> Observation:
    """Every live worker's process group (all hosts at once), then the coordinator."""
    by_host: dict[str, list[Worker]] = collections.defaultdict(list)
    for w in job.live_workers:
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
    coord = coordinator_status(config, pool, job)
    alive = True if coord is not None else coordinator_alive(config, pool, job)
    return Observation(procs, unreachable, coord, alive)


def facts(job: Job) -> JobFacts:
    """The policy's view of a job's record."""
    run_events = [e for e in job.events if e.time >= (job.started_at or 0)]
    failed_checkpoints: dict[int, int] = {}
    for e in run_events:
        if e.kind == CHECKPOINT_FAILED_KIND and isinstance(e.data.get("wid"), int):
            wid = e.data["wid"]
            failed_checkpoints[wid] = max(failed_checkpoints.get(wid, 0), e.data.get("count") or 0)
    return JobFacts(
        id=job.id, state=job.state, min_workers=job.min_workers,
        workers=tuple(WorkerFacts(w.wid, w.host, w.state, w.generation, w.started_at, w.exit_code)
                      for w in job.workers),
        generation=job.generation, world_size=job.world_size, started_at=job.started_at,
        recorded=frozenset(e.data.get("generation") for e in job.events if e.kind in HISTORY_KINDS),
        forged_recorded=max((e.data.get("count") or 0 for e in run_events if e.kind == FORGED_KIND), default=0),
        checkpoint_failures_recorded=failed_checkpoints)
