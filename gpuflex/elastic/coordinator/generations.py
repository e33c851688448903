"""The coordinator's generation logic: from the store's heartbeats, failure reports,
readiness, verdicts, crash records and the desired membership to the next generation.

Each full read decides, in this order:

- finished or aborted: nothing more is published;
- crashed: a worker's training code raised (its signed `crashed/{wid}`): a bug, not a
  fault. The job is held, no generation is formed without it, whatever the survivors;
- forming: a worker of the first generation, or a member of a published generation not
  verified yet, died or did not arrive within `formation_timeout_s`: the generation is
  formed without it, or held below MIN (forming.py); an in-place job none of whose first
  workers ever beat (a plain script) ends: `abort` with the cause "never-joined";
- recover: a member of the current generation reported a failure or stopped beating;
  once every member has reported, gone stale or finished, the reporters (plus ready
  newcomers) form the next generation;
- rollback: the newest generation's state did not verify; the previous members
  (leavers included, they wait for the verdict) form the next one and the newcomers are
  rejected;
- resize: the desired membership differs and every newcomer is ready. A newcomer that died
  warming up, or never started within `formation_timeout_s`, is left out (rejected, dropped
  from the desired membership; status "left_out" says why: resizing.py). When what can be
  reached is the current membership again (a desired worker was rejected or left before),
  nothing is published and status "unreachable" says why;
- release: workers wanted once but no longer, before they ever joined, exit 0.

Never below MIN: a generation of fewer than `min_workers` is not published; the job is
"held" (survivors wait at their step boundary) until ready newcomers make up MIN or the
control side requeues or fails it. No unbounded retry: each rollback and recovery is a
failed generation for `FailureStreak` (failures.py); when it says so, the coordinator
writes the signed `abort` record instead (every worker exits ABORTED_EXIT). An abort is
{reason, cause, at}: `cause` "repeated" (the streak) or "never-joined" (forming.py), `at`
its wall-clock time (the control side judges a worker's end before it by itself).

`_tick` reads the store and handles the first two; the rest is decided without writing
by next_generation.decide (from a `Seen`: one full read) and carried out by `_apply`, the
only place a decision writes.

Every tick reads one key, the events counter workers bump after each write the coordinator
acts on; the full read (a dozen keys per member) runs when it moved, while anything is
pending, and every IDLE_TICK_S otherwise (crash and waiting records: only when it moved).

Nothing a worker writes is believed unless it verifies (auth.py): a record that does not is
ignored as if absent, counted and logged (`status()["forged"]`). The coordinator's own
records (`run`, `latest`, the newest `members/{g}`, `abort`) are put back when changed; one
published ahead of it (a forged `members/{g+1}`, an `abort`) is deleted. Time comes from
injected clocks, so the decisions run in tests without processes (tests/fakes/store_fake.py).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Callable, Protocol

from gpuflex.elastic.protocol import failpoints, keys
from gpuflex.elastic.protocol.auth import ForgeryLog, KeptRecords, SignedRecords, Signer
from gpuflex.elastic.protocol.signals import STOP_ASKERS
from gpuflex.elastic.coordinator.failures import FailureStreak, Heartbeats, WorkerReports, printable
from gpuflex.elastic.coordinator.forming import FormationWatch
from gpuflex.elastic.coordinator.next_generation import (Decision, End, Hold, Publish, Seen, Settled, Unreachable,
                                                         decide)
from gpuflex.elastic.coordinator.progress_view import ProgressView
from gpuflex.elastic.coordinator.resizing import Requests, WarmUps, check_resize

log = logging.getLogger(__name__)

IDLE_TICK_S = 0.5   # full reads of a settled job: heartbeat staleness and progress
HISTORY_KEPT = 100  # generations status lists (older ones are only counted)
TIMINGS_LOOKBACK = 3   # older generations whose late timings are still looked for
REPEATED = "repeated"  # an abort's cause: the same failure (or failures without progress) too often


class Store(Protocol):
    """The job store's methods the decisions use (torch.distributed.TCPStore has them)."""

    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def set(self, key: str, value: str) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...


class Generations:
    """The coordinator's decisions over the job store: which generation comes next.

    `store` is the job's TCPStore (or any object with its check/get/set/add); `clock`
    (monotonic: heartbeat staleness, idle ticks, formation deadlines) and `wall` (time.time:
    records) are injected so the decisions can be tested without processes. `secret`: the
    job's HMAC key (None: unauthenticated, see auth.py). `min_workers`: no generation is
    ever smaller; `max_failures`: the same failure this many times in a row ends the job;
    `formation_timeout_s`: how long a formation waits for a worker. Not thread-safe."""

    def __init__(self, store: Store, initial: list[int], hb_timeout_s: float,
                 formation_timeout_s: float = 60, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, secret: str | None = None,
                 min_workers: int = 1, max_failures: int = 3) -> None:
        if min_workers < 1:
            raise ValueError(f"min workers must be at least 1, not {min_workers}")
        self.store = store
        run = secrets.token_hex(8)   # binds this store's records to this run of the job
        self.signer = Signer(secret, run)
        self.forged = ForgeryLog("coordinator")
        self.records = SignedRecords(self.has, store.get, self.signer, self.forged)
        self.requests = Requests(self.forged)
        self.kept = KeptRecords(store, self.forged)   # records it wrote and keeps
        self.min_workers = min_workers
        self.streak = FailureStreak(max_failures)
        self.clock, self.wall = clock, wall
        self.desired: list[int] = list(initial)
        self.generation = 0
        self.members: list[int] = []
        self.history: list[dict[str, Any]] = []
        self.rejected: set[int] = set()
        self.known: set[int] = set(initial)   # every worker id ever wanted
        self.released: set[int] = set()
        self.ever_members: set[int] = set()
        self.finished = False
        self.stopped: dict[str, Any] | None = None   # keys.STOPPED: a stop agreed before the end
        self.abort: dict[str, str] | None = None
        self.held: dict[str, Any] | None = None
        self.unreachable: dict[str, Any] | None = None
        self.reports = WorkerReports(self.get_json, self.has)   # crash and waiting records
        self.heartbeats = Heartbeats(self.has, store.get, hb_timeout_s, clock)
        self.formation = FormationWatch(formation_timeout_s, self.heartbeats, self.valid, clock=clock, wall=wall)
        self.warm_ups = WarmUps(formation_timeout_s, self.heartbeats, clock=clock, wall=wall)
        self.progress: dict[str, Any] | None = None   # rank 0's, its checkpoint failures kept (progress_view.py)
        self.progress_view = ProgressView(wall)
        self._verdict_reason = ""
        self._events, self._last_full = -1, 0.0
        self._busy = True          # something is pending: read everything every tick
        self.kept.put(keys.RUN, Signer(secret).sign(keys.RUN, run))
        store.set(keys.DESIRED, json.dumps(self.desired))

    # ---- store helpers -------------------------------------------------------------
    def has(self, key: str) -> bool:
        return self.store.check([key])

    def valid(self, key: str) -> bool:
        return self.records.valid(key)

    def get_json(self, key: str) -> Any:
        """A signed JSON record's value; None when absent, forged or not JSON."""
        return self.records.json(key)

    def write(self, key: str, value: str) -> None:
        self.store.set(key, self.signer.sign(key, value))

    def keep(self, key: str, value: str) -> None:   # a record put back if changed
        self.kept.put(key, self.signer.sign(key, value))

    def gone(self, wid: int) -> bool:
        return self.valid(keys.done(wid)) or self.valid(keys.left(wid))

    def set_desired(self, members: list[int]) -> None:
        self.desired = sorted(set(members))
        self.store.set(keys.DESIRED, json.dumps(self.desired))

    def reject(self, wids: list[int]) -> None:
        """Workers left out for good (one that wakes up later exits EVICTED_EXIT)."""
        for w in wids:
            if w not in self.rejected:
                self.rejected.add(w)
                self.write(keys.rejected(w), "1")

    # ---- decisions -----------------------------------------------------------------
    def publish(self, members: list[int], kind: str, message: str) -> None:
        g = self.generation + 1
        if failpoints.ARMED: failpoints.hit("coordinator.publish", gen=g, kind=kind, members=members)
        rec = {"generation": g, "kind": kind, "members": members, "prev": self.members,
               "created": self.wall(), "message": message}
        self.kept.forget(keys.members(self.generation))
        self.keep(keys.members(g), json.dumps(rec))
        self.kept.put(keys.LATEST, str(g))
        self.generation, self.members = g, list(members)
        self.formation.begin(g)
        self.ever_members |= set(members)
        self.held = self.unreachable = None
        self.history.append({**rec, "verified": False, "ok": None, "timings": None})
        del self.history[:-HISTORY_KEPT]
        log.info("generation %d (%s): members %s - %s", g, kind, members, message)

    def hold(self, reason: str, workers: list[int], phase: str) -> None:
        """No generation can be formed now: the survivors wait, status says why, naming the
        workers it is for (the control side adds their hosts) and the phase."""
        if self.held is None or self.held["reason"] != reason:
            log.warning("generation %d held: %s", self.generation, reason)
            since = self.held["since"] if self.held else self.wall()
            self.held = {"reason": reason, "since": since, "workers": sorted(workers), "phase": phase}
        self._busy = False   # an event (a newcomer ready, a report) or the idle tick looks again

    def failed_again(self, g: int, reason: str) -> bool:
        """Generation g failed with `reason`: True when that ended the job (abort written)."""
        why = self.streak.add(g, reason)
        if why is None:
            return False
        self.end(why, REPEATED)
        return True

    def end(self, reason: str, cause: str) -> None:
        """End the job: the signed `abort` record {reason, cause, at}; nothing is published
        from now on, and every gpuflex.elastic worker exits ABORTED_EXIT."""
        self.abort = {"reason": reason, "cause": cause, "at": self.wall()}
        self.held = None
        self.keep(keys.ABORT, json.dumps(self.abort))
        self._busy = False
        log.error("job aborted: %s", reason)

    def tick(self) -> None:
        """One look: the events counter, and everything when it moved, while pending, or every IDLE_TICK_S."""
        events = self.store.add(keys.EVENTS, 0)
        now = self.clock()
        moved = events != self._events
        if not moved and not self._busy and now - self._last_full < IDLE_TICK_S:
            return
        self._events, self._last_full = events, now
        self._busy = True
        self._tick(moved)

    def _tick(self, moved: bool) -> None:
        self.kept.enforce([keys.members(self.generation + 1), keys.ABORT])
        if self.has(keys.PROGRESS):
            self.progress = self.progress_view.read(self.store.get(keys.PROGRESS))
        self._read_request()
        if moved and self.stopped is None and self.has(keys.STOPPED):
            self.stopped = stop_record(self.get_json(keys.STOPPED))
        if self.valid(keys.FINISHED):
            self.finished = True
        if self.finished or self.abort is not None:
            self._busy = False
            return
        if moved:
            self.reports.read(self.members, set(self.desired) - self.ever_members - self.rejected)
        crash = self.reports.first_crash()
        if crash is not None:
            self.hold(f"worker {crash['wid']} crashed: {crash['error']}", [crash["wid"]],
                      f"generation {self.generation}, {crash.get('phase') or 'training'}")
            return
        for w in self.known - set(self.desired) - self.ever_members - self.released:
            self.released.add(w)   # wanted once, never joined, no longer wanted
            self.write(keys.released(w), "1")
        desired_new = [w for w in self.desired
                       if w not in self.ever_members and w not in self.rejected]
        if self.generation and (late := self.warm_ups.overdue(desired_new, self._ready, self.generation)):
            self.reject(late)
            self.set_desired([w for w in self.desired if w not in late])
            desired_new = [w for w in desired_new if w not in late]
        alive = self.heartbeats.alive
        ready_new = [w for w in desired_new if self.valid(keys.ready(w)) and alive(w)]
        if self.generation == 0:   # the first: everyone ready, or without the dead and the late
            self._apply(decide(self._seen(desired_new, ready_new,
                                          first=self.formation.first(desired_new, ready_new, self.min_workers))))
            return
        g, cur = self.generation, self.history[-1]
        self._read_verdict(g, cur)
        for h in self.history[-1 - TIMINGS_LOOKBACK:-1]:
            if h["timings"] is None:
                h["timings"] = self._timings(h["generation"])
        self._apply(decide(self._seen(
            desired_new, ready_new, prev=tuple(cur["prev"]), ok=cur["ok"], verified=cur["verified"],
            failed=tuple(w for w in self.members if self.valid(keys.fail(g, w))),
            stale=tuple(w for w in self.members if not self.gone(w) and not alive(w)),
            joining=self.formation.joining(self.members, self.gone, self.min_workers) if cur["ok"] is None else None,
            verdict_reason=self._verdict_reason, gone=self.gone,
            alive_not_done=lambda w: alive(w) and not self.valid(keys.done(w)),
            fail_reason=lambda w: self.records.read(keys.fail(g, w)))))

    def _seen(self, desired_new: list[int], ready_new: list[int], **read: Any) -> Seen:
        return Seen(self.generation, tuple(self.members), tuple(self.desired), frozenset(self.rejected),
                    self.min_workers, desired_new=tuple(desired_new), ready_new=tuple(ready_new), **read)

    def _apply(self, decision: Decision) -> None:
        """Carry out what next_generation.decide said: the only writes of a decision."""
        if decision.rollback is not None:
            self.history[-1]["verified"] = True  # decided, so it is reported
            self.reject(list(decision.rollback))
        step = decision.step
        if isinstance(step, End):
            self.end(step.reason, step.cause)
        elif isinstance(step, Hold):
            self.hold(step.reason, list(step.workers), step.phase)
        elif isinstance(step, Publish):
            if step.failure is not None and self.failed_again(*step.failure):
                return
            self.reject(list(step.reject))
            if step.desired is not None:
                self.set_desired(list(step.desired))
            self.publish(list(step.members), step.kind, step.message)
        elif isinstance(step, Settled):
            self.unreachable = None
            self._busy = False   # settled: full reads only every IDLE_TICK_S
        elif isinstance(step, Unreachable):
            if self.unreachable is None or self.unreachable["reason"] != step.reason:
                log.warning("membership %s cannot be reached: %s", self.desired, step.reason)
            self.unreachable = {"desired": list(self.desired), "reason": step.reason}
            self._busy = False   # a resize or an event looks again

    def _read_request(self) -> None:
        """A worker's signed desired_request (resizing.Requests: acted on once, when newer)."""
        members = self.requests.read(self.get_json(keys.DESIRED_REQUEST), self.known, self.min_workers)
        if members is not None:
            self.set_desired(members)
            self.known |= set(self.desired)

    def _ready(self, wid: int) -> bool:
        return self.valid(keys.ready(wid))

    def _timings(self, g: int) -> Any:
        """Generation g's timings (rank 0 writes them after its first step): progress."""
        t = self.get_json(keys.timings(g))
        self.streak.trained(t.get("step") if isinstance(t, dict) else None)
        return t

    def _read_verdict(self, g: int, cur: dict[str, Any]) -> None:
        if cur["ok"] is None:
            v = self.get_json(keys.verdict(g))
            if isinstance(v, dict):
                self.formation.done()
                cur["ok"] = bool(v.get("ok"))
                cur["verified"] = cur["ok"]
                if failpoints.ARMED and cur["ok"]: failpoints.hit("coordinator.formed", gen=g)
                if not cur["ok"]:
                    self._verdict_reason = printable(v.get("reason") or "no reason given", 500)
                    cur["message"] += f"; rolled back: {self._verdict_reason}"
        if cur["timings"] is None:
            cur["timings"] = self._timings(g)

    # ---- what the control socket asks -----------------------------------------------
    def status(self) -> dict[str, Any]:
        """The job as the control side sees it; a generation counts as verified once its
        timings arrived (or a newer one exists). `forged`: {"count": records that failed
        verification and were ignored (each distinct record once), "last": the key of the
        newest one (None: none)}. `history`: the last HISTORY_KEPT generations of
        `generations_total`. `abort`, `held` ({reason, since, workers, phase}), `unreachable` (null or {reason, ...}),
        `crashed`, `waiting`, `known` (every id ever wanted), `rejected` (ids left out for
        good) and `left_out` (newcomers left out of a resize: {n, wid, reason, phase,
        generation, at}, n counting them) lists,
        `forming` (null or {generation, since, waiting_for, phase}) and `stopped` (null or
        {wid, by, step, of}: stop_record) are always present."""
        cur = self.history[-1] if self.history else None
        settled = bool(cur and cur["verified"] and cur["ok"] and sorted(self.members) == self.desired
                       and self.abort is None and self.held is None)
        return {"generation": self.generation, "members": self.members, "desired": self.desired,
                "settled": settled, "finished": self.finished, "stopped": self.stopped, "progress": self.progress,
                "forged": self.forged.summary(), "min_workers": self.min_workers,
                "abort": self.abort, "held": self.held, "unreachable": self.unreachable,
                "forming": None if self.finished or self.abort or self.held else self.formation.record(),
                "crashed": [self.reports.crashed[w] for w in sorted(self.reports.crashed)],
                "waiting": self.reports.waiting, "generations_total": self.generation, "known": sorted(self.known),
                "left_out": list(self.warm_ups.left_out), "rejected": sorted(self.rejected),
                "history": [dict(h, verified=h["verified"] and (h["timings"] is not None or h is not cur))
                            for h in self.history]}

    def resize(self, wanted: Any) -> list[int]:
        """The desired membership from now on (ValueError: not a non-empty list of ids, fewer
        than the job's minimum, or the job was aborted)."""
        self.set_desired(check_resize(wanted, self.min_workers, self.abort))
        self.known |= set(self.desired)
        self.unreachable = None
        self._busy = True
        return self.desired


def stop_record(value: Any) -> dict[str, Any] | None:
    """keys.STOPPED's value checked (a verified record, still not trusted to be well-formed):
    {wid, by, step, of} with `by` one of STOP_ASKERS, so no text of the store's reaches an
    event; None when it is not that."""
    if not isinstance(value, dict):
        return None
    nums = [value.get(k) for k in ("wid", "step", "of")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2 ** 53 for n in nums):
        return None
    by = value.get("by")
    return {"wid": nums[0], "by": by if by in STOP_ASKERS else "a stop request", "step": nums[1], "of": nums[2]}
