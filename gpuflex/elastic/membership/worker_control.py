"""The worker's control socket ops (status, resize, checkpoint, stop) and rank 0's
progress report to the store."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from gpuflex.elastic.protocol.control_socket import ControlServer
from gpuflex.elastic.membership.rendezvous import Rendezvous
from gpuflex.elastic.protocol.signals import BY_CONTROL_SOCKET, StepSignals


def start_control(path: str | None, signals: StepSignals, status: Callable[[], dict[str, Any]],
                  request_members: Callable[[list[int]], None]) -> ControlServer | None:
    """Serve the ops on `path` (None: no socket). `request_members` passes a resize's
    membership on to the coordinator (ValueError when it cannot yet)."""
    if not path:
        return None

    def on_status(_msg: dict[str, Any]) -> dict[str, Any]:
        return status()

    def resize(msg: dict[str, Any]) -> dict[str, Any]:
        members = msg.get("members")
        if members is not None:
            if not isinstance(members, list) or not members or not all(isinstance(w, int) for w in members):
                raise ValueError("members must be a non-empty list of worker ids")
            request_members(sorted(set(members)))
        signals.poke()
        return {"poked": True}

    def checkpoint(_msg: dict[str, Any]) -> dict[str, Any]:
        signals.request_checkpoint()
        return {"requested": True}

    def stop(_msg: dict[str, Any]) -> dict[str, Any]:
        signals.request_stop(BY_CONTROL_SOCKET)
        return {"stopping": True}

    return ControlServer(path, {"status": on_status, "resize": resize, "checkpoint": checkpoint, "stop": stop})


PROGRESS_INTERVAL_S = 1.0


class Progress:
    """Rank 0's throughput, and its status put into the store about once a second (for
    `gpuflex status`)."""

    def __init__(self, batch_size: int, status: Callable[[], dict[str, Any]]) -> None:
        self.batch_size, self.status = batch_size, status
        self.rate = 0.0   # samples per second over the last steps
        self._last = 0.0

    def report(self, step_log: list[list[float]], rdzv: Rendezvous, force: bool = False) -> None:
        """Called by rank 0 at each step boundary (at most once a second unless `force`)."""
        now = time.monotonic()
        if now - self._last < PROGRESS_INTERVAL_S and not force:
            return
        # the last 20 steps at the world size now: a window reaching back past a resize
        # would mix the sizes and the resize's pause into the rate the throughput policy
        # keeps for this size (gpuflex.control.throughput); 0 until two steps are at it
        n = 0
        while n < min(len(step_log), 20) and step_log[-1 - n][2] == step_log[-1][2]:
            n += 1
        dt_ = step_log[-1][1] - step_log[-n][1] if n >= 2 else 0.0
        self.rate = (n - 1) * self.batch_size / dt_ if dt_ > 0 else 0.0
        self._last = now
        rdzv.post_progress(json.dumps(self.status()))
