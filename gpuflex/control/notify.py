"""Webhooks: a JSON POST when a job ends, fails, is preempted or times out.

Where a note comes from: `journal.set_state` is the one place a job's state changes, so it
hands every move to `collect`, which keeps a `Note` in the session (`session.info`) when
the job has a URL (`submit --notify`, else `[notify] url`, stored per job at submit) and
the move is one a user hears of (`gpuflex.config_fields.NOTIFY_EVENTS`). Nothing is sent there: the transaction may
still be rolled back (a refused command, an error), and a lock is held.

When it is sent: an `Outbox` listens on the service's sessionmaker; a commit moves the
session's notes into it, a rollback drops them. The service posts the outbox after the
command's transaction has committed and its lock is released (`JobService.notify`), so
a rolled-back command posts nothing and a slow receiver holds no lock.

How: each note once (a "notified" event records it; a command that dies between its
commit and the post loses it rather than sending it twice), all at once in threads, each
with a short timeout. A receiver that fails, refuses or does not answer is logged and
recorded as a "notify-failed" event: never a traceback, never a failed command, never a
wait past the timeout.

What: the job's id, name, user, state, exit code, reason, times and array id/index; never
its secret, command line or environment (they may hold credentials).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import urllib.parse
from typing import Any, Callable, Iterable

from sqlalchemy import event
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from gpuflex.db import queries
from gpuflex.states import JobState

log = logging.getLogger(__name__)

# a requeue's causes that mean someone else took the GPUs: a higher-priority job
# (control/queueing.PREEMPTED_CAUSE) or the GPU's owner (the harvest tick's requeue)
PREEMPTION_CAUSES = frozenset({"preempted", "requeue"})
TIMEOUT_S = 2.0
_PENDING = "gpuflex.notify.pending"


def event_of(target: JobState, cause: str | None) -> str | None:
    """The name (gpuflex.config_fields.NOTIFY_EVENTS) of a move to `target`, a requeue's `cause`
    telling a preemption; None for a move nobody is told of (started, scaling, a requeue
    after a fault or for a resize)."""
    if target.final:
        return target.value
    if target is JobState.QUEUED and cause in PREEMPTION_CAUSES:
        return "preempted"
    return None


@dataclasses.dataclass(frozen=True)
class Note:
    """One webhook to post: the job, the event, where, and the JSON body."""

    job_id: int
    event: str
    url: str
    payload: dict[str, Any]


def payload(job: Any, event_name: str, reason: str, exit_code: int | None) -> dict[str, Any]:
    """The body of a job's webhook (see the module docstring for what is never in it)."""
    return {
        "job": job.id, "name": job.name, "user": job.user, "event": event_name, "state": job.state.value,
        "exit_code": exit_code, "reason": reason, "restarts": job.restarts,
        "submitted_at": job.created_at, "started_at": job.started_at, "ended_at": job.ended_at,
        "array_id": job.array_id, "array_index": job.array_index, "time": time.time(),
    }


def collect(session: Session, job: Any, target: JobState, reason: str, data: dict[str, Any]) -> None:
    """Keep a note of this move in the session when the job has a URL and the move is one
    of NOTIFY_EVENTS (posted after the commit, if there is one: see the module docstring)."""
    url = getattr(job, "notify_url", None)
    name = event_of(target, data.get("cause"))
    if not url or name is None:
        return
    exit_code = data.get("exit_code", job.exit_code if target.final else None)
    session.info.setdefault(_PENDING, []).append(
        Note(job.id, name, url, payload(job, name, reason, exit_code)))


class Outbox:
    """The notes of committed transactions of one sessionmaker, waiting to be posted."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self.notes: list[Note] = []
        self._lock = threading.Lock()
        self._listening = True
        event.listen(sessions, "after_commit", self._committed)
        event.listen(sessions, "after_rollback", self._rolled_back)

    def close(self) -> None:
        """Stop listening (the notes not taken yet stay in `notes`)."""
        if self._listening:
            self._listening = False
            event.remove(self.sessions, "after_commit", self._committed)
            event.remove(self.sessions, "after_rollback", self._rolled_back)

    def _committed(self, session: Session) -> None:
        notes = session.info.pop(_PENDING, None)
        if notes:
            with self._lock:
                self.notes.extend(notes)

    def _rolled_back(self, session: Session) -> None:
        session.info.pop(_PENDING, None)

    def take(self) -> list[Note]:
        with self._lock:
            notes, self.notes = self.notes, []
        return notes

    def deliver(self, events: Iterable[str], record: Callable[..., Any]) -> None:
        """Post the notes of the `events` kinds (the rest are dropped) and record each as a
        "notified" or "notify-failed" event of its job with `record` (journal.record), in
        a transaction of its own; a database that refuses the record only loses it."""
        wanted = set(events)
        notes = [n for n in self.take() if n.event in wanted]
        if not notes:
            return
        results = post_all(notes)
        try:
            with self.sessions.begin() as session:
                for note, why in results:
                    job = queries.job(session, note.job_id)
                    if job is None:
                        continue
                    if why is None:
                        record(session, job, "notified", f"{note.event}: posted to {where(note.url)}",
                               event=note.event)
                    else:
                        record(session, job, "notify-failed", f"{note.event}: {where(note.url)}: {why}",
                               event=note.event, error=why)
        except SQLAlchemyError as e:
            log.warning("cannot record the webhooks' outcome: %s", e)


def where(url: str) -> str:
    """The receiver's host and port, for messages: a webhook URL's path or user part often
    holds its token, which no log or event shows."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def post(url: str, body: dict[str, Any], timeout_s: float = TIMEOUT_S) -> str | None:
    """POST `body` as JSON to `url`; None when the receiver answered 2xx, else why not.
    urllib.request (http.client, email: ~50 ms) is imported here, by the commands that post."""
    import urllib.error
    import urllib.request

    class NoRedirects(urllib.request.HTTPRedirectHandler):
        """A redirect is an answer, not an order: urllib would follow it as a GET, or to ftp."""

        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    data = json.dumps(body, sort_keys=True).encode("utf-8")
    req = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/json", "User-Agent": "gpuflex-notify"})
    try:
        with urllib.request.build_opener(NoRedirects).open(req, timeout=timeout_s) as resp:
            status = resp.status
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} {e.reason}"
    except (urllib.error.URLError, OSError, ValueError) as e:   # refused, unreachable, timed out
        why = getattr(e, "reason", None) or e
        return f"{type(why).__name__}: {why}" if not isinstance(why, str) else why
    return None if 200 <= status < 300 else f"HTTP {status}"


def post_all(notes: list[Note], timeout_s: float = TIMEOUT_S) -> list[tuple[Note, str | None]]:
    """Post every note at once; each note with None (sent) or why it was not. Returns
    within about `timeout_s` (+1 s) whatever the receivers do: a thread still waiting then
    counts as failed and is left to end on its own (daemon: it never holds the exit)."""
    results: dict[int, str | None] = {}
    threads = []
    for i, note in enumerate(notes):
        def send(i: int = i, note: Note = note) -> None:
            results[i] = post(note.url, note.payload, timeout_s)
        t = threading.Thread(target=send, name=f"gpuflex-notify-{note.job_id}", daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout_s + 1.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out = []
    for i, note in enumerate(notes):
        why = results.get(i, f"no answer within {timeout_s:g} s")
        if why is not None:
            log.warning("job %s: webhook for %s to %s failed: %s", note.job_id, note.event, where(note.url), why)
        out.append((note, why))
    return out
