"""Formation deadlines: a generation being formed waits for its members for a bounded time.

Issue 16 saw a job hang for minutes after one of its three workers was killed while it
imported torch: the first generation waited for it (then for a ten-minute start timeout),
and a member that never reaches a later generation's barrier left the others waiting for
a decision nobody would make. A generation is *forming* from the moment it is wanted (the
coordinator's start, for the first; its publication, for the others) until rank 0's
verdict. While it forms, `FormationWatch` says who it still waits for, and which workers
to form it without:

- dead: a worker whose heartbeat went stale before it joined (or, for the first
  generation, became ready), at once;
- stuck: one that is alive but has not joined (not become ready) `timeout_s` after the
  formation started.

The coordinator then forms the generation without them while MIN still holds (they are
rejected: one that wakes up later exits EVICTED_EXIT), or else holds the job with a reason
that names them and the phase (the control side requeues a held job). A member that
joined and then died is a recovery's case (a failed collective, a stale heartbeat), not
this one. The deadline counts from the start of the formation, so it must exceed a
training step: the members of a running generation join a resize at their next step
boundary. Standard library only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from gpuflex.elastic import keys
from gpuflex.elastic.failures import Heartbeats

JOINING = "joining"
STARTING = "starting"          # the first generation: the workers are not ready yet
FORMING = "forming the process group and copying state"   # everyone joined, no verdict yet


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a formation comes to: form with `members` (the workers in `dropped` left
    out), or, when `hold` is set, no generation (too few left) and that reason."""

    members: list[int]
    dropped: list[int]
    message: str
    hold: str | None = None


class FormationWatch:
    """The formation in progress: its generation, since when (wall clock, for status),
    and who it waits for. `heartbeats` tells dead from alive, `valid(key)` whether a
    signed record is there; `clock` (monotonic) times the deadline."""

    def __init__(self, timeout_s: float, heartbeats: Heartbeats, valid: Callable[[str], bool], *,
                 clock: Callable[[], float], wall: Callable[[], float]) -> None:
        if not timeout_s > 0:
            raise ValueError(f"formation timeout must be positive, not {timeout_s}")
        self.timeout_s, self.heartbeats, self.valid = timeout_s, heartbeats, valid
        self.clock, self.wall = clock, wall
        self.active = True
        self.generation, self.since, self.started = 1, wall(), clock()
        self.phase, self.waiting_for = STARTING, []

    def begin(self, g: int) -> None:
        """Generation g was published: its members have `timeout_s` to join it."""
        self.active = True
        self.generation, self.since, self.started = g, self.wall(), self.clock()
        self.phase, self.waiting_for = JOINING, []

    def done(self) -> None:
        """The generation's verdict arrived: it is formed (or rolled back)."""
        self.active = False

    def record(self) -> dict[str, Any] | None:
        """{generation, since, waiting_for, phase} for status; None when nothing forms."""
        if not self.active:
            return None
        return {"generation": self.generation, "since": self.since,
                "waiting_for": list(self.waiting_for), "phase": self.phase}

    def first(self, desired: list[int], ready: list[int], min_workers: int) -> Outcome | None:
        """The first generation, from the desired workers and those ready (and alive):
        None while it should wait."""
        self.waiting_for = [w for w in desired if w not in ready]
        everyone = f"{len(ready)} worker(s) ready"
        return self._decide(list(ready), self.waiting_for, "become ready", everyone, min_workers)

    def joining(self, members: list[int], gone: Callable[[int], bool], min_workers: int) -> Outcome | None:
        """A published generation not verified yet: None while its members are joining
        in time (or all have joined, and the formation is the process group's business)."""
        g = self.generation
        self.waiting_for = [w for w in members if not gone(w) and not self.valid(keys.joined(g, w))]
        self.phase = JOINING if self.waiting_for else FORMING
        if not self.waiting_for:
            return None
        return self._decide([w for w in members if not gone(w)], self.waiting_for, "join", "", min_workers)

    def _dead(self, wid: int) -> bool:
        """It has beaten (its heartbeat thread ran) and stopped: a worker that never beat
        may still be importing torch."""
        return self.heartbeats.has(keys.hb(wid)) and not self.heartbeats.alive(wid)

    def _decide(self, have: list[int], missing: list[int], verb: str, everyone: str,
                min_workers: int) -> Outcome | None:
        dead = [w for w in missing if self._dead(w)]
        overdue = self.clock() - self.started > self.timeout_s
        stuck = [w for w in missing if w not in dead] if overdue else []
        if len(dead) + len(stuck) < len(missing):
            return None   # someone may still arrive in time
        dropped = sorted(dead + stuck)
        members = [w for w in have if w not in dropped]
        parts = ([f"worker(s) {dead} died (no heartbeat)"] if dead else []) + \
                ([f"worker(s) {stuck} did not {verb} within {self.timeout_s:g} s"] if stuck else [])
        why = f"{' and '.join(parts)} while {self.phase} generation {self.generation}" if dropped else everyone
        if len(members) < min_workers:
            return Outcome(members, dropped, why, hold=f"{why}: {len(members)} worker(s) left, below "
                                                        f"the job's minimum of {min_workers}")
        return Outcome(members, dropped, f"formed without them: {why}" if dropped else why)
