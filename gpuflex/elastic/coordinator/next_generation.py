"""Which generation comes next, decided without writing: `decide(Seen) -> Decision`.

Generations._tick (generations.py) reads the store into a `Seen`, asks `decide`, and
applies the `Decision` (its `apply`): the writes (rejected records, the desired membership,
a published generation, a hold, the abort) all happen there. The order of the rules is
the module docstring of generations.py: crashed and finished are handled before, while
reading; here, in a published generation, a rollback, then a formation's outcome, then a
recovery, then a resize.

`Seen` holds what every full read gathers; what only one rule needs (a member's failure
reason, whether a previous member is alive and not done) is asked through its read-only
lookups, so a tick reads no more keys than it did. Tests give it sets and lambdas.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Union

from gpuflex.elastic.coordinator.failures import common_reason
from gpuflex.elastic.coordinator.forming import NEVER_JOINED, Outcome


@dataclasses.dataclass(frozen=True)
class Seen:
    """One full read of the store. `generation` and `members`: the newest published one
    (0 and () before the first), `prev` the members before it, `ok` its verdict (None: none
    yet) and `verified` whether it is decided; `first`/`joining`: the formation watch's
    outcome for the first generation / the newest one while it has no verdict (None: still
    waiting, or not asked)."""

    generation: int
    members: tuple[int, ...]
    desired: tuple[int, ...]
    rejected: frozenset[int]
    min_workers: int
    prev: tuple[int, ...] = ()
    ok: bool | None = None
    verified: bool = False
    desired_new: tuple[int, ...] = ()     # desired, never members, not rejected
    ready_new: tuple[int, ...] = ()       # of those, ready and beating
    first: Outcome | None = None
    joining: Outcome | None = None
    failed: tuple[int, ...] = ()          # members that reported a failure of this generation
    stale: tuple[int, ...] = ()           # members neither gone nor beating
    verdict_reason: str = ""              # why the newest generation's state check failed
    gone: Callable[[int], bool] = lambda w: False          # done or left
    alive_not_done: Callable[[int], bool] = lambda w: True  # beating and without a done record
    fail_reason: Callable[[int], str | None] = lambda w: None


@dataclasses.dataclass(frozen=True)
class Publish:
    """Publish generation+1 with `members`. Before: when `failure` (generation, reason) is
    set, it counts for the failure streak, and if that ends the job nothing else happens;
    then `reject` are rejected and `desired` (None: unchanged) is the desired membership."""

    members: tuple[int, ...]
    kind: str
    message: str
    reject: tuple[int, ...] = ()
    desired: tuple[int, ...] | None = None
    failure: tuple[int, str] | None = None


@dataclasses.dataclass(frozen=True)
class Hold:
    """No generation now: the survivors wait (`workers`: who it is for, `phase`)."""

    reason: str
    workers: tuple[int, ...]
    phase: str


@dataclasses.dataclass(frozen=True)
class End:
    """End the job: the abort record with this reason and cause."""

    reason: str
    cause: str


@dataclasses.dataclass(frozen=True)
class Settled:
    """The membership is the desired one: nothing pending, full reads only when idle."""


@dataclasses.dataclass(frozen=True)
class Unreachable:
    """The desired membership cannot be reached (status "unreachable" says why)."""

    reason: str


Step = Union[Publish, Hold, End, Settled, Unreachable]


@dataclasses.dataclass(frozen=True)
class Decision:
    """`rollback`: the newest generation's state did not verify: it is marked decided and
    its newcomers rejected, whatever `step` is. `step`: None while waiting (for the others
    to see a failure, for newcomers to warm up, for the formation watch)."""

    step: Step | None = None
    rollback: tuple[int, ...] | None = None


def decide(seen: Seen) -> Decision:
    if seen.generation == 0:   # the first: everyone ready, or without the dead and the late
        return Decision(formed(seen, seen.first, "initial") if seen.first is not None else None)
    if seen.ok is False:
        return rollback(seen)
    if seen.joining is not None:
        return Decision(formed(seen, seen.joining, "recover"))
    if seen.failed or seen.stale:
        return Decision(recover(seen))
    if seen.verified:
        return Decision(resize(seen))
    return Decision()


def formed(seen: Seen, out: Outcome, kind: str) -> Step:
    """A formation's outcome: end the job, hold, or publish without the workers it dropped
    (a recovery that dropped some is a failure of the generation for the streak)."""
    if out.end is not None:
        return End(out.end, NEVER_JOINED)
    if out.hold is not None:
        return Hold(out.hold, tuple(out.dropped), out.phase)
    return Publish(tuple(out.members), kind, out.message, reject=tuple(out.dropped),
                   desired=tuple(w for w in seen.desired if w not in out.dropped),
                   failure=(seen.generation, out.message) if out.dropped and kind == "recover" else None)


def recover(seen: Seen) -> Step | None:
    """Once every member reported, went stale or finished: the reporters (plus ready
    newcomers) form the next generation, or the job is held below MIN."""
    g, members = seen.generation, seen.members
    undecided = [w for w in members if w not in seen.failed and w not in seen.stale and not seen.gone(w)]
    if undecided:
        return None   # the others will see the failure at their next collective
    survivors = [w for w in seen.failed if w not in seen.stale]
    joiners = [w for w in seen.ready_new if w not in survivors]
    keep = [w for w in survivors if w in seen.desired] or survivors
    lost = [w for w in members if w not in survivors]
    nxt = keep + joiners
    reason = common_reason(seen.fail_reason(w) for w in seen.failed) or f"worker(s) {list(seen.stale)} stopped beating"
    if len(nxt) < seen.min_workers:
        forming = reason.startswith("formation") or not seen.verified
        return Hold(f"would fall to {len(nxt)} worker(s), below the job's minimum of {seen.min_workers}"
                    + (f" (lost worker(s) {lost})" if lost else ""), tuple(lost),
                    f"generation {g}, {'forming' if forming else 'steady'}")
    message = (f"lost worker(s) {lost}: {reason}" if lost else
               f"re-formed after a failed collective in generation {g} (no worker lost): {reason}")
    return Publish(tuple(nxt), "recover", message, desired=tuple(w for w in seen.desired if w not in lost),
                   failure=(g, reason))


def resize(seen: Seen) -> Step | None:
    """The desired membership once every newcomer is ready; why it cannot be reached."""
    if list(seen.desired) == sorted(seen.members):
        return Settled()
    if set(seen.desired_new) != set(seen.ready_new):
        return None   # newcomers still warming up
    keep = [w for w in seen.members if w in seen.desired]
    target = keep + sorted(seen.ready_new)
    gone = [w for w in seen.desired if w not in seen.members and w not in seen.desired_new]
    if not keep:
        return Unreachable("no current member would be kept, so the job's state would be lost")
    if len(target) < seen.min_workers:
        return Unreachable(f"{len(target)} worker(s) is below the job's minimum of {seen.min_workers}")
    if sorted(target) == sorted(seen.members):
        return Unreachable(f"worker(s) {gone} cannot join again: rejected, or left the job earlier")
    return Publish(tuple(target), "resize", f"resize {len(seen.members)} -> {len(target)}")


def rollback(seen: Seen) -> Decision:
    """The newest generation's state did not verify: its newcomers are rejected and the
    previous members still there (leavers included: they wait for the verdict) form the
    next one, or the job is held below MIN."""
    prev, g = seen.prev, seen.generation
    newcomers = tuple(w for w in seen.members if w not in prev)
    rejected = seen.rejected | set(newcomers)
    back = [w for w in prev if w not in rejected and seen.alive_not_done(w)]
    if len(back) < seen.min_workers:
        return Decision(Hold(f"rolling back generation {g} would leave {len(back)} "
                             f"worker(s), below the job's minimum of {seen.min_workers}",
                             tuple(w for w in prev if w not in back), f"generation {g}, rolling back"), newcomers)
    return Decision(Publish(tuple(back), "rollback", f"state check failed; back to {back}", desired=tuple(back),
                            failure=(g, f"state check failed: {seen.verdict_reason}")), newcomers)
