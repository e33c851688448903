"""A job's life on the control side: placing queued jobs, and reconciling running ones.

Reconciling is read, decide, write: gpuflex.control.observe reads what the hosts and the
coordinator say, gpuflex.policy.lifecycle decides (pure), gpuflex.control.executor writes
the decision and acts on it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpuflex.control import executor, journal
from gpuflex.control import launch as L
from gpuflex.control.executor import Ops
from gpuflex.control.observe import facts, observe
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.errors import TransportError
from gpuflex.hosts import hostops
from gpuflex.policy.lifecycle import decide
from gpuflex.policy.placement import place
from gpuflex.states import JobState

log = logging.getLogger(__name__)

LAUNCH_RETRY_S = 30   # wait this long before launching a job again after a host failed it
SWEEP_MIN_AGE_S = 600  # a socket directory changed more recently than this may be a run starting


def reconcile(ops: Ops, job: Job) -> dict[str, Any] | None:
    """Bring one running job's record in line with its processes and coordinator; returns
    the coordinator's status (None when it did not answer)."""
    seen = observe(ops.config, ops.pool, job)
    executor.apply(ops, job, decide(facts(job), seen))
    return seen.coordinator


def sweep_socket_dirs(ops: Ops, active: list[Job]) -> None:
    """Remove this machine's stale control-socket directories of ours (see
    gpuflex.hosts.hostops.sweep_socket_dirs), never one of `active`'s runs; only where
    this machine is one of the pool's hosts."""
    if not any(h.is_local for h in ops.config.hosts):
        return
    keep = [j.socket_dir for j in active if j.socket_dir]
    for path in hostops.sweep_socket_dirs(L.SOCKET_ROOT, L.SOCKET_PREFIX, keep, SWEEP_MIN_AGE_S):
        log.debug("removed the stale socket directory %s", path)


def place_queued(ops: Ops) -> None:
    """Start queued jobs that fit, by priority then age; record why the others wait."""
    for job in queries.queued_jobs(ops.session):
        failed = queries.last_event_of(ops.session, job.id, ["launch-failed"])   # one row, not the history
        if failed is not None and time.time() - (failed.last_time or failed.time) < LAUNCH_RETRY_S:
            continue   # a host failed us a moment ago: do not hammer it on every command
        want_max = job.target_workers or job.max_workers
        p = place(ops.pool.free(ops.session), job.min_workers, max(want_max, job.min_workers),
                  job.gpus_per_worker)
        if not p.ok:
            if job.queue_reason != p.reason:
                job.queue_reason = p.reason
                journal.record(ops.session, job, "queued", p.reason)
            continue
        try:
            executor.start_job(ops, job, list(p.assignments))
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
