"""What a harvest tick decides (gpuflex.policy.harvest.plan): its actions, as plain records
the control side carries out in committed steps (gpuflex.control.harvest) and `gpuflex
harvest --json` prints (`action_json`). Pure, as the rest of policy/."""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from gpuflex.policy.placement import Assignment

GpuRef = tuple[str, int]          # (host, device index)


@dataclasses.dataclass(frozen=True)
class HostDown:
    host: str
    error: str


@dataclasses.dataclass(frozen=True)
class Yield:
    """Retire `wids` of `job` (in place): a foreign process is on `gpus` since `since`."""

    job: int
    wids: tuple[int, ...]
    gpus: tuple[GpuRef, ...]
    since: float
    reason: str


@dataclasses.dataclass(frozen=True)
class Requeue:
    """Checkpoint and requeue `job`: yielding `gpus` would take it below MIN."""

    job: int
    wids: tuple[int, ...]         # the workers on the reclaimed GPUs
    gpus: tuple[GpuRef, ...]
    since: float
    reason: str


@dataclasses.dataclass(frozen=True)
class Place:
    """Start a queued job (as lifecycle.place_queued will)."""

    job: int
    assignments: tuple[Assignment, ...]


@dataclasses.dataclass(frozen=True)
class Grow:
    """One more worker for a --harvest job on idle `devices` of `host`."""

    job: int
    host: str
    devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Shrink:
    """Retire `wids` of `job` in place (the throughput policy: its devices do more elsewhere)."""

    job: int
    wids: tuple[int, ...]
    reason: str


@dataclasses.dataclass(frozen=True)
class Note:
    """Why the throughput policy resized `job`, or left it at its size (an event)."""

    job: int
    reason: str


Action = Union[HostDown, Yield, Requeue, Place, Grow, Shrink, Note]
_NAMES = {HostDown: "host-down", Yield: "yield", Requeue: "requeue", Place: "place", Grow: "grow",
          Shrink: "shrink", Note: "note"}


def action_json(a: Action) -> dict[str, Any]:
    out: dict[str, Any] = {"action": _NAMES[type(a)]}
    for f in dataclasses.fields(a):
        v = getattr(a, f.name)
        if f.name == "assignments":
            v = [{"host": x.host, "devices": list(x.devices)} for x in v]
        elif isinstance(v, tuple):
            v = [list(x) if isinstance(x, tuple) else x for x in v]
        out[f.name] = v
    return out


@dataclasses.dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...] = ()

    def of(self, kind: type) -> list:
        return [a for a in self.actions if isinstance(a, kind)]

    def to_json(self) -> list[dict[str, Any]]:
        return [action_json(a) for a in self.actions]
