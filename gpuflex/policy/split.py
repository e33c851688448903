"""The control side of a job's split of its global batch (issue 12), pure: which of the
runtime's re-plans are new, and which worker, if any, is a straggler to release.

Both read rank 0's progress record, which the coordinator passes on as the workers wrote
it: JSON from the job's own processes, unsigned. So every field is checked for its kind
here, and what is not as the contract says (docs/architecture.md, "Mixed GPUs") is left
out rather than trusted: a malformed record can cost an event or a release, never a
crash of the command that read it.

Re-plans. The runtime numbers them (`seq`, carried in its committed state across resizes
and restarts from a checkpoint) and keeps the last 8. A re-plan is new when its seq is
above the newest recorded one's, or when it was made after that one: a run restarted
from an older checkpoint numbers its re-plans again from there, so a seq alone would
hide them; the entries it carries over from the checkpoint are older than the newest
recorded, and are not recorded twice. Both times are the runtime's own clocks.

Stragglers. The runtime marks a member `slow_since` the moment it became slower than the
members' median by [jobs] straggler_factor, and clears it when it catches up. One that
stays so for [jobs] straggler_s, in a job above its MIN, is released (shrunk away in
place), one per look, the one slow the longest first: the others' shares are re-planned
without it and its GPU is left for other jobs. Its slowness is measured on rank 0's clock
(the record's own `time`), so a clock skew between hosts does not age it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

REPLAN_KIND = "replan"
STRAGGLER_KIND = "straggler"
# how long harvest does not grow a job back onto a GPU it released a straggler from: a
# throttled GPU or a co-tenant seldom clears sooner, and each try costs a resize and another
# straggler_s at the slow pace
REGROW_AFTER_S = 3600.0
KEEP_REPLANS = 8             # the runtime keeps the last 8; more in a record is not the contract
MAX_SHARES = 4096            # workers listed in one plan (beyond it: not a record of ours)
REASONS = ("start", "membership", "speeds")


def number(value: Any) -> float | None:
    """A finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def count(value: Any) -> int | None:
    """A non-negative int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def shares(value: Any) -> dict[str, int] | None:
    """{"<wid>": share} with digit keys and non-negative int shares, else None."""
    if not isinstance(value, Mapping) or len(value) > MAX_SHARES:
        return None
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k.isascii() or not k.isdigit() or len(k) > 10 or count(v) is None:
            return None
        out[k] = v
    return out


def replan(entry: Any) -> dict[str, Any] | None:
    """One re-plan as the contract writes it, checked field by field; None when its seq,
    step, new shares or time are not there (it cannot be told apart or shown)."""
    if not isinstance(entry, Mapping):
        return None
    seq, step, time = count(entry.get("seq")), count(entry.get("step")), number(entry.get("time"))
    new, old = shares(entry.get("new")), shares(entry.get("old"))
    if seq is None or step is None or time is None or new is None:
        return None
    reason = entry.get("reason")
    return {"seq": seq, "step": step, "reason": reason if reason in REASONS else None,
            "old": old or {}, "new": new, "predicted_step_s": number(entry.get("predicted_step_s")),
            "previous_step_s": number(entry.get("previous_step_s")), "time": time}


def new_replans(progress: Any, last_seq: int | None, last_time: float | None) -> list[dict[str, Any]]:
    """The re-plans of `progress` not recorded yet, oldest first (see the module's doc):
    after (`last_seq`, `last_time`), the newest recorded one's; every one when none is."""
    entries = progress.get("replans") if isinstance(progress, Mapping) else None
    if not isinstance(entries, list):
        return []
    out = []
    for r in (replan(e) for e in entries[-KEEP_REPLANS:]):
        if r is None:
            continue
        if last_seq is None or last_time is None or r["seq"] > last_seq or r["time"] > last_time:
            out.append(r)
    return sorted(out, key=lambda r: (r["time"], r["seq"]))


def shares_text(plan: Mapping[str, int]) -> str:
    """"w0 43, w1 43, w2 14" (by worker id)."""
    return ", ".join(f"w{k} {v}" for k, v in sorted(plan.items(), key=lambda kv: int(kv[0])))


def replan_message(r: Mapping[str, Any]) -> str:
    """One line: "re-plan 3 at step 120 (speeds): w0 43, w1 43, w2 14 -> w0 48, w1 48, w2 4;
    predicted step 0.351 s (was 0.412 s)"."""
    text = f"re-plan {r['seq']} at step {r['step']}" + (f" ({r['reason']})" if r.get("reason") else "") + ": "
    text += (shares_text(r["old"]) + " -> " if r.get("old") else "shares ") + shares_text(r["new"])
    predicted, previous = r.get("predicted_step_s"), r.get("previous_step_s")
    if predicted is not None:
        text += f"; predicted step {predicted:.3f} s"
        text += f" (was {previous:.3f} s)" if previous is not None else ""
    return text


@dataclasses.dataclass(frozen=True)
class Member:
    """A worker meant to be in the job now (alive, not leaving)."""

    wid: int
    host: str


@dataclasses.dataclass(frozen=True)
class Release:
    """Release this worker: it has been slower than the median by the factor for `slow_for_s`."""

    wid: int
    host: str
    relative: float | None
    slow_for_s: float


def straggler(members: Sequence[Member], min_workers: int, progress: Any, straggler_s: float,
              now: float) -> Release | None:
    """The member to release, if any (see the module's doc): slow for at least
    `straggler_s` on the record's clock (its `time`, else `now`), the job still at MIN or
    more without it; the one slow the longest, then the slowest, then the lowest id."""
    if len(members) <= min_workers or not isinstance(progress, Mapping):
        return None
    workers = progress.get("workers")
    if not isinstance(workers, Mapping):
        return None
    clock = number(progress.get("time"))
    clock = now if clock is None else clock
    found = []
    for m in members:
        entry = workers.get(str(m.wid))
        since = number(entry.get("slow_since")) if isinstance(entry, Mapping) else None
        if since is None or clock - since < straggler_s:
            continue
        relative = number(entry.get("relative"))
        found.append((since, relative if relative is not None else math.inf, m.wid,
                      Release(m.wid, m.host, relative, clock - since)))
    return min(found, key=lambda f: f[:3])[3] if found else None
