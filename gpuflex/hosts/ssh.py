"""`SSHTransport`: a remote host reached with paramiko.

Registered as the transport kind "ssh": `make_transport` imports this module for the
first host whose address is not "local", so paramiko is loaded only where SSH is used.

Security: key authentication only (the configured `identity_file`, else the agent and
the default keys), and the server's host key must already be in the host's
`known_hosts` (paramiko.RejectPolicy: an unknown key is refused; pinning a new host is
the explicit `gpuflex hosts trust NAME`). Remote commands are argv lists joined once
with `transport.shell_join`: every word quoted, except that a program path starting with
`~/` keeps that prefix unquoted, so the remote shell expands it to the remote user's home.

One SSH connection per transport, opened on first use and reused by every call
(paramiko multiplexes channels, so threads may share it); a dropped connection is
reopened once per call. Every failure to reach the host or to finish a command in time
raises `TransportError` naming the host.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import json
import logging
import os
import select
import socket
import threading
import time
from typing import Any

import paramiko

from gpuflex.config import HostConfig
from gpuflex.errors import CommandTimeout, TransportError
from gpuflex.hosts.transport import CommandResult, Transport, register_transport, shell_join

log = logging.getLogger(__name__)

_READ = 1 << 16
MAX_OUTPUT = 64 << 20  # a runaway command must not fill the control host's memory


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint: 'SHA256:' + unpadded base64 of the key blob's digest."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(address: str, port: int) -> str:
    """How OpenSSH names a host in known_hosts: 'addr' on port 22, else '[addr]:port'."""
    return address if port == 22 else f"[{address}]:{port}"


class UnknownHostKey(paramiko.SSHException):
    """The server's key is not in known_hosts (raised by `_RejectUnknown`, with the key)."""

    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        super().__init__(f"{hostname} not found in known_hosts")
        self.hostname = hostname
        self.key = key


class _RejectUnknown(paramiko.RejectPolicy):
    """RejectPolicy that keeps the offered key, so the error can show its fingerprint."""

    def missing_host_key(self, client, hostname, key):
        raise UnknownHostKey(hostname, key)


def _where(host: HostConfig) -> str:
    return f"{host.address}:{host.port}"


def connect_error(host: HostConfig, exc: BaseException) -> TransportError:
    """Turn whatever paramiko or the socket raised while connecting into one clear message."""
    where = _where(host)
    kh = host.known_hosts
    trust = f"run 'gpuflex hosts trust {host.name}' to pin it"
    if isinstance(exc, paramiko.BadHostKeyException):
        return TransportError(host.name, (
            f"host key mismatch for {where} — the server offered {exc.key.get_name()} "
            f"{fingerprint(exc.key)}, but {kh} pins {fingerprint(exc.expected_key)}. Either the "
            f"host was reinstalled or someone is in the middle; check, then {trust} again."))
    if isinstance(exc, UnknownHostKey):
        return TransportError(host.name, (
            f"unknown host key for {where} ({exc.key.get_name()} {fingerprint(exc.key)}) — it is "
            f"not in {kh}; verify it, then {trust}."))
    if isinstance(exc, paramiko.AuthenticationException):
        how = f"identity file {host.identity_file}" if host.identity_file else "the agent or default keys"
        return TransportError(host.name, f"authentication failed for {_user(host)}@{where} with {how}: {exc}")
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        return TransportError(host.name, f"SSH connection refused by {where}")
    if isinstance(exc, ConnectionRefusedError):
        return TransportError(host.name, f"SSH connection refused by {where}")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return TransportError(host.name, f"connection to {where} timed out after {host.connect_timeout_s} s")
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        # "No existing session": the key exchange did not finish within the timeout
        if "banner" in text.lower() or text == "No existing session":
            return TransportError(host.name, f"no SSH server answered at {where} within "
                                             f"{host.connect_timeout_s} s ({text})")
        return TransportError(host.name, f"SSH handshake with {where} failed: {text}")
    if isinstance(exc, OSError):
        return TransportError(host.name, f"cannot connect to {where}: {exc.strerror or exc}")
    return TransportError(host.name, f"cannot connect to {where}: {type(exc).__name__}: {exc}")


def _user(host: HostConfig) -> str:
    if host.user:
        return host.user
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


class SSHTransport(Transport):
    """A host reached over SSH; see the module docstring for the security rules."""

    def __init__(self, host: HostConfig) -> None:
        super().__init__(host)
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()

    # ---- connection --------------------------------------------------------------
    def _connect(self) -> paramiko.SSHClient:
        host = self.host
        client = paramiko.SSHClient()
        kh = os.path.expanduser(host.known_hosts)
        if os.path.exists(kh):
            try:
                client.load_system_host_keys(kh)  # "system" keys are read, never written back
            except Exception as e:  # noqa: BLE001 - OSError, SSHException, InvalidHostKey
                raise TransportError(host.name, f"cannot read known_hosts {kh}: {e}") from None
        client.set_missing_host_key_policy(_RejectUnknown())
        identity = os.path.expanduser(host.identity_file) if host.identity_file else None
        if identity and not os.path.exists(identity):
            raise TransportError(host.name, f"identity file {host.identity_file} does not exist")
        t = host.connect_timeout_s
        try:
            client.connect(
                host.address, port=host.port, username=_user(host),
                key_filename=identity,
                allow_agent=True,
                look_for_keys=identity is None,  # with an explicit key, try only that one
                timeout=t, banner_timeout=t, auth_timeout=t, channel_timeout=t,
            )
        except Exception as e:  # paramiko raises a zoo of types; all become one message
            client.close()
            raise connect_error(host, e) from None
        return client

    def client(self) -> paramiko.SSHClient:
        """The pooled connection, opened (or reopened if it dropped) under a lock."""
        with self._lock:
            c = self._client
            if c is not None:
                tr = c.get_transport()
                if tr is not None and tr.is_active():
                    return c
                c.close()
                self._client = None
            self._client = self._connect()
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # ---- commands ----------------------------------------------------------------
    def _open_session(self) -> paramiko.Channel:
        for attempt in (0, 1):
            tr = self.client().get_transport()
            try:
                return tr.open_session(timeout=self.host.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError) as e:
                # the pooled connection died under us (host rebooted, sshd restarted): reopen once
                log.debug("%s: cannot open a channel (%r)%s", self.host.name, e,
                          "" if attempt else "; reconnecting")
                with self._lock:
                    if self._client is not None and self._client.get_transport() is tr:
                        self._client.close()
                        self._client = None
                if attempt:
                    raise TransportError(self.host.name, f"cannot open a channel to {_where(self.host)}: "
                                                         f"{e or type(e).__name__}") from None
        raise AssertionError("unreachable")

    def open_channel(self) -> paramiko.Channel:
        """A new session channel on the pooled connection (`gpuflex run`'s, which keeps
        it open for as long as its command runs: gpuflex.hosts.remote_session)."""
        return self._open_session()

    def run(self, argv: list[str], *, input: str | None = None,
            timeout: float | None = None) -> CommandResult:
        timeout = self.host.command_timeout_s if timeout is None else timeout
        command = shell_join(argv)
        chan = self._open_session()
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            if input:
                try:
                    chan.sendall(input.encode())
                except OSError:   # "Socket is closed": it exited before reading it all; its status says why
                    log.debug("%s: %s ended before reading its input", self.host.name, argv[0])
            if not chan.closed:
                chan.shutdown_write()
            out, err = _collect(chan, time.monotonic() + timeout)
            if out is None:
                raise CommandTimeout(self.host.name, f"command timed out after {timeout} s: {argv[0]}", timeout)
            if not chan.status_event.wait(max(0.0, min(timeout, 5.0))):
                raise CommandTimeout(self.host.name, f"no exit status from {argv[0]} within {timeout} s", timeout)
            rc = chan.recv_exit_status()
        except socket.timeout:
            raise CommandTimeout(self.host.name, f"command timed out after {timeout} s: {argv[0]}", timeout) from None
        except _TooMuchOutput:
            raise TransportError(self.host.name, f"{argv[0]} wrote more than {MAX_OUTPUT} bytes; "
                                                 "stopped reading") from None
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise TransportError(self.host.name, f"lost the connection to {_where(self.host)} "
                                                 f"while running {argv[0]}: {e or type(e).__name__}") from None
        finally:
            chan.close()
        # -1: the remote process died from a signal (OpenSSH sends exit-signal, no status)
        return CommandResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    def _sftp(self) -> "paramiko.SFTPClient":
        """An SFTP session on the pooled connection whose every read and write gives up after
        command_timeout_s without progress (socket.timeout, an OSError): a host that stalls
        mid-transfer fails the copy instead of hanging the command."""
        sftp = self.client().open_sftp()
        sftp.get_channel().settimeout(self.host.command_timeout_s)
        return sftp

    def put(self, local_path: str, remote_path: str) -> None:
        """By SFTP over the pooled connection (no second login)."""
        try:
            with self._sftp() as sftp:
                sftp.put(local_path, remote_path)
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise TransportError(self.host.name, f"cannot send {remote_path} to {_where(self.host)} by SFTP "
                                                 f"(its sshd needs a 'Subsystem sftp' line): "
                                                 f"{e or type(e).__name__}") from None

    def get(self, files: list[tuple[str, str]]) -> None:
        """By SFTP over the pooled connection, one SFTP session for all the files."""
        remote = ""
        try:
            with self._sftp() as sftp:
                for remote, local in files:
                    sftp.get(remote, local)
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise TransportError(self.host.name, f"cannot fetch {remote} from {_where(self.host)} by SFTP: "
                                                 f"{getattr(e, 'strerror', None) or e or type(e).__name__}") from None

    def control_request(self, path: str, message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """Relay one JSON-lines exchange through `python -m gpuflex.hosts.relay PATH` on the host.

        paramiko cannot open OpenSSH's direct-streamlocal channels, so the socket stays a
        0600 unix socket on the host and a tiny relay process talks to it.
        """
        res = self.run([self.host.python, "-m", "gpuflex.hosts.relay", path, "--timeout", str(timeout)],
                       input=json.dumps(message) + "\n", timeout=timeout + self.host.connect_timeout_s)
        lines = res.stdout.strip().splitlines()
        try:
            reply = json.loads(lines[-1])
        except (ValueError, IndexError):
            raise TransportError(self.host.name, f"control relay failed (exit {res.returncode}): "
                                                 f"{(res.stderr or res.stdout).strip()[-300:]}") from None
        if not isinstance(reply, dict):
            raise TransportError(self.host.name, f"control relay sent a non-object reply: {lines[-1][:200]}")
        if reply.pop("relay_error", False):
            # the socket itself could not be reached: the same as LocalTransport's OSError
            raise TransportError(self.host.name, f"control socket {path}: {reply.get('error')}")
        return reply


register_transport("ssh", SSHTransport)


class _TooMuchOutput(Exception):
    pass


def _collect(chan: paramiko.Channel, deadline: float) -> tuple[bytes | None, bytes]:
    """Read stdout and stderr until both end; (None, b"") when the deadline passes first."""
    out, err = bytearray(), bytearray()
    while True:
        while chan.recv_ready():
            out += chan.recv(_READ)
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(_READ)
        if len(out) + len(err) > MAX_OUTPUT:
            raise _TooMuchOutput()
        if chan.eof_received or chan.closed:
            if not chan.recv_ready() and not chan.recv_stderr_ready():
                return bytes(out), bytes(err)
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            return None, b""
        # the channel's fileno is set whenever either stream has data or EOF arrives
        select.select([chan], [], [], min(left, 1.0))


def probe_host_key(host: HostConfig) -> paramiko.PKey:
    """The key a host's SSH server offers, read without authenticating or trusting it."""
    t = host.connect_timeout_s
    try:
        sock = socket.create_connection((host.address, host.port), timeout=t)
    except Exception as e:
        raise connect_error(host, e) from None
    tr = paramiko.Transport(sock)
    tr.banner_timeout = t
    try:
        tr.start_client(timeout=t)
        return tr.get_remote_server_key()
    except Exception as e:
        raise connect_error(host, e) from None
    finally:
        tr.close()


# ---- pinning host keys (`gpuflex hosts trust`) ----------------------------------------
def _entry_names_host(hostname: str, name: str) -> bool:
    if hostname.startswith("|1|"):  # HashKnownHosts entries
        return paramiko.HostKeys.hash_host(name, hostname) == hostname
    return hostname == name


def pinned_keys(host: HostConfig) -> list[paramiko.PKey]:
    """Keys the host's known_hosts pins for it (empty if none or no file)."""
    path = os.path.expanduser(host.known_hosts)
    try:
        keys = paramiko.HostKeys(path)
    except FileNotFoundError:
        return []
    except Exception as e:  # noqa: BLE001 - OSError, SSHException, InvalidHostKey
        raise TransportError(host.name, f"cannot read known_hosts {host.known_hosts}: {e}") from None
    found = keys.lookup(known_hosts_name(host.address, host.port))
    return list(found.values()) if found else []


def pin_host_key(host: HostConfig, key: paramiko.PKey) -> str:
    """Pin `key` for the host in its known_hosts; returns "unchanged", "added" or "replaced".

    Other lines stay as they are (comments, other hosts, hashed entries); a different key
    of the same type for this host is removed. The file is replaced atomically, mode 0600.
    """
    path = os.path.expanduser(host.known_hosts)
    name = known_hosts_name(host.address, host.port)
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        lines = []
    out, replaced = [], False
    for line in lines:
        entry = None
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
            except Exception as e:  # noqa: BLE001 - a line we cannot read is kept verbatim
                log.debug("%s: keeping a known_hosts line paramiko cannot read (%s)", path, e)
                entry = None
        if entry is None or entry.key is None or entry.key.get_name() != key.get_name() \
                or not any(_entry_names_host(h, name) for h in entry.hostnames):
            out.append(line if line.endswith("\n") else line + "\n")
            continue
        if entry.key == key:
            return "unchanged"
        replaced = True
        others = [h for h in entry.hostnames if not _entry_names_host(h, name)]
        if others:  # a line shared with other names keeps them
            out.append(f"{','.join(others)} {entry.key.get_name()} {entry.key.get_base64()}\n")
    out.append(f"{name} {key.get_name()} {key.get_base64()}\n")
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = f"{path}.gpuflex-{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise TransportError(host.name, f"cannot write known_hosts {host.known_hosts}: {e.strerror}") from None
    return "replaced" if replaced else "added"
