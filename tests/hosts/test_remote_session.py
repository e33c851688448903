"""gpuflex.hosts.remote_session's handshake with attach, on a fake channel (no SSH;
sessions on the sshd bed: tests/e2e/ssh/test_interactive_ssh.py)."""

from __future__ import annotations

import time

import pytest

from gpuflex.hosts import remote_session


class Channel:
    """What _handshake reads: stdout in chunks, then (maybe) an exit status."""

    def __init__(self, *chunks: bytes, status: int | None = None) -> None:
        self.chunks, self.status, self.closed = list(chunks), status, False

    def recv_ready(self) -> bool:
        return bool(self.chunks)

    def recv(self, n: int) -> bytes:
        return self.chunks.pop(0)

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return not self.chunks and self.status is not None

    def recv_exit_status(self) -> int:
        return self.status


def test_the_pid_line_is_found_after_what_a_login_script_printed(capfd):
    chan = Channel(b"welcome\nGPUFLEX-AT", b'TACH {"pid": 4242}\n')
    assert remote_session._handshake(chan, time.monotonic() + 60) == {"pid": 4242}
    assert capfd.readouterr().out == "welcome\n"


def test_a_supervisor_that_ended_before_its_line_is_an_error_with_its_exit():
    chan = Channel(b"python: No module named gpuflex\n", status=1)
    with pytest.raises(EOFError, match="ended before starting .exit 1.: python: No module named gpuflex"):
        remote_session._handshake(chan, time.monotonic() + 60)
