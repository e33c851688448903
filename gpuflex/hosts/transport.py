"""The `Transport` seam: how gpuflex runs things on a host.

`LocalTransport` acts on this machine; `SSHTransport` (gpuflex.hosts.ssh) on a remote
host through paramiko. Both carry out process operations with the same host-side code
(`gpuflex.hosts.hostops`), so a worker's life looks the same everywhere.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import signal
import socket
import subprocess
from typing import Any

from gpuflex.config import HostConfig
from gpuflex.errors import TransportError
from gpuflex.hosts import hostops

MAX_CONTROL_REPLY = 1 << 20


@dataclasses.dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


@dataclasses.dataclass(frozen=True)
class SpawnSpec:
    """A worker (or store) process to start detached on a host."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    log: str
    exit_path: str


@dataclasses.dataclass(frozen=True)
class Spawned:
    pid: int
    pgid: int


@dataclasses.dataclass(frozen=True)
class ProcStatus:
    alive: bool
    exit: dict[str, Any] | None   # {"returncode": int, "ended_at": float} once ended

    @property
    def returncode(self) -> int | None:
        return None if self.exit is None else int(self.exit["returncode"])


class Transport(abc.ABC):
    """Runs commands and manages detached process groups on one host.

    Every method raises TransportError when the host cannot be reached or the command
    cannot be run; a command that runs and fails is a CommandResult, not an error.
    """

    def __init__(self, host: HostConfig) -> None:
        self.host = host

    @abc.abstractmethod
    def run(self, argv: list[str], *, input: str | None = None,
            timeout: float | None = None) -> CommandResult:
        """Run argv to completion on the host."""

    @abc.abstractmethod
    def control_request(self, path: str, message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """One JSON-lines exchange with a worker's control socket at `path` on the host."""

    def close(self) -> None:
        """Release connections (no-op where there are none)."""

    def hostop(self, op: str, request: dict[str, Any], extra_timeout_s: float = 0.0) -> Any:
        """Run a gpuflex.hosts.hostops operation on the host; returns its reply."""
        res = self.run([self.host.python, "-m", "gpuflex.hosts.hostops", op],
                       input=json.dumps(request), timeout=self.host.command_timeout_s + extra_timeout_s)
        try:
            reply = json.loads(res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise TransportError(self.host.name, f"hostops {op} failed (exit {res.returncode}): "
                                 f"{(res.stderr or res.stdout).strip()[-300:]}") from None
        if "error" in reply:
            raise TransportError(self.host.name, f"hostops {op}: {reply['error']}")
        return reply["ok"]

    def spawn(self, spec: SpawnSpec) -> Spawned:
        data = self.hostop("spawn", dataclasses.asdict(spec))
        return Spawned(pid=int(data["pid"]), pgid=int(data["pgid"]))

    def status(self, items: list[tuple[int | None, str]]) -> list[ProcStatus]:
        """Liveness and exit record of (pgid, exit_path) pairs."""
        data = self.hostop("status", {"items": [{"pgid": p, "exit_path": e} for p, e in items]})
        return [ProcStatus(alive=d["alive"], exit=d["exit"]) for d in data]

    def signal(self, pgids: list[int], signum: int) -> list[bool]:
        return self.hostop("signal", {"pgids": pgids, "signal": int(signum)})

    def stop(self, pgids: list[int], grace_s: float) -> list[str]:
        """SIGTERM, wait `grace_s`, SIGKILL; per group "gone", "terminated" or "killed"."""
        return self.hostop("stop", {"pgids": pgids, "grace_s": grace_s}, extra_timeout_s=grace_s + 5)

    def read(self, path: str, offset: int = 0, limit: int = 1 << 20) -> dict[str, Any]:
        return self.hostop("read", {"path": path, "offset": offset, "limit": limit})


class LocalTransport(Transport):
    """This machine. Process operations run in-process, except spawn (it forks)."""

    def run(self, argv: list[str], *, input: str | None = None,
            timeout: float | None = None) -> CommandResult:
        try:
            p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise TransportError(self.host.name, f"command not found: {argv[0]}") from None
        except OSError as e:  # not executable, a directory, ...
            raise TransportError(self.host.name, f"cannot run {argv[0]}: {e.strerror}") from None
        except subprocess.TimeoutExpired:
            raise TransportError(self.host.name, f"command timed out after {timeout} s: {argv[0]}") from None
        return CommandResult(p.returncode, p.stdout, p.stderr)

    def hostop(self, op: str, request: dict[str, Any], extra_timeout_s: float = 0.0) -> Any:
        if op == "spawn":
            return super().hostop(op, request)
        if op == "status":
            return hostops.status(request["items"])
        if op == "signal":
            return hostops.signal_groups(request["pgids"], request["signal"])
        if op == "stop":
            return hostops.stop_groups(request["pgids"], request["grace_s"])
        if op == "read":
            return hostops.read_file(request["path"], request.get("offset", 0), request.get("limit", 1 << 20))
        raise ValueError(op)

    def control_request(self, path: str, message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        try:
            return unix_request(os.path.expanduser(path), message, timeout)
        except OSError as e:
            raise TransportError(self.host.name, f"control socket {path}: {e}") from None


def unix_request(path: str, message: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one JSON line to a unix socket and read one JSON line back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(message).encode() + b"\n")
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
    return json.loads(buf)


def make_transport(host: HostConfig) -> Transport:
    if host.is_local:
        return LocalTransport(host)
    from gpuflex.hosts.ssh import SSHTransport  # paramiko only where SSH is used

    return SSHTransport(host)


SIGTERM = signal.SIGTERM
