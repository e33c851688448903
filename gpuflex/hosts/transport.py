"""The `Transport` seam: how gpuflex runs things on a host, and the registry of kinds.

`LocalTransport` acts on this machine; `SSHTransport` (gpuflex.hosts.ssh) on a remote
host through paramiko. Both carry out process operations with the same host-side code
(`gpuflex.hosts.hostops`), so a worker's life looks the same everywhere.

Transports are registered by kind (`register_transport`). A host's kind is
`HostConfig.transport` ("local" or "ssh", derived from its `address`), and
`make_transport(host)` builds the transport registered for it. A kind not registered
yet is loaded by convention from the module `gpuflex.hosts.<kind>`, which registers
itself on import (as gpuflex.hosts.ssh does), so a new transport is a new module and
this one never names it. "local" is registered here: it needs nothing but this module.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from typing import Any, Callable

from gpuflex.config import HostConfig
from gpuflex.errors import CommandTimeout, TransportError
from gpuflex.hosts import gather, hostops
from gpuflex.hosts.relay import socket_error, unix_request


@dataclasses.dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


@dataclasses.dataclass(frozen=True)
class SpawnSpec:
    """A worker (or store) process to start detached on a host.

    Before it starts, the host creates the directories of `log` and `exit_path` and each
    of `private_dirs` (gpuflex's own: the job's directory, its checkpoints) 0700 and
    ours, and `socket_dir` (the run's control sockets) 0700, refusing one another user
    made; the log and the exit record are 0600.

    `env` is added to the environment of the host's hostops process; with `clean_env` it
    is the whole environment but for the host's identity (supervisor.HOST_IDENTITY: HOME,
    USER, LOGNAME, SHELL), so a job's workers get the environment recorded at submit
    rather than that of whoever runs the command that starts them. A program path
    (`argv[0]`) and `cwd` starting with `~` are the host user's.

    `deadline` (epoch seconds on this, the control host's, clock; None: none) is the run's
    time limit, kept by the supervisor itself, since no daemon watches the hosts. The host
    is sent the seconds left (`spawn_request`), not the epoch: a host clock minutes off
    would otherwise end the run minutes early or late. At the deadline the supervisor sends
    SIGTERM to the worker's group, waits `grace_s`, SIGKILLs what is left, and its exit
    record says `"time_limit": true`.

    `container` (issue 33: `submit --image`): {"engine", "image", "args"}: the supervisor
    runs `argv` in that image through the host's engine (gpuflex.hosts.container), with
    `cwd`, `private_dirs` and `socket_dir` mounted and the environment passed in.

    `fork_start` (an in-place job's worker): fork it from the run's warm interpreter on the
    host when it can be (gpuflex.hosts.zygote), waiting at most `fork_ready_s` for one that
    is starting.
    """

    argv: list[str]
    cwd: str
    env: dict[str, str]
    log: str
    exit_path: str
    private_dirs: list[str] = dataclasses.field(default_factory=list)
    socket_dir: str | None = None
    clean_env: bool = False
    deadline: float | None = None
    grace_s: float = 0.0
    container: dict[str, Any] | None = None
    fork_start: bool = False
    fork_ready_s: float = 0.0


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


def time_left_s(deadline: float | None, now: float) -> float | None:
    """The seconds from `now` to `deadline` (both this host's clock; None: no deadline), what
    a host is sent so that it keeps the limit on its own clock (supervisor.local_deadline). A
    deadline already past leaves 0."""
    return None if deadline is None else max(0.0, deadline - now)


def spawn_request(spec: SpawnSpec, now: float) -> dict[str, Any]:
    """What hostops spawn is sent: the spec, with the seconds left to its deadline at `now`
    beside the epoch (`time_left_s`)."""
    request = dataclasses.asdict(spec)
    if spec.deadline is not None:
        request["time_left_s"] = time_left_s(spec.deadline, now)
    return request


def exit_on_our_clock(record: dict[str, Any] | None, host_now: Any, received: float) -> dict[str, Any] | None:
    """An exit record whose `ended_at` (the host's clock) is moved onto this host's clock by
    the difference between the two, measured by the same reply: the host's time when it
    answered (`host_now`) against ours when the answer came (`received`). The error is the
    reply's transit, which can only make the end look later, never earlier. A reply without
    `host_now` (an older gpuflex on the host) is taken as it is."""
    if record is None or not isinstance(host_now, (int, float)) or isinstance(host_now, bool):
        return record
    ended = record.get("ended_at")
    if not isinstance(ended, (int, float)) or isinstance(ended, bool):
        return record
    return {**record, "ended_at": ended + (received - float(host_now)), "host_ended_at": ended}


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
        if "refused" in reply:   # the host's words for a person (hostops: supervisor.SpawnError)
            raise TransportError(self.host.name, str(reply["refused"]))
        if "error" in reply:
            raise TransportError(self.host.name, f"hostops {op}: {reply['error']}")
        return reply["ok"]

    def spawn(self, spec: SpawnSpec) -> Spawned:
        data = self.hostop("spawn", spawn_request(spec, time.time()))
        return Spawned(pid=int(data["pid"]), pgid=int(data["pgid"]))

    def status(self, items: list[tuple[int | None, str]]) -> list[ProcStatus]:
        """Liveness and exit record of (pgid, exit_path) pairs; an exit record's `ended_at`
        on this (the control host's) clock (exit_on_our_clock)."""
        data = self.hostop("status", {"items": [{"pgid": p, "exit_path": e} for p, e in items]})
        received = time.time()
        return [ProcStatus(alive=d["alive"], exit=exit_on_our_clock(d["exit"], d.get("now"), received))
                for d in data]

    def signal(self, pgids: list[int], signum: int) -> list[bool]:
        return self.hostop("signal", {"pgids": pgids, "signal": int(signum)})

    def stop(self, pgids: list[int], grace_s: float) -> list[str]:
        """SIGTERM, wait `grace_s`, SIGKILL; per group "gone", "terminated" or "killed"."""
        return self.hostop("stop", {"pgids": pgids, "grace_s": grace_s}, extra_timeout_s=grace_s + 5)

    def read(self, path: str, offset: int = 0, limit: int = 1 << 20) -> dict[str, Any]:
        return self.hostop("read", {"path": path, "offset": offset, "limit": limit})

    def put(self, local_path: str, remote_path: str) -> None:
        """Copy a local file to an absolute path on the host (`submit --sync`'s tar)."""
        raise TransportError(self.host.name, f"a {self.host.transport} host cannot be sent files")

    def gather(self, root: str, path: str) -> dict[str, Any]:
        """What `gpuflex fetch` copies of `path` under `root` on the host (gpuflex.hosts.gather's reply)."""
        res = self.run([self.host.python, "-m", "gpuflex.hosts.gather", root, path])
        try:
            return json.loads(res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            said = ((res.stderr + res.stdout).strip() or f"exit {res.returncode}").splitlines()[-1][:300]
            raise TransportError(self.host.name, f"fetch: {said}") from None

    def get(self, files: list[tuple[str, str]]) -> None:
        """Copy files of the host (absolute paths) to local paths whose directories exist
        (`gpuflex fetch`), in one session."""
        raise TransportError(self.host.name, f"a {self.host.transport} host cannot send files back")

    def cleanup(self, socket_dirs: list[str]) -> list[bool]:
        """Remove a finished run's socket directories (ours only); True per one gone."""
        return self.hostop("cleanup", {"socket_dirs": socket_dirs})


class LocalTransport(Transport):
    """This machine. Process operations run in-process, except spawn (it forks)."""

    def run(self, argv: list[str], *, input: str | None = None,
            timeout: float | None = None) -> CommandResult:
        argv = [os.path.expanduser(argv[0]), *argv[1:]] if argv else argv   # a configured ~/venv/bin/python
        try:
            p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise TransportError(self.host.name, f"command not found: {argv[0]}") from None
        except OSError as e:  # not executable, a directory, ...
            raise TransportError(self.host.name, f"cannot run {argv[0]}: {e.strerror}") from None
        except subprocess.TimeoutExpired:
            raise CommandTimeout(self.host.name, f"command timed out after {timeout} s: {argv[0]}", timeout) from None
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
        if op == "cleanup":
            return hostops.cleanup(request["socket_dirs"])
        if op == "end-run":
            try:
                return hostops.end_run(request["socket_dir"])
            except (ValueError, OSError) as e:
                raise TransportError(self.host.name, f"hostops {op}: {type(e).__name__}: {e}") from None
        raise ValueError(op)

    def put(self, local_path: str, remote_path: str) -> None:
        try:
            shutil.copyfile(local_path, remote_path)
        except OSError as e:
            raise TransportError(self.host.name, f"cannot copy to {remote_path}: {e.strerror}") from None

    def gather(self, root: str, path: str) -> dict[str, Any]:
        return gather.gather(root, path)

    def get(self, files: list[tuple[str, str]]) -> None:
        for remote, local in files:
            try:   # the path was resolved on the host side: a link put in its place since is not read
                fd = os.open(remote, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as src, open(local, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except OSError as e:
                raise TransportError(self.host.name, f"cannot copy {e.filename or remote}: {e.strerror}") from None

    def control_request(self, path: str, message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        try:
            return unix_request(os.path.expanduser(path), message, timeout)
        except (OSError, ValueError) as e:
            raise TransportError(self.host.name, f"control socket {path}: {socket_error(e)}") from None


_TILDE = re.compile(r"^(~(?:[A-Za-z_][A-Za-z0-9._-]*)?/)")   # ~/ or ~user/; never ~-/ or ~+/ (OLDPWD, PWD)


def shell_join(argv: list[str]) -> str:
    """`shlex.join(argv)` for a remote shell, except that a program path starting with
    `~/` (or `~user/`) keeps that prefix unquoted, so the remote shell expands it to the
    remote user's home (a configured `python = "~/venv/bin/python"`)."""
    if argv:
        m = _TILDE.match(argv[0])
        if m:
            rest = argv[0][m.end():]
            return " ".join([m.group(1) + (shlex.quote(rest) if rest else ""), *map(shlex.quote, argv[1:])])
    return shlex.join(argv)


TransportFactory = Callable[[HostConfig], "Transport"]
_KIND = re.compile(r"^[a-z][a-z0-9_]*$")
_factories: dict[str, TransportFactory] = {}


def register_transport(kind: str, factory: TransportFactory) -> None:
    """Make `make_transport` build hosts of `kind` with `factory(host)`.

    Registering a kind again replaces its factory (a test may put a fake in its place).
    Raises ValueError for a kind that is not a lowercase identifier.
    """
    if not _KIND.match(kind):
        raise ValueError(f"transport kind must be a lowercase identifier, got {kind!r}")
    _factories[kind] = factory


def make_transport(host: HostConfig) -> Transport:
    """A new transport for `host`, of the kind `host.transport` names.

    Raises TransportError (naming the host and the registered kinds) when no transport
    of that kind is registered and no module `gpuflex.hosts.<kind>` registers one.
    """
    kind = host.transport
    if kind not in _factories and _KIND.match(kind):
        module = f"{__package__}.{kind}"
        try:
            importlib.import_module(module)  # registers itself; paramiko only where SSH is used
        except ModuleNotFoundError as e:
            if e.name != module:
                raise  # the module exists but lacks a dependency: say so, not "unknown kind"
    factory = _factories.get(kind)
    if factory is None:
        raise TransportError(host.name, f"no transport of kind {kind!r} "
                                        f"(registered: {', '.join(sorted(_factories))}).")
    return factory(host)


register_transport("local", LocalTransport)
