"""The coordinator's generation logic: from the store's heartbeats, failure reports,
readiness, verdicts and the desired membership to the next generation.

Each full read decides:

- recover: a member of the current generation reported a failure or stopped beating;
  once every member has reported, gone stale or finished, the reporters (plus ready
  newcomers) form the next generation;
- rollback: the newest generation's state did not verify; the previous members
  (leavers included, they wait for the verdict) form the next one and the newcomers are
  rejected;
- resize: the desired membership differs and every newcomer is ready;
- release: workers wanted once but no longer, before they ever joined, exit 0.

Every tick reads one key, the events counter that workers bump after each write the
coordinator acts on. The full read (a dozen keys per member) runs when that counter moved,
while anything is pending (a formation, a resize, a failure), and every IDLE_TICK_S in a
settled job, for heartbeats and progress; a settled job thus costs the coordinator almost
no CPU beside the workers it shares a host with.

Nothing a worker writes is believed unless it verifies (auth.py): a record that does not is
ignored as if absent, counted and logged, and `status()["forged"]` reports it. The records
the coordinator wrote itself (`run`, `latest`, the newest `members/{g}`) are checked at each
full read and put back when someone changed them; a record published ahead of it (a forged
`members/{g+1}`) is deleted.

The store is reached through the few TCPStore methods in `Store`, and time through
injected clocks, so the decisions run in tests without processes (tests/fakes/store_fake.py).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Callable, Protocol

from gpuflex.elastic import keys
from gpuflex.elastic.auth import ForgeryLog, SignedRecords, Signer

log = logging.getLogger(__name__)

IDLE_TICK_S = 0.5   # full reads of a settled job: heartbeat staleness and progress


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
    (monotonic: heartbeat staleness, idle ticks) and `wall` (time.time: records, the start
    timeout) are injected so the decisions can be tested without processes. `secret` is
    the job's HMAC key (None: an unauthenticated job, see auth.py). Not thread-safe: the
    coordinator serializes calls."""

    def __init__(self, store: Store, initial: list[int], hb_timeout_s: float,
                 start_timeout_s: float = 600, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, secret: str | None = None) -> None:
        self.store = store
        run = secrets.token_hex(8)   # binds this store's records to this run of the job
        self._run_text = Signer(secret).sign(keys.RUN, run)
        self.signer = Signer(secret, run)
        self.forged = ForgeryLog("coordinator")
        self.records = SignedRecords(self.has, store.get, self.signer, self.forged)
        self._request_seq = 0                    # the newest desired_request acted on
        self._own: dict[str, str] = {keys.RUN: self._run_text}   # records it wrote and keeps
        self.hb_timeout_s = hb_timeout_s
        self.start_timeout_s = start_timeout_s
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
        self.started = wall()
        self._hb_seen: dict[int, tuple[str, float]] = {}
        self.progress: dict[str, Any] | None = None
        self._events = -1
        self._busy = True          # something is pending: read everything every tick
        self._last_full = 0.0
        store.set(keys.RUN, self._run_text)
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

    def alive(self, wid: int) -> bool:
        """A worker is alive while its heartbeat counter keeps changing."""
        key = keys.hb(wid)
        now = self.clock()
        if not self.has(key):
            return False
        value = self.store.get(key).decode(errors="replace")
        prev = self._hb_seen.get(wid)
        if prev is None or prev[0] != value:
            self._hb_seen[wid] = (value, now)
            return True
        return now - prev[1] < self.hb_timeout_s

    def gone(self, wid: int) -> bool:
        return self.valid(keys.done(wid)) or self.valid(keys.left(wid))

    # ---- decisions -----------------------------------------------------------------
    def publish(self, members: list[int], kind: str, message: str) -> None:
        g = self.generation + 1
        rec = {"generation": g, "kind": kind, "members": members, "prev": self.members,
               "created": self.wall(), "message": message}
        text = self.signer.sign(keys.members(g), json.dumps(rec))
        self._own.pop(keys.members(self.generation), None)
        self._own[keys.members(g)] = text
        self._own[keys.LATEST] = str(g)
        self.store.set(keys.members(g), text)
        self.store.set(keys.LATEST, str(g))
        self.generation, self.members = g, list(members)
        self.ever_members |= set(members)
        self.history.append({**rec, "verified": False, "ok": None, "timings": None})
        log.info("generation %d (%s): members %s - %s", g, kind, members, message)

    def tick(self) -> None:
        """One look at the store: the events counter, and everything when it moved, while
        anything is pending, or every IDLE_TICK_S."""
        events = self.store.add(keys.EVENTS, 0)
        now = self.clock()
        if events == self._events and not self._busy and now - self._last_full < IDLE_TICK_S:
            return
        self._events, self._last_full = events, now
        self._busy = True
        self._tick()

    def _tick(self) -> None:
        self._keep_own_records()
        if self.has(keys.PROGRESS):
            self.progress = _progress(self.store.get(keys.PROGRESS))
        self._read_request()
        if self.valid(keys.FINISHED):
            self.finished = True
        if self.finished:
            self._busy = False
            return
        for w in self.known - set(self.desired) - self.ever_members - self.released:
            self.released.add(w)   # wanted once, never joined, no longer wanted
            self.write(keys.released(w), "1")
        desired_new = [w for w in self.desired
                       if w not in self.ever_members and w not in self.rejected]
        ready_new = [w for w in desired_new if self.valid(keys.ready(w)) and self.alive(w)]
        if self.generation == 0:
            waited = self.wall() - self.started
            if len(ready_new) == len(desired_new) or (ready_new and waited > self.start_timeout_s):
                self.publish(ready_new, "initial", f"{len(ready_new)} worker(s) ready")
            return
        g, cur = self.generation, self.history[-1]
        self._read_verdict(g, cur)
        for h in self.history[:-1]:
            if h["timings"] is None:
                h["timings"] = self.get_json(keys.timings(h["generation"]))
        failed = [w for w in self.members if self.valid(keys.fail(g, w))]
        stale = [w for w in self.members if not self.gone(w) and not self.alive(w)]
        if cur["ok"] is False:
            self._rollback(cur)
            return
        if failed or stale:
            undecided = [w for w in self.members
                         if w not in failed and w not in stale and not self.gone(w)]
            if undecided:
                return  # the others will see the failure at their next collective
            survivors = [w for w in failed if w not in stale]
            joiners = [w for w in ready_new if w not in survivors]
            keep = [w for w in survivors if w in self.desired] or survivors
            if keep or joiners:
                lost = [w for w in self.members if w not in survivors]
                self.desired = [w for w in self.desired if w not in lost]
                self.store.set(keys.DESIRED, json.dumps(self.desired))
                self.publish(keep + joiners, "recover", f"lost worker(s) {lost}")
            return
        if not cur["verified"]:
            return
        if self.desired != sorted(self.members) and set(desired_new) == set(ready_new):
            keep = [w for w in self.members if w in self.desired]
            if keep:
                self.publish(keep + sorted(ready_new), "resize",
                             f"resize {len(self.members)} -> {len(keep) + len(ready_new)}")
        elif self.desired == sorted(self.members):
            self._busy = False   # settled: full reads only every IDLE_TICK_S

    def _keep_own_records(self) -> None:
        """The records only the coordinator writes, as it wrote them: one changed by someone
        else is put back, one published ahead of it deleted; each counted as forged."""
        for key, text in self._own.items():
            have = self.store.get(key) if self.has(key) else None
            if have is None or have.decode(errors="replace") != text:
                if have is not None:
                    self.forged.note(key, have, "overwritten")
                self.store.set(key, text)
        ahead = keys.members(self.generation + 1)
        if self.has(ahead):
            self.forged.note(ahead, self.store.get(ahead), "not published by the coordinator")
            self.store.delete_key(ahead)

    def _read_request(self) -> None:
        """A worker's signed desired_request, {"members": [...], "seq": n}: acted on once,
        and only when newer than the last one (an old request replayed is ignored)."""
        req = self.get_json(keys.DESIRED_REQUEST)
        if req is None:
            return
        members, seq = (req.get("members"), req.get("seq")) if isinstance(req, dict) else (None, None)
        if not isinstance(seq, int) or not isinstance(members, list) or not members \
                or not all(isinstance(w, int) and not isinstance(w, bool) for w in members):
            self.forged.note(keys.DESIRED_REQUEST, json.dumps(req), "malformed request")
            return
        if seq <= self._request_seq:
            if seq < self._request_seq:
                self.forged.note(keys.DESIRED_REQUEST, json.dumps(req), "replayed")
            return
        self._request_seq = seq
        self.desired = sorted(set(members))
        self.known |= set(self.desired)
        self.store.set(keys.DESIRED, json.dumps(self.desired))

    def _read_verdict(self, g: int, cur: dict[str, Any]) -> None:
        if cur["ok"] is None:
            v = self.get_json(keys.verdict(g))
            if isinstance(v, dict):
                cur["ok"] = bool(v.get("ok"))
                cur["verified"] = cur["ok"]
                if not cur["ok"]:
                    cur["message"] += f"; rolled back: {v.get('reason')}"
        if cur["timings"] is None:
            cur["timings"] = self.get_json(keys.timings(g))

    def _rollback(self, cur: dict[str, Any]) -> None:
        newcomers = [w for w in cur["members"] if w not in cur["prev"]]
        for w in newcomers:
            self.rejected.add(w)
            self.write(keys.rejected(w), "1")
        back = [w for w in cur["prev"] if self.alive(w) and not self.valid(keys.done(w))]
        self.desired = sorted(back)
        self.store.set(keys.DESIRED, json.dumps(self.desired))
        cur["ok"] = False
        cur["verified"] = True  # decided, so it is reported
        self.publish(back, "rollback", f"state check failed; back to {back}")

    # ---- what the control socket asks -----------------------------------------------
    def status(self) -> dict[str, Any]:
        """The job as the control side sees it; a generation counts as verified once its
        timings arrived (or a newer one exists). `forged`: {"count": records that failed
        verification and were ignored (each distinct record once), "last": the key of the
        newest one (None: none)}."""
        cur = self.history[-1] if self.history else None
        settled = bool(cur and cur["verified"] and cur["ok"] and sorted(self.members) == self.desired)
        return {"generation": self.generation, "members": self.members, "desired": self.desired,
                "settled": settled, "finished": self.finished, "progress": self.progress,
                "forged": self.forged.summary(),
                "history": [dict(h, verified=h["verified"] and (h["timings"] is not None or h is not cur))
                            for h in self.history]}

    def resize(self, wanted: Any) -> list[int]:
        """The desired membership from now on (ValueError: not a non-empty list of ids)."""
        if not isinstance(wanted, list) or not wanted or not all(isinstance(w, int) for w in wanted):
            raise ValueError("members must be a non-empty list of worker ids")
        self.desired = sorted(set(wanted))
        self.known |= set(self.desired)
        self.store.set(keys.DESIRED, json.dumps(self.desired))
        self._busy = True
        return self.desired


def _progress(raw: bytes) -> dict[str, Any] | None:
    """Rank 0's progress (unsigned: shown, never acted on); None unless a JSON object."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
