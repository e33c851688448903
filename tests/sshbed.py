"""A bed of real OpenSSH servers on loopback addresses, one per simulated GPU host.

`start_bed(root, n)` starts `sshd -D -e -f <own config>` on 127.0.0.2, 127.0.0.3, ...
(one per host, unprivileged ports), each with its own throw-away ed25519 host key, a
shared throw-away user key in its AuthorizedKeysFile, its own workdir and its own fake
`nvidia-smi` state file. It writes a known_hosts pinning every host key and a
`gpuflex.toml` with one [[hosts]] per server. `SshBed.stop()` kills them all.

Plain functions (the benchmarks use them too) plus pytest fixtures at the bottom.
Traffic goes only to 127.0.0.0/8.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE_SMI = REPO / "tests" / "fakes" / "nvidia-smi"
START_TIMEOUT_S = 15


def find_sshd() -> str | None:
    """An absolute path to sshd (it must be absolute: sshd re-executes itself)."""
    for cand in (shutil.which("sshd"), "/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if cand and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    return None


def keygen(path: Path, comment: str = "gpuflex-test") -> str:
    """A new passphrase-less ed25519 key at `path`; returns the public key line."""
    for p in (path, Path(str(path) + ".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)
    return Path(str(path) + ".pub").read_text().strip()


def default_gpus(name: str, count: int = 2) -> list[dict]:
    return [{"index": i, "uuid": f"GPU-{name}-{i:04d}-fake", "name": "NVIDIA H100 80GB HBM3",
             "utilization": 0, "memory_used": 0, "memory_total": 81559, "driver_version": "580.159.04"}
            for i in range(count)]


@dataclasses.dataclass
class SshdHost:
    name: str
    address: str
    port: int
    dir: Path
    host_key_pub: str           # "ssh-ed25519 AAAA... comment"
    smi_state: Path
    nvidia_smi: Path            # wrapper that runs the fake with this host's state
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def known_hosts_line(self) -> str:
        kind, blob = self.host_key_pub.split()[:2]
        return f"[{self.address}]:{self.port} {kind} {blob}"

    def set_smi(self, gpus: list[dict] | None = None, processes: list[dict] | None = None, **extra) -> None:
        """Replace the fake nvidia-smi state (atomically: a probe never sees half a file)."""
        state = {"gpus": default_gpus(self.name) if gpus is None else gpus,
                 "processes": processes or [], **extra}
        tmp = self.smi_state.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.smi_state)


@dataclasses.dataclass
class SshBed:
    root: Path
    user_key: Path
    known_hosts: Path
    config_path: Path
    db_url: str
    hosts: list[SshdHost]

    def host(self, name: str) -> SshdHost:
        return next(h for h in self.hosts if h.name == name)

    def reset_smi(self) -> None:
        for h in self.hosts:
            h.set_smi()

    def stop(self) -> None:
        for h in self.hosts:
            _stop(h.proc)
            h.proc = None


def host_toml(h: SshdHost, bed: SshBed, **overrides) -> str:
    fields = {
        "name": h.name, "address": h.address, "port": h.port, "user": _current_user(),
        "identity_file": str(bed.user_key), "known_hosts": str(bed.known_hosts), "gpus": "all",
        "nvidia_smi": str(h.nvidia_smi), "python": sys.executable, "workdir": str(h.workdir),
        "connect_timeout_s": 5, "command_timeout_s": 30,
    }
    fields.update(overrides)
    lines = ["[[hosts]]"] + [f"{k} = {json.dumps(v)}" for k, v in fields.items() if v is not None]
    return "\n".join(lines) + "\n"


def write_config(bed: SshBed, path: Path | None = None, hosts: list[SshdHost] | None = None,
                 extra_hosts_toml: str = "", **overrides) -> Path:
    """A gpuflex.toml for (some of) the bed's hosts; `overrides` apply to every host."""
    path = path or bed.config_path
    text = f"[database]\nurl = {json.dumps(bed.db_url)}\n\n"
    text += "\n".join(host_toml(h, bed, **overrides) for h in (hosts or bed.hosts))
    path.write_text(text + extra_hosts_toml)
    return path


def start_bed(root: Path, n: int = 3, first_octet: int = 2, gpus_per_host: int = 2,
              names: list[str] | None = None) -> SshBed:
    """Start `n` sshd on 127.0.0.<first_octet>... and write known_hosts + gpuflex.toml in `root`."""
    sshd = find_sshd()
    if sshd is None:
        raise RuntimeError("sshd not found (install openssh-server)")
    if first_octet + n - 1 > 254:
        raise ValueError("too many hosts for 127.0.0.0/24")
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
    user_key = root / "id_ed25519"
    authorized = root / "authorized_keys"
    authorized.write_text(keygen(user_key, "gpuflex-test-user") + "\n")
    os.chmod(authorized, 0o600)
    names = names or [f"gpu{i + 1:02d}" for i in range(n)]
    hosts = []
    for i, name in enumerate(names):
        d = root / name
        d.mkdir(exist_ok=True)
        pub = keygen(d / "ssh_host_ed25519_key", f"gpuflex-test-{name}")
        h = SshdHost(name=name, address=f"127.0.0.{first_octet + i}", port=0, dir=d, host_key_pub=pub,
                     smi_state=d / "smi.json", nvidia_smi=d / "nvidia-smi", workdir=d / "work")
        h.workdir.mkdir(exist_ok=True)
        (d / "home").mkdir(exist_ok=True)
        h.nvidia_smi.write_text("#!/bin/sh\nexec " + shlex.join(
            [sys.executable, "-I", "-S", str(FAKE_SMI), "--state", str(h.smi_state)]) + ' "$@"\n')
        h.nvidia_smi.chmod(0o755)
        h.set_smi(default_gpus(name, gpus_per_host))
        hosts.append(h)
    bed = SshBed(root=root, user_key=user_key, known_hosts=root / "known_hosts",
                 config_path=root / "gpuflex.toml", db_url=f"sqlite:///{root / 'gpuflex.db'}", hosts=hosts)
    try:
        extra = _optional_options(sshd, root)
        for h in hosts:
            _start_sshd(sshd, h, authorized, extra)
        deadline = time.monotonic() + START_TIMEOUT_S
        for h in hosts:
            _wait_banner(h, deadline)
    except BaseException:
        bed.stop()
        raise
    bed.known_hosts.write_text("".join(h.known_hosts_line + "\n" for h in hosts))
    write_config(bed)
    return bed


def _current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _config_text(h: SshdHost, authorized: Path, extra: list[str]) -> str:
    return "\n".join([
        f"ListenAddress {h.address}:{h.port}",
        f"HostKey {h.dir / 'ssh_host_ed25519_key'}",
        f"PidFile {h.dir / 'sshd.pid'}",
        # the bed's key for every user; and a user's own ~/.ssh/authorized_keys, as a stock
        # sshd has it: sshd opens these as the user logging in, and the first lies under the
        # test's own (root's 0700) temp directory, which a user a test makes cannot enter
        f"AuthorizedKeysFile {authorized} .ssh/authorized_keys",
        "UsePAM no",
        "StrictModes no",           # the temp dirs are not root-owned 0755 all the way up
        "PermitRootLogin yes",      # CI runs the tests as root
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UseDNS no",
        "PrintMotd no",
        "MaxSessions 64",           # one pooled connection carries many channels
        "MaxStartups 64:30:128",
        "LogLevel INFO",
        "Subsystem sftp internal-sftp",   # submit --sync sends its tar by SFTP, as a stock sshd allows
        # a throw-away HOME: the login shell would otherwise source the real ~/.bashrc
        # for every command (bash does so under sshd), and a developer's pyenv/conda
        # init there costs a quarter second per command
        f"SetEnv HOME={h.dir / 'home'}",
        *extra,
    ]) + "\n"


def _optional_options(sshd: str, root: Path) -> list[str]:
    """Options newer sshd know: OpenSSH >= 9.8 penalizes sources that fail (the refused-key
    tests would lock out every later connection from 127.0.0.1)."""
    probe = root / "sshd_probe_config"
    probe.write_text(f"HostKey {root / 'id_ed25519'}\nPerSourcePenalties no\n")
    ok = subprocess.run([sshd, "-t", "-f", str(probe)], capture_output=True, text=True).returncode == 0
    return ["PerSourcePenalties no"] if ok else []


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _start_sshd(sshd: str, h: SshdHost, authorized: Path, extra: list[str], tries: int = 3) -> None:
    for attempt in range(tries):
        h.port = _free_port(h.address)
        cfg = h.dir / "sshd_config"
        cfg.write_text(_config_text(h, authorized, extra))
        log = open(h.dir / "sshd.log", "ab")
        h.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=log, start_new_session=True)
        log.close()
        # a lost race for the port shows as an early exit: pick another port
        if _listening(h, time.monotonic() + START_TIMEOUT_S):
            return
        _stop(h.proc)
        h.proc = None
    raise RuntimeError(f"sshd for {h.name} did not start; see {h.dir / 'sshd.log'}:\n"
                       + (h.dir / "sshd.log").read_text()[-2000:])


def bed_cli(bed: SshBed, home: Path, jobs_toml: str):
    """A fixture's body: the CLI over every host of the bed (fake GPUs reset) with
    `jobs_toml` as its [jobs] table; afterwards any sshd a test stopped is started again
    and every job is cancelled and its processes killed."""
    from tests.conftest import GpuflexCLI, cleanup_jobs   # conftest's helpers; the bed stays importable alone
    bed.reset_smi()
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n{jobs_toml}'
                   + "\n".join(host_toml(h, bed) for h in bed.hosts))
    cli = GpuflexCLI(home, cfg)
    yield cli
    for h in bed.hosts:
        if h.proc is None or h.proc.poll() is not None:
            restart_sshd(bed, h)
    cleanup_jobs(cli, home / "g.db")


def one_host_cli(bed: SshBed, home: Path):
    """A fixture's body: the CLI over the bed's first host alone (fake GPUs reset, [jobs]
    cancel_grace_s = 3), yielded with that host; afterwards every job is cancelled and its
    processes killed."""
    from tests.conftest import GpuflexCLI, cleanup_jobs   # as bed_cli
    bed.reset_smi()
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n[jobs]\ncancel_grace_s = 3\n\n'
                   + host_toml(bed.hosts[0], bed))
    cli = GpuflexCLI(home, cfg)
    yield cli, bed.hosts[0]
    cleanup_jobs(cli, home / "g.db")


def restart_sshd(bed: SshBed, h: SshdHost) -> None:
    """Start a stopped host's sshd again on the same address, port and keys (the config
    and known_hosts stay valid)."""
    _stop(h.proc)
    log = open(h.dir / "sshd.log", "ab")
    h.proc = subprocess.Popen([find_sshd(), "-D", "-e", "-f", str(h.dir / "sshd_config")],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    if not _listening(h, time.monotonic() + START_TIMEOUT_S):
        raise RuntimeError(f"sshd for {h.name} did not restart; see {h.dir / 'sshd.log'}")
    _wait_banner(h, time.monotonic() + START_TIMEOUT_S)


def _listening(h: SshdHost, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if h.proc.poll() is not None:
            return False
        try:
            with socket.create_connection((h.address, h.port), timeout=1):
                return True
        except OSError:
            time.sleep(0.02)
    return False


def _wait_banner(h: SshdHost, deadline: float) -> None:
    """Bounded wait until the server sends its SSH banner."""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((h.address, h.port), timeout=2) as s:
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"sshd for {h.name} at {h.address}:{h.port} sent no banner in time")


def _stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM the sshd's whole session (listener and per-connection children), then SIGKILL."""
    if proc is None:
        return
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ---- pytest fixtures -------------------------------------------------------------------
try:
    import pytest
except ImportError:  # the benchmarks import this module without pytest
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="module")
    def ssh_hosts(tmp_path_factory):
        """Three sshd hosts gpu01..gpu03 on 127.0.0.2..4 (module-scoped; fake GPU state reset
        by `ssh_bed`)."""
        if find_sshd() is None:
            pytest.skip("OpenSSH sshd is not installed (make test installs openssh-server as root)")
        if shutil.which("ssh-keygen") is None:
            pytest.skip("ssh-keygen is not installed (package openssh-client)")
        bed = start_bed(tmp_path_factory.mktemp("sshbed"), n=3)
        try:
            yield bed
        finally:
            bed.stop()

    @pytest.fixture
    def ssh_bed(ssh_hosts):
        """The module's bed with every host's fake nvidia-smi state and config reset."""
        ssh_hosts.reset_smi()
        write_config(ssh_hosts)
        return ssh_hosts
