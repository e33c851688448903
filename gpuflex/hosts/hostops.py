"""Host-side process operations, the same on this machine and over SSH.

Run as `python -m gpuflex.hosts.hostops OP` with a JSON request on stdin; it prints one
JSON reply. `LocalTransport` calls the functions directly where that is safe; `spawn`
always runs as its own process because it forks. Standard library only: remote hosts
need nothing but gpuflex itself importable by their `python`.

A worker runs under a small supervisor that is the leader of a new session (so the
whole group can be signalled) and that records the worker's exit status in an exit
file; a group that is gone without an exit file was killed or lost with its host.
The supervisor also keeps the run's time limit (the spec's deadline): no daemon of ours
runs on a host, so it is the only one there when the deadline comes.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import Any, Iterator

from gpuflex.hosts import container
from gpuflex.hosts.private import exclusive_dir, open_private, private_dir, remove_own_dir

# a run's process-group marks: this prefix and the group's id. gpuflex.elastic.protocol.run_dir reads
# them with the same prefix (a test holds the two equal); not imported from there, because this
# module runs under the host's python with nothing but the standard library.
GROUP_MARK = "group-"

log = logging.getLogger(__name__)

# What a worker started with a clean environment (SpawnSpec.clean_env) still takes from
# this host: who it runs as and where that user's home is, which the host decides.
HOST_IDENTITY = ("HOME", "USER", "LOGNAME", "SHELL")


def spawn(spec: dict[str, Any]) -> dict[str, int]:
    """Start `spec["argv"]` detached; returns {"pid": worker pid, "pgid": group id}.

    spec: argv (a leading `~` in argv[0] is this host's home), cwd, env (added to this
    environment; with clean_env, to HOST_IDENTITY only), log (stdout+stderr appended),
    exit_path (JSON exit record written when the worker ends), private_dirs,
    socket_dir, deadline and grace_s (see gpuflex.hosts.transport.SpawnSpec). gpuflex's own directories are
    0700 and its files 0600 (gpuflex.hosts.private), set explicitly: the worker's umask,
    which its own outputs follow, is left alone. Raises NotPrivate (an OSError) when one
    of them is another user's or a symlink.
    """
    log_path = os.path.expanduser(spec["log"])
    exit_path = os.path.expanduser(spec["exit_path"])
    for d in [os.path.dirname(log_path), os.path.dirname(exit_path), *(spec.get("private_dirs") or ())]:
        private_dir(d)
    if spec.get("socket_dir"):
        exclusive_dir(spec["socket_dir"])
    log_fd = open_private(log_path, os.O_WRONLY | os.O_APPEND)
    read_fd, write_fd = os.pipe()
    first = os.fork()
    if first == 0:  # the future supervisor
        os.close(read_fd)
        try:
            os.setsid()
            _supervise(spec, log_fd, exit_path, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    os.close(log_fd)
    with os.fdopen(read_fd) as r:
        reply = r.read()
    if not reply:
        raise RuntimeError("the supervisor died before starting the worker")
    data = json.loads(reply)
    if "error" in data:
        raise RuntimeError(data["error"])
    return data


def _supervise(spec: dict[str, Any], log_fd: int, exit_path: str, report_fd: int) -> None:
    if spec.get("socket_dir"):
        mark_group(spec["socket_dir"])   # before the process exists: see end_run
    argv = list(spec["argv"])
    argv[0] = os.path.expanduser(argv[0])
    cwd = os.path.expanduser(spec.get("cwd") or "~")
    env = spawn_env(spec)
    if spec.get("container"):   # issue 33: the worker in a container, the engine's client our child
        # the worker's values in the client's environment, never its argv (container.py)
        argv, env = container.spec_argv(spec, argv, cwd, env, os.getpgrp()), \
            container.client_environment(spec["container"]["engine"], env, os.environ)
    try:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env,
            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
        )
    except OSError as e:
        error = f"cannot start {spec['argv'][0]!r}: {e.strerror}"
        if not os.access(cwd, os.R_OK | os.X_OK):   # issue 33: say whose view of which directory failed
            error = (f"cannot start {spec['argv'][0]!r}: user {pwd.getpwuid(os.getuid()).pw_name} "
                     f"cannot read the job's directory {cwd} "
                     f"({e.strerror}); the workers run there as this host's SSH user: give it a path "
                     "this user shares, or submit with --sync to send the code")
        os.write(report_fd, json.dumps({"error": error}).encode())
        os.close(report_fd)
        return
    os.close(log_fd)
    # The supervisor stays to write the exit record: group signals are for the worker.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    os.write(report_fd, json.dumps({"pid": proc.pid, "pgid": os.getpgrp()}).encode())
    os.close(report_fd)
    # Detach from whoever started us (an SSH channel, the CLI).
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    rc, timed_out = wait_until(proc, spec.get("deadline"), float(spec.get("grace_s") or 0.0))
    if timed_out and spec.get("container"):   # the limit's SIGKILL ended only the engine's client
        container.kill(spec["container"]["engine"], os.getpgrp(), signal.SIGKILL)
    record = {"returncode": rc, "ended_at": time.time(), **({"time_limit": True} if timed_out else {})}
    tmp = exit_path + ".tmp"
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, exit_path)


def wait_until(proc: subprocess.Popen, deadline: float | None, grace_s: float) -> tuple[int, bool]:
    """Wait for the worker; at `deadline` (epoch seconds) SIGTERM its group, wait
    `grace_s`, then SIGKILL every process of the group but this supervisor. Returns the
    worker's return code and whether the deadline ended it. Waits in slices, so a clock
    set forward or back moves the deadline with it."""
    if deadline is None:
        return proc.wait(), False
    while (left := float(deadline) - time.time()) > 0:
        try:
            return proc.wait(timeout=min(left, 60.0)), False
        except subprocess.TimeoutExpired:
            pass
    _signal_own_group(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=max(0.0, grace_s))
    except subprocess.TimeoutExpired:
        _signal_own_group(signal.SIGKILL)
        rc = proc.wait()
    _signal_own_group(signal.SIGKILL)   # what the worker left behind: the limit ends the whole run
    return rc, True


def _signal_own_group(signum: int) -> None:
    """`signum` to every process of this supervisor's group except itself (it ignores
    SIGTERM but not SIGKILL)."""
    me, group = os.getpid(), os.getpgrp()
    for pid, state, _, pgrp in proc_stats():
        if pgrp == group and pid != me and state != "Z":
            try:
                os.kill(pid, signum)
            except OSError:
                pass


def spawn_env(spec: dict[str, Any]) -> dict[str, str]:
    """The environment a spawned process gets (see `spawn`)."""
    if spec.get("clean_env"):
        env = {k: os.environ[k] for k in HOST_IDENTITY if k in os.environ}
    else:
        env = dict(os.environ)
    env.update(spec.get("env") or {})
    return env



def mark_group(socket_dir: str) -> None:
    """Mark this process's group as one of the run's, in the run's socket directory."""
    fd = os.open(os.path.join(socket_dir, f"{GROUP_MARK}{os.getpgrp()}"), os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)


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


def proc_stats() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, ppid, pgrp) of each process in /proc (Linux), read lazily."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: split after the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2:
            yield int(entry.name), fields[0], int(fields[1]), int(fields[2])


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
    """For each {pgid, exit_path}: {"alive": bool, "exit": exit record or None}."""
    out = []
    for item in items:
        # alive first: the supervisor (the group's leader) writes the record before it exits,
        # so a group seen gone has its record by now; read first, a record written between
        # the two looks like a worker gone without one (lost)
        alive = bool(item.get("pgid")) and group_alive(int(item["pgid"]))
        out.append({"alive": alive, "exit": read_exit(item["exit_path"])})
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
    except (KeyError, ValueError, TypeError, RuntimeError, OSError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps({"ok": reply}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
