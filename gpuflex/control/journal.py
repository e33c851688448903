"""The journal: every change of a job's or a worker's state, and every event, written here.

Events are the job's history (`gpuflex events`, `gpuflex report`, the CLI's waits read
them); a state change always writes one ("state"), so the history never misses a move.
Transitions are checked against gpuflex.states before they are written.
"""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from gpuflex.db.models import Event, Job, Worker
from gpuflex.states import JobState, WorkerState


def record(session: Session, job: Job, kind: str, message: str, **data) -> Event:
    """Append one event to the job's history."""
    ev = Event(job=job, time=time.time(), kind=kind, message=message, data=data)
    session.add(ev)
    return ev


def note_once(session: Session, job: Job, kind: str, message: str, **data) -> None:
    """Record an event unless the job's last event already says the same (a host that
    stays unreachable is noted once, not at every command)."""
    last = job.events[-1] if job.events else None
    if last is None or last.kind != kind or last.message != message:
        record(session, job, kind, message, **data)


def set_state(session: Session, job: Job, target: JobState, message: str, **data) -> None:
    """Move the job to `target` (IllegalTransition if its states do not allow it)."""
    job.state.check_transition(target)
    job.state = target
    if target.final:
        job.ended_at = time.time()
    record(session, job, "state", f"{target.value}: {message}", state=target.value, **data)


_HOW = {WorkerState.EXITED: "exited 0", WorkerState.LOST: "was lost (killed, or its host is gone)",
        WorkerState.STOPPED: "was stopped"}


def end_worker(session: Session, job: Job, w: Worker, state: WorkerState, rc: int | None,
               ended_at: float | None = None) -> None:
    """A worker's process has ended (`state` is final): its exit code and end time."""
    w.state.check_transition(state)
    w.state, w.exit_code, w.ended_at = state, rc, ended_at or time.time()
    how = f"failed with exit code {rc}" if state is WorkerState.FAILED else _HOW[state]
    record(session, job, "worker", f"worker {w.wid} on {w.host} {how}",
           wid=w.wid, host=w.host, exit_code=rc, state=state.value)


def retiring(w: Worker) -> None:
    """A worker asked to leave at its next step boundary."""
    w.state.check_transition(WorkerState.LEAVING)
    w.state = WorkerState.LEAVING
