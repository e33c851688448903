"""Relay one JSON-lines exchange to a unix control socket on this host.

Run as `python -m gpuflex.hosts.relay PATH [--timeout S]` by `SSHTransport.control_request`
(paramiko has no direct-streamlocal channel). Reads one JSON line on stdin, sends it
to the socket at PATH, prints the one-line reply. Every failure is a JSON line
`{"ok": false, "error": ...}`; `"relay_error": true` marks a failure of the relay
itself (socket missing, refused, timed out) as opposed to a reply from the server.
Standard library only: it runs on the host, where gpuflex's own dependencies may be
missing. `unix_request` is the exchange itself, which `LocalTransport` calls directly.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

MAX_CONTROL_REPLY = 1 << 20


def unix_exchange(path: str, payload: bytes, timeout: float) -> bytes:
    """Send `payload` to a unix socket and read back one line (up to its newline, or to
    the server's close).

    Raises OSError (no socket, refused, timed out, closed without a reply, a reply over
    1 MiB).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass   # a server that answers at once and closes (busy): its reply is read below
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_CONTROL_REPLY:
                raise OSError("reply too large")
    if not buf:
        raise OSError("connection closed without a reply")
    return buf


def socket_error(e: Exception) -> str:
    """Why a unix socket request failed, in words for a person (not "[Errno 111]")."""
    if isinstance(e, ConnectionRefusedError):
        return "connection refused: nothing listens on it (its process is gone)"
    if isinstance(e, FileNotFoundError):
        return "no such socket (its process has not made it, or is gone)"
    if isinstance(e, PermissionError):
        return "permission denied"
    if isinstance(e, TimeoutError):
        return "no answer in time"
    if isinstance(e, ValueError):
        return f"the reply is not JSON: {e}"
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def unix_request(path: str, message: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one JSON line to a unix socket and read one JSON line back.

    Raises OSError (as `unix_exchange`) or ValueError (the reply is not JSON).
    """
    return json.loads(unix_exchange(path, json.dumps(message).encode() + b"\n", timeout))


def relay(path: str, line: str, timeout: float) -> dict:
    try:
        message = json.loads(line)
    except ValueError as e:
        return {"ok": False, "error": f"relay: stdin is not one JSON line: {e}", "relay_error": True}
    if not isinstance(message, dict):
        return {"ok": False, "error": "relay: the message must be a JSON object", "relay_error": True}
    try:
        reply = unix_request(os.path.expanduser(path), message, timeout)
    except (OSError, ValueError) as e:
        return {"ok": False, "error": socket_error(e), "relay_error": True}
    if not isinstance(reply, dict):
        return {"ok": False, "error": f"the server sent a non-object reply: {reply!r:.200}", "relay_error": True}
    return reply


def main(argv: list[str]) -> int:
    timeout = 5.0
    args = list(argv)
    if "--timeout" in args:
        i = args.index("--timeout")
        try:
            timeout = float(args[i + 1])
        except (IndexError, ValueError):
            print(json.dumps({"ok": False, "error": "relay: --timeout needs seconds", "relay_error": True}))
            return 2
        del args[i:i + 2]
    if len(args) != 1:
        print(json.dumps({"ok": False, "error": "usage: python -m gpuflex.hosts.relay PATH [--timeout S]",
                          "relay_error": True}))
        return 2
    reply = relay(args[0], sys.stdin.readline(), timeout)
    print(json.dumps(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
