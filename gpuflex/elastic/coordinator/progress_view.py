"""Rank 0's progress record as the coordinator's status shows it, with what a later write
would lose kept.

Rank 0 reports its failed checkpoint writes in its progress record (`checkpoint_failures`,
a count in that process, and `checkpoint_error`, the reason) at once; the reason is cleared
by its next successful write. A command that read the status only after that write used
to record "a checkpoint write failed" without saying why (issue 16's fault matrix, with
1 s checkpoints). The coordinator reads the record at every full read (at least every
IDLE_TICK_S, far more often than checkpoints are written), so it keeps each worker's last
failure here: the status's record carries `checkpoint_failures` as {count, last_error,
last_time} (null error and time until one failed). Standard library only.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from gpuflex.elastic.coordinator.failures import printable
from gpuflex.elastic.protocol.store_values import progress_record

ERROR_CHARS = 300


class ProgressView:
    """`read(raw)`: the progress record (None unless a JSON object) with its checkpoint
    failures as {count, last_error, last_time}, the last failure's reason and time kept
    per worker after the worker cleared them. `wall` dates a failure whose record has no
    time of its own."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.failures: dict[int, dict[str, Any]] = {}   # wid -> {count, last_error, last_time}

    def read(self, raw: bytes) -> dict[str, Any] | None:
        record = progress_record(raw)
        if record is None:
            return None
        wid, count, error = record.get("wid"), record.get("checkpoint_failures"), record.get("checkpoint_error")
        if not _is_int(wid) or not _is_int(count):
            return record
        kept = self.failures.get(wid, {"count": 0, "last_error": None, "last_time": None})
        if count < kept["count"]:   # a new process under the same id counts from 0 again
            kept = {"count": 0, "last_error": None, "last_time": None}
        if error and (count > kept["count"] or kept["last_error"] is None):
            when = record.get("time")
            kept = {"count": count, "last_error": printable(error, ERROR_CHARS),
                    "last_time": when if isinstance(when, (int, float)) and not isinstance(when, bool) else self.wall()}
        else:
            kept = {**kept, "count": count}
        self.failures[wid] = kept
        return {**record, "checkpoint_failures": dict(kept)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
