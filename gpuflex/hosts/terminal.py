"""The local side of an interactive session (`gpuflex run`): the command forked before its
job is recorded, blocked until told to go (so its process group goes into the database
with the job), then run in the foreground on the caller's terminal.

With a terminal on stdin the command gets a PTY of its own (it is the session leader of
its PTY, so its process group is its pid, and `gpuflex cancel` reaches it), and the
caller's terminal is put in raw mode and relayed both ways: Ctrl-C, job control and
full-screen programs work as in a shell. Without one (a pipe, a test), it inherits
stdin/stdout/stderr as they are, in a process group of its own. Signals `gpuflex run`
gets (SIGTERM, SIGHUP; SIGINT without a PTY) are passed to the command's group.

`attend` keeps the time limit, as a supervisor does (gpuflex.hosts.supervisor.wait_until):
at the deadline SIGTERM to the group, the grace, then SIGKILL. On an SSH host the same
code runs under gpuflex.hosts.attach, which also tells it when its caller is gone (the
terminal hung up, or the connection's process ended): the group gets SIGHUP, the grace,
then SIGKILL, so a session never outlives the `gpuflex run` that started it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import pty
import select
import signal
import sys
import termios
import time
import tty

from typing import Callable

from gpuflex.hosts.private import open_private, private_dir

ABORTED = 125   # the command never ran (its session was refused)
NOT_FOUND = 127


@dataclasses.dataclass
class Held:
    """A forked command waiting for `go`: its pid (its group's id too), the pipe that
    lets it go, and the PTY's master end (None: no PTY)."""

    pid: int
    go_fd: int
    master: int | None


def fork_blocked(argv: list[str], use_pty: bool) -> Held:
    """Fork the command, blocked until `go` (or ended by `abort`)."""
    r, w = os.pipe()
    if use_pty:
        pid, master = pty.fork()
    else:
        pid, master = os.fork(), None
    if pid == 0:   # the command-to-be
        try:
            os.close(w)
            if not use_pty:
                os.setpgid(0, 0)
            with os.fdopen(r) as f:
                data = f.read()
            if not data:
                os._exit(ABORTED)
            env = {**os.environ, **json.loads(data)}
            try:
                os.execvpe(argv[0], argv, env)
            except OSError as e:
                os.write(2, f"gpuflex run: cannot start {argv[0]!r}: {e.strerror}\n".encode())
                os._exit(NOT_FOUND)
        finally:
            os._exit(ABORTED)
    os.close(r)
    if not use_pty:
        try:
            os.setpgid(pid, pid)   # both sides set it: whichever runs first, the group exists
        except OSError:
            pass
    return Held(pid, w, master)


def go(held: Held, env: dict[str, str]) -> None:
    """Let the command start, with `env` added to this process's environment."""
    os.write(held.go_fd, json.dumps(env).encode())
    os.close(held.go_fd)


def abort(held: Held) -> None:
    """End the blocked command without it running."""
    os.close(held.go_fd)
    os.waitpid(held.pid, 0)
    if held.master is not None:
        os.close(held.master)


def exit_code(status: int) -> int:
    """A shell's exit code for a wait status: 128+N for a signal N."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def attend(held: Held, deadline: float | None, grace_s: float,
           orphaned: Callable[[], bool] | None = None) -> tuple[int, bool]:
    """Relay the terminal until the command ends, keeping the deadline (and hanging the
    command up once `orphaned()` is true). Returns its exit code and whether the time
    limit ended it."""
    state = {"timed_out": False, "term_at": None, "orphaned": orphaned}

    def forward(signum: int, frame) -> None:
        _killpg(held.pid, signum)

    passed = [signal.SIGTERM, signal.SIGHUP] + ([signal.SIGINT] if held.master is None else [])
    previous = {s: signal.signal(s, forward) for s in passed}
    try:
        if held.master is not None:
            return _relay(held, deadline, grace_s, state), state["timed_out"]
        while True:
            pid, status = os.waitpid(held.pid, os.WNOHANG)
            if pid:
                return exit_code(status), state["timed_out"]
            _keep_deadline(held.pid, deadline, grace_s, state)
            time.sleep(0.05)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _keep_deadline(pgid: int, deadline: float | None, grace_s: float, state: dict) -> None:
    now = time.time()
    if state["term_at"] is None:
        orphaned = state.get("orphaned")
        if orphaned is not None and orphaned():
            _hang_up(pgid, state)
        elif deadline is not None and now >= deadline:
            state["timed_out"], state["term_at"] = True, now
            _killpg(pgid, signal.SIGTERM)
    elif now >= state["term_at"] + grace_s:
        _killpg(pgid, signal.SIGKILL)


def _hang_up(pgid: int, state: dict) -> None:
    """The caller is gone: SIGHUP to the group now, SIGKILL after the grace."""
    if state["term_at"] is None:
        state["term_at"] = time.time()
        _killpg(pgid, signal.SIGHUP)


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except OSError:
        pass


def _relay(held: Held, deadline: float | None, grace_s: float, state: dict) -> int:
    """Copy the caller's stdin to the PTY and the PTY to stdout until the PTY closes."""
    master, stdin = held.master, sys.stdin.fileno()
    interactive = os.isatty(stdin)
    saved = termios.tcgetattr(stdin) if interactive else None
    if interactive:
        _copy_size(stdin, master)
        signal.signal(signal.SIGWINCH, lambda *_: _copy_size(stdin, master))
        tty.setraw(stdin, termios.TCSADRAIN)   # keeps what was typed ahead (TCSAFLUSH drops it)
    inputs = [master, stdin]
    try:
        while True:
            _keep_deadline(held.pid, deadline, grace_s, state)
            try:
                ready, _, _ = select.select(inputs, [], [], 0.2)
            except InterruptedError:
                continue
            if master in ready:
                try:
                    data = os.read(master, 65536)
                except OSError as e:   # EIO: every process holding the PTY's other end is gone
                    if e.errno != errno.EIO:
                        raise
                    data = b""
                if not data:
                    break
                try:
                    os.write(sys.stdout.fileno(), data)
                except OSError:   # the caller's terminal is gone; the command is hung up
                    _hang_up(held.pid, state)
            if stdin in ready:
                try:
                    data = os.read(stdin, 65536)
                except OSError:   # EIO: the caller's terminal hung up (an SSH connection closed)
                    _hang_up(held.pid, state)
                    inputs = [master]
                    continue
                if data:
                    os.write(master, data)
                else:   # the caller's input ended: pass an end-of-file on, once
                    os.write(master, b"\x04")
                    inputs = [master]
    finally:
        if saved is not None:
            signal.signal(signal.SIGWINCH, signal.SIG_DFL)
            try:
                termios.tcsetattr(stdin, termios.TCSAFLUSH, saved)
            except termios.error:   # that terminal is gone
                pass
        os.close(master)
    _, status = os.waitpid(held.pid, 0)
    return exit_code(status)


def _copy_size(src: int, dst: int) -> None:
    try:
        fcntl.ioctl(dst, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass


def write_exit(exit_path: str, rc: int, timed_out: bool) -> None:
    """The command's exit record, as a worker's supervisor writes one (hostops.status reads it).
    A leading `~` is this host's home, as in a spawn spec (the built-in workdir is under ~)."""
    exit_path = os.path.expanduser(exit_path)
    private_dir(os.path.dirname(exit_path))
    tmp = exit_path + ".tmp"
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
        json.dump({"returncode": rc, "ended_at": time.time(), **({"time_limit": True} if timed_out else {})}, f)
    os.replace(tmp, exit_path)
