"""Gang placement of workers onto free devices (GPUs or CPU slots). Pure.

A gang on mixed GPUs runs each synchronous step at its slowest worker's pace unless its
batch is split by speed (issue 12), and even then a plan over one model is the simplest:
so among the placements that fit now, one whose GPUs are all of one model is preferred,
as long as it places as many workers. It never waits for one: a job that fits only
across models starts across models at once.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from gpuflex.policy.speeds import table_speed, words


@dataclasses.dataclass(frozen=True)
class HostFree:
    """Free devices of one host. `slots` is True for `cpu:N` hosts (devices are slot numbers).
    `models`: each device's GPU model as nvidia-smi names it, in the order of `devices`
    (None or left out: not known; CPU slots have none)."""

    name: str
    devices: tuple[int, ...]
    slots: bool = False
    models: tuple[str | None, ...] = ()

    def model(self, i: int) -> str | None:
        """The model of the i-th free device (None: not known)."""
        return self.models[i] if i < len(self.models) else None


@dataclasses.dataclass(frozen=True)
class Assignment:
    host: str
    devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Either `assignments` (at least the minimum asked for) or a `reason` why not."""

    assignments: tuple[Assignment, ...] = ()
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def devices_per_worker(per_worker: int, slots: bool) -> int:
    """A worker with K GPUs takes K devices; on a CPU-slot host, K slots (at least one)."""
    return max(per_worker, 1) if slots else per_worker


def place(free: list[HostFree], minimum: int, maximum: int, per_worker: int) -> Placement:
    """Place between `minimum` and `maximum` workers, as many as fit, on the fewest hosts.

    Hosts with the most free devices are filled first, so a gang spreads over as few
    hosts as possible; no device is given to two workers. A worker never spans hosts.
    Then, if that mixes GPU models, the same number of workers on one model is taken
    instead where the free devices allow it (see the module's doc: `one_model`).
    """
    if minimum < 1 or maximum < minimum or per_worker < 0:
        raise ValueError(f"bad request: {minimum}:{maximum} x {per_worker}")
    out = _fill(free, maximum, per_worker)
    if len(out) < minimum:
        return Placement(reason=_shortfall(free, minimum, per_worker))
    return Placement(assignments=tuple(one_model(free, out, per_worker) or out))


def _fill(free: list[HostFree], maximum: int, per_worker: int) -> list[Assignment]:
    """Up to `maximum` workers, the hosts with room for the most first (then by name)."""
    capacity = []
    for h in free:
        need = devices_per_worker(per_worker, h.slots)
        fit = len(h.devices) // need if need else maximum
        capacity.append((fit, h, need))
    capacity.sort(key=lambda c: (-c[0], c[1].name))
    out: list[Assignment] = []
    for fit, h, need in capacity:
        for i in range(fit):
            if len(out) == maximum:
                break
            out.append(Assignment(h.name, tuple(h.devices[i * need:(i + 1) * need])))
    return out


def models_of(free: list[HostFree], assignments: Sequence[Assignment]) -> set[tuple[str, ...] | None]:
    """The GPU models (as words; None: not known) of the devices these assignments take."""
    known = {(h.name, d): h.model(i) for h in free for i, d in enumerate(h.devices)}
    return {None if m is None else words(m) for a in assignments for m in (known.get((a.host, d)) for d in a.devices)}


def one_model(free: list[HostFree], placed: list[Assignment], per_worker: int) -> list[Assignment] | None:
    """As many workers as `placed` on GPUs of one known model, when `placed` mixes models
    (or holds GPUs of no known model beside known ones) and the free devices allow it;
    None otherwise. Of several models that can: the one on the fewest hosts, then the
    fastest (gpuflex.policy.speeds), then by name."""
    if per_worker == 0 or len(models_of(free, placed)) < 2:
        return None
    names = {words(m): m for h in free for m in h.models if m is not None}
    options = []
    for key, name in names.items():
        only = [HostFree(h.name, tuple(d for i, d in enumerate(h.devices) if h.model(i) is not None
                                       and words(h.model(i)) == key), h.slots) for h in free]
        found = _fill(only, len(placed), per_worker)
        if len(found) == len(placed):
            options.append((len({a.host for a in found}), -(table_speed(name) or 0.0), key, found))
    return min(options, key=lambda o: o[:3])[3] if options else None


def _shortfall(free: list[HostFree], minimum: int, per_worker: int) -> str:
    kinds = {h.slots for h in free}
    unit = "slots" if kinds == {True} else "GPUs"
    need = minimum * max(per_worker, 1)
    have = sum(len(h.devices) for h in free)
    where = ", ".join(h.name for h in free) or "no host"
    return f"waiting for {need} free {unit} on {where} ({have} free now)"
