"""The journal: every change of a job's or a worker's state, and every event, written here.

Events are the job's history (`gpuflex events`, `gpuflex report`, the CLI's waits read
them); a state change always writes one ("state"), so the history never misses a move.
Transitions are checked against gpuflex.states before they are written.

An event that repeats the job's last one (same kind, same message once generation numbers
are set aside) is not a new row: that row's `count` goes up and `last_time` moves, and it
takes the newest message and data. A failure that recurs thousands of times (a rollback
loop, a host that stays unreachable) is then one row, and the table, `status` and `events`
stay small whatever happens. State changes and reclaims are each their own row: every
move is history, and each reclaim's latency is a figure of `gpuflex report`.

An event's `time` is when the thing happened; `recorded_at` when a command wrote the row.
They differ for what a job's coordinator or workers recorded (a generation formed, a
newcomer left out, a worker's exit) and a later command noticed: the event keeps the time
their record gives (their host's clock; one past this host's now, a clock ahead, is taken
as now). What this run has recorded already is told by `recorded_at`, never by a time
another host's clock gave.
"""

from __future__ import annotations

import re
import time

from sqlalchemy.orm import Session

from gpuflex.control import notify
from gpuflex.db import queries
from gpuflex.db.models import Event, Job, Worker
from gpuflex.policy.outcomes import instant
from gpuflex.states import JobState, WorkerState

NEVER_COALESCED = frozenset({"state", "reclaim"})
_GENERATION = re.compile(r"\bgeneration \d+")


def same_event(a: str, b: str) -> bool:
    """Whether two messages say the same, generation numbers aside ("generation 1808:
    rolled back" and "generation 1809: rolled back")."""
    return a == b or _GENERATION.sub("generation N", a) == _GENERATION.sub("generation N", b)


def record(session: Session, job: Job, kind: str, message: str, *, happened_at: float | None = None,
           **data) -> Event:
    """Append one event to the job's history, or count it on the job's last event when it
    repeats that one (see the module docstring). `happened_at`: when it happened, if that
    was before now (a coordinator's or worker's record); else it happens now."""
    now = time.time()
    at = now if happened_at is None else min(happened_at, now)
    if kind not in NEVER_COALESCED:
        if job.id is None:
            session.flush()
        last = queries.last_event(session, job.id)
        if last is not None and last.kind == kind and same_event(last.message, message):
            last.count = (last.count or 1) + 1
            last.last_time, last.message, last.data = at, message, data
            return last
    ev = Event(job=job, time=at, recorded_at=now, kind=kind, message=message, data=data, count=1)
    session.add(ev)
    return ev


def set_state(session: Session, job: Job, target: JobState, message: str, label: str | None = None,
              **data) -> None:
    """Move the job to `target` (IllegalTransition if its states do not allow it); the
    event reads "LABEL: message", LABEL the state unless given ("succeeded after 1
    restart(s)"). A move the job's owner is to hear of becomes a webhook note, posted
    only once the transaction has committed (gpuflex.control.notify)."""
    job.state.check_transition(target)
    job.state = target
    if target.final:
        job.ended_at = time.time()
    text = f"{label or target.value}: {message}"
    record(session, job, "state", text, state=target.value, **data)
    notify.collect(session, job, target, text, data)


_HOW = {WorkerState.EXITED: "exited 0", WorkerState.LOST: "was lost (killed, or its host is gone)",
        WorkerState.STOPPED: "was stopped"}


def end_worker(session: Session, job: Job, w: Worker, state: WorkerState, rc: int | None,
               ended_at: float | None = None) -> None:
    """A worker's process has ended (`state` is final): its exit code and end time (its
    exit record's, when it left one: the event is dated then too)."""
    w.state.check_transition(state)
    w.state, w.exit_code, w.ended_at = state, rc, ended_at or time.time()
    how = f"failed with exit code {rc}" if state is WorkerState.FAILED else _HOW[state]
    record(session, job, "worker", f"worker {w.wid} on {w.host} {how}", happened_at=instant(ended_at),
           wid=w.wid, host=w.host, exit_code=rc, state=state.value)


def retiring(w: Worker) -> None:
    """A worker asked to leave at its next step boundary (and when: `retired_at`)."""
    w.state.check_transition(WorkerState.LEAVING)
    w.state, w.retired_at = WorkerState.LEAVING, time.time()
