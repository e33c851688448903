"""The split plan: which member trains how many samples of each step (issue 12), measured,
agreed and committed.

Measurement. Each rank times its own compute of a step (from its first training forward,
else from the batch handed to the script, to the end of its local backward, less the time
spent at the step barrier: not the wait in the gradient collective, nor rank 0's
evaluation before the forward; run/context.py) and keeps seconds per sample as an EWMA
(`Meter`).

Agreement. At the top of a step, in the first step of each generation and every
EXCHANGE_EVERY steps, the members pass the step barrier and all-reduce one small float64
matrix, a row per rank [worker id, own seconds per sample (0: none yet), speed hint,
rank 0's clock]; each rank fills its own row, so the sum is every row, bit for bit the same
on every rank. Cost: one barrier crossing and one all-reduce of 4 x world doubles per
EXCHANGE_EVERY steps (and per formation). From those numbers each rank computes the same
plan (shares.py): a new one at the first step of a new membership (by speed where that
beats the even split as a re-plan must, else even), or when the measured speeds predict a
step at least REPLAN_GAIN shorter.

Commitment. The plan (members, shares, the step it starts at, the re-plan counter, the
agreed speeds, the last re-plans) is a registered object ("split"), so it is part of the
light commit of every step boundary (a failed step's re-plan is undone with the step),
of the state tree a newcomer receives and of the checkpoint: every step runs with the plan
committed for it, after a resize, a kill -9 or a restart. Nothing in it is local: the only
clock it holds is the one rank 0 put in the exchange.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.protocol.env import SPEED_HINT, SPLIT, STRAGGLER_FACTOR
from gpuflex.elastic.data.shares import (even_shares, estimates, median, predicted_step_s, speed_shares,
                                    worth_replanning)

log = logging.getLogger(__name__)

SPLITS = ("speed", "even")
DEFAULT_STRAGGLER_FACTOR = 3.0
EXCHANGE_EVERY = 8   # steps between exchanges of the measurements
EWMA_ALPHA = 0.3     # the weight of a new step's measurement
HISTORY = 8          # re-plans kept in the plan (and shown in the progress record)


def split_mode(split: str | None, environ: Mapping[str, str] | None = None) -> str:
    """`ElasticRun(split=...)`: as given, else GPUFLEX_SPLIT, else "speed"."""
    env = os.environ if environ is None else environ
    mode = split if split is not None else (env.get(SPLIT) or "speed")
    if mode not in SPLITS:
        where = "split" if split is not None else SPLIT
        raise ValueError(f"{where} must be one of {', '.join(SPLITS)}, got {mode!r}")
    return mode


def _positive(environ: Mapping[str, str], name: str, default: float, least: float = 0.0) -> float:
    raw = environ.get(name)
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = default
    if not math.isfinite(value) or value <= least:
        log.warning("gpuflex: %s=%r is not a number above %g; using %g", name, raw, least, default)
        return default
    return value


class Meter:
    """This rank's own seconds of compute per sample, smoothed (0: nothing measured yet)."""

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        self.alpha, self.sec = alpha, 0.0

    def add(self, seconds: float, samples: int) -> None:
        if samples <= 0 or not seconds > 0:
            return
        x = seconds / samples
        self.sec = x if self.sec <= 0 else self.alpha * x + (1 - self.alpha) * self.sec


def exchange(group: Collectives, rank: int, world: int, row: list[float]) -> list[list[float]] | None:
    """Every rank's row, by rank (one all-reduce); None if the collective failed (noted)."""
    t = torch.zeros(world, len(row), dtype=torch.float64)
    t[rank] = torch.tensor(row, dtype=torch.float64)
    dev = t.to(group.device) if group.backend == "nccl" else t
    if not group.call(dist.all_reduce, dev, group=group.pg):
        return None
    return dev.cpu().tolist()


class SplitPlan:
    """The committed plan (state_dict/load_state_dict: registered as "split") and this
    rank's local part (mode, hint, meter, the generation last exchanged in)."""

    def __init__(self, global_batch_size: int, split: str | None = None,
                 environ: Mapping[str, str] | None = None, least: int = 1, empty_ok: bool = False,
                 unit: int = 1) -> None:
        env = os.environ if environ is None else environ
        self.unit = unit   # every share is a whole number of units (bitwise mode; else 1 sample)
        self.mode = split_mode(split, env)
        self.least = least   # the smallest share a speed split gives a member (BatchNorm: 2)
        self.empty_ok = empty_ok   # the script takes an empty batch: a share below `least` may become 0
        self.hint = _positive(env, SPEED_HINT, 1.0)
        self.straggler_factor = _positive(env, STRAGGLER_FACTOR, DEFAULT_STRAGGLER_FACTOR, least=1.0)
        self.global_batch_size = global_batch_size
        self.meter = Meter()
        self.exchanged_in = -1   # the generation of the last exchange (local)
        self.members: list[int] = []    # worker ids by rank
        self.shares: list[int] = []     # samples of a full global batch, by rank
        self.start = 0                  # the first step run with this plan
        self.seq = 0                    # re-plans so far, over the whole run
        self.speeds: dict[str, float] = {}       # agreed seconds per sample, by worker id
        self.slow_since: dict[str, float] = {}   # stragglers, by worker id: since when (rank 0's clock)
        self.history: list[dict[str, Any]] = []  # the last HISTORY re-plans

    # ---- committed state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy({"members": self.members, "shares": self.shares, "start": self.start,
                              "seq": self.seq, "speeds": self.speeds, "slow_since": self.slow_since,
                              "history": self.history})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        s = copy.deepcopy(dict(state))
        self.members, self.shares = [int(w) for w in s["members"]], [int(n) for n in s["shares"]]
        self.start, self.seq = int(s["start"]), int(s["seq"])
        self.speeds = {str(k): float(v) for k, v in s["speeds"].items()}
        self.slow_since = {str(k): float(v) for k, v in s["slow_since"].items()}
        self.history = list(s["history"])

    # ---- the plan in use -----------------------------------------------------------------------
    def shares_for(self, world: int) -> tuple[int, ...] | None:
        """The shares of a full global batch, by rank, for a step at this world size (None:
        no plan for it yet, the even split)."""
        if len(self.shares) == world:
            return tuple(self.shares)
        if self.unit > 1:   # no plan yet: the even split, in whole units
            return tuple(n * self.unit for n in even_shares(world, self.global_batch_size // self.unit))
        return None

    def due(self, step: int, generation: int) -> bool:
        """Whether the members exchange their measurements at the top of this step."""
        return generation != self.exchanged_in or step % EXCHANGE_EVERY == 0

    def row(self, wid: int, now: float) -> list[float]:
        return [float(wid), self.meter.sec, self.hint, now]

    def decide(self, rows: list[list[float]], step: int, generation: int) -> dict[str, Any] | None:
        """From the exchanged rows (the same on every rank): update the agreed speeds and
        stragglers, and re-plan if the membership changed or the speeds say so. Returns the
        re-plan made (also in `history`), or None."""
        self.exchanged_in = generation
        wids = [int(r[0]) for r in rows]
        now = rows[0][3]
        for w, r in zip(wids, rows):
            if r[1] > 0:
                self.speeds[str(w)] = r[1]
        self.speeds = dict(sorted(self.speeds.items()))
        measured = [self.speeds.get(str(w), 0.0) for w in wids]
        est = estimates(measured, [r[2] for r in rows])
        self._mark_stragglers(wids, measured, now)
        u = self.unit   # shares are planned in units, then counted in samples
        b = self.global_batch_size // u
        even = [n * u for n in even_shares(len(wids), b)]
        new = [n * u for n in speed_shares(est, b, wids, -(-self.least // u), self.empty_ok)] \
            if self.mode == "speed" else even
        if wids != self.members:
            new = new if worth_replanning(even, new, est) else even   # speeds must earn an uneven split
            reason = "membership" if self.members else "start"
        elif worth_replanning(self.shares, new, est):
            reason = "speeds"
        else:
            return None
        old = dict(zip(self.members, self.shares))
        same = reason == "speeds"
        self.seq += 1
        entry = {"seq": self.seq, "step": step, "reason": reason,
                 "old": {str(w): n for w, n in old.items()}, "new": {str(w): n for w, n in zip(wids, new)},
                 "predicted_step_s": predicted_step_s(new, est) if any(measured) else None,   # hints: no unit
                 "previous_step_s": predicted_step_s(self.shares, est) if same else None, "time": now}
        self.members, self.shares, self.start = wids, new, step
        self.history = (self.history + [entry])[-HISTORY:]
        log.info("gpuflex: split plan %d from step %d (%s): %s", self.seq, step, reason, entry["new"])
        return entry

    def _mark_stragglers(self, wids: list[int], measured: list[float], now: float) -> None:
        known = [m for m in measured if m > 0]
        mid = median(known)
        slow = {str(w) for w, m in zip(wids, measured) if mid > 0 and m > self.straggler_factor * mid}
        self.slow_since = {w: self.slow_since.get(w, now) for w in sorted(slow)}

    # ---- rank 0's progress record -----------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """"split", "workers" and "replans" of the progress record (empty before a plan)."""
        if not self.members:
            return {}
        rates = {str(w): (1.0 / self.speeds[str(w)] if self.speeds.get(str(w), 0) > 0 else None)
                 for w in self.members}
        fastest = max((r for r in rates.values() if r is not None), default=None)
        workers = {w: {"share": n, "samples_per_s": None if rates[w] is None else round(rates[w], 3),
                       "relative": None if rates[w] is None or not fastest else round(rates[w] / fastest, 4),
                       "slow_since": self.slow_since.get(w)}
                   for w, n in zip(map(str, self.members), self.shares)}
        return {"split": self.mode, "workers": workers, "replans": copy.deepcopy(self.history)}
