"""Gang placement of workers onto free devices (GPUs or CPU slots). Pure."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HostFree:
    """Free devices of one host. `slots` is True for `cpu:N` hosts (devices are slot numbers)."""

    name: str
    devices: tuple[int, ...]
    slots: bool = False


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
    """
    if minimum < 1 or maximum < minimum or per_worker < 0:
        raise ValueError(f"bad request: {minimum}:{maximum} x {per_worker}")
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
    if len(out) < minimum:
        return Placement(reason=_shortfall(free, minimum, per_worker))
    return Placement(assignments=tuple(out))


def _shortfall(free: list[HostFree], minimum: int, per_worker: int) -> str:
    kinds = {h.slots for h in free}
    unit = "slots" if kinds == {True} else "GPUs"
    need = minimum * max(per_worker, 1)
    have = sum(len(h.devices) for h in free)
    where = ", ".join(h.name for h in free) or "no host"
    return f"waiting for {need} free {unit} on {where} ({have} free now)"
