"""Each user's fair share of a pool's devices, and how the throughput policy starts queued
`--harvest` jobs by it (issue 32): pure. gpuflex.policy.allocation decides the running
jobs' sizes from these shares; gpuflex.policy.harvest and gpuflex.control.queueing start
jobs with `Starting`."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping


def fair_shares(demand: Mapping[str, float], pool: float) -> dict[str, float]:
    """Max-min fair shares of `pool` devices among users who could use `demand` each
    (the sum of their jobs' MAX): equal, except that a user who could use less than an
    equal part gets what they could use and the rest is split among the others."""
    out = {u: 0.0 for u in demand}
    left, active = float(pool), sorted(u for u in demand if demand[u] > 0)
    while active and left > 1e-9:
        each = left / len(active)
        short = [u for u in active if demand[u] - out[u] <= each]
        if not short:
            for u in active:
                out[u] += each
            break
        for u in short:
            left -= demand[u] - out[u]
            out[u] = float(demand[u])
            active.remove(u)
    return out


@dataclasses.dataclass
class Starting:
    """How the throughput policy starts queued --harvest jobs: no bigger than their user's
    fair share (it grows them from there as they measure well), the user furthest below
    their share first. From `starting`."""

    share: dict[str, float]
    held: dict[str, int]

    def behind(self, user: str) -> float:
        """The user's devices over their share (0: none held; the lowest go first)."""
        s = self.share.get(user, 0.0)
        return self.held.get(user, 0) / s if s > 0 else 0.0

    def most(self, user: str, most: int, min_workers: int, per_worker: int) -> int:
        """Workers to start with, at most `most`: what the user's share leaves, never below MIN."""
        left = self.share.get(user, 0.0) - self.held.get(user, 0)
        return max(min_workers, min(most, int(left // max(per_worker, 1))))

    def took(self, user: str, devices: int) -> None:
        """A job of the user started on `devices` (the next placements see it)."""
        self.held[user] = self.held.get(user, 0) + devices


def claim(job: Any, running: bool) -> tuple[str, int, int]:
    """(user, devices at its MAX, devices it holds) of a job, as `starting` takes them: a
    harvest plan's JobView or a database Job (`user`, `max_workers`, `gpus_per_worker`,
    `members` with their `gpus`); a queued one holds none."""
    return (job.user, job.max_workers * max(job.gpus_per_worker, 1),
            sum(len(w.gpus) for w in job.members) if running else 0)


def starting(jobs: Iterable[tuple[str, int, int]], idle: int) -> Starting:
    """`jobs`: (user, devices at its MAX, devices it holds) of every running and queued job;
    `idle`: the devices nobody holds. Shares are max-min fair over all those devices."""
    demand: dict[str, int] = {}
    held: dict[str, int] = {}
    for user, most, holds in jobs:
        demand[user] = demand.get(user, 0) + most
        held[user] = held.get(user, 0) + holds
    return Starting(fair_shares(demand, sum(held.values()) + idle), held)
