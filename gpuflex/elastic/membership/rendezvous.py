"""The worker's side of the store protocol (see gpuflex.elastic.protocol.keys).

Every store failure surfaces as `StoreLost`: the runtime then exits with
STORE_LOST_EXIT and gpuflex restarts the job from its last on-disk checkpoint.

What this worker writes with `set` is signed with the job's secret, and what it acts on
(generation records, verdicts, barrier arrivals, rejected/released/finished) is believed
only when it verifies (auth.py, keys.py): a forged record is ignored as if absent, and
logged once. `latest` is only a hint: the record it names must verify.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from typing import Any, Callable

from torch.distributed import TCPStore

from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.auth import Forged, ForgeryLog, SignedRecords, Signer

POLL_S = 0.01
WATCH_S = 0.1   # how often the heartbeat thread looks for a newer generation


class StoreLost(Exception):
    pass


class Superseded(Exception):
    """A newer generation was published while this one was forming."""


class Evicted(Exception):
    pass


_ABSENT = "\x00absent"   # no record's value: text records hold no NUL


class Leaving(Exception):
    """This worker was retired (a verified shrink, or released before it ever joined): exit 0."""


class Aborted(Exception):
    """The coordinator ended the job (its signed `abort` record): exit ABORTED_EXIT."""


class Rendezvous:
    """This worker's connection to the job store. `secret`: the job's HMAC key (None: an
    unauthenticated job, which then accepts only unsigned records, see auth.py)."""

    def __init__(self, address: str, wid: int, *, secret: str | None = None, timeout_s: float = 60,
                 heartbeat_s: float = 0.5) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.wid = host, int(port), wid
        self.timeout = dt.timedelta(seconds=timeout_s)
        self.forged = ForgeryLog(f"gpuflex[w{wid}]")
        self.closed = False
        self.store = self._connect()
        self.lost = threading.Event()
        self.signer = self._read_run(Signer(secret), timeout_s)
        self.records = SignedRecords(self.has, lambda key: self._call(self.store.get, key), self.signer,
                                     self.forged)
        self.newer = threading.Event()   # a generation after `watching` has been published
        self.watching = 0
        self.progress: str | None = None   # rank 0's status, sent by the heartbeat thread
        self._on_beat: list[Callable[[TCPStore], None]] = []
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._beat, args=(heartbeat_s,), name="gpuflex-heartbeat",
                                    daemon=True)
        self._hb.start()

    def _connect(self) -> TCPStore:
        try:
            return TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                            timeout=self.timeout)
        except (RuntimeError, OSError) as e:
            raise StoreLost(f"cannot reach the job store at {self.host}:{self.port}: {e}") from None

    def _read_run(self, base: Signer, timeout_s: float) -> Signer:
        """The signer of this run of the store, from the coordinator's signed `run` record
        (it puts the record back if someone changes it: wait for a valid one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self._call(self.store.get, keys.RUN)
            try:
                return base.for_run(base.verify(keys.RUN, text))
            except Forged as e:
                self.forged.note(keys.RUN, text, e.reason)
            if time.monotonic() > deadline:
                raise StoreLost("the job store's run record is not signed with this job's secret")
            time.sleep(0.1)

    def _beat(self, period: float) -> None:
        """The heartbeat, the watch for a generation newer than `watching` and rank 0's
        progress, on a connection of their own: the training thread learns of a resize from `newer`
        without a store round trip of its own (one is ~1 ms on a busy host)."""
        try:
            store = self._connect()
            last_beat = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_beat >= period:
                    store.add(keys.hb(self.wid), 1)
                    last_beat = now
                if not self.newer.is_set() and store.check([keys.members(self.watching + 1)]):
                    self.newer.set()
                progress, self.progress = self.progress, None
                if progress is not None:
                    store.set(keys.PROGRESS, progress)
                for fn in self._on_beat:
                    fn(store)
                self._stop.wait(WATCH_S)
        except (RuntimeError, OSError, StoreLost):
            self.lost.set()

    def newer_generation(self, current: int, poked: bool) -> int:
        """Rank 0 at a step boundary: the latest generation if it is newer than `current`,
        else 0. The store is asked only when the watch saw one or a poke came, so a settled
        step makes no store call."""
        if not (poked or self.newer.is_set()):
            return 0
        self.newer.clear()   # the watch looks again if this one is not newer after all
        return self.newest_after(current)

    def newest_after(self, g: int) -> int:
        """The latest generation if it is newer than g and its record verifies, else 0."""
        latest = self.latest()
        return latest if latest > g and self.generation(latest) is not None else 0

    def post_progress(self, status: str) -> None:
        """Rank 0's status for `gpuflex status`: the heartbeat thread sends it."""
        self.progress = status

    def watch_after(self, g: int) -> None:
        """Generation g is the current one: watch for g+1."""
        self.watching = g
        self.newer.clear()

    def on_beat(self, fn: Callable[[TCPStore], None]) -> None:
        """Call `fn(store)` from the heartbeat thread every WATCH_S, on its own connection
        (the training thread may be blocked on its own in a wait); its store errors count
        as a lost store."""
        self._on_beat.append(fn)

    def close(self) -> None:
        """Stop the heartbeat; later store calls raise StoreLost."""
        self.closed = True
        self._stop.set()
        if self._hb.is_alive() and self._hb is not threading.current_thread():
            self._hb.join(timeout=5)

    def records_on(self, store: TCPStore) -> SignedRecords:
        """This job's signed records read over another connection (the heartbeat thread's)."""
        return SignedRecords(lambda key: store.check([key]), store.get, self.signer, self.forged)

    def sign(self, key: str, value: str) -> str:
        return self.signer.sign(key, value)

    def abort_reason(self) -> str | None:
        """The coordinator's reason when it ended the job (a signed `abort` record)."""
        rec = self.get_json(keys.ABORT)
        if rec is None:
            return None
        return str(rec.get("reason") if isinstance(rec, dict) else rec)[:500]

    def check_abort(self) -> None:
        reason = self.abort_reason()
        if reason is not None:
            raise Aborted(reason)

    # ---- store access that turns every failure into StoreLost ---------------------------
    def _call(self, fn: Callable, *args) -> Any:
        if self.lost.is_set():
            raise StoreLost("the job store stopped answering heartbeats")
        if self.closed:
            raise StoreLost("the connection to the job store was closed")
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:
            self.lost.set()
            raise StoreLost(f"job store error: {e}") from None

    def has(self, key: str) -> bool:
        return self._call(self.store.check, [key])

    def set(self, key: str, value: str) -> None:
        """A signed record, then the events counter."""
        self._call(self.store.set, key, self.signer.sign(key, value))
        self._call(self.store.add, keys.EVENTS, 1)

    def add(self, key: str, amount: int) -> int:
        return self._call(self.store.add, key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str) -> bytes:
        """`desired` if `key` is absent (expected "") or holds `expected`; the value after."""
        return self._call(self.store.compare_set, key, expected, desired)

    def append(self, key: str, value: str) -> None:
        """Append to `key` (created when absent): the store answers nothing, so it costs no round trip."""
        self._call(self.store.append, key, value)

    def peek(self, key: str) -> bytes | None:
        """The value of `key`, None when absent, without waiting for it (one round trip: a
        compare_set whose expected value no key holds creates nothing)."""
        value = self._call(self.store.compare_set, key, _ABSENT, _ABSENT)
        return None if value == _ABSENT.encode() else value

    def wait_get(self, key: str, timeout_s: float) -> bytes | None:
        """The value of `key` once it exists (one round trip: the store answers when it is
        set); None when `timeout_s` passed first."""
        if self.lost.is_set() or self.closed:
            raise StoreLost("the job store stopped answering heartbeats")
        self.store.set_timeout(dt.timedelta(seconds=timeout_s))
        try:
            return self.store.get(key)
        except (RuntimeError, OSError) as e:
            if "timeout" in str(e).lower():
                return None
            self.lost.set()
            raise StoreLost(f"job store error: {e}") from None
        finally:
            self.store.set_timeout(self.timeout)

    def valid(self, key: str) -> bool:
        """A signed record is there and verifies (a forged one is logged once)."""
        return self.records.valid(key)

    def get_json(self, key: str) -> Any:
        """A signed JSON record's value; None when absent, forged or not JSON."""
        return self.records.json(key)

    def latest(self) -> int:
        """The newest generation number, a hint (unsigned): 0 when absent or not a number."""
        raw = self._call(self.store.get, keys.LATEST) if self.has(keys.LATEST) else b"0"
        try:
            return max(0, int(raw))
        except ValueError:
            return 0

    def generation(self, g: int) -> dict[str, Any] | None:
        """Generation g's record; None when it is absent, forged or not one of g."""
        rec = self.get_json(keys.members(g))
        if not (isinstance(rec, dict) and rec.get("generation") == g
                and isinstance(rec.get("members"), list) and isinstance(rec.get("prev"), list)
                and all(isinstance(w, int) for w in rec["members"] + rec["prev"])):
            return None
        return rec

    def record(self, g: int, stop: Callable[[], bool]) -> dict[str, Any] | None:
        """Generation g's record, which rank 0 found valid: if it does not verify now,
        someone changed it since, and the coordinator puts it back; wait for that (None:
        `stop()` became true)."""
        while not stop():
            rec = self.generation(g)
            if rec is not None:
                return rec
            time.sleep(POLL_S)
        return None

    def request_members(self, members: list[int]) -> None:
        """Ask the coordinator for this membership (a control socket's resize), numbered so
        that an old request replayed is not acted on again."""
        seq = self._call(self.store.add, keys.REQUEST_SEQ, 1)
        self.set(keys.DESIRED_REQUEST, json.dumps({"members": members, "seq": seq}))

    def expected_place(self) -> tuple[int, int]:
        """(rank, world size) this worker expects in the generation it joins: its place in
        the coordinator's desired membership, counting itself in (survivors keep the low
        ranks). Only a guess for shaping warm-up batches (`desired` is unsigned): (0, 1)
        when it says nothing."""
        try:
            desired = json.loads(self._call(self.store.get, keys.DESIRED)) if self.has(keys.DESIRED) else None
        except ValueError:
            desired = None
        if not (isinstance(desired, list) and len(desired) <= 1 << 16):
            return 0, 1
        ids = sorted({w for w in desired if isinstance(w, int)} | {self.wid})   # not in it yet: it will be
        return ids.index(self.wid), len(ids)

    # ---- protocol steps -------------------------------------------------------------
    def wait_for_generation(self, after: int, was_member: bool, stop: Callable[[], bool]) -> dict[str, Any] | None:
        """The newest generation > `after` that includes this worker.

        Returns None when `stop()` becomes true. Raises Evicted when this worker, once a
        member, is left out of a newer generation, or when the coordinator rejected it.
        """
        polls, checked = 0, after
        while not stop():
            if polls % 10 == 0:   # the rarer outcomes are looked at every 10th poll
                self.check_abort()
                if self.valid(keys.rejected(self.wid)):
                    raise Evicted("the coordinator rejected this worker")
                if self.valid(keys.released(self.wid)):
                    raise Leaving("released before joining")
                if self.valid(keys.FINISHED):
                    raise Leaving("training finished before this worker joined")
            polls += 1
            g = self.latest()
            info = self.generation(g) if g > after else None
            if info is not None:
                if self.wid in info["members"]:
                    return info
                if was_member:
                    checked = self._left_out_after(checked, g)
                else:
                    after = g
            time.sleep(POLL_S)
        return None

    def _left_out_after(self, checked: int, g: int) -> int:
        """Raise Evicted if a generation in (checked, g] left this worker out of its previous
        members, else return g. Not only the newest: a member frozen past a recovery and
        woken after the next one was published found itself in neither's members and the
        newest's `prev`, and waited for the job's end (the fault matrix's resize.first_step
        x SIGSTOP of rank 0, whose recovery lost its last rank too)."""
        for h in range(checked + 1, g + 1):
            rec = self.generation(h)
            if rec is not None and self.wid in rec["prev"] and self.wid not in rec["members"]:
                raise Evicted(f"left out of generation {h}")
        return g

    def barrier(self, g: int, members: list[int], timeout_s: float) -> None:
        """Wait until every member of g has arrived; Superseded if a newer one appears.
        Past `timeout_s`, TimeoutError once a missing member crashed or its heartbeat counter
        stood still for the last `timeout_s / 2`; one still beating is busy, not gone (a
        resize is agreed at the members' next step boundary, so a newcomer waits here while
        a member evaluates between steps). That wait is bounded by the coordinator: a member
        alive but not joined within its formation deadline (`[jobs] formation_timeout_s`,
        coordinator/forming.py) is formed without, and the newer generation supersedes this one."""
        self.set(keys.joined(g, self.wid), "1")
        pending = {w: keys.joined(g, w) for w in members}
        start = time.monotonic()
        look, deadline = start + timeout_s / 2, start + timeout_s   # heartbeats read from `look` on only
        beats: dict[int, bytes] | None = None
        while pending:
            pending = {w: k for w, k in pending.items() if not self.valid(k)}
            if not pending:
                return
            if self.newest_after(g):
                raise Superseded(g)
            self.check_abort()
            now = time.monotonic()
            if beats is None and now > look:   # the baseline the deadline's look compares with
                beats = {}
                self._silent(pending, beats)
            elif beats is not None and now > deadline:
                silent = self._silent(pending, beats)
                if silent:
                    raise TimeoutError(f"generation {g}: members missing at the barrier: {list(pending.values())} "
                                       f"({silent})")
                deadline = now + timeout_s / 2   # all alive: look again after a while
            time.sleep(POLL_S)

    def _silent(self, pending: dict[int, str], beats: dict[int, bytes]) -> str:
        """Why a missing member counts as gone: crashed, or its heartbeat counter the same as
        at the last look (`beats`, updated); "" when every one of them beat since."""
        why = []
        for w in pending:
            if self.valid(keys.crashed(w)):
                why.append(f"worker {w} crashed")
                continue
            beat = self._call(self.store.get, keys.hb(w)) if self.has(keys.hb(w)) else b""
            if not beat or beats.get(w) == beat:
                why.append(f"worker {w} sent no heartbeat")
            beats[w] = beat
        return ", ".join(why)

    def report_fail(self, g: int, why: str) -> None:
        self.set(keys.fail(g, self.wid), why[:500])

    def wait_verdict(self, g: int, stop: Callable[[], bool]) -> bool | None:
        """For a leaver: True once g verified, False if it was rolled back (or superseded)."""
        while not stop():
            verdict = self.get_json(keys.verdict(g))
            if isinstance(verdict, dict):
                return bool(verdict.get("ok"))
            if self.newest_after(g):
                return False
            self.check_abort()
            time.sleep(POLL_S)
        return None
