"""Resizing a restart-elastic job (`--elastic restart`): stop the whole gang, start it again
at the new size.

A restart job's script saves and resumes its own checkpoints (torchrun's model): it cannot
change its world size while it runs, so every resize of it -- `gpuflex scale`, a harvest
grow, an owner's reclaim -- is a restart: SIGTERM to every worker (the script checkpoints
on it), `cancel_grace_s` (a reclaim: no longer than its deadline allows), SIGKILL for what
is left, then the whole gang launched again at the new size with a fresh coordinator,
store port and socket directory, as any run starts (executor.launch_run), with
`job.restarts` one higher (the workers see it as GPUFLEX_RESTART_COUNT and
TORCHELASTIC_RESTART_COUNT).

The stop is a requeue (executor.requeue: the job QUEUED, its target the new size) and the
launch a placement on the chosen devices. `restart_in_steps` commits each on its own
under the ops lock the caller holds: a command killed between them leaves a queued job
that the next command places at the new size, never a running job without processes. A
launch that fails leaves the job queued the same way.

Each restart is an event "restart": old and new size, cause, and `down_s`, the time from
the SIGTERM to the last worker of the new gang spawned. The script's own start-up and
checkpoint load come on top (benchmarks/restart_vs_inplace.py measures the whole stall
from the steps).

A fixed gang (elastic NULL) is never resized: `gpuflex scale` refuses it (GANG_REFUSAL),
harvest neither grows it nor shrinks it (gpuflex.policy.harvest requeues it instead).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, ContextManager

from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control import executor, journal
from gpuflex.control.executor import Ops
from gpuflex.control.pool import Pool
from gpuflex.db import queries
from gpuflex.db.models import Job, Worker
from gpuflex.errors import JobError, TransportError, UsageError
from gpuflex.policy.placement import Assignment

log = logging.getLogger(__name__)

RESTART_KIND = "restart"     # the event of each restart of a resize
RESTART = "restart"          # jobs.elastic of a restart-elastic job
GANG_REFUSAL = "a fixed gang cannot be resized; submit with --elastic restart or inplace and --workers MIN:MAX."

Transactions = Callable[[], ContextManager[Session]]


def is_restart(job: Job) -> bool:
    return job.elastic == RESTART


def is_fixed_gang(job: Job) -> bool:
    """A gang of fixed size (elastic NULL), never resized; not gpuflex.control.launch.is_gang,
    which is every job launched as a whole (a restart job too)."""
    return job.elastic is None


def refuse_fixed_gang(job: Job) -> None:
    """UsageError for a resize of a fixed gang (one line, nothing changed)."""
    if is_fixed_gang(job):
        raise UsageError(f"job {job.id} runs {job.max_workers} worker(s) as a gang: {GANG_REFUSAL}")


# ---- the new gang ---------------------------------------------------------------------
def in_rank_order(job: Job) -> list[Worker]:
    """The job's members, rank 0 first (a worker without a rank after those with one)."""
    return sorted(job.members, key=lambda w: (w.rank is None, w.rank or 0, w.wid))


def assignments_of(workers: list[Worker]) -> list[Assignment]:
    return [Assignment(w.host, tuple(w.gpus)) for w in workers]


def without(job: Job, wids: list[int] | tuple[int, ...]) -> list[Assignment]:
    """The gang's devices, less those of `wids` (a shrink, a reclaim), in rank order."""
    return assignments_of([w for w in in_rank_order(job) if w.wid not in set(wids)])


def with_more(job: Job, added: list[Assignment]) -> list[Assignment]:
    """The gang's devices and `added` after them (a grow): rank 0 stays where it was."""
    return assignments_of(in_rank_order(job)) + list(added)


# ---- stop, then launch ------------------------------------------------------------------
def stop(ops: Ops, job: Job, size: int, cause: str, grace_s: float | None = None,
         old: int | None = None) -> float:
    """Stop every worker (SIGTERM, `grace_s` or cancel_grace_s, SIGKILL) and the coordinator,
    and queue the job at `size` workers (executor.requeue: job.restarts + 1). Returns when
    the SIGTERM went out."""
    old = len(job.members) if old is None else old
    sigterm_at = time.time()
    job.target_workers = size
    executor.requeue(ops, job, f"restarting at {size} worker(s) (was {old}): {cause}", cause, grace_s)
    job.queue_reason = f"restarting at {size} worker(s): {cause}"
    return sigterm_at


def launch_gang(ops: Ops, job: Job, assignments: list[Assignment], old: int, cause: str,
                sigterm_at: float) -> bool:
    """Start the queued job's new gang on `assignments` and record the restart; False (the
    job stays queued, placed by a later command) when a host fails the launch."""
    try:
        executor.start_job(ops, job, assignments)
    except TransportError as e:
        log.debug("job %s: the restart's launch failed: %s", job.id, e)
        executor.stop_processes(ops, job)
        job.queue_reason = f"restart at {len(assignments)} worker(s) failed to launch (retried later): {e}"
        journal.record(ops.session, job, "launch-failed", str(e))
        return False
    down = time.time() - sigterm_at
    journal.record(ops.session, job, RESTART_KIND,
                   f"restarted at {len(assignments)} worker(s) (was {old}): {cause}; down {down:.2f} s "
                   f"(SIGTERM sent -> new gang spawned)",
                   old_size=old, new_size=len(assignments), cause=cause, down_s=round(down, 3),
                   sigterm_at=sigterm_at, restarts=job.restarts)
    return True


def restart(ops: Ops, job: Job, assignments: list[Assignment], cause: str, grace_s: float | None = None,
            sigterm_at: float | None = None, old: int | None = None) -> bool:
    """Stop and relaunch the gang on `assignments`, in the caller's transaction. When the
    caller sent the SIGTERM itself (a reclaim): `sigterm_at` (the down time's start) and
    `old`, the size the gang had."""
    if not assignments:
        raise JobError(f"job {job.id}: a restart needs at least one worker.")
    old = len(job.members) if old is None else old
    sent = stop(ops, job, len(assignments), cause, grace_s, old)
    return launch_gang(ops, job, assignments, old, cause, sent if sigterm_at is None else sigterm_at)


def restart_in_steps(tx: Transactions, config: Config, pool: Pool, job_id: int,
                     assignments: list[Assignment], cause: str) -> bool:
    """`restart` with the stop and the launch committed one by one (see the module
    docstring); the caller holds the ops lock over the call."""
    with tx() as session:
        job = queries.job(session, job_id)
        old = len(job.members)
        sigterm_at = stop(Ops(config, pool, session), job, len(assignments), cause)
    with tx() as session:
        return launch_gang(Ops(config, pool, session), queries.job(session, job_id), assignments, old, cause,
                           sigterm_at)
