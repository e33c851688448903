"""Slurm's everyday verbs on jobs already recorded (issue 33): which jobs a `cancel` with
ids and filters means, `hold`/`release` of queued jobs, `update` of a job's time limit and
priority, and a manual `requeue` of a running job.

Every verb resolves all the jobs it names and checks each (its state, the caller's right
to change it: gpuflex.control.access) before it writes anything, so one bad id among
several refuses the whole command with the database as it was. The service
(gpuflex.control.service) calls these under the ops lock, then places the queue.

What may change when:
- hold/release: queued jobs only (a running job is never held: requeue it with --hold).
- update --priority: a queued job's place in the queue; a running job's priority is what a
  higher-priority job's preemption compares (it matters again if it is requeued).
- update --time: a queued job's limit, for each run. A running job's limit may only be
  lowered (or set where it had none): the deadline moves earlier and the next gpuflex
  command past it stops the run (state timeout). Raising it is refused: each host's
  supervisor keeps the deadline it was started with and would stop the run there; requeue
  the job, then raise it.
- requeue: running (or scaling) jobs only, stopped the way preemption stops them
  (executor.requeue: SIGTERM, grace, a checkpoint at the step boundary) and queued again.
  An ended job stays ended (its history and usage are final): submit it again.
"""

from __future__ import annotations

from typing import Callable, Iterable

from sqlalchemy.orm import Session

from gpuflex.control import access, executor, journal
from gpuflex.control.executor import Ops
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.errors import UsageError
from gpuflex.jobspec import format_time
from gpuflex.states import JobState

MANUAL_CAUSE = "requeued"   # a manual requeue's cause (never counted against --retries)
CANCELLABLE = (JobState.QUEUED, JobState.RUNNING, JobState.SCALING)


def resolve(refs: Iterable[str], expand: Callable[[str], list[Job]], get: Callable[[str], Job],
            states: Iterable[JobState] = CANCELLABLE) -> list[Job]:
    """The jobs `refs` name, once each, by id: an array's id (or a name whose newest job
    is one of an array's) stands for every job of the array in `states` (`expand`: not
    ended, or only the queued ones for hold and release), or all of them when none is (so
    the verb's refusal names one); any other reference for its job (`get`:
    UnknownJobError for the first that names none)."""
    wanted = set(states)
    out: dict[int, Job] = {}
    for ref in refs:
        array = expand(ref)
        for job in ([j for j in array if j.state in wanted] or array) if array else [get(ref)]:
            out.setdefault(job.id, job)
    return sorted(out.values(), key=lambda j: j.id)


def matching(session: Session, user: str, states: list[JobState] | None, name: str | None) -> list[Job]:
    """The jobs of `user` in `states` (default: not ended) named `name` (any, when None), by id."""
    wanted = states or list(CANCELLABLE)
    return [j for j in queries.jobs(session, wanted)
            if j.user == user and (name is None or j.name == name)]


def filtered(jobs: list[Job], user: str | None, states: list[JobState] | None, name: str | None) -> list[Job]:
    """Those of `jobs` that the filters given keep (Slurm: ids and filters both apply)."""
    return [j for j in jobs if (user is None or j.user == user) and (not states or j.state in states)
            and (name is None or j.name == name)]


def check_cancellable_states(states: list[JobState] | None) -> None:
    """UsageError for a `cancel --state` that names an ended state (nothing there to stop)."""
    for s in states or ():
        if s not in CANCELLABLE:
            raise UsageError(f"--state {s.value}: an ended job cannot be cancelled; give "
                             + ", ".join(c.value for c in CANCELLABLE) + ".")


def check_may_change(config, jobs: list[Job], verb: str) -> None:
    """NotOwnerError (or the UsageError of a job whose processes the caller cannot reach)
    for the first job the caller may not change; nothing is written before."""
    for job in jobs:
        if not job.state.final:
            access.check_owner(config, job, verb)


def cancel(ops: Ops, jobs: list[Job]) -> None:
    """Cancel each job: a queued one is marked, a running one's processes are stopped."""
    for job in jobs:
        # who: the owner, or an admin (named so) cancelling another user's job
        job.exit_reason = why = f"cancelled by {access.changed_by(job)}"
        if job.state is JobState.QUEUED:   # nothing runs: no process to stop
            journal.set_state(ops.session, job, JobState.CANCELLED, why, by=access.caller())
        else:
            executor.stop_job(ops, job, JobState.CANCELLED, why, by=access.caller())


def _only_queued(jobs: list[Job], verb: str) -> None:
    """UsageError for the first job not queued: only the queue has jobs to hold."""
    for job in jobs:
        if job.state is not JobState.QUEUED:
            advice = " ('gpuflex requeue --hold' stops and holds a running one)" if verb == "hold" else ""
            done = "held" if verb == "hold" else "released"
            raise UsageError(f"job {job.id} is {job.state}: only a queued job can be {done}{advice}.")


def hold(session: Session, jobs: list[Job]) -> list[str]:
    """Hold queued jobs: the scheduler leaves them queued until released. Returns a line per job."""
    _only_queued(jobs, "hold")
    lines = []
    for job in jobs:
        if job.held:
            lines.append(f"job {job.id} was held already")
            continue
        job.held = True
        job.queue_reason = f"held by {access.changed_by(job)}: 'gpuflex release {job.id}' lets it start"
        journal.record(session, job, "held", job.queue_reason, by=access.caller())
        lines.append(f"job {job.id} held")
    return lines


def release(session: Session, jobs: list[Job]) -> list[str]:
    """Release held jobs: the queue places them again. Returns a line per job."""
    _only_queued(jobs, "release")
    lines = []
    for job in jobs:
        if not job.held:
            lines.append(f"job {job.id} was not held")
            continue
        job.held = False
        job.queue_reason = None
        journal.record(session, job, "released", f"released by {access.changed_by(job)}", by=access.caller())
        lines.append(f"job {job.id} released")
    return lines


def update(session: Session, jobs: list[Job], time_limit_s: float | None, priority: int | None) -> list[str]:
    """Set the time limit and/or priority of queued or running jobs (see the module's doc
    for what a running job allows). Returns a line per job."""
    for job in jobs:
        if job.state.final:
            raise UsageError(f"job {job.id} is {job.state}: only a queued or running job can be updated.")
        if time_limit_s is not None and job.state.active and job.time_limit_s is not None \
                and time_limit_s > job.time_limit_s:
            raise UsageError(f"job {job.id} is running: its time limit can only be lowered (from "
                             f"{format_time(job.time_limit_s)}); each host's supervisor keeps the deadline it "
                             f"was started with. Requeue it, then raise it.")
    lines = []
    for job in jobs:
        changes = {}
        if time_limit_s is not None and time_limit_s != job.time_limit_s:
            old = "none" if job.time_limit_s is None else format_time(job.time_limit_s)
            changes["time limit"] = (old, format_time(time_limit_s))
            job.time_limit_s = time_limit_s
        if priority is not None and priority != job.priority:
            changes["priority"] = (str(job.priority), str(priority))
            job.priority = priority
        if not changes:
            lines.append(f"job {job.id} unchanged")
            continue
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())
        journal.record(session, job, "updated", f"{what} by {access.changed_by(job)}", by=access.caller(),
                       **{k.replace(" ", "_"): b for k, (_, b) in changes.items()})
        lines.append(f"job {job.id} updated: {what}")
    return lines


def requeue(ops: Ops, jobs: list[Job], hold_after: bool) -> list[str]:
    """Stop running jobs the way preemption does and queue them again (held, with
    `hold_after`). Returns a line per job."""
    for job in jobs:
        if not job.state.active:
            raise UsageError(f"job {job.id} is {job.state}: only a running job can be requeued"
                             + (" (submit it again)." if job.state.final else "."))
        if job.kind is not None:   # its command lives on its owner's terminal: nothing could restart it
            raise UsageError(f"job {job.id} is an interactive session: it cannot be requeued "
                             f"(cancel it, or end its command).")
    lines = []
    for job in jobs:
        executor.requeue(ops, job, f"requeued by {access.changed_by(job)}", cause=MANUAL_CAUSE)
        if hold_after:
            job.held = True
            job.queue_reason = f"held by {access.changed_by(job)}: 'gpuflex release {job.id}' lets it start"
            journal.record(ops.session, job, "held", job.queue_reason, by=access.caller())
        lines.append(f"job {job.id} requeued" + (" and held" if hold_after else ""))
    return lines
