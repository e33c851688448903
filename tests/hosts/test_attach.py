"""gpuflex.hosts.attach's handshake reading, without processes (the sessions it supervises
on an SSH host: tests/e2e/ssh/test_interactive_ssh.py)."""

from __future__ import annotations

import os

from gpuflex.hosts import attach


def test_the_go_line_is_read_alone_leaving_the_commands_input_unread():
    r, w = os.pipe()
    try:
        os.write(w, b'{"env": {}}\r\ntyped ahead\n')
        assert attach.read_line(r) == b'{"env": {}}'
        assert os.read(r, 100) == b"typed ahead\n"   # the command's, still there
    finally:
        os.close(r)
        os.close(w)


def test_an_input_that_ends_before_the_go_line_is_no_go():
    r, w = os.pipe()
    os.write(w, b'{"env": ')
    os.close(w)
    try:
        assert attach.read_line(r) == b""
    finally:
        os.close(r)
