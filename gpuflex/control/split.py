"""The control side of an in-place job's split of its global batch (issue 12): after each
look at a running job, its runtime's new re-plans become events, and a straggler is
released. What is new and who is a straggler is decided in gpuflex.policy.split (pure);
this module writes and acts.

A straggler is released as a reclaim releases a worker (gpuflex.control.scaling.retire:
asked to leave at its next step boundary, the others re-planned without it), so its GPU
is free for other jobs once it exits. Only a RUNNING job (no resize under way) whose
coordinator answered settled is asked; if the coordinator refuses anyway, the worker is
killed, as a reclaim escalates, and the job recovers without it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpuflex.control import executor, journal, scaling
from gpuflex.control.executor import Ops
from gpuflex.control.observe import last_replan
from gpuflex.db.models import Job
from gpuflex.elastic.protocol.wire import CoordinatorStatus
from gpuflex.errors import GpuflexError
from gpuflex.jobspec import INPLACE
from gpuflex.policy import split as P
from gpuflex.states import JobState

log = logging.getLogger(__name__)


def follow(ops: Ops, job: Job, status: CoordinatorStatus | None, now: float | None = None) -> None:
    """After a reconcile of `job` that read the coordinator's `status` (None: no answer):
    record its new re-plans, then release a straggler if there is one."""
    if status is None or job.elastic != INPLACE:
        return
    record_replans(ops, job, status.progress)
    release_straggler(ops, job, status, time.time() if now is None else now)


def record_replans(ops: Ops, job: Job, progress: Any) -> int:
    """One "replan" event per re-plan not recorded yet; how many were recorded."""
    new = P.new_replans(progress, *last_replan(job))
    for r in new:   # at the runtime's time of the re-plan
        journal.record(ops.session, job, P.REPLAN_KIND, P.replan_message(r), happened_at=r["time"], **r)
    return len(new)


def release_straggler(ops: Ops, job: Job, status: CoordinatorStatus, now: float) -> P.Release | None:
    """Shrink the job in place without its straggler, if it has one (the policy's rules),
    with a "straggler" event; the release, or None."""
    if job.state is not JobState.RUNNING or not status.settled:
        return None
    members = [P.Member(w.wid, w.host) for w in job.members]
    found = P.straggler(members, job.min_workers, status.progress, ops.config.jobs.straggler_s, now)
    if found is None:
        return None
    rel = f"{found.relative:.2f}x the fastest member, " if found.relative is not None else ""
    why = (f"worker {found.wid} on {found.host} is a straggler: {rel}slower than the median by "
           f"{ops.config.jobs.straggler_factor:g}x or more for {found.slow_for_s:.0f} s")
    data = {"worker": found.wid, "host": found.host, "relative": found.relative,
            "slow_for_s": round(found.slow_for_s, 3)}
    try:
        scaling.retire(ops, job, [found.wid], why=f"straggler w{found.wid}", wait_s=5)
    except GpuflexError as e:
        log.debug("job %s: the straggler's shrink was not taken: %s", job.id, e)
        journal.record(ops.session, job, P.STRAGGLER_KIND, f"{why}; the shrink was refused ({e}): killed",
                       escalated=True, **data)
        executor.stop_workers(ops, job, [w for w in job.live_workers if w.wid == found.wid],
                              f"straggler, its shrink refused: {e}")
        return found
    journal.record(ops.session, job, P.STRAGGLER_KIND, f"{why}: released", escalated=False, **data)
    return found
