"""Liveness from heartbeats: the step barrier, and the crash record.

A collective's timeout cannot tell a busy member from a dead one: a rank 0 that evaluates
for a minute between steps, a first compiled step or a slow checkpoint made the others'
gloo collective time out, the step was undone and replayed, the busy work ran again: a
livelock. So every member passes a barrier over the job store right before the job's
collectives of a step (`StepBarrier.cross`); a member waiting there waits as long as those
it waits for are alive (their heartbeat counters keep moving: the heartbeat thread beats
even while the training thread is busy), and gives up only when one of them is dead
(silent for the heartbeat timeout), crashed, or has left the generation (reported a
failure). A frozen (SIGSTOP) or partitioned member is thus fenced within the heartbeat
timeout, and a busy one is waited for without rollback.

The hot path: at a voting barrier each member first appends its signed arrival ("wid
vote") to the barrier's arrivals key; then, at every barrier, one `add` on a
per-generation counter, then, for all but the last arriver, one blocking `get` of the
barrier's outcome key (the store answers when it is set). The last arriver decides by
`compare_set` of the signed outcome: "ok", or at a voting barrier (`cross(..., vote=v)`)
"ok SUM" with the sum of the votes, once it has read the arrivals (one round trip) and
every member's verifies. A member that gave up writes "fail: reason",
signed, by the same `compare_set`, so the outcome is decided once and every member reads
the same one: a barrier that failed leaves nobody inside a collective the others will
not enter, and a member that arrives after the others gave up (a frozen one, resumed)
reads the failure.

Whoever can reach the store's port can write any key. So nothing unsigned decides here:
an outcome that does not verify (one written ahead of the barrier, or over the real one)
is logged as forged and never acted on; a member that reads one re-decides from the
verified arrivals (the same bytes any member would write: the outcome is a function of
them) and replaces exactly the forged value, or, while arrivals are missing, waits as for
any member. A forged count can only make a member decide early: at a voting barrier it checks the
arrivals and waits on; at a plain one (decided on the count: an extra round trip there
cost 20 % of a small model's step) the members enter the step's collective early and wait
for the rest inside it, fenced by the process-group timeout as before the barrier existed.
A forged arrival line does not verify and counts for nothing; so a forger can delay a
barrier, never change its votes or put its text in a reason.
Who is missing, the staleness of heartbeats and the `waiting/{wid}` record are the
heartbeat thread's work, on its own connection (`Rendezvous.on_beat`), and only while
the training thread has waited for more than CHECK_AFTER_S.

Store keys (keys.py has them all):
barrier/{g}            the arrivals counter of generation g (n-th barrier done at n x world): a hint
barrier/{g}/{n}/in     the n-th barrier's arrivals: a line "wid SIGNED-VOTE" per member
barrier/{g}/{n}        its outcome, signed: "ok" (a voting barrier: "ok SUM") or "fail: reason"
barrier/{g}/at/{wid}   the last barrier a waiting member arrived at (who is missing): a hint
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator, TypeVar

from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.auth import Forged
from gpuflex.elastic.protocol.keys import arrival_key, arrivals_key, counter_key, outcome_key
from gpuflex.elastic.membership.rendezvous import Rendezvous, StoreLost

log = logging.getLogger(__name__)

OK = "ok"
CHECK_AFTER_S = 0.2    # a wait shorter than this costs the heartbeat thread nothing
CHECK_EVERY_S = 0.25   # how often a long wait looks at the missing members
POST_AFTER_S = 1.0     # a wait longer than this is shown (waiting/{wid})
WAIT_SLICE_S = 10.0    # the training thread's wait, in slices (a dead heartbeat thread cannot hang it)
FORGED_POLL_S = 0.05   # how often a member that read a forged outcome looks again
REASON_CHARS = 300     # a failure reason read from the store, at most
TRACEBACK_LINES = 15


@dataclasses.dataclass
class _Wait:
    """The barrier the training thread is waiting at, shared with the heartbeat thread."""

    g: int
    n: int
    phase: str
    started: float        # time.monotonic()
    since: float          # time.time()
    marked: bool = False  # its arrival was written
    last_check: float = 0.0
    beats: dict[int, tuple[bytes, float]] = dataclasses.field(default_factory=dict)  # wid: (counter, since)


class StepBarrier:
    """The step barrier of this worker (see the module docstring). `cross` is called by
    the training thread; the rest runs on the heartbeat thread."""

    def __init__(self, rdzv: Rendezvous, wid: int, heartbeat_timeout_s: float) -> None:
        self.rdzv, self.wid, self.hb_timeout_s = rdzv, wid, heartbeat_timeout_s
        self.g, self.n = -1, 0
        self.waiting_for: list[int] = []   # the members this one waits for now (for status)
        self.crossed = 0                   # barriers passed in this process
        self.voted = 0                     # the sum of the votes at the last voting barrier crossed
        self._wait: _Wait | None = None
        self._members: dict[int, list[int]] = {}
        self._posted: tuple[int, ...] = ()
        self._spent: list[str] = []   # outcomes nobody reads any more, deleted by `watch`
        self._lock = threading.Lock()
        rdzv.on_beat(self.watch)

    # ---- the training thread --------------------------------------------------------------
    def cross(self, g: int, world: int, phase: str, vote: int | None = None) -> str | None:
        """Pass the next barrier of generation g (every member calls the same sequence of
        them): None once all `world` members arrived, else why not (a member is dead,
        crashed or left; the job was aborted). StoreLost when the store is gone. With
        `vote` (every member passes one, 0 for nothing; non-negative) the sum of the
        members' votes is `self.voted` once crossed."""
        if g != self.g:
            self.g, self.n = g, 0
        self.n += 1
        n, rdzv = self.n, self.rdzv
        done = outcome_key(g, n)
        if vote is not None:   # a plain barrier is decided on the count (below): no arrival line
            rdzv.append(arrivals_key(g, n), f"{self.wid} {rdzv.sign(_arrival(arrivals_key(g, n), self.wid), str(vote))}\n")
        outcome = None
        if rdzv.add(counter_key(g), 1) >= n * world:
            # A voting barrier's outcome carries the votes: decided from the verified arrivals
            # (the round trip the vote sum always cost). A plain one's "ok" is decided on the
            # count, as fast as before: a forged count can only let the members into the
            # step's collective early, where they wait for the rest (the process-group
            # timeout fences it), never put a decision or a text of the forger's in.
            outcome = (self._decide(g, n, world, b"") if vote is not None else
                       rdzv.compare_set(done, "", rdzv.sign(done, OK)))
            if outcome is not None and n > 1:   # every member arrived here, so each has read barrier n-1's outcome
                with self._lock:
                    self._spent += [outcome_key(g, n - 1)] + ([arrivals_key(g, n - 1)] if vote is not None else [])
        try:
            value = self._read(done, outcome)
            while value is None:   # not decided yet, or a forged outcome: decide it or wait
                with self._lock:
                    if self._wait is None:
                        self._wait = _Wait(g, n, phase, time.monotonic(), time.time())
                outcome = rdzv.wait_get(done, WAIT_SLICE_S)
                if outcome is not None and self._read(done, outcome) is None:
                    outcome = (self._decide(g, n, world, outcome) if vote is not None else
                               self._decide_on_count(g, n, world, outcome))
                    if outcome is None:
                        time.sleep(FORGED_POLL_S)
                value = self._read(done, outcome)
        finally:
            with self._lock:
                self._wait = None
                self.waiting_for = []
        word, _, total = value.partition(" ")
        if word == OK:
            self.crossed += 1
            self.voted = int(total) if total.isdigit() else 0
            return None
        return bounded(value.removeprefix("fail: "))

    def _read(self, key: str, outcome: bytes | None) -> str | None:
        """The outcome's verified text; None when there is none yet or it is forged (logged)."""
        if outcome is None:
            return None
        try:
            return self.rdzv.signer.verify(key, outcome)
        except Forged as e:
            self.rdzv.forged.note(key, outcome, e.reason)
            return None

    def _decide_on_count(self, g: int, n: int, world: int, over: bytes) -> bytes | None:
        """A plain barrier's "ok" in place of the forged outcome `over`, once the count says
        every member arrived (a hint, as for the last arriver); None before."""
        if self.rdzv.add(counter_key(g), 0) < n * world:
            return None
        return self.rdzv.compare_set(outcome_key(g, n), over, self.rdzv.sign(outcome_key(g, n), OK))

    def _decide(self, g: int, n: int, world: int, over: bytes) -> bytes | None:
        """Voting barrier n's outcome once every member's arrival verifies, put in place of `over`
        (b"": an absent outcome; else the forged value read): the outcome after, which may
        be another member's. None while some member's arrival is missing."""
        key = arrivals_key(g, n)
        votes: dict[int, int] = {}
        for line in (self.rdzv.peek(key) or b"").split(b"\n"):
            wid, _, signed = line.partition(b" ")
            if not wid.isdigit() or int(wid) in votes:
                continue
            try:
                vote = self.rdzv.signer.verify(_arrival(key, int(wid)), signed)
            except Forged as e:
                self.rdzv.forged.note(key, line, e.reason)
                continue
            if vote.isdigit():
                votes[int(wid)] = int(vote)
        if len(votes) < world:
            return None
        total = sum(votes.values())
        text = f"{OK} {total}" if total else OK
        return self.rdzv.compare_set(outcome_key(g, n), over,
                                     self.rdzv.sign(outcome_key(g, n), text))

    def cross_noted(self, group: Any, g: int, world: int, phase: str, vote: int | None = None) -> bool:
        """`cross` before a step's collectives on `group` (Collectives): False when it
        failed, the reason noted as a failed collective's (`group.failure`), so the runtime
        handles it as one. A lost store is noted the same way (`rdzv.lost` is set: the
        boundary then exits as for any lost store). `vote`: a voting barrier (`cross`)."""
        if world == 1 or group.failure is not None:
            return group.failure is None
        try:
            why = self.cross(g, world, phase, vote)
        except StoreLost as e:
            why = str(e)
        if why is not None:
            group.failure = why
        return why is None

    def cross_user(self, group: Any, g: int, world: int) -> bool:
        """`cross` before a user collective (`run.all_reduce`, `run.global_mean`; every member
        makes the same calls): False when it failed. Not noted as the step's failure: the
        gradients may be applied already, so an undo would replay the step; the step's own
        boundary meets the failure (a lost store: `rdzv.lost`)."""
        if world == 1 or group.failure is not None:
            return group.failure is None
        try:
            return self.cross(g, world, "user") is None
        except StoreLost:
            return False

    # ---- the heartbeat thread ---------------------------------------------------------------
    def watch(self, store: Any) -> None:
        """One look, from the heartbeat thread: at a long wait, who is missing and whether
        one of them is gone (then the barrier fails for every member); the waiting record
        kept up to date."""
        with self._lock:
            w, spent, self._spent = self._wait, self._spent, []
        for key in spent:
            store.delete_key(key)
        now = time.monotonic()
        missing: list[int] = []
        if w is not None and now - w.started >= CHECK_AFTER_S:
            if now - w.last_check >= CHECK_EVERY_S:
                w.last_check = now
                missing = self._look(store, w, now)
                with self._lock:
                    if self._wait is w:
                        self.waiting_for = missing
            else:
                missing = list(self.waiting_for)
        show = tuple(missing) if w is not None and now - w.started >= POST_AFTER_S else ()
        if show != self._posted:
            record = {"for": list(show), "since": w.since if show else time.time(),
                      "phase": w.phase if show else ""}
            store.set(keys.waiting(self.wid), self.rdzv.sign(keys.waiting(self.wid), json.dumps(record)))
            store.add(keys.EVENTS, 1)
            self._posted = show
            if show:
                log.info("gpuflex[w%d]: waiting at the %s barrier for busy worker(s) %s",
                         self.wid, w.phase, list(show))

    def _look(self, store: Any, w: _Wait, now: float) -> list[int]:
        """The members not yet at barrier w; fails the barrier when one of them is gone."""
        if not w.marked:
            store.set(arrival_key(w.g, self.wid), str(w.n))
            w.marked = True
        records = self.rdzv.records_on(store)
        members = self._members.get(w.g)
        if members is None:   # read once a generation (a record that does not verify: next time)
            rec = records.json(keys.members(w.g))
            members = [m for m in rec.get("members", []) if isinstance(m, int)] if isinstance(rec, dict) else []
            if members:
                self._members = {w.g: members}
        missing = []
        for m in members:
            if m == self.wid:
                continue
            at = store.get(arrival_key(w.g, m)) if store.check([arrival_key(w.g, m)]) else b"0"
            if (int(at) if at.isdigit() else 0) < w.n:
                missing.append(m)
        why = self._gone(store, records, w, missing, now)
        if why is not None:
            log.info("gpuflex[w%d]: giving up the %s barrier: %s", self.wid, w.phase, why)
            key, signed = outcome_key(w.g, w.n), self.rdzv.sign(outcome_key(w.g, w.n), f"fail: {why}")
            now_there = store.compare_set(key, "", signed)
            try:
                self.rdzv.signer.verify(key, now_there)
            except Forged:   # a forged outcome is in the way: replace exactly it (not one written since)
                store.compare_set(key, now_there, signed)
        return missing

    def _gone(self, store: Any, records: Any, w: _Wait, missing: list[int], now: float) -> str | None:
        """Why the barrier cannot complete: the job was aborted, or a missing member
        crashed, left the generation, or stopped beating; None while all are alive."""
        if records.valid(keys.ABORT):
            return "the job was aborted"
        for m in missing:
            if records.valid(keys.crashed(m)):
                return f"worker {m} crashed (at the {w.phase} barrier)"
            if records.valid(keys.fail(w.g, m)):
                return f"worker {m} left generation {w.g} (at the {w.phase} barrier)"
            beat = store.get(keys.hb(m)) if store.check([keys.hb(m)]) else b""
            seen = w.beats.get(m)
            if seen is None or seen[0] != beat:
                w.beats[m] = (beat, now)
            elif now - seen[1] >= self.hb_timeout_s:   # the same words each time: a repeat is recognised
                return f"worker {m} sent no heartbeat for {self.hb_timeout_s:g}s (at the {w.phase} barrier)"
        return None


def _arrival(key: str, wid: int) -> str:
    """What a member's arrival line is signed as: its key and its worker id."""
    return f"{key}#{wid}"


def bounded(text: str, limit: int = REASON_CHARS) -> str:
    """Text read from the store, fit for a reason: non-printable characters escaped, cut to `limit`."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out[:limit]


T = TypeVar("T")


def close_at_exit(close: Callable[[], None]) -> None:
    """For a loop left early: by a `break` (the script goes on; the worker is done when it
    exits) or by an exception, which the crash hook must report before anything closes.
    (Unwinding the script's frames closes the loop's generators before `sys.excepthook`
    runs, so closing there would mark a crashed worker done.)"""
    atexit.register(close)


def close_after(items: Iterator[T], close: Callable[[], None]) -> Iterator[T]:
    """`items`, then `close()`; or `close_at_exit(close)` when the loop is left early."""
    try:
        yield from items
    except BaseException:
        close_at_exit(close)
        raise
    close()


def crash_record(etype: type[BaseException], exc: BaseException, tb: Any, phase: str) -> dict[str, Any]:
    """The `crashed/{wid}` record of an exception that escaped the training loop."""
    lines = "".join(traceback.format_exception(etype, exc, tb)).splitlines()
    error = traceback.format_exception_only(etype, exc)[-1].strip()
    return {"error": error[:500], "traceback": [ln[:300] for ln in lines[-TRACEBACK_LINES:]],
            "phase": phase}


def report_crash(rdzv: Rendezvous, wid: int, record: dict[str, Any]) -> None:
    """Write the signed crash record (and bump the events counter), then stop the heartbeat
    so the coordinator and the others see this worker gone at once."""
    try:
        rdzv.set(keys.crashed(wid), json.dumps(record))
    finally:
        rdzv.close()


def exit_as_crashed() -> None:
    """From a crash on, the process only exits (with 1): SIGTERM is ignored. The job's stop
    comes as soon as the control side reads the crash record, and the interpreter's
    finalization (long in a torch process on a loaded host) puts SIGTERM back to its
    default: the worker died of it (-15), its exit code no longer said it crashed. The
    SIGKILL after the stop's grace still ends an exit that hangs."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def install_crash_hook(report: Callable[[dict[str, Any]], None], phase: Callable[[], str]) -> None:
    """Chain `sys.excepthook`: an exception escaping the script is first reported
    (`report(crash_record)`: the worker writes it to the store and closes its connections,
    so the process exits at once), then printed as before; Python then exits 1."""
    previous = sys.excepthook

    def hook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(etype, KeyboardInterrupt):
            try:
                report(crash_record(etype, value, tb, phase()))
            except Exception as e:   # the traceback below must still be printed
                log.warning("gpuflex: could not record the crash: %s", e)
            exit_as_crashed()
        previous(etype, value, tb)

    sys.excepthook = hook
