"""The host side of an interactive session on an SSH host (`gpuflex run`): run as
`python -m gpuflex.hosts.attach SPEC` on an SSH channel (with a PTY when the caller's
stdin is a terminal), it is the command's supervisor there, as gpuflex.hosts.hostops's
is a worker's, and does on the host what `gpuflex run` does for a local session
(gpuflex.hosts.terminal, the same code).

SPEC (JSON): {"argv": [...], "cwd": "..."}. It enters cwd, forks the command blocked
(its own PTY, or its own process group, whose id is its pid), and prints one line,
`MARK {"pid": N}` (or `MARK {"error": "..."}`), then waits for one line on stdin, the
go: {"env": {...}, "exit_path": "...", "deadline": ..., "time_left_s": ..., "grace_s": ...},
sent once the session is recorded with that group; the limit is kept on this host's clock
from time_left_s (supervisor.local_deadline). An end of input instead of the go ends the
command unrun (the session was refused). With a PTY its terminal is put in raw mode
before the handshake, so the go line is neither echoed nor edited.

Then it relays the terminal and keeps the deadline until the command ends, writes the
command's exit record at exit_path (`gpuflex cancel` and reconcile read it as a
worker's) and exits with the command's exit code, which the channel carries back. A
cancel signals the command's group, never this process (not in that group). When the
caller is gone (the channel's PTY hung up, or the SSH connection's process, this one's
parent, ended), the command is hung up: SIGHUP, the grace, SIGKILL.

Standard library only, as hostops: the host needs nothing but gpuflex importable.
"""

from __future__ import annotations

import json
import os
import sys
import termios
import time
import tty

from gpuflex.hosts import terminal
from gpuflex.hosts.supervisor import local_deadline

MARK = "GPUFLEX-ATTACH "
MAX_GO = 1 << 20   # the go line: the command's environment, a few KiB


def read_line(fd: int) -> bytes:
    """One line from `fd`, read a byte at a time: nothing after it is taken, since the
    command reads the rest of this input (b"": the input ended first)."""
    line = b""
    while len(line) < MAX_GO:
        c = os.read(fd, 1)
        if not c:
            return b""
        if c == b"\n":
            return line
        if c != b"\r":
            line += c
    return b""


def say(message: dict) -> None:
    os.write(1, (MARK + json.dumps(message) + "\n").encode())


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    use_pty = os.isatty(0)
    if use_pty:
        tty.setraw(0, termios.TCSADRAIN)
    try:
        os.chdir(os.path.expanduser(spec["cwd"]))
    except OSError as e:
        say({"error": f"cannot enter the session's directory {spec['cwd']} on this host: {e.strerror}"})
        return terminal.ABORTED
    held = terminal.fork_blocked(list(spec["argv"]), use_pty)
    say({"pid": held.pid})
    line = read_line(0)
    if not line:
        terminal.abort(held)
        return terminal.ABORTED
    go = json.loads(line)
    terminal.go(held, go["env"])
    parent = os.getppid()
    rc, timed_out = terminal.attend(held, local_deadline(go, time.time()), float(go["grace_s"]),
                                    orphaned=lambda: os.getppid() != parent)
    terminal.write_exit(go["exit_path"], rc, timed_out)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
