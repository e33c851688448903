"""GPU verdicts after a probe (pure): what `gpuflex.control.probes` writes to `Gpu.verdict`.

The verdicts are described in `gpuflex.hosts.probe`'s docstring. The samples are read
through a Protocol, so this module needs nothing from the hosts layer.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from gpuflex.config import HarvestSettings


class Sample(Protocol):
    """What a verdict reads of one GPU's probe (`gpuflex.hosts.probe.GpuSample`)."""

    utilization_pct: float | None
    memory_used_mib: float | None


def verdict(*, owner: str | None, foreign: bool, ours: bool, quiet: bool, streak: int,
            previous: str | None, harvest: HarvestSettings, zombie: bool = False) -> tuple[str, int]:
    """(verdict, new idle streak) for one GPU after one probe; see the module docstring."""
    if foreign:
        return "busy", 0
    if zombie and not ours:
        return "zombie", 0
    if owner is None:
        return "free", streak + 1 if quiet else 0
    if ours and not quiet:
        # our own worker keeps it busy: what it was when we took it still holds
        return (previous if previous in ("idle", "owner") else "owner"), streak
    streak = streak + 1 if quiet else 0
    return ("idle" if streak >= harvest.idle_samples else "owner"), streak


def is_quiet(g: Sample, harvest: HarvestSettings) -> bool:
    """Low utilization and memory; an unknown ([N/A]) value is not proof of quiet."""
    return (g.utilization_pct is not None and g.utilization_pct <= harvest.idle_util_pct
            and g.memory_used_mib is not None and g.memory_used_mib <= harvest.idle_memory_mib)


def is_zombie(g: Sample, apps: Sequence[object], harvest: HarvestSettings) -> bool:
    """Memory in use (above idle_memory_mib) while nvidia-smi lists no compute process."""
    return not apps and g.memory_used_mib is not None and g.memory_used_mib > harvest.idle_memory_mib
