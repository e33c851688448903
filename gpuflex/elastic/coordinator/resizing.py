"""What a resize waits on before the coordinator can publish it: a request for a new desired
membership, and that membership's newcomers becoming ready.

Requests come two ways: the control socket's `resize` (the CLI's `gpuflex scale`, checked by
`check_resize`), and a worker's signed `desired_request` in the store (`Requests`: acted on
once, only when newer than the last, never when malformed or replayed).

A newcomer warms up (imports, builds its model, compiles a first step) before it says it is
ready, and the resize waits for every desired newcomer. Issue 16's fault matrix found the
wait unbounded: a newcomer killed while it warmed up never says it is ready, so the resize
stayed pending for the rest of the job (the job trained on at the old size, stayed
"scaling", `scale --wait` timed out). `WarmUps` bounds it as the formation deadline
(forming.py) bounds a formation:

- dead: a desired newcomer whose heartbeat went stale (it beat, then stopped) before it was
  taken into a generation, at once;
- never started: one with no heartbeat and no ready record `timeout_s` after it was first
  wanted. One that beats is warming up, however long that takes (a compile may take
  minutes).

The coordinator leaves such newcomers out (rejected, dropped from the desired membership:
the resize goes on with the rest, or the job stays at its size) and status lists each under
`left_out`, naming the worker and the phase, so the control side can say why a resize
ended short. Standard library only.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.auth import ForgeryLog
from gpuflex.elastic.coordinator.failures import Heartbeats, members_ok
from gpuflex.elastic.protocol.store_values import MAX_WID, is_id_list

log = logging.getLogger(__name__)

WARM_UP = "warm-up"
READY_WAITING = "ready, waiting for the resize"
LEFT_OUT_KEPT = 20   # records of left-out newcomers status lists (the newest)


def check_resize(wanted: Any, min_workers: int, abort: dict[str, str] | None) -> list[int]:
    """`wanted` as a desired membership; ValueError when it is not a non-empty list of ids,
    names fewer than the job's minimum, or the job was aborted."""
    if not is_id_list(wanted):
        raise ValueError(f"members must be a non-empty list of worker ids (0..{MAX_WID})")
    if len(set(wanted)) < min_workers:
        raise ValueError(f"{len(set(wanted))} worker(s) is below the job's minimum of {min_workers}")
    if abort is not None:
        raise ValueError(f"the job was aborted: {abort['reason']}")
    return list(wanted)


class Requests:
    """Workers' signed desired_request records, {"members": [...], "seq": n}: `read` returns
    the members of one newer than the last acted on, else None; a malformed or replayed one
    is noted in `forged`, one below the job's minimum logged and ignored."""

    def __init__(self, forged: ForgeryLog) -> None:
        self.forged = forged
        self.seq = 0   # the newest request acted on

    def read(self, req: Any, known: set[int], min_workers: int) -> list[int] | None:
        if req is None:
            return None
        members, seq = (req.get("members"), req.get("seq")) if isinstance(req, dict) else (None, None)
        if not isinstance(seq, int) or not members_ok(members, known):
            self.forged.note(keys.DESIRED_REQUEST, json.dumps(req), "malformed request")
            return None
        if seq <= self.seq:
            if seq < self.seq:
                self.forged.note(keys.DESIRED_REQUEST, json.dumps(req), "replayed")
            return None
        self.seq = seq
        if len(set(members)) < min_workers:
            log.warning("ignored a request for %s: below the job's minimum of %d workers", members, min_workers)
            return None
        return list(members)


class WarmUps:
    """The desired newcomers of a running job, from when each was first wanted until a
    generation takes it in: `overdue` says which to leave out (see the module's doc) and
    keeps a record of each in `left_out`. `heartbeats` tells dead from alive; `clock`
    (monotonic) times the deadline, `wall` dates the records."""

    def __init__(self, timeout_s: float, heartbeats: Heartbeats, *, clock: Callable[[], float],
                 wall: Callable[[], float]) -> None:
        if not timeout_s > 0:
            raise ValueError(f"warm-up timeout must be positive, not {timeout_s}")
        self.timeout_s, self.heartbeats, self.clock, self.wall = timeout_s, heartbeats, clock, wall
        self.wanted_since: dict[int, float] = {}
        self.left_out: list[dict[str, Any]] = []   # {n, wid, reason, phase, generation, at}
        self.count = 0

    def overdue(self, newcomers: list[int], ready: Callable[[int], bool], generation: int) -> list[int]:
        """The newcomers among `newcomers` (desired, not yet members) to leave out now."""
        now = self.clock()
        self.wanted_since = {w: self.wanted_since.get(w, now) for w in newcomers}
        out = []
        for w in newcomers:
            is_ready = ready(w)
            if self.heartbeats.has(keys.hb(w)):
                if self.heartbeats.alive(w):
                    continue
                reason = "stopped beating " + ("after it was ready, before the resize took it in" if is_ready
                                               else "while it warmed up, before it was ready")
            elif not is_ready and now - self.wanted_since[w] > self.timeout_s:
                reason = f"neither beat nor became ready within {self.timeout_s:g} s of being wanted"
            else:
                continue
            out.append(w)
            self._note(w, reason, READY_WAITING if is_ready else WARM_UP, generation)
        return out

    def _note(self, wid: int, reason: str, phase: str, generation: int) -> None:
        self.count += 1
        self.wanted_since.pop(wid, None)
        log.warning("newcomer %d left out of the resize (%s): %s", wid, phase, reason)
        self.left_out.append({"n": self.count, "wid": wid, "reason": reason, "phase": phase,
                              "generation": generation, "at": self.wall()})
        del self.left_out[:-LEFT_OUT_KEPT]
