"""The throughput policy (issue 32, `[harvest] policy = "throughput"`): each elastic job's
world size, chosen for the pool's total progress. Pure: counts of workers and devices in,
target sizes and their reasons out; gpuflex.policy.harvest turns them into actions.

Progress is each job's throughput relative to its own at MIN (its speedup, from the
model fitted on its measured points: gpuflex.policy.throughput), summed over the jobs, so
a compute-bound job that doubles its speed with one more worker outweighs a
communication-bound one that gains 3%. The rules, in order:

1. Stays: a job with too few measurements (one world size or none) is not resized for
   throughput, and says why; nor is a job this policy resized less than `hold_s` ago
   (hysteresis), nor a job that cannot shrink in place (a restart job). Fair share alone
   may still shrink the first two (rule 2).
2. Start the waiting: a queued job that did not fit is given room by shrinking elastic
   jobs (one worker at a time, never below MIN), those that lose the least progress per
   device first, only when what they lose is less than what the queued job gains
   (starting it is worth 1.0, its speedup at MIN, over the devices it needs), or when it
   is of a higher priority, or its user is below their fair share and theirs is above it.
   That last reason needs no measurement: a job left at its size by rule 1 (not measured
   yet, or resized lately) gives a worker to a below-share user's queued job too, after
   the jobs rule 1 leaves free, and only while its user stays at or above their share
   (taken as linear: a worker loses 1/MIN). Without it, a user whose jobs started on a pool
   nobody else wanted held all of it until they ended. A user below fair share is never
   shrunk for another. If the room cannot be made in full, nothing is shrunk.
3. Even out shares: a job of a user below fair share whose next worker pays for the
   resize's stall (gain >= stall_s / horizon_s; `min_gain`, the noise threshold, is not
   asked: the move is for fairness, and the rule below keeps it from being undone)
   takes a worker from a job of a user above theirs (never below
   MIN, never of a higher priority, a measured job not held), the one that loses least
   first, when the taker's deficit and the giver's surplus come to more than the worker
   (the move narrows the gap between them, and the move back would not: never undone the
   next tick), and only when no device is idle or on its way to being idle for the
   taker. Without it a user whose jobs all started while the pool was full stays below
   their share for as long as the others run.
4. Grow: idle devices go one worker at a time to the job whose next worker adds the most
   progress per device (higher priority first, then a user below fair share), within
   MAX and its user's quota. A worker is added only when its relative gain pays for the
   resize's stall within the horizon (gain >= stall_s / horizon_s) and, unless its user
   is below their fair share, is above `min_gain` (noise). A job measured at one size only may grow by one worker onto
   devices no measured job wants (before the measured jobs of users at or above their
   share when its user is below theirs), to measure a second size (it never shrinks).
5. Shrink what loses: a job whose one fewer worker is faster by more than `min_gain`
   (past its communication-bound optimum) gives that worker back.

A user's fair share is max-min fair (`shares.fair_shares`): the pool's devices split equally
among the users with work, except that a user whose jobs could use less (the sum of
their MAX) gets that and the rest is split among the others. Queued --harvest jobs start
no bigger than what their user's share leaves (never below MIN), the user furthest below
their share first (`shares.Starting`, used by the harvest plan and by the real placement,
gpuflex.control.queueing): a job started at its MAX holds devices it has not shown it can
use, and cannot be shrunk until it has measured two sizes.

Every change carries its reason ("job 12 3->2: one fewer worker loses 1%; job 15 needs 1").
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from gpuflex.policy.shares import fair_shares
from gpuflex.policy.throughput import Model, fit, merge, why_not


@dataclasses.dataclass(frozen=True)
class Rules:
    horizon_s: float = 900.0     # a resize must pay for its stall within this long
    stall_s: float = 5.0         # what one resize costs the job (an in-place resize: seconds)
    min_gain: float = 0.05       # relative gains below this are noise (hysteresis)
    hold_s: float = 300.0        # a job this policy resized is left alone this long

    @property
    def threshold(self) -> float:
        return max(self.min_gain, self.stall_s / self.horizon_s)


@dataclasses.dataclass(frozen=True)
class Elastic:
    """A running elastic job the policy may resize."""

    id: int
    user: str
    size: int
    min_workers: int
    max_workers: int
    per_worker: int = 1
    priority: int = 0
    model: Model | None = None
    why_not: str | None = None      # why there is no model
    measured: frozenset[int] = frozenset()   # world sizes measured
    hosts: int = 1
    shrinkable: bool = True          # in place; a restart job only grows
    resized_at: float | None = None  # when this policy last resized it


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A queued job that did not fit: `need` devices for its MIN."""

    id: int
    user: str
    need: int
    priority: int = 0
    most: int | None = None     # devices at its MAX (its user's demand); None: `need`


@dataclasses.dataclass(frozen=True)
class Decision:
    job: int
    old: int
    new: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Allocation:
    sizes: Mapping[int, int]
    changes: tuple[Decision, ...] = ()     # new != old
    stays: tuple[Decision, ...] = ()       # left at their size, and why
    made_room_for: tuple[int, ...] = ()    # queued jobs the shrinks make room for


def speedup(j: Elastic, n: int) -> float:
    """The job's throughput at n over its throughput at MIN (needs its model)."""
    assert j.model is not None
    h = max(1, min(j.hosts, n))
    return j.model.throughput(n, h) / j.model.throughput(j.min_workers, max(1, min(j.hosts, j.min_workers)))


def allocate(jobs: Sequence[Elastic], waiting: Sequence[Waiting], free: int, *, held: Mapping[str, int],
             pool: int, room: Mapping[str, int | None] | None = None, rules: Rules = Rules(),
             now: float = 0.0, coming: int = 0) -> Allocation:
    """Target sizes of `jobs` given `free` idle devices; see the module docstring.
    `coming`: devices on their way to being idle (leavers of an earlier shrink, GPUs not
    yet quiet long enough): step 3 counts them, and the idle ones, as its takers' before
    it shrinks anyone, else it would shrink another job each tick until the first freed
    device is idle.
    `held`: devices each user's jobs hold now (all their jobs); `pool`: the devices the
    policy shares; `room`: devices each user may still take (None or missing: no quota)."""
    size = {j.id: j.size for j in jobs}
    held = dict(held)
    room = dict(room or {})
    users = {j.user for j in jobs} | {w.user for w in waiting}
    share = fair_shares({u: sum(j.max_workers * j.per_worker for j in jobs if j.user == u)
                         + sum(w.most or w.need for w in waiting if w.user == u) for u in users}, pool)
    why: dict[int, list[str]] = {j.id: [] for j in jobs}
    stays: list[Decision] = []
    locked: set[int] = set()
    for j in jobs:
        reason = None
        if j.resized_at is not None and now - j.resized_at < rules.hold_s:
            reason = f"resized less than {rules.hold_s:g} s ago"
        elif j.model is None:
            reason = j.why_not or "too few measurements"
        elif not j.shrinkable:
            reason = "a restart job: grown, never shrunk, by this policy"
        if reason is not None:
            stays.append(Decision(j.id, j.size, j.size, f"job {j.id} stays at {j.size}: {reason}"))
            locked.add(j.id)

    def below(user: str) -> bool:
        return held.get(user, 0) < share[user]

    def may_take(user: str, devices: int) -> bool:
        r = room.get(user)
        return r is None or r >= devices

    def take(j: Elastic, workers: int) -> None:   # workers < 0: give back
        size[j.id] += workers
        held[j.user] = held.get(j.user, 0) + workers * j.per_worker
        if room.get(j.user) is not None:
            room[j.user] -= workers * j.per_worker

    # -- 2. make room for the waiting --
    made_room: list[int] = []
    for w in sorted(waiting, key=lambda w: (-w.priority, not below(w.user), held.get(w.user, 0), w.id)):
        if not may_take(w.user, w.need) or free >= w.need:
            continue
        worth = 1.0 / max(w.need, 1)     # progress per device of starting it
        trial, trial_held = dict(size), dict(held)
        got, steps = free, []
        while got < w.need:
            best = None
            for j in jobs:
                n = trial[j.id]
                if n <= j.min_workers or j.priority > w.priority:
                    continue
                if below(j.user) and j.user != w.user:
                    continue
                fair = below(w.user) and not below(j.user)
                if j.id in locked and not (fair and j.shrinkable and j.user != w.user
                                           and trial_held.get(j.user, 0) - j.per_worker >= share[j.user]):
                    continue   # a job left at its size, unless fair share asks (never below the giver's share)
                # a job not measured yet is taken as linear (its loss the most a worker can lose)
                lost = (speedup(j, n) - speedup(j, n - 1)) if j.model is not None else 1.0 / j.min_workers
                loss = lost * (1 + rules.stall_s / rules.horizon_s)
                per_device = loss / j.per_worker
                if not (per_device < worth or j.priority < w.priority or fair):
                    continue
                key = (j.priority, j.id in locked, per_device, -n, j.id)
                if best is None or key < best[0]:
                    best = (key, j, loss)
            if best is None:
                break
            _, j, loss = best
            steps.append((j, trial[j.id], loss))
            trial[j.id] -= 1
            trial_held[j.user] = trial_held.get(j.user, 0) - j.per_worker
            got += j.per_worker
        if got < w.need:
            continue   # nothing shrunk in vain
        for j, n, loss in steps:
            take(j, -1)
            if j.id in locked:
                why[j.id].append(f"{j.user} is above their share and job {w.id} of {w.user}, below theirs, needs "
                                 f"{w.need}" + ("" if j.model is not None else " (its scaling not measured yet)"))
            else:
                why[j.id].append(f"one fewer worker loses {max(loss, 0) / speedup(j, n):.0%}; job {w.id} needs "
                                 f"{w.need}")
        free = got - w.need
        held[w.user] = held.get(w.user, 0) + w.need
        made_room.append(w.id)

    # -- 3. even out shares --
    spare, promised = free + coming, dict(held)
    while True:
        move = _rebalance(jobs, size, promised, share, locked, may_take, rules)
        if move is None:
            break
        j, k, gain, loss = move
        promised[j.user] = promised.get(j.user, 0) + j.per_worker
        if spare >= j.per_worker:    # an idle device (step 4 grows them first), or one on its way
            spare -= j.per_worker
            continue
        promised[k.user] -= k.per_worker
        take(k, -1)
        take(j, 1)
        why[k.id].append(f"one fewer worker loses {loss:.0%}; {j.user} is below their share")
        why[j.id].append(f"one more worker adds {gain:.0%}; {j.user} is below their share")

    # -- 4. grow onto idle devices --
    explored: set[int] = set()
    while True:
        best = None
        for j in jobs:
            n = size[j.id]
            if n >= j.max_workers or j.per_worker > free or not may_take(j.user, j.per_worker):
                continue
            if j.resized_at is not None and now - j.resized_at < rules.hold_s:
                continue
            if j.model is None:
                if j.id in explored or size[j.id] != j.size or j.size not in j.measured or len(j.measured) != 1:
                    continue
                # after every measured job of its priority, but before the measured jobs of users
                # at or above their share when its user is below theirs
                key = (int(not below(j.user)), -j.priority, not below(j.user), 0.0, j.id)
                best = best if best is not None and best[0] < key else (key, j, None)
                continue
            gain = speedup(j, n + 1) / speedup(j, n) - 1
            if gain < (rules.stall_s / rules.horizon_s if below(j.user) else rules.threshold):
                continue
            per_device = (speedup(j, n + 1) - speedup(j, n)) / j.per_worker
            key = (0, -j.priority, not below(j.user), -per_device, j.id)
            if best is None or key < best[0]:
                best = (key, j, gain)
        if best is None:
            break
        _, j, gain = best
        take(j, 1)
        free -= j.per_worker
        if gain is None:
            explored.add(j.id)
            why[j.id].append(f"measured at {j.size} worker(s) only: one more to measure its scaling")
        else:
            why[j.id].append(f"one more worker adds {gain:.0%}")

    # -- 5. shrink what loses --
    for j in jobs:
        if j.id in locked:
            continue
        while size[j.id] > j.min_workers:
            n = size[j.id]
            gain = speedup(j, n - 1) / speedup(j, n) - 1
            if gain <= rules.min_gain:
                break
            take(j, -1)
            why[j.id].append(f"one fewer worker is {gain:.0%} faster")

    stays = [d for d in stays if size[d.job] == d.old]   # a fair share's shrink moved it after all
    changes = tuple(Decision(j.id, j.size, size[j.id], f"job {j.id} {j.size}->{size[j.id]}: "
                             + "; ".join(_short(why[j.id])))
                    for j in jobs if size[j.id] != j.size)
    return Allocation(sizes=size, changes=changes, stays=tuple(stays), made_room_for=tuple(made_room))


def _rebalance(jobs: Sequence[Elastic], size: Mapping[int, int], held: Mapping[str, int], share: Mapping[str, float],
               locked: set[int], may_take, rules: Rules):
    """Step 3's next move: (taker, giver, taker's gain, giver's loss), or None. The taker
    is the job of the user furthest below their share whose next worker gains most; the
    giver the job of a user above theirs that loses least by one fewer. A move is made
    only when the taker's deficit and the giver's surplus come to more than the worker
    moved: it narrows the gap between them, and the move back would not (shares are
    fractional: without this, users at 4 and 5 of shares 4.5 would trade a worker every
    tick)."""
    best = None
    for j in jobs:
        n = size[j.id]
        if (j.id in locked or n >= j.max_workers or held.get(j.user, 0) >= share[j.user]
                or not may_take(j.user, j.per_worker)):
            continue
        gain = speedup(j, n + 1) / speedup(j, n) - 1
        if gain < rules.stall_s / rules.horizon_s:
            continue
        for k in jobs:
            m = size[k.id]
            if (k.id in locked or k.user == j.user or m <= k.min_workers or k.priority > j.priority
                    or k.per_worker != j.per_worker or held.get(k.user, 0) <= share[k.user]
                    # the move narrows the gap: the taker's deficit and the giver's surplus come
                    # to more than a worker (so the move back never qualifies)
                    or (share[j.user] - held.get(j.user, 0)) + (held.get(k.user, 0) - share[k.user]) <= j.per_worker):
                continue
            loss = 1 - speedup(k, m - 1) / speedup(k, m)
            key = (held.get(j.user, 0) - share[j.user], -gain, loss, j.id, k.id)
            if best is None or key < best[0]:
                best = (key, (j, k, gain, loss))
    return None if best is None else best[1]


def _short(reasons: list[str]) -> list[str]:
    """The reasons of one job's steps, each said once (a grow by 3 is one line)."""
    out: list[str] = []
    for r in reasons:
        if r not in out:
            out.append(r)
    return out[:3]


def elastic(view) -> Elastic:
    """A running job as the policy sees it, from the harvest plan's JobView (its members,
    its measured points; gpuflex.policy.harvest)."""
    pts = merge(view.points)
    n = len(view.workers)
    return Elastic(id=view.id, user=view.user, size=n, min_workers=view.min_workers, max_workers=view.max_workers,
                   per_worker=max(view.gpus_per_worker, 1), priority=view.priority, model=fit(pts),
                   why_not=why_not(pts), measured=frozenset(p.world for p in pts),
                   hosts=len({w.host for w in view.workers}) or 1, shrinkable=view.inplace,
                   resized_at=view.resized_at)


def rules_of(settings) -> Rules:
    """The [harvest] settings' rules (horizon_s, resize_stall_s, min_gain_pct, hold_s)."""
    return Rules(horizon_s=float(settings.horizon_s), stall_s=float(settings.resize_stall_s),
                 min_gain=float(settings.min_gain_pct) / 100, hold_s=float(settings.hold_s))
