"""The multi-host soak's faults, each the mechanics of its own test on the sshd bed:

- partition: tests/e2e/ssh/test_partition_ssh.py's iptables rules (a cgroup the host's job
  processes are moved into, and their TCP sockets' ports), held, then removed;
- reboot: tests/e2e/ssh/test_ssh_jobs.py's host down (its sshd stopped) plus every process
  of that host SIGKILLed, sshd started again later on the same address and keys;
- pg_restart: tests/e2e/test_postgres_restart.py's `PgCluster.restart()` while a command runs;
- disk_full: the PostgreSQL cluster's tmpfs filled to the last block while a command runs
  (tests/e2e/test_database_disk_full.py's fill), then freed; a server that stopped on it
  (PostgreSQL PANICs when it cannot write its WAL) is started again;
- kill -9 of a worker, a newcomer (during a scale) or a coordinator.

Every function here returns a line saying what it did; none waits without a bound.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterable

from tests import sshbed
from tests.e2e.ssh.test_partition_ssh import cgroup2_root, group_pids, tcp_ports

LIVE = ("starting", "running", "leaving")


class Partition:
    """One host's job processes cut off from every TCP peer until `heal()`."""

    def __init__(self, pids: list[int], tag: str) -> None:
        root = cgroup2_root()
        if root is None:
            raise RuntimeError("no cgroup v2 mount for the iptables cgroup match")
        self.root, self.name = root, f"gpuflex-soak-{os.getpid()}-{tag}"
        self.group = root / self.name
        self.group.mkdir()
        self.rules = [["OUTPUT", "-m", "cgroup", "--path", self.name, "-p", "tcp", "-j", "DROP"]]
        self._iptables("-I", self.rules[0])
        for pid in pids:
            with contextlib.suppress(OSError):
                (self.group / "cgroup.procs").write_text(str(pid))
        for port in sorted(tcp_ports(pids)):
            for way in ("--sport", "--dport"):
                self.rules.append(["OUTPUT", "-p", "tcp", way, str(port), "-j", "DROP"])
                self._iptables("-I", self.rules[-1])
        self.healed = False

    @staticmethod
    def _iptables(op: str, rule: list[str]) -> None:
        subprocess.run(["iptables", op, *rule], check=True, capture_output=True, timeout=30)

    def heal(self) -> None:
        if self.healed:
            return
        self.healed = True
        for rule in self.rules:
            with contextlib.suppress(subprocess.CalledProcessError):
                self._iptables("-D", rule)
        with contextlib.suppress(OSError):
            for pid in (self.group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.root / "cgroup.procs").write_text(pid)
            self.group.rmdir()


def our_group_alive(pgid: int, root: Path, ended_at: float | None = None) -> bool:
    """Whether process group `pgid` still runs something of the soak: a process whose command
    line names the soak's directory, or that runs in it (a supervisor, a worker, a
    coordinator: each starts in its job's directory under the soak's; a gang's `sleep` is in
    its supervisor's group). A group id recorded an hour ago may name another program's
    group by now: pids wrap around at /proc/sys/kernel/pid_max (32768 here; the second
    2-hour soak wrapped them, and two succeeded jobs' group ids led newer soak processes at
    the check), so a process that started after `ended_at` (its job's end) is not the
    recorded one. (Naming gpuflex was not enough: a test suite run beside the 2-hour soak
    had its own coordinators counted.)"""
    mark = str(root).encode()
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if ended_at is not None and started_at(pid) > ended_at + 1.0:
                continue
            if mark in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
            if cwd == root or root in cwd.parents:
                return True
    return False


def started_at(pid: int) -> float:
    """When process `pid` started, in seconds since the epoch (/proc/PID/stat's start time
    after the boot time of /proc/stat)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def error_lines(stderr: str) -> list[str]:
    """A failed command's stderr without gpuflex's notes ("gpuflex: waiting 10 s so far for
    the database's ops lock ...", "gpuflex: job 7: ended process group(s) ..."): what the
    one-line rule judges."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("gpuflex: ")]


def host_pids(jobs: list[dict], host: str) -> list[int]:
    """Every process of the live workers' groups on `host` (supervisor, worker, children)."""
    pids: list[int] = []
    for j in jobs:
        for w in j["workers"]:
            if w["host"] == host and w["state"] in LIVE and w.get("pid"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    pids += group_pids(os.getpgid(w["pid"]))
    return sorted(set(pids))


def partition(jobs: list[dict], host: str, tag: str) -> tuple[Partition | None, str]:
    pids = host_pids(jobs, host)
    if not pids:
        return None, f"no live worker on {host}: nothing to cut off"
    return Partition(pids, tag), f"{host}: {len(pids)} processes cut off from TCP"


def reboot_down(bed: sshbed.SshBed, jobs: list[dict], host: str, workdirs: Iterable[Path] = ()) -> str:
    """The host goes down: its sshd stopped, every process it ran SIGKILLed: its workers'
    groups, anything naming its directory (supervisors, host operations) and anything
    running in one of its `workdirs` (the users' workdirs on it: a coordinator runs in its
    job's directory there, and one started a moment ago is in no job's status yet; the
    2-hour soak's reboot left one running)."""
    h = bed.host(host)
    sshbed._stop(h.proc)
    h.proc = None
    pids = set(host_pids(jobs, host))
    mark = str(h.dir).encode()
    dirs = [Path(d) for d in workdirs]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if mark in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
                    continue
                cwd = Path(os.readlink(entry / "cwd"))
                if any(cwd == d or d in cwd.parents for d in dirs):
                    pids.add(int(entry.name))
    killed = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return f"{host} down: sshd stopped, {killed} processes killed"


def reboot_up(bed: sshbed.SshBed, host: str) -> str:
    sshbed.restart_sshd(bed, bed.host(host))
    return f"{host} up: sshd back on {bed.host(host).address}:{bed.host(host).port}"


def fill(directory: Path) -> int:
    """Write a file in `directory` until its disk is full; returns the bytes written."""
    fd = os.open(directory / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
    n = 0
    try:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9):
            while True:
                try:
                    n += os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    return n


def kill_pid(pid: int | None, mark: str) -> bool:
    """SIGKILL `pid` only if its command line names `mark` (the lab's directory): a pid read
    from a status a moment ago may have been reused since."""
    if not pid:
        return False
    try:
        if mark.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (OSError, ProcessLookupError):
        return False


def coordinator_pid(store_pgid: int | None) -> int | None:
    """The coordinator process of the job whose store group is `store_pgid`."""
    if not store_pgid:
        return None
    from gpuflex.hosts.hostops import proc_stats
    for pid, _, _, pgrp in proc_stats():
        if pgrp == store_pgid:
            with contextlib.suppress(OSError):
                if b"gpuflex.elastic.coordinator" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
    return None
