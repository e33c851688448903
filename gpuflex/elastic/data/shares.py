"""How a step's fixed global batch is split over members of different speeds (issue 12).

In a synchronous step every member waits for the slowest, so the step takes
max over members of share x seconds per sample. Shares proportional to speed make every
member finish together; the gradient does not change, because each member's backward is
weighted by its share of the global batch (micro.py): the sum over the members is the
full-batch mean at any split.

Pure functions, the same on every rank: given the same numbers (exchanged at a step
boundary, see split.py) every rank computes the same shares. Rounding is the largest
remainder method: each member gets the floor of its exact share, and the samples left go
to the largest fractional parts, ties to the smaller member id. Every member then gets at
least one sample (two for a model with BatchNorm), taken from the largest shares: a script
may not survive an empty batch (its collate, its loss), so a share of 0 happens only when
the script says it can take one (`ElasticRun(empty_batches=True)`). A member with an empty
share still joins the step's gradient collective, with zero gradients and weight 0
(runtime.backward), so the collectives line up and the sum is unchanged.

Re-planning is hysteretic: a new plan replaces the current one on a membership change,
or when its predicted step time is at least REPLAN_GAIN shorter than the current plan's
under the same measurements, and at least REPLAN_MIN_S shorter: measurement noise alone
does not move samples about. The floor matters where a step's compute is a few
milliseconds: there the fixed part of a step (launches, hooks, the scheduler's noise on a
busy host), which the per-sample model does not see, makes a member with fewer samples
look slower per sample, and re-plans on such numbers would feed on themselves.
"""

from __future__ import annotations

import math
from typing import Sequence

REPLAN_GAIN = 0.05   # a new plan must predict a step this much shorter to replace the current one
REPLAN_MIN_S = 0.001  # ... and by at least this many seconds


def proportional(weights: Sequence[float], total: int, ids: Sequence[int] | None = None) -> list[int]:
    """Integer shares of `total` proportional to `weights` (>= 0), summing to `total`:
    largest remainder, ties to the smaller id (`ids`: one per weight, default the
    positions). All weights zero (or not finite): as equal as possible, in id order."""
    n = len(weights)
    if n == 0:
        raise ValueError("no members to split the batch over")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    ids = list(range(n)) if ids is None else list(ids)
    if len(ids) != n or len(set(ids)) != n:
        raise ValueError(f"need one distinct id per weight, got {ids!r} for {n} weights")
    w = [x if math.isfinite(x) and x > 0 else 0.0 for x in weights]
    s = sum(w)
    if s <= 0:
        w, s = [1.0] * n, float(n)
    exact = [total * x / s for x in w]
    shares = [math.floor(e) for e in exact]
    left = total - sum(shares)
    order = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), ids[i]))
    for i in order[:left]:
        shares[i] += 1
    return shares


def speed_shares(sec_per_sample: Sequence[float], total: int, ids: Sequence[int] | None = None,
                 least: int = 1, empty_ok: bool = False) -> list[int]:
    """Shares proportional to speed (1 / seconds per sample); a member with no positive
    measurement counts as infinitely slow unless none has one (then even). No member gets
    fewer than `least` samples (`at_least`; with `empty_ok`, unless it gets none)."""
    return at_least(proportional([1.0 / s if s > 0 else 0.0 for s in sec_per_sample], total, ids), least, ids,
                    empty_ok)


def at_least(shares: Sequence[int], least: int, ids: Sequence[int] | None = None,
             empty_ok: bool = False) -> list[int]:
    """`shares` with no member below `least` (a model with BatchNorm cannot train on one
    sample in train mode: "Expected more than 1 value per channel"), the total unchanged:
    a short share is filled one sample at a time from the largest share (ties to the
    smaller id) that stays at `least` or more. Where the total cannot give every member
    `least`, the even split. `empty_ok` (the script takes an empty batch): a share below
    `least` goes instead, whole, to the largest share, and the member gets 0."""
    out = list(shares)
    ids = list(range(len(out))) if ids is None else list(ids)
    if empty_ok:
        for i, n in enumerate(out):
            if 0 < n < least:
                top = min(range(len(out)), key=lambda j: (-out[j], ids[j]))
                if top != i:
                    out[top] += n
                    out[i] = 0
        return out
    total = sum(out)
    if total < least * len(out):
        return proportional([1.0] * len(out), total, ids)
    for i in sorted(range(len(out)), key=lambda k: ids[k]):
        while out[i] < least:
            top = min(range(len(out)), key=lambda j: (-out[j], ids[j]))
            out[top] -= 1
            out[i] += 1
    return out


def even_shares(n: int, total: int) -> list[int]:
    """The even split (shares differ by at most one, the larger ones first: sampler.split)."""
    return proportional([1.0] * n, total)


def predicted_step_s(shares: Sequence[int], sec_per_sample: Sequence[float]) -> float:
    """The step's compute time under `shares`: the slowest member's share x seconds per sample."""
    return max((n * s for n, s in zip(shares, sec_per_sample)), default=0.0)


def worth_replanning(current: Sequence[int], new: Sequence[int], sec_per_sample: Sequence[float],
                     gain: float = REPLAN_GAIN, min_s: float = REPLAN_MIN_S) -> bool:
    """Whether `new` predicts a step at least `gain` and `min_s` shorter than `current`
    (same members)."""
    if list(current) == list(new):
        return False
    old_s = predicted_step_s(current, sec_per_sample)
    new_s = predicted_step_s(new, sec_per_sample)
    return old_s > 0 and new_s <= (1.0 - gain) * old_s and old_s - new_s >= min_s


def rescale(shares: Sequence[int], total: int) -> list[int]:
    """A plan's shares for a shorter global batch (an epoch's last one): proportional to
    them, the same rounding (the positions as ids)."""
    if sum(shares) == total:
        return list(shares)
    return proportional([float(x) for x in shares], total)


def estimates(measured: Sequence[float], hints: Sequence[float]) -> list[float]:
    """Seconds per sample for each member: its measurement (> 0) where it has one, else
    from its speed hint (relative speed) scaled to the measured members' seconds x hint
    (their mean), or 1 / hint where none is measured."""
    hints = [h if math.isfinite(h) and h > 0 else 1.0 for h in hints]
    known = [(m, h) for m, h in zip(measured, hints) if m > 0]
    unit = sum(m * h for m, h in known) / len(known) if known else 1.0
    return [m if m > 0 else unit / h for m, h in zip(measured, hints)]


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    if n == 0:
        return 0.0
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
