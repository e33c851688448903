"""The caller's side of an interactive session on an SSH host (`gpuflex run`): the command
is started under gpuflex.hosts.attach on a channel of the host's pooled SSH connection,
blocked until the session is recorded (the protocol is in attach's docstring), then
relayed: with a terminal on stdin, the channel has a PTY of the terminal's size and
TERM, the terminal is in raw mode and window-size changes follow; otherwise stdin,
stdout and stderr are relayed as they are. Signals `gpuflex run` gets (SIGTERM, SIGHUP;
SIGINT without a PTY) are sent to the command's group on the host, as a local
session's are. The exit code is the one the channel brings back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import sys
import termios
import time
import tty
from typing import Callable

import paramiko

from gpuflex.errors import TransportError
from gpuflex.hosts.attach import MARK
from gpuflex.hosts.transport import shell_join, time_left_s

_READ = 1 << 16
LINGER_S = 2.0


@dataclasses.dataclass
class RemoteHeld:
    """A command waiting on an SSH host for its go: the channel and its group's id there."""

    chan: paramiko.Channel
    pid: int
    use_pty: bool


def start(transport, cwd: str, argv: list[str], use_pty: bool) -> RemoteHeld:
    """Start `argv` blocked in `cwd` on the transport's host; TransportError when it
    cannot be (the host unreachable, the directory missing there)."""
    host = transport.host
    chan = transport.open_channel()
    stdin = sys.stdin.fileno()
    try:
        if use_pty:
            cols, rows = os.get_terminal_size(stdin)
            chan.get_pty(term=os.environ.get("TERM") or "vt100", width=cols, height=rows)
        chan.exec_command(shell_join([host.python, "-m", "gpuflex.hosts.attach",
                                      json.dumps({"argv": argv, "cwd": cwd})]))
        reply = _handshake(chan, time.monotonic() + host.command_timeout_s)
    except (paramiko.SSHException, EOFError, OSError) as e:
        chan.close()
        raise TransportError(host.name, f"cannot start the session: {e or type(e).__name__}") from None
    if "pid" not in reply:
        chan.close()
        raise TransportError(host.name, str(reply.get("error") or reply))
    return RemoteHeld(chan, int(reply["pid"]), use_pty)


def _handshake(chan: paramiko.Channel, deadline: float) -> dict:
    """attach's first line; what a login script printed before it goes to stdout."""
    seen = b""
    while time.monotonic() < deadline:
        at = seen.find(MARK.encode())
        end = seen.find(b"\n", at) if at >= 0 else -1
        if end >= 0:
            if at:
                os.write(sys.stdout.fileno(), seen[:at])
            return json.loads(seen[at + len(MARK):end].decode().strip())
        if chan.recv_ready():
            seen += chan.recv(_READ)
        elif chan.recv_stderr_ready():
            os.write(sys.stderr.fileno(), chan.recv_stderr(_READ))
        elif chan.exit_status_ready() or chan.closed:
            err = seen.decode("utf-8", "replace").strip()[-300:]
            raise EOFError(f"it ended before starting (exit {chan.recv_exit_status()}){': ' + err if err else ''}")
        else:
            select.select([chan], [], [], 0.5)
    raise EOFError("no answer from gpuflex.hosts.attach in time")


def go(held: RemoteHeld, env: dict[str, str], exit_path: str, deadline: float | None, grace_s: float) -> None:
    # the seconds left beside the epoch: the host keeps the limit on its own clock (attach.py)
    held.chan.sendall((json.dumps({"env": env, "exit_path": exit_path, "deadline": deadline,
                                   "time_left_s": time_left_s(deadline, time.time()),
                                   "grace_s": grace_s}) + "\n").encode())


def abort(held: RemoteHeld) -> None:
    """End the blocked command unrun: its input ends before the go."""
    try:
        held.chan.shutdown_write()
        held.chan.status_event.wait(10)
    finally:
        held.chan.close()


def attend(held: RemoteHeld, signal_group: Callable[[int], None]) -> int:
    """Relay until the command ends; its exit code (255 when the host's side died
    without one, as ssh says)."""
    chan, stdin = held.chan, sys.stdin.fileno()
    pending: list[int] = []
    passed = [signal.SIGTERM, signal.SIGHUP] + ([] if held.use_pty else [signal.SIGINT])
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in passed}
    saved = termios.tcgetattr(stdin) if held.use_pty and os.isatty(stdin) else None
    if saved is not None:
        signal.signal(signal.SIGWINCH, lambda *_: _resize(chan, stdin))
        tty.setraw(stdin, termios.TCSADRAIN)   # keeps what was typed ahead (TCSAFLUSH drops it)
    inputs, ended_at = [chan, stdin], None
    try:
        while True:
            while pending:
                signal_group(pending.pop(0))
            if chan.exit_status_ready() and ended_at is None:
                ended_at = time.monotonic()
            # its output may still follow the exit status: until the end of it, or a
            # moment for one a process it left behind keeps open (ssh waits for ever)
            drained = not chan.recv_ready() and not chan.recv_stderr_ready()
            if drained and (chan.closed or (ended_at is not None and (
                    chan.eof_received or time.monotonic() > ended_at + LINGER_S))):
                break
            try:
                ready, _, _ = select.select(inputs, [], [], 0.2)
            except InterruptedError:
                continue
            while chan.recv_ready():
                os.write(sys.stdout.fileno(), chan.recv(_READ))
            while chan.recv_stderr_ready():
                os.write(sys.stderr.fileno(), chan.recv_stderr(_READ))
            if stdin in ready:
                data = os.read(stdin, _READ)
                if data:
                    chan.sendall(data)
                elif held.use_pty:   # the caller's input ended: an end-of-file on the PTY
                    chan.sendall(b"\x04")
                    inputs = [chan]
                else:                # ... or the channel's
                    chan.shutdown_write()
                    inputs = [chan]
    except (paramiko.SSHException, OSError):
        pass   # the connection dropped: the host's side hangs the command up
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if saved is not None:
            signal.signal(signal.SIGWINCH, signal.SIG_DFL)
            termios.tcsetattr(stdin, termios.TCSAFLUSH, saved)
        rc = chan.recv_exit_status() if chan.exit_status_ready() else -1
        chan.close()
    return 255 if rc < 0 else rc


def _resize(chan: paramiko.Channel, stdin: int) -> None:
    try:
        cols, rows = os.get_terminal_size(stdin)
        chan.resize_pty(width=cols, height=rows)
    except (OSError, paramiko.SSHException):
        pass
