"""Who records a leaver's end, and when: pure (the leavers as their hosts saw them, now,
the watch's deadline) -> record now, go on watching, or stop. No I/O.

A shrink marks its leavers `leaving` and returns once the coordinator took the request;
the leavers exit at the switch, a step boundary or two later. Nothing else runs on the
control host (there is no daemon), so without a watcher the rows said `leaving` after the
processes were gone, until some later command refreshed. The end is now recorded by
whoever sees it first:

- the command that shrank the job watches its leavers' process groups for a bounded time
  (`gpuflex scale`: `SCALE_WATCH_S`), and records each end as soon as it sees it (a refresh,
  so the leaver's exit record decides its final state as for any other worker);
- every command's refresh reads the coordinator and the hosts (gpuflex.control.lifecycle):
  the backstop for a leaver slower than the bound, or a watcher killed;
- a leaver still alive `LEAVE_BOUND_S` after the request never left, and is stopped
  (gpuflex.policy.reconcile).
"""

from __future__ import annotations

import dataclasses

SCALE_WATCH_S = 30.0   # a shrink's leavers exit a step or two after the switch: most within this
POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class LeaverSeen:
    """A live `leaving` row and its process group: alive, gone, or unknown (None: its host
    did not answer)."""

    wid: int
    alive: bool | None


@dataclasses.dataclass(frozen=True)
class WatchStep:
    """What the watcher does now: `record` (some leaver's group is gone: refresh, which
    ends its row), then stop when `done`, else look again after `wait_s`. `still`: the
    leavers not seen gone, whom a watcher that stops leaves to the next command."""

    record: bool
    done: bool
    still: tuple[int, ...] = ()
    wait_s: float = 0.0


def watch_step(leavers: tuple[LeaverSeen, ...], now: float, deadline: float) -> WatchStep:
    """Record as soon as any leaver is seen gone; stop once none is left, or at the deadline
    (the next command's refresh records the rest). A host that does not answer is not a
    leaver gone: its row stays `leaving` until someone sees the end."""
    still = tuple(sorted(s.wid for s in leavers if s.alive is not False))
    record = len(still) < len(leavers)
    if not still or now >= deadline:
        return WatchStep(record=record, done=True, still=still)
    return WatchStep(record=record, done=False, still=still, wait_s=min(POLL_S, max(0.0, deadline - now)))
