"""The worker's control socket ops: status, resize (a poke), checkpoint, stop."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from gpuflex.elastic.control import ControlServer

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun


def start_control(run: "ElasticRun") -> ControlServer | None:
    path = os.environ.get("GPUFLEX_CONTROL")
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
            run.rdzv.set("desired_request", json.dumps(sorted(set(members))))
        run._poke.set()
        return {"poked": True}

    def checkpoint(_msg: dict[str, Any]) -> dict[str, Any]:
        run._checkpoint_requested.set()
        return {"requested": True}

    def stop(_msg: dict[str, Any]) -> dict[str, Any]:
        run._stop_requested.set()
        return {"stopping": True}

    return ControlServer(path, {"status": status, "resize": resize, "checkpoint": checkpoint, "stop": stop})
