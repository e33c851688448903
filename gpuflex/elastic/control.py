"""The control socket: a unix socket (mode 0600 in a 0700 directory) speaking JSON lines.

Each connection sends one JSON object per line and gets one JSON object per line back:
`{"ok": true, ...}` or `{"ok": false, "error": "..."}`. Handlers run on the server's
threads and must only read cached values or set flags: they never touch the training
loop's tensors, so a client can never stall training. Malformed, oversized or slow
messages get an error reply or a timeout; nothing a client sends crashes the server.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from typing import Any, Callable

MAX_LINE = 64 * 1024
CLIENT_TIMEOUT_S = 2.0
MAX_CLIENTS = 8

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def secure_dir(path: str) -> None:
    """Create `path` with mode 0700, or check that an existing one is ours and 0700."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=False)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"{path} exists and is not a directory owned by us")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)


class ControlServer:
    """Serves `handlers` (op name -> function) on a unix socket until `close()`."""

    def __init__(self, path: str, handlers: dict[str, Handler]) -> None:
        self.path = path
        self.handlers = handlers
        secure_dir(os.path.dirname(path))
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(16)
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="gpuflex-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                _reply(conn, {"ok": False, "error": "busy: too many control connections"})
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(CLIENT_TIMEOUT_S)
            buf = b""
            while True:
                try:
                    chunk = conn.recv(65536)
                except socket.timeout:
                    _reply(conn, {"ok": False, "error": f"timeout: no complete line within {CLIENT_TIMEOUT_S} s"})
                    return
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        _reply(conn, self.dispatch(line))
                if len(buf) > MAX_LINE:
                    _reply(conn, {"ok": False, "error": f"message too large (limit {MAX_LINE} bytes)"})
                    return
        except OSError:
            return
        finally:
            conn.close()
            self._slots.release()

    def dispatch(self, line: bytes) -> dict[str, Any]:
        if len(line) > MAX_LINE:
            return {"ok": False, "error": f"message too large (limit {MAX_LINE} bytes)"}
        try:
            msg = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            return {"ok": False, "error": f"malformed JSON: {e}"}
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            return {"ok": False, "error": 'expected an object with a string "op"'}
        handler = self.handlers.get(msg["op"])
        if handler is None:
            return {"ok": False, "error": f"unknown op {msg['op']!r} (known: {', '.join(sorted(self.handlers))})"}
        try:
            reply = handler(msg)
        except (ValueError, TypeError, KeyError) as e:
            return {"ok": False, "error": f"bad {msg['op']} request: {e}"}
        except Exception as e:  # a handler bug must not kill the server thread
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, **reply}


def _reply(conn: socket.socket, data: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(data).encode() + b"\n")
    except OSError:
        pass
