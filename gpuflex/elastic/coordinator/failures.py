"""What the coordinator makes of failures: which workers stopped beating, when the same
failure has repeated enough to end the job, and the workers' crash and waiting records as
status shows them.

A job whose generations keep failing the same way (a state check that can never pass, a
member that always times the others out at the same step) would otherwise be re-formed
forever: issue 15 saw 1,809 generations of one rollback. `FailureStreak` counts the failed
generations in a row, by cause, and says when to stop. A cause is the reported reason with
its numbers blanked (`cause_of`), so "generation 7" and "generation 8", two ports or two
addresses do not make every failure look new. Training progress between two failures
(a newer step in rank 0's signed timings) starts the count again: an elastic job that
loses a worker now and then, and trains in between, is never ended by this.

The records come from the workers, signed (their authenticity is checked by the caller);
what they say is still bounded and made printable here, since it is shown to users.

Two more judgements of the coordinator live here, beside the generations' logic (which is
at its size limit): which members a resize request may name (`check_members`), and when
the job is gone so the coordinator should end itself (`OrphanWatch`). Standard library only.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from gpuflex.elastic.protocol import keys

ERROR_CHARS = 500
LINE_CHARS = 300
TRACEBACK_LINES = 15
PHASE_CHARS = 60
WAITED_FOR = 64          # ids listed in one waiting record
BACKSTOP_FACTOR = 3      # failures of any causes in a row without progress, times the limit
BACKSTOP_MIN = 10

log = logging.getLogger(__name__)

_HEX = re.compile(r"0x[0-9a-fA-F]+")
_DIGITS = re.compile(r"\d+")
_SPACE = re.compile(r"\s+")


def printable(value: Any, limit: int) -> str:
    """`value` as one line of at most `limit` printable characters."""
    text = (value if isinstance(value, str) else str(value))[:limit + 1]
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def cause_of(reason: str) -> str:
    """A failure reason with what changes from one try to the next blanked: addresses, then
    every run of digits (generation numbers, ranks, ports, timeouts), and the spacing."""
    text = _DIGITS.sub("N", _HEX.sub("0xN", reason))
    return _SPACE.sub(" ", text).strip()[:LINE_CHARS]


NEWCOMER_SPAN = 1024     # how far above the known ids a newcomer's id may be


class Heartbeats:
    """Liveness from the workers' heartbeat counters (hb/{wid}): a worker is alive while its
    counter keeps changing, and stale once it has not changed for `timeout_s` of `clock`."""

    def __init__(self, has: Callable[[str], bool], get: Callable[[str], bytes], timeout_s: float,
                 clock: Callable[[], float]) -> None:
        self.has, self.get, self.timeout_s, self.clock = has, get, timeout_s, clock
        self.seen: dict[int, tuple[str, float]] = {}   # wid: (counter, when it last changed)

    def alive(self, wid: int) -> bool:
        now = self.clock()
        if not self.has(keys.hb(wid)):
            return False
        value = self.get(keys.hb(wid)).decode(errors="replace")
        prev = self.seen.get(wid)
        if prev is None or prev[0] != value:
            self.seen[wid] = (value, now)
            return True
        return now - prev[1] < self.timeout_s

    def last_change(self) -> float | None:
        """When (by `clock`) a worker's counter was last seen to change; None: never."""
        return max((when for _, when in self.seen.values()), default=None)


def common_reason(reasons: Iterable[str | None]) -> str:
    """The most common of the members' failure reports (numbers aside), as one of them wrote
    it; "" when there is none."""
    texts = [r for r in reasons if r]
    if not texts:
        return ""
    common = Counter(cause_of(r) for r in texts).most_common(1)[0][0]
    return printable(next(r for r in texts if cause_of(r) == common), ERROR_CHARS)


@dataclass
class FailureStreak:
    """The failed generations in a row: `add` one per failed generation (a rollback, a
    recovery); it returns the reason to end the job, or None to try again. `trained` tells
    it of training progress.

    The job ends when `limit` failures in a row have the same cause, or when
    max(BACKSTOP_MIN, BACKSTOP_FACTOR x limit) failures in a row of any causes came with no
    training progress (causes that alternate must not retry forever either). Progress (a
    step newer than at the previous failure) starts both counts again."""

    limit: int
    cause: str = ""
    same: int = 0            # failures in a row with `cause`
    same_first: int = 0      # the first generation of those
    total: int = 0           # failures in a row, any cause, no progress between
    total_first: int = 0
    last: int = 0            # the newest generation counted
    step: int | None = None  # the newest training step known at the last failure

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"max failures must be at least 1, not {self.limit}")

    @property
    def backstop(self) -> int:
        return max(BACKSTOP_MIN, BACKSTOP_FACTOR * self.limit)

    trained_to: int | None = None   # the newest training step known (see `trained`)

    def trained(self, step: Any) -> None:
        """A generation formed at `step` and took its first step (rank 0's signed timings)."""
        if isinstance(step, int) and not isinstance(step, bool):
            self.trained_to = step if self.trained_to is None else max(self.trained_to, step)

    def add(self, generation: int, reason: str) -> str | None:
        if generation <= self.last:   # counted already (a decision looked at again)
            return None
        step = self.trained_to
        if step is not None and (self.step is None or step > self.step):
            self.same = self.total = 0
        self.step, self.last = step, generation
        cause = cause_of(reason)
        if self.same and cause == self.cause:
            self.same += 1
        else:
            self.cause, self.same, self.same_first = cause, 1, generation
        if not self.total:
            self.total_first = generation
        self.total += 1
        shown = printable(reason, ERROR_CHARS)
        if self.same >= self.limit:
            return f"{shown} ({self.same} times in a row: generations {self.same_first}..{generation})"
        if self.total >= self.backstop:
            return (f"{self.total} failed generations in a row without training progress "
                    f"(generations {self.total_first}..{generation}), the last: {shown}")
        return None


def listed_crash(wid: int, raw: Any) -> dict[str, Any]:
    """A worker's crashed/{wid} record as status lists it: {wid, error, traceback, phase}."""
    rec = raw if isinstance(raw, dict) else {}
    lines = rec.get("traceback")
    lines = lines[-TRACEBACK_LINES:] if isinstance(lines, list) else []
    return {"wid": wid, "error": printable(rec.get("error") or "unknown error", ERROR_CHARS),
            "traceback": [printable(line, LINE_CHARS) for line in lines],
            "phase": printable(rec.get("phase") or "unknown", PHASE_CHARS)}


def waiting_record(wid: int, raw: Any) -> dict[str, Any] | None:
    """A member's waiting/{wid} record as status lists it: {wid, for, since, phase}; None
    when it waits for nobody (or the record is not one)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("for"), list):
        return None
    waited = [w for w in raw["for"] if isinstance(w, int) and not isinstance(w, bool)][:WAITED_FOR]
    if not waited:
        return None
    since = raw.get("since")
    ok = isinstance(since, (int, float)) and not isinstance(since, bool) and math.isfinite(since)
    return {"wid": wid, "for": waited, "since": float(since) if ok else None,
            "phase": printable(raw.get("phase") or "", PHASE_CHARS)}


@dataclass
class WorkerReports:
    """The workers' crash and waiting records as the coordinator last read them.
    `read_json(key)` is a signed JSON record's value (None: absent or forged), `has(key)`
    whether the store holds the key. A crash record, once seen, stays."""

    read_json: Callable[[str], Any]
    has: Callable[[str], bool]
    crashed: dict[int, dict[str, Any]] = field(default_factory=dict)
    waiting: list[dict[str, Any]] = field(default_factory=list)

    def read(self, members: list[int], newcomers: Iterable[int]) -> None:
        for w in sorted(set(members) | set(newcomers)):
            if w not in self.crashed and self.has(keys.crashed(w)):
                rec = self.read_json(keys.crashed(w))
                if rec is not None:
                    self.crashed[w] = listed_crash(w, rec)
                    log.error("worker %d crashed (%s): %s", w, self.crashed[w]["phase"],
                              self.crashed[w]["error"])
        self.waiting = [r for r in (waiting_record(w, self.read_json(keys.waiting(w)))
                                    for w in members) if r is not None]

    def first_crash(self) -> dict[str, Any] | None:
        return self.crashed[min(self.crashed)] if self.crashed else None


def check_members(wanted: Any, known: Iterable[int], max_workers: int | None = None) -> list[int]:
    """`wanted` (a resize request's members) as worker ids this job can have, else
    ValueError naming the bad value. An id is one the coordinator knows (started with, or
    asked for before), or a newcomer's: the control side numbers newcomers on from the
    highest id it ever gave, so a new id lies above the known ones, within NEWCOMER_SPAN
    (gaps come only from spawns whose resize never arrived). -1, true, 10**9 or 2**70 are
    none of these; `max_workers` (the job's MAX) bounds how many there are."""
    if not isinstance(wanted, list) or not wanted:
        raise ValueError(f"members must be a non-empty list of worker ids, not {printable(wanted, 80)}")
    bad = [w for w in wanted if not isinstance(w, int) or isinstance(w, bool) or w < 0]
    if bad:
        raise ValueError(f"members must be worker ids (integers of at least 0), not {printable(bad[0], 40)}")
    known = set(known)
    top = max(known, default=-1)
    strange = [w for w in wanted if w not in known and not top < w <= top + NEWCOMER_SPAN]
    if strange:
        raise ValueError(f"worker {printable(strange[0], 40)} is not a worker of this job (known: "
                         f"{printable(sorted(known), 200)}; a newcomer's id follows {top})")
    ids = sorted(set(wanted))
    if max_workers is not None and len(ids) > max_workers:
        raise ValueError(f"{len(ids)} workers is above the job's maximum of {max_workers}")
    return ids


class OrphanWatch:
    """Whether the coordinator's job is gone, so it should end itself (issue 16: one
    outlived its workers and its job directory and spun for minutes; no daemon watches the
    hosts to end it). The job is gone when its directory was removed (or replaced), or
    when for `timeout_s` of `clock` no worker's heartbeat moved and no command reached
    the control socket. Both signs are told by the caller: `contact()` at each request,
    `beat(when)` with the heartbeats' last change."""

    def __init__(self, timeout_s: float, job_dir: str | None,
                 clock: Callable[[], float]) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the orphan timeout must be above 0 s, not {timeout_s}")
        self.timeout_s, self.job_dir, self.clock = timeout_s, job_dir, clock
        self.last_sign = clock()
        self._dir_fd = _open_dir(job_dir)   # None: missing from the start, gone already

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def contact(self) -> None:
        self.last_sign = max(self.last_sign, self.clock())

    def beat(self, when: float | None) -> None:
        if when is not None:
            self.last_sign = max(self.last_sign, when)

    def reason(self) -> str | None:
        """Why the job is gone; None while it is not."""
        if self.job_dir and not _same_dir(self.job_dir, self._dir_fd):
            return f"its job directory {self.job_dir} was removed"
        idle = self.clock() - self.last_sign
        if idle >= self.timeout_s:
            return (f"no worker heartbeat and no command for {idle:.0f} s "
                    f"(orphan timeout {self.timeout_s:g} s)")
        return None


def _open_dir(path: str | None) -> int | None:
    """A descriptor of the directory `path` (it tells the directory's removal even when
    another of the same name, perhaps with the same inode number, takes its place)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY) if path else None
    except OSError:
        return None


def _same_dir(path: str, fd: int | None) -> bool:
    """Whether the directory open as `fd` still exists and is the one named `path`."""
    try:
        held, named = os.fstat(fd), os.stat(path)
    except (OSError, TypeError):
        return False
    return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def members_ok(wanted: Any, known: Iterable[int]) -> bool:
    """Whether `check_members` accepts `wanted` (a worker's signed resize request: one
    naming ids that are not this job's is malformed, as over the control socket)."""
    try:
        check_members(wanted, known)
    except ValueError:
        return False
    return True
