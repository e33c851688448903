"""Host-side process operations, the same on this machine and over SSH.

Run as `python -m gpuflex.hosts.hostops OP` with a JSON request on stdin; it prints one
JSON reply. `LocalTransport` calls the functions directly where that is safe; `spawn`
always runs as its own process because it forks. Standard library only: remote hosts
need nothing but gpuflex itself importable by their `python`.

`spawn` starts a worker under its supervisor (gpuflex.hosts.supervisor), which records
the worker's exit in an exit file (forked from the run's warm interpreter when it can
be: gpuflex.hosts.zygote); the rest here asks about and acts on what runs:
`status` (is the group alive, what did the exit file say), signals and stops of groups,
reads of logs, the end of a run whose command died, and the clean-up of socket
directories.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import stat
import sys
import time
from typing import Any

from gpuflex.hosts import container
from gpuflex.hosts.private import remove_own_dir
from gpuflex.hosts.supervisor import GROUP_MARK, SpawnError, proc_stats
from gpuflex.hosts.zygote import spawn

log = logging.getLogger(__name__)


def end_run(socket_dir: str) -> list[int]:
    """SIGKILL every live process group marked in a run's socket directory (a run whose
    command died before it recorded it: gpuflex.control.intents), then remove the
    directory; returns the groups killed. Only our own directory, only our own groups."""
    d = socket_dir.rstrip("/")
    if not os.path.basename(d).startswith("gpuflex-"):
        raise ValueError(f"not a run's socket directory: {socket_dir!r}")
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ValueError(f"{socket_dir!r} is not our directory")
    pgids = sorted(int(e.name[len(GROUP_MARK):]) for e in os.scandir(d)
                   if e.name.startswith(GROUP_MARK) and e.name[len(GROUP_MARK):].isdigit())
    killed = [g for g, sent in zip(pgids, signal_groups(pgids, signal.SIGKILL)) if sent]
    deadline = time.monotonic() + 5
    while any(group_alive(g) for g in killed) and time.monotonic() < deadline:
        time.sleep(0.02)
    remove_own_dir(d)
    return killed


def cleanup(socket_dirs: list[str]) -> list[bool]:
    """Remove each of a finished run's socket directories (with any socket a killed
    process left) if it is ours; per directory, True when it is gone."""
    return [remove_own_dir(d) if os.path.basename(d.rstrip("/")).startswith("gpuflex-") else False
            for d in socket_dirs]


def sweep_socket_dirs(root: str, name: str, keep: list[str], min_age_s: float) -> list[str]:
    """Remove our `root` socket directories whose whole name matches the regular expression
    `name` and that no process serves any more (left by a run that ended without gpuflex
    seeing it end, or by an older gpuflex), except those in `keep` and those changed in the
    last `min_age_s` (a run starting now); returns the ones removed. Another user's
    directory, a symlink, or a name that only starts alike is never touched."""
    removed = []
    now = time.time()
    try:
        entries = [e for e in os.scandir(root) if re.fullmatch(name, e.name)]
    except OSError:
        return removed
    for e in entries:
        try:
            st = os.lstat(e.path)
            if e.path in keep or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() \
                    or now - st.st_mtime < min_age_s:
                continue
            if any(_served(s.path) for s in os.scandir(e.path)
                   if stat.S_ISSOCK(s.stat(follow_symlinks=False).st_mode)):
                continue
        except OSError:
            continue
        if remove_own_dir(e.path):
            removed.append(e.path)
    return removed


def _served(path: str) -> bool:
    """Whether a process accepts connections on the unix socket `path` (unsure: True)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process of group `pgid` exists (Linux /proc)."""
    return any(state != "Z" and pgrp == pgid for _, state, _, pgrp in proc_stats())


def read_exit(exit_path: str) -> dict[str, Any] | None:
    """The worker's exit record; None while there is none (or it cannot be read)."""
    try:
        with open(os.path.expanduser(exit_path)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # written atomically, so this is not a half-written file
        log.warning("cannot read the exit record %s: %s", exit_path, e)
        return None


def status(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each {pgid, exit_path}: {"alive": bool, "exit": exit record or None, "now": this
    host's time.time() when read}. `now` lets the caller put the record's `ended_at` (this
    host's clock) on its own (gpuflex.hosts.transport.exit_on_our_clock)."""
    out = []
    for item in items:
        # alive first: the supervisor (the group's leader) writes the record before it exits,
        # so a group seen gone has its record by now; read first, a record written between
        # the two looks like a worker gone without one (lost)
        alive = bool(item.get("pgid")) and group_alive(int(item["pgid"]))
        out.append({"alive": alive, "exit": read_exit(item["exit_path"]), "now": time.time()})
    return out


def signal_groups(pgids: list[int], signum: int) -> list[bool]:
    """Send `signum` to each group; False where the group no longer exists."""
    sent = []
    for pgid in pgids:
        if not group_alive(int(pgid)):   # a group of zombies only (no reaper) is gone
            sent.append(False)
            continue
        engine = container.engine_in_group(int(pgid), proc_stats()) if signum == signal.SIGKILL else None
        try:
            os.killpg(int(pgid), signum)
            sent.append(True)
        except ProcessLookupError:
            sent.append(False)
        except PermissionError:  # the group id was reused by another user's processes
            log.warning("not signalling process group %s: it belongs to another user", pgid)
            sent.append(False)
            continue
        if engine is not None:   # the group's container runs outside it (gpuflex.hosts.container)
            container.kill(engine, int(pgid), signum)
    return sent


def stop_groups(pgids: list[int], grace_s: float) -> list[str]:
    """SIGTERM each group, wait up to `grace_s`, then SIGKILL what is left.

    Returns per group: "gone" (already gone), "terminated" or "killed".
    """
    result = ["terminated" if ok else "gone"
              for ok in signal_groups(pgids, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    pending = [i for i, r in enumerate(result) if r == "terminated"]
    while pending and time.monotonic() < deadline:
        pending = [i for i in pending if group_alive(int(pgids[i]))]
        if pending:
            time.sleep(0.05)
    for i in pending:
        if group_alive(int(pgids[i])):
            signal_groups([pgids[i]], signal.SIGKILL)
            result[i] = "killed"
    # SIGKILL is not instant: wait (briefly) until the kernel has removed them
    deadline = time.monotonic() + 5
    while any(group_alive(int(pgids[i])) for i in pending) and time.monotonic() < deadline:
        time.sleep(0.02)
    return result


def read_file(path: str, offset: int = 0, limit: int = 1 << 20) -> dict[str, Any]:
    """Up to `limit` bytes of `path` from `offset`, as text; {"missing": True} if absent.

    Before the end of the file the chunk stops at the last whole UTF-8 character and
    "offset" points there, so a character is never split between two reads.
    """
    try:
        with open(os.path.expanduser(path), "rb") as f:
            f.seek(offset)
            data = f.read(limit)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return {"missing": True, "data": "", "offset": offset, "size": 0}
    if offset + len(data) < size:
        data = data[:_utf8_boundary(data) or len(data)]
    return {"missing": False, "data": data.decode("utf-8", "replace"), "offset": offset + len(data),
            "size": size}


def _utf8_boundary(data: bytes) -> int:
    """Length of `data` without a trailing incomplete UTF-8 character (unchanged if none)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: the lead is further back
            continue
        need = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if 0xF0 <= byte < 0xF8 else 1
        return len(data) - back if need > back else len(data)
    return len(data)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(json.dumps({"error": "usage: python -m gpuflex.hosts.hostops OP < request.json"}))
        return 2
    op = argv[0]
    try:
        req = json.loads(sys.stdin.read() or "{}")
        if op == "spawn":
            reply: Any = spawn(req)
        elif op == "status":
            reply = status(req["items"])
        elif op == "signal":
            reply = signal_groups(req["pgids"], int(req["signal"]))
        elif op == "stop":
            reply = stop_groups(req["pgids"], float(req["grace_s"]))
        elif op == "read":
            reply = read_file(req["path"], int(req.get("offset", 0)), int(req.get("limit", 1 << 20)))
        elif op == "cleanup":
            reply = cleanup(list(req["socket_dirs"]))
        elif op == "end-run":
            reply = end_run(str(req["socket_dir"]))
        else:
            print(json.dumps({"error": f"unknown op {op!r}"}))
            return 2
    except SpawnError as e:   # words for the job's owner: no exception name, no "hostops spawn"
        print(json.dumps({"refused": str(e)}))
        return 1
    except (KeyError, ValueError, TypeError, RuntimeError, OSError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps({"ok": reply}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
