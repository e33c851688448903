"""The coordinator's control socket as types: its `status` reply and the `resize` request.

The control side (gpuflex.control) asks the coordinator over a Unix socket
(control_socket.py) and gets JSON back. The reply is parsed here once, at the edge, into a
`CoordinatorStatus`; everything after it (gpuflex.policy.lifecycle, the reconcile's stray
checks, the harvest plan) reads typed fields and never re-checks the JSON's shape. A reply
whose shape is wrong (a list where a list of worker ids belongs, a text where a count
belongs) is refused whole with a `WireError` naming the field: the caller treats it as no
answer, as it treats a coordinator that does not answer.

The membership (`members`, `desired`) must be worker ids to the last entry; in the lists
that only name workers to spare or to drop (`known`, `rejected`) an entry that is no id is
not trusted and dropped. A key the reply leaves out takes its default (an older coordinator, a test's fake): that is
not malformed. `desired` alone stays None when absent: without the coordinator's word on
the membership it wants, no worker is a stray. The records inside (history entries, crash
and waiting records, progress, forged, held, abort) are mappings whose values the policy
interprets, each record on its own: one whose values make no sense is ignored there, not
the whole status.

Standard library only: the control side imports it without torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

RESIZE = "resize"   # the op that sets the desired membership
STATUS = "status"   # the op that asks for a CoordinatorStatus


class WireError(ValueError):
    """A coordinator's reply that does not have the protocol's shape; `field` names where."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"the coordinator's status: {field} {problem}")
        self.field = field
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class LeftOut:
    """A newcomer the coordinator left out of a resize (resizing.WarmUps): `n` counts them
    over the run, `at` is the coordinator's wall-clock time (None: not said)."""

    n: int
    wid: int
    reason: Any = None
    phase: Any = None
    at: Any = None


@dataclasses.dataclass(frozen=True)
class CoordinatorStatus:
    """The coordinator's `status` reply (gpuflex.elastic.coordinator.generations.Generations.status)."""

    generation: int = 0
    members: tuple[int, ...] = ()
    desired: tuple[int, ...] | None = None   # None: not said (then nothing is a stray)
    known: tuple[int, ...] = ()       # every worker id ever wanted
    rejected: tuple[int, ...] = ()    # ids left out for good
    left_out: tuple[LeftOut, ...] = ()
    settled: bool = False
    finished: bool = False
    stopped: Mapping[str, Any] | None = None   # {wid, by, step, of}: a stop agreed before the end
    min_workers: int | None = None
    generations_total: int | None = None
    history: tuple[Mapping[str, Any], ...] = ()
    crashed: tuple[Mapping[str, Any], ...] = ()
    waiting: tuple[Mapping[str, Any], ...] = ()
    progress: Mapping[str, Any] | None = None
    forged: Mapping[str, Any] | None = None
    abort: Mapping[str, Any] | None = None
    held: Mapping[str, Any] | None = None
    unreachable: Mapping[str, Any] | None = None
    forming: Mapping[str, Any] | None = None


def parse_status(reply: Any) -> CoordinatorStatus:
    """The status reply as a CoordinatorStatus; WireError when its shape is wrong."""
    if not isinstance(reply, Mapping):
        raise WireError("reply", f"is not a JSON object but {type(reply).__name__}")
    return CoordinatorStatus(
        generation=_count(reply, "generation", 0),
        members=_wids(reply, "members", ()),
        desired=_wids(reply, "desired", None),
        known=_ids_named(reply, "known"),
        rejected=_ids_named(reply, "rejected"),
        left_out=tuple(_left_out(i, e) for i, e in enumerate(_records(reply, "left_out"))),
        settled=_flag(reply, "settled"),
        finished=_flag(reply, "finished"),
        min_workers=_count(reply, "min_workers", None),
        generations_total=_count(reply, "generations_total", None),
        history=_records(reply, "history"),
        crashed=_records(reply, "crashed"),
        waiting=_records(reply, "waiting"),
        **{k: _record(reply, k) for k in ("progress", "forged", "abort", "held", "unreachable", "forming",
                                          "stopped")})


def resize_request(members: list[int]) -> dict[str, Any]:
    """The `resize` request: the desired membership from now on."""
    if not isinstance(members, list) or not all(_is_int(w) and w >= 0 for w in members):
        raise ValueError(f"a resize names a list of worker ids, not {members!r}")
    return {"op": RESIZE, "members": list(members)}


def status_request() -> dict[str, Any]:
    return {"op": STATUS}


# ---- the fields' shapes ------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(reply: Mapping[str, Any], key: str, default: int | None) -> int | None:
    v = reply.get(key)
    if v is None:
        return default
    if not _is_int(v) or v < 0:
        raise WireError(key, f"is not a count: {v!r}")
    return v


def _flag(reply: Mapping[str, Any], key: str) -> bool:
    v = reply.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise WireError(key, f"is not true or false: {v!r}")
    return v


def _wids(reply: Mapping[str, Any], key: str, default: tuple[int, ...] | None) -> tuple[int, ...] | None:
    v = reply.get(key)
    if v is None:
        return default
    if not isinstance(v, list) or not all(_is_int(w) and w >= 0 for w in v):
        raise WireError(key, f"is not a list of worker ids: {v!r:.200}")
    return tuple(v)


def _ids_named(reply: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """A list that only ever names workers (to spare or to drop): an entry that is no
    worker id names none and is not trusted; the list itself must be one."""
    v = reply.get(key)
    if v is None:
        return ()
    if not isinstance(v, list):
        raise WireError(key, f"is not a list: {v!r:.200}")
    return tuple(w for w in v if _is_int(w) and w >= 0)


def _records(reply: Mapping[str, Any], key: str) -> tuple[Mapping[str, Any], ...]:
    v = reply.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(e, Mapping) for e in v):
        raise WireError(key, f"is not a list of JSON objects: {v!r:.200}")
    return tuple(v)


def _record(reply: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    v = reply.get(key)
    if v is not None and not isinstance(v, Mapping):
        raise WireError(key, f"is not a JSON object: {v!r:.200}")
    return v


def _left_out(i: int, e: Mapping[str, Any]) -> LeftOut:
    for k in ("n", "wid"):
        if not _is_int(e.get(k)) or e[k] < 0:
            raise WireError(f"left_out[{i}].{k}", f"is not a count: {e.get(k)!r}")
    return LeftOut(e["n"], e["wid"], e.get("reason"), e.get("phase"), e.get("at"))
