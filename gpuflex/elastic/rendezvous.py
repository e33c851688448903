"""The worker's side of the store protocol (see gpuflex.elastic.keys).

Every store failure surfaces as `StoreLost`: the runtime then exits with
STORE_LOST_EXIT and gpuflex restarts the job from its last on-disk checkpoint.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from typing import Any, Callable

from torch.distributed import TCPStore

from gpuflex.elastic import keys

POLL_S = 0.01
WATCH_S = 0.1   # how often the heartbeat thread looks for a newer generation


class StoreLost(Exception):
    pass


class Superseded(Exception):
    """A newer generation was published while this one was forming."""


class Evicted(Exception):
    pass


class Leaving(Exception):
    """This worker was retired (a verified shrink, or released before it ever joined): exit 0."""


class Rendezvous:
    def __init__(self, address: str, wid: int, *, timeout_s: float = 60, heartbeat_s: float = 0.5) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.wid = host, int(port), wid
        self.timeout = dt.timedelta(seconds=timeout_s)
        self.store = self._connect()
        self.lost = threading.Event()
        self.newer = threading.Event()   # a generation after `watching` has been published
        self.watching = 0
        self.progress: str | None = None   # rank 0's status, sent by the heartbeat thread
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
        latest = self.latest()
        return latest if latest > current else 0

    def post_progress(self, status: str) -> None:
        """Rank 0's status for `gpuflex status`: the heartbeat thread sends it."""
        self.progress = status

    def watch_after(self, g: int) -> None:
        """Generation g is the current one: watch for g+1."""
        self.watching = g
        self.newer.clear()

    def close(self) -> None:
        self._stop.set()
        if self._hb.is_alive() and self._hb is not threading.current_thread():
            self._hb.join(timeout=5)

    # ---- store access that turns every failure into StoreLost ---------------------------
    def _call(self, fn: Callable, *args) -> Any:
        if self.lost.is_set():
            raise StoreLost("the job store stopped answering heartbeats")
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:
            self.lost.set()
            raise StoreLost(f"job store error: {e}") from None

    def has(self, key: str) -> bool:
        return self._call(self.store.check, [key])

    def set(self, key: str, value: str) -> None:
        self._call(self.store.set, key, value)
        self._call(self.store.add, keys.EVENTS, 1)

    def get_json(self, key: str) -> Any:
        return json.loads(self._call(self.store.get, key))

    def latest(self) -> int:
        return int(self._call(self.store.get, keys.LATEST)) if self.has(keys.LATEST) else 0

    def generation(self, g: int) -> dict[str, Any]:
        return self.get_json(keys.members(g))

    # ---- protocol steps -------------------------------------------------------------
    def wait_for_generation(self, after: int, was_member: bool, stop: Callable[[], bool]) -> dict[str, Any] | None:
        """The newest generation > `after` that includes this worker.

        Returns None when `stop()` becomes true. Raises Evicted when this worker, once a
        member, is left out of a newer generation, or when the coordinator rejected it.
        """
        polls = 0
        while not stop():
            if polls % 10 == 0:   # the rarer outcomes are looked at every 10th poll
                if self.has(keys.rejected(self.wid)):
                    raise Evicted("the coordinator rejected this worker")
                if self.has(keys.released(self.wid)):
                    raise Leaving("released before joining")
                if self.has(keys.FINISHED):
                    raise Leaving("training finished before this worker joined")
            polls += 1
            g = self.latest()
            if g > after:
                info = self.generation(g)
                if self.wid in info["members"]:
                    return info
                if was_member and self.wid in info["prev"]:
                    raise Evicted(f"left out of generation {g}")
                after = g if not was_member else after
            time.sleep(POLL_S)
        return None

    def barrier(self, g: int, members: list[int], timeout_s: float) -> None:
        """Wait until every member of g has arrived; Superseded if a newer one appears."""
        self.set(keys.joined(g, self.wid), "1")
        pending = [keys.joined(g, w) for w in members]
        deadline = time.monotonic() + timeout_s
        while pending:
            pending = [k for k in pending if not self.has(k)]
            if not pending:
                return
            if self.latest() > g:
                raise Superseded(g)
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {g}: members missing at the barrier: {pending}")
            time.sleep(POLL_S)

    def report_fail(self, g: int, why: str) -> None:
        self.set(keys.fail(g, self.wid), why[:500])

    def wait_verdict(self, g: int, stop: Callable[[], bool]) -> bool | None:
        """For a leaver: True once g verified, False if it was rolled back (or superseded)."""
        while not stop():
            if self.has(keys.verdict(g)):
                return bool(self.get_json(keys.verdict(g)).get("ok"))
            if self.latest() > g:
                return False
            time.sleep(POLL_S)
        return None
