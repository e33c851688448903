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
boundary.

A worker that never beat has not joined the gpuflex.elastic runtime: a plain script
(torch.distributed, a shell command) never will. In a gang (`gang`: the coordinator's
`--gang`, any job but an in-place elastic one) such a worker is never dropped nor the job
held for it: the control side watches its process instead, and nothing forms. In an
in-place job it is stuck like any other, and past half the deadline the record says why
and names `--elastic restart` (NOT_JOINED_HINT) when no worker of the first generation
became ready or ever beat (one killed while importing torch is not a plain script). At the
deadline such a job cannot run as it is: the outcome is an `end` (never_joined_reason:
one line, the advice whole, as long whatever the job's size), not a hold, so the job fails
once instead of being requeued into the same wait again and again (each requeue's fresh
coordinator starts a fresh failure streak). Standard library only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from gpuflex.elastic.protocol import keys
from gpuflex.elastic.coordinator.failures import Heartbeats

JOINING = "joining"
STARTING = "starting"          # the first generation: the workers are not ready yet
FORMING = "forming the process group and copying state"   # everyone joined, no verdict yet
NOT_JOINED_ADVICE = "a plain script runs with --elastic restart, or as a fixed-size gang (--workers N without --elastic)"
NOT_JOINED_HINT = f"never joined the gpuflex.elastic runtime (no heartbeat): {NOT_JOINED_ADVICE}"
NEVER_JOINED = "never-joined"   # the cause of the end of an in-place job none of whose workers joined


def never_joined_reason(workers: int, timeout_s: float) -> str:
    """Why an in-place job none of whose `workers` beat or became ready within the formation
    deadline ends: one line, the advice whole."""
    return (f"its {workers} worker(s) never joined the gpuflex.elastic runtime (no heartbeat) within the "
            f"formation deadline of {timeout_s:g} s: {NOT_JOINED_ADVICE}; a gpuflex.elastic script slower than "
            "that to reach ElasticRun() needs a longer [jobs] formation_timeout_s")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a formation comes to: form with `members` (the workers in `dropped` left
    out), or, when `hold` is set, no generation (too few left) and that reason, or, when
    `end` is set, the end of the job with that reason (an in-place job of a plain script:
    neither a longer wait nor a requeue would change it); `phase` names the formation
    ("generation 2, joining")."""

    members: list[int]
    dropped: list[int]
    message: str
    hold: str | None = None
    phase: str = ""
    end: str | None = None


class FormationWatch:
    """The formation in progress: its generation, since when (wall clock, for status),
    and who it waits for. `heartbeats` tells dead from alive, `valid(key)` whether a
    signed record is there; `clock` (monotonic) times the deadline."""

    def __init__(self, timeout_s: float, heartbeats: Heartbeats, valid: Callable[[str], bool], *,
                 clock: Callable[[], float], wall: Callable[[], float], gang: bool = False) -> None:
        if not timeout_s > 0:
            raise ValueError(f"formation timeout must be positive, not {timeout_s}")
        self.timeout_s, self.heartbeats, self.valid = timeout_s, heartbeats, valid
        self.clock, self.wall, self.gang = clock, wall, gang
        self.active = True
        self.generation, self.since, self.started = 1, wall(), clock()
        self.phase, self.waiting_for = STARTING, []
        self.desired_first: list[int] = []   # the first generation's desired workers

    def begin(self, g: int) -> None:
        """Generation g was published: its members have `timeout_s` to join it."""
        self.active = True
        self.generation, self.since, self.started = g, self.wall(), self.clock()
        self.phase, self.waiting_for = JOINING, []

    def done(self) -> None:
        """The generation's verdict arrived: it is formed (or rolled back)."""
        self.active = False

    def as_gang(self) -> None:
        """From now on, a worker that never beat is the control side's to watch (see the
        module's doc)."""
        self.gang = True

    def record(self) -> dict[str, Any] | None:
        """{generation, since, waiting_for, phase} for status, with `hint` once half the
        deadline passed in an in-place job none of whose workers became ready or ever beat
        (what to do about it); None when nothing forms, or when a gang waits only for
        workers that never beat (plain processes: nothing of the runtime's forms)."""
        if not self.active:
            return None
        not_joined = [w for w in self.waiting_for if not self._beat(w)]
        if self.gang and self.waiting_for and len(not_joined) == len(self.waiting_for):
            return None
        late = self.clock() - self.started > self.timeout_s / 2
        plain = self.generation == 1 and self.phase == STARTING and len(not_joined) == len(self.desired_first)
        hint = f"worker(s) {not_joined} {NOT_JOINED_HINT}" if plain and not_joined and late and not self.gang else None
        return {"generation": self.generation, "since": self.since, "waiting_for": list(self.waiting_for),
                "phase": self.phase, **({"hint": hint} if hint else {})}

    def first(self, desired: list[int], ready: list[int], min_workers: int) -> Outcome | None:
        """The first generation, from the desired workers and those ready (and alive):
        None while it should wait."""
        self.waiting_for = [w for w in desired if w not in ready]
        self.desired_first = list(desired)
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

    def _beat(self, wid: int) -> bool:
        """It has beaten at least once: it runs the gpuflex.elastic runtime."""
        return self.heartbeats.has(keys.hb(wid))

    def _dead(self, wid: int) -> bool:
        """It has beaten (its heartbeat thread ran) and stopped: a worker that never beat
        may still be importing torch."""
        return self._beat(wid) and not self.heartbeats.alive(wid)

    def _decide(self, have: list[int], missing: list[int], verb: str, everyone: str,
                min_workers: int) -> Outcome | None:
        dead = [w for w in missing if self._dead(w)]
        overdue = self.clock() - self.started > self.timeout_s
        # a gang never drops one that never beat: a plain process the control side watches
        stuck = [w for w in missing if w not in dead and (self._beat(w) or not self.gang)] if overdue else []
        if len(dead) + len(stuck) < len(missing):
            return None   # someone may still arrive in time
        dropped = sorted(dead + stuck)
        members = [w for w in have if w not in dropped]
        parts = ([f"worker(s) {dead} died (no heartbeat)"] if dead else []) + \
                ([f"worker(s) {stuck} did not {verb} within {self.timeout_s:g} s"] if stuck else [])
        why = f"{' and '.join(parts)} while {self.phase} generation {self.generation}" if dropped else everyone
        phase = f"generation {self.generation}, {self.phase}"
        # an in-place job's first generation, no one ready, no one ever beat: a plain script
        # (not one killed while it started: another one beat)
        if not self.gang and self.generation == 1 and self.phase == STARTING and stuck and not have \
                and not any(map(self._beat, missing)):
            return Outcome([], dropped, why, phase=phase, end=never_joined_reason(len(missing), self.timeout_s))
        if len(members) < min_workers:
            return Outcome(members, dropped, why, hold=f"{why}: {len(members)} worker(s) left, below "
                                                       f"the job's minimum of {min_workers}", phase=phase)
        return Outcome(members, dropped, f"formed without them: {why}" if dropped else why, phase=phase)
