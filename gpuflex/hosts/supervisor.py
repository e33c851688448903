"""A worker's supervisor: the process `hostops spawn` leaves behind on a host (standard
library only, as hostops, which runs it there).

`spawn` forks a supervisor that leads a new session (so the whole group can be
signalled), starts the worker in it and records the worker's exit status in an exit file
when it ends; a group that is gone without an exit file was killed or lost with its host.
The supervisor also keeps the run's time limit (the spec's deadline): no daemon of ours
runs on a host, so it is the only one there when the deadline comes. Before the worker
exists it marks its group in the run's socket directory (`mark_group`), so a command that
died before recording the run can still end it (hostops.end_run).
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import time
from typing import Any, Callable, Iterator

from gpuflex.hosts import container
from gpuflex.hosts.private import exclusive_dir, open_private, private_dir

# a run's process-group marks: this prefix and the group's id. gpuflex.elastic.protocol.run_dir reads
# them with the same prefix (a test holds the two equal); not imported from there, because this
# module runs under the host's python with nothing but the standard library.
GROUP_MARK = "group-"

# What a worker started with a clean environment (SpawnSpec.clean_env) still takes from
# this host: who it runs as and where that user's home is, which the host decides.
HOST_IDENTITY = ("HOME", "USER", "LOGNAME", "SHELL")


class SpawnError(RuntimeError):
    """The worker could not start, in words for the job's owner ("cannot start './x': ..."):
    hostops replies them as they are, without the exception's name."""


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """What every spawn does first: the run's deadline on this host's clock (the time this
    command took to get here is the run's, not the limit's; `time_left_s` is spent), and
    its directories made private (NotPrivate, an OSError, when one of them is another
    user's or a symlink). The spec to start the worker from."""
    spec = {**spec, "deadline": local_deadline(spec, time.time()), "time_left_s": None}
    log_path = os.path.expanduser(spec["log"])
    exit_path = os.path.expanduser(spec["exit_path"])
    for d in [os.path.dirname(log_path), os.path.dirname(exit_path), *(spec.get("private_dirs") or ())]:
        private_dir(d)
    if spec.get("socket_dir"):
        exclusive_dir(spec["socket_dir"])
    return spec


def spawn(spec: dict[str, Any]) -> dict[str, int]:
    """Start `spec["argv"]` detached; returns {"pid": worker pid, "pgid": group id}.

    spec: argv (a leading `~` in argv[0] is this host's home), cwd, env (added to this
    environment; with clean_env, to HOST_IDENTITY only), log (stdout+stderr appended),
    exit_path (JSON exit record written when the worker ends), private_dirs,
    socket_dir, time_left_s (or an older gpuflex's deadline: local_deadline) and grace_s (see
    gpuflex.hosts.transport.SpawnSpec). gpuflex's own directories are
    0700 and its files 0600 (gpuflex.hosts.private), set explicitly: the worker's umask,
    which its own outputs follow, is left alone. Raises NotPrivate (an OSError) when one
    of them is another user's or a symlink.
    """
    return start(prepare(spec))


def start(spec: dict[str, Any]) -> dict[str, int]:
    """Fork the supervisor of a `prepare`d spec and return what it reports."""
    log_fd = open_private(os.path.expanduser(spec["log"]), os.O_WRONLY | os.O_APPEND)
    read_fd, write_fd = os.pipe()
    first = os.fork()
    if first == 0:  # the future supervisor
        os.close(read_fd)
        try:
            os.setsid()
            supervise(spec, log_fd, os.path.expanduser(spec["exit_path"]), write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    os.close(log_fd)
    with os.fdopen(read_fd) as r:
        reply = r.read()
    if not reply:
        raise SpawnError("the supervisor died before starting the worker")
    data = json.loads(reply)
    if "error" in data:
        raise SpawnError(data["error"])
    return data


def local_deadline(spec: dict[str, Any], now: float) -> float | None:
    """The run's deadline on this host's clock (epoch seconds; None: none). The control host
    sends the seconds left (`time_left_s`), which no difference between the two clocks can
    move; an epoch `deadline` alone (a spec from an older gpuflex) is taken as it is."""
    if spec.get("time_left_s") is not None:
        return now + float(spec["time_left_s"])
    return None if spec.get("deadline") is None else float(spec["deadline"])


def _popen(argv: list[str], cwd: str, env: dict[str, str], log_fd: int) -> Any:
    """The worker as a new process of its own: `argv` executed."""
    return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                            stderr=subprocess.STDOUT)


def supervise(spec: dict[str, Any], log_fd: int, exit_path: str, report_fd: int,
               start: Callable[[list[str], str, dict[str, str], int], Any] = _popen) -> None:
    """The supervisor's life: start the worker (`start`: a process with `pid` and
    `wait(timeout)`; gpuflex.hosts.zygote forks it from a warm interpreter instead), report
    its pid and group on `report_fd`, wait for it (the run's deadline kept) and write its
    exit record."""
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
        proc = start(argv, cwd, env, log_fd)
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


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (Linux; PID may be "self"):
    proc(5)'s field n at index n - 3, the state first. None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: split after the last ')'
    return stat[stat.rfind(")") + 2:].split()


def proc_stats() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, ppid, pgrp) of each process in /proc (Linux), read lazily."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)
        if fields is not None and len(fields) > 2:
            yield int(entry.name), fields[0], int(fields[1]), int(fields[2])
