"""What a run's directory holds for whoever comes after the coordinator.

A run's socket directory (/tmp/gpuflex-<hex>, 0700, new at each run of a job on each host
it uses: gpuflex.control.launch) holds the run's control sockets and a mark
`group-<pgid>` per process group gpuflex started there for the run, made by the group's
supervisor before its process started (gpuflex.hosts.supervisor). On the coordinator's host it
also holds, once the coordinator ended the job, the abort record (`abort.json`: {reason,
cause, at}, 0600, written whole): the next gpuflex command reads it there when the
coordinator no longer answers (it ends itself once no command came for its orphan
timeout), so how the job ended does not depend on when a command runs. For the same reason,
a coordinator that ends itself leaves its last status reply (`status.json`, 0600, written
whole): the generations it formed that no command heard of (a job that shrank past a lost
host and finished while no command ran) are judged from it, not from the older one the
database holds. The directory goes
with the run (the command that ends it removes it), so a record is never read by a later
run of the same job.

When the job ended because its workers never joined the runtime (a plain script never reads
the store, so it never sees the abort), the coordinator stops the run's other process groups
on its host itself, as a cancel would: SIGTERM to each group, then, after the grace, SIGKILL
to what is left but the group's supervisor (its leader), which writes the worker's exit
record. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from typing import Any, Callable

from gpuflex.elastic.protocol.keys import ABORT_REASON_CHARS

GROUP_MARK = "group-"        # a mark's name: this prefix and the group's id
ABORT_RECORD = "abort.json"  # the coordinator's abort record, in the run's directory on its host
LAST_STATUS = "status.json"  # the coordinator's last status reply, written when it ends itself


def others_may_write(st: os.stat_result) -> tuple[str, str] | None:
    """What lets another user write the file or directory whose stat is `st`, and what to
    do about it: ("belongs to uid N, not to you", ...) or ("is writable by group or others
    (mode M)", "chmod go-w it"); None when only this user may. A checkpoint, and a sharded
    one's DCP metadata (a pickle), is read only when nobody else could have written it:
    `gpuflex submit --resume-from` checks before it records anything, the worker again
    before it reads (sharding/checkpoints.py)."""
    if st.st_uid != os.getuid():
        return (f"belongs to uid {st.st_uid}, not to you (uid {os.getuid()})",
                "copy it into a directory of your own if you trust it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})", "chmod go-w it"
    return None


def marked_groups(run_dir: str) -> list[int]:
    """The process groups marked in `run_dir` (none when it is gone)."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    return sorted(int(n[len(GROUP_MARK):]) for n in names if n.startswith(GROUP_MARK) and n[len(GROUP_MARK):].isdigit())


def write_abort(run_dir: str, record: dict[str, Any]) -> str:
    """Write the abort record into `run_dir` whole (a reader sees none or all of it), mode
    0600; returns its path. OSError when it cannot be written."""
    return write_record(run_dir, ABORT_RECORD, record)


def write_record(run_dir: str, name: str, record: dict[str, Any]) -> str:
    """Write `record` as JSON into `run_dir`/`name` whole (a reader sees none or all of it),
    mode 0600; returns its path. OSError when it cannot be written."""
    path = os.path.join(run_dir, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def parse_abort(text: str) -> dict[str, Any] | None:
    """An abort record's text as {reason, cause, at} (cause and at None when absent or of the
    wrong type); None when it is not one (empty, not JSON, no reason)."""
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("reason"), str) or not rec["reason"]:
        return None
    at = rec.get("at")
    return {"reason": "".join(c for c in rec["reason"] if c.isprintable())[:ABORT_REASON_CHARS],
            "cause": rec.get("cause") if isinstance(rec.get("cause"), str) else None,
            "at": float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None}


def group_processes(pgid: int) -> list[int]:
    """The live (not zombie) processes of group `pgid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()   # the command name may hold ") "
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def stop_groups(pgids: list[int], grace_s: float, *, sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic) -> list[int]:
    """SIGTERM each group; after `grace_s`, SIGKILL each process still in one but its leader
    (a worker's supervisor: it ignores SIGTERM, and writes the exit record once the worker
    ended). Returns the groups signalled (a group gone, or another user's, is skipped)."""
    sent = []
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
            sent.append(pgid)
        except (ProcessLookupError, PermissionError):
            continue

    def left() -> list[int]:
        return [p for g in sent for p in group_processes(g) if p != g]

    end = clock() + max(0.0, grace_s)
    while left() and clock() < end:
        sleep(0.05)
    for pid in left():
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return sent
