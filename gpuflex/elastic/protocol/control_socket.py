"""The control socket: a unix socket (mode 0600 in a 0700 directory) speaking JSON lines.

Each connection sends one JSON object per line and gets one JSON object per line back:
`{"ok": true, ...}` or `{"ok": false, "error": "..."}`. Handlers run on the server's
threads and must only read cached values or set flags: they never touch the training
loop's tensors, so a client can never stall training. Malformed, oversized, too deeply
nested or slow messages get an error reply or a timeout; nothing a client sends crashes
the server.

Slow peers are bounded per request, not per read: a whole request (its line) must arrive
within REQUEST_TIMEOUT_S of the moment the server began waiting for it, and its reply must
leave within that time too, so a client trickling a byte a second holds its slot for at
most that long. Slots are few (MAX_CLIENTS threads); when all are taken a new connection
takes the slot of the peer that has waited longest without completing a request, once it
has waited EVICT_AFTER_S: the CLI and the workers' pokes send their line as soon as they
connect, so the peer that loses its slot is the slowest one, and 8 trickling clients
cannot lock `status` out (a request is answered at once instead of "busy").
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from typing import Any, Callable

MAX_LINE = 64 * 1024
MAX_DEPTH = 32             # nesting of arrays and objects in one request
REQUEST_TIMEOUT_S = 2.0
EVICT_AFTER_S = 0.5
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


def too_deep(line: bytes) -> bool:
    """Whether a JSON text's arrays and objects nest past MAX_DEPTH (brackets inside strings
    do not count), so such a request is refused before json.loads recurses."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return False
    return _scan_depth(line) > MAX_DEPTH


def _scan_depth(line: bytes) -> int:
    depth = deepest = 0
    in_string = escaped = False
    for c in line:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:          # backslash
                escaped = True
            elif c == 0x22:          # quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):      # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif c in (0x5D, 0x7D):      # ] }
            depth -= 1
    return deepest


class _Peer:
    """One connection and, while it waits for a request's line, since when (None while its
    request is being answered)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.waiting_since: float | None = time.monotonic()
        self.evicted = False


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
        self._lock = threading.Lock()
        self._peers: list[_Peer] = []
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
            peer = self._admit(conn)
            if peer is None:
                _farewell(conn, "busy: too many control connections")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(peer,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> _Peer | None:
        """A slot for `conn`: a free one, or that of the peer waiting longest for its
        request's line (at least EVICT_AFTER_S); None when every peer is being answered or
        has only just connected."""
        with self._lock:
            if len(self._peers) >= MAX_CLIENTS:
                waiting = [p for p in self._peers if p.waiting_since is not None]
                oldest = min(waiting, key=lambda p: p.waiting_since or 0.0, default=None)
                if oldest is None or time.monotonic() - (oldest.waiting_since or 0.0) < EVICT_AFTER_S:
                    return None
                self._evict(oldest)
            peer = _Peer(conn)
            self._peers.append(peer)
            return peer

    def _evict(self, peer: _Peer) -> None:
        """Close `peer`'s connection under it (its thread sees the end and leaves)."""
        peer.evicted = True
        self._peers.remove(peer)
        _farewell(peer.conn, "closed: a slow request gave its slot to a new connection")
        try:
            peer.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _serve(self, peer: _Peer) -> None:
        conn = peer.conn
        try:
            buf = b""
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while not peer.evicted:
                if b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        self._answer(peer, line)
                        deadline = time.monotonic() + REQUEST_TIMEOUT_S
                    continue
                if len(buf) > MAX_LINE:
                    _farewell(conn, f"message too large (limit {MAX_LINE} bytes)")
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    _farewell(conn, f"timeout: no complete request within {REQUEST_TIMEOUT_S} s")
                    return
                conn.settimeout(left)
                try:
                    chunk = conn.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    return
                buf += chunk
        except OSError:
            return
        finally:
            with self._lock:
                if peer in self._peers:
                    self._peers.remove(peer)
            conn.close()

    def _answer(self, peer: _Peer, line: bytes) -> None:
        """One request: answered without a risk of eviction, its reply bounded in time."""
        with self._lock:
            if peer.evicted:
                return
            peer.waiting_since = None
        reply = self.dispatch(line)
        peer.conn.settimeout(REQUEST_TIMEOUT_S)
        _reply(peer.conn, reply)
        with self._lock:
            peer.waiting_since = time.monotonic()

    def dispatch(self, line: bytes) -> dict[str, Any]:
        if len(line) > MAX_LINE:
            return {"ok": False, "error": f"message too large (limit {MAX_LINE} bytes)"}
        if too_deep(line):
            return {"ok": False, "error": f"malformed JSON: nested deeper than {MAX_DEPTH} levels"}
        try:
            msg = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            return {"ok": False, "error": f"malformed JSON: {e}"}
        except RecursionError:
            return {"ok": False, "error": "malformed JSON: nested too deeply"}
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


def _farewell(conn: socket.socket, error: str) -> None:
    """A last error line for a peer that is being closed, never waiting for it to read."""
    try:
        conn.send(json.dumps({"ok": False, "error": error}).encode() + b"\n", socket.MSG_DONTWAIT)
    except OSError:
        pass
