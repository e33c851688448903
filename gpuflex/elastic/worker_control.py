"""The worker's control socket ops: status, resize (a poke), checkpoint, stop."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from gpuflex.elastic import keys
from gpuflex.elastic.control import ControlServer

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun


def start_control(run: "ElasticRun", path: str | None) -> ControlServer | None:
    if not path:
        return None

    def status(_msg: dict[str, Any]) -> dict[str, Any]:
        return run.status()

    def resize(msg: dict[str, Any]) -> dict[str, Any]:
        members = msg.get("members")
        if members is not None:
            if not isinstance(members, list) or not members or not all(isinstance(w, int) for w in members):
                raise ValueError("members must be a non-empty list of worker ids")
            if run.rdzv is None:
                raise ValueError("not connected to the job store yet")
            run.rdzv.set(keys.DESIRED_REQUEST, json.dumps(sorted(set(members))))
        run._poke.set()
        return {"poked": True}

    def checkpoint(_msg: dict[str, Any]) -> dict[str, Any]:
        run._checkpoint_requested.set()
        return {"requested": True}

    def stop(_msg: dict[str, Any]) -> dict[str, Any]:
        run._stop_requested.set()
        return {"stopping": True}

    return ControlServer(path, {"status": status, "resize": resize, "checkpoint": checkpoint, "stop": stop})


PROGRESS_INTERVAL_S = 1.0


def report_progress(run: "ElasticRun") -> None:
    """Rank 0 puts its status into the store about once a second (for `gpuflex status`)."""
    if run.rank != 0 or run.rdzv is None:
        return
    now = time.monotonic()
    if now - run._last_progress < PROGRESS_INTERVAL_S:
        return
    n = min(len(run.step_log), 20)
    if n >= 2:
        dt_ = run.step_log[-1][1] - run.step_log[-n][1]
        run._rate = (n - 1) * run.sampler.global_batch_size / dt_ if dt_ > 0 else 0.0
    run._last_progress = now
    run.rdzv.progress = json.dumps(run.status())   # sent by the heartbeat thread
