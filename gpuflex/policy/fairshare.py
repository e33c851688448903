"""Fair share between users (issue 14): per-user GPU quotas and decayed usage. Pure.

A lab shares one pool, so two rules keep one user's jobs from taking it:

- **Quota.** A user's jobs together may hold at most their limit of devices (GPUs, or CPU
  slots counted the same): `[quota] users.NAME`, else the smallest `users."@GROUP"` of a
  unix group the user is in, else `default_gpus` (None: no limit). Admins (`[access]
  admins`) have none while `admins_exempt`. A queued job whose MIN would take its user past
  the limit waits, saying so; an elastic job starts at the size that fits and grows only
  within it (`scale`, harvest's grow).
- **Fair share.** Among jobs of equal priority the user with the least *recent* usage goes
  first: GPU-hours, each moment weighted by 2^(-age / half_life). Each held interval is
  integrated exactly (the integral of the exponential over [start, end]), so the figure
  does not depend on how often it is computed. Priority still comes first and age (job
  id) breaks the last tie.

Who holds what and when comes from the caller (gpuflex.control.queueing reads the
workers table); nothing here reads a clock, a database or the user database.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

from gpuflex.config import QuotaSettings

HOUR_S = 3600.0
# intervals that ended more than this many half-lives ago weigh under 2^-30 of one held
# now: the caller need not read them
FORGET_HALF_LIVES = 30


@dataclasses.dataclass(frozen=True)
class Hold:
    """`devices` held by one worker of `user` from `start` to `end` (None: still held)."""

    user: str
    start: float
    end: float | None
    devices: int


@dataclasses.dataclass(frozen=True)
class Quota:
    """One user's limit (None: none) and the devices their jobs hold now."""

    user: str
    limit: int | None
    held: int

    def room(self) -> int | None:
        """Devices the user may still take (None: no limit)."""
        return None if self.limit is None else max(0, self.limit - self.held)

    def workers_allowed(self, per_worker: int) -> int | None:
        """How many more workers of `per_worker` devices fit (None: no limit)."""
        room = self.room()
        return None if room is None else room // max(per_worker, 1)

    def refusal(self, workers: int, per_worker: int) -> str | None:
        """Why `workers` more workers of `per_worker` devices would go over the quota; None
        when they fit. E.g. "alice holds 6 of her 8 GPUs ([quota]); this job needs 4"."""
        need = workers * max(per_worker, 1)
        room = self.room()
        if room is None or need <= room:
            return None
        return f"{self.user} holds {self.held} of their {self.limit} GPUs ([quota]); this job needs {need}"


def limit_for(settings: QuotaSettings, user: str, groups: Iterable[str] = (), admin: bool = False) -> int | None:
    """The user's limit: their own override, else the smallest override of a group they
    are in (`@name` keys), else the default; None for an exempt admin or no limit."""
    if admin and settings.admins_exempt:
        return None
    if user in settings.users:
        return settings.users[user]
    by_group = [settings.users[f"@{g}"] for g in groups if f"@{g}" in settings.users]
    if by_group:
        return min(by_group)
    return settings.default_gpus


def decayed_hours(start: float, end: float | None, now: float, half_life_h: float) -> float:
    """Hours held over [start, end or now], each moment weighted by 2^(-(now - t) / half
    life): the exact integral, (H / ln 2) (2^(-(now - end)/H) - 2^(-(now - start)/H))."""
    if half_life_h <= 0:
        raise ValueError(f"half_life_h must be above 0, not {half_life_h}")
    stop = now if end is None else min(end, now)
    if stop <= start:
        return 0.0
    h = half_life_h * HOUR_S
    weight = math.exp2(-(now - stop) / h) - math.exp2(-(now - start) / h)
    return h / math.log(2) * weight / HOUR_S


def usage(holds: Iterable[Hold], now: float, half_life_h: float) -> dict[str, float]:
    """Decayed GPU-hours per user."""
    out: dict[str, float] = {}
    for x in holds:
        out[x.user] = out.get(x.user, 0.0) + x.devices * decayed_hours(x.start, x.end, now, half_life_h)
    return out


def forget_before(now: float, half_life_h: float) -> float:
    """Intervals that ended before this time may be left out of `usage`."""
    return now - FORGET_HALF_LIVES * half_life_h * HOUR_S


@dataclasses.dataclass(frozen=True)
class Queued:
    """A queued job as the order sees it."""

    id: int
    priority: int
    user: str


def placing_order(jobs: Sequence[Queued], used: Mapping[str, float]) -> list[int]:
    """Job ids in the order they are placed: higher priority first, then the user with the
    least decayed usage, then the older job (lower id)."""
    return [j.id for j in sorted(jobs, key=lambda j: (-j.priority, used.get(j.user, 0.0), j.id))]
