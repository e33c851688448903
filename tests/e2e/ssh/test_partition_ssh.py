"""A network partition on the sshd test bed (issue 28): one host's job processes cut off from
every TCP peer (the job's store, the process group) for 30 s while its sshd stays up, then
healed. The job must go on without that host's worker, exact, and the host must be used
again by a grow once the partition heals.

The partition is iptables rules on the OUTPUT chain (all loopback traffic passes it): one
matching a cgroup v2 the test makes and moves the host's job processes into, for the sockets
they open from then on (a socket keeps the cgroup it was made in), and one per local port
of the sockets they hold already, both directions. Everything else on the machine is
untouched. Needs root, iptables with the cgroup match
(`make test` installs Debian's iptables where it is missing) and a cgroup2 mount; the rule
and the cgroup are removed at the end whatever happens."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.sshbed import ssh_hosts  # noqa: F401 (a fixture)
from tests.e2e.ssh.test_ssh_jobs import sj  # noqa: F401 (a fixture)
from tests.e2e.test_elastic_jobs import (DEADLINE_S, assert_matches_reference, example_argv, live_members,
                                         reference, scale, step_of, wait_for, world_sizes)

PARTITION_S = 30   # the partition: longer than heartbeat_timeout_s (3) and pg_timeout_s


def cgroup2_root() -> Path | None:
    """Where cgroup v2 is mounted (the unified hierarchy, alone or beside v1's)."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def group_pids(pgid: int) -> list[int]:
    """Every process of process group `pgid` (a worker's supervisor, the worker, its children)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[2]) == pgid:
                pids.append(int(entry.name))
    return pids


def tcp_ports(pids: list[int]) -> set[int]:
    """The local ports of the TCP sockets `pids` hold (listeners and connections)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@contextlib.contextmanager
def partition(pids: list[int]) -> Iterator[Callable[[], None]]:
    """`pids` cut off from TCP until the yielded heal() (or the end); skips the test where
    the machine cannot do it."""
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        pytest.skip("a partition needs root and iptables (make test installs Debian's iptables)")
    root = cgroup2_root()
    if root is None:
        pytest.skip("a partition needs a cgroup v2 mount (the iptables cgroup match)")
    name = f"gpuflex-test-partition-{os.getpid()}"
    group = root / name
    group.mkdir()
    rules = [["OUTPUT", "-m", "cgroup", "--path", name, "-p", "tcp", "-j", "DROP"]]
    added = subprocess.run(["iptables", "-I", *rules[0]], capture_output=True, text=True, timeout=30)
    if added.returncode != 0:
        group.rmdir()
        pytest.skip(f"iptables refused the cgroup rule: {added.stderr.strip()}")
    healed = False

    def heal() -> None:
        nonlocal healed
        if not healed:
            for rule in rules:
                subprocess.run(["iptables", "-D", *rule], check=True, capture_output=True, timeout=30)
            healed = True

    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, OSError):   # gone already: nothing to cut off
                (group / "cgroup.procs").write_text(str(pid))
        for port in sorted(tcp_ports(pids)):
            for way in ("--sport", "--dport"):
                rules.append(["OUTPUT", "-p", "tcp", way, str(port), "-j", "DROP"])
                subprocess.run(["iptables", "-I", *rules[-1]], check=True, capture_output=True, timeout=30)
        assert len(rules) > 1, "the partitioned processes hold no TCP socket: nothing was cut"
        yield heal
    finally:
        heal()
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
        group.rmdir()


def test_a_host_partitioned_for_30_s_is_left_out_the_job_goes_on_exact_and_the_host_is_used_again(
        sj, ssh_hosts, tmp_path_factory, home):
    """Five workers over three hosts (two, two, one on gpu03). gpu03's worker cut off from
    TCP for 30 s, its sshd up: the others go on in a new generation without it; once healed
    it ends and a grow back to 5 places a newcomer on gpu03 (the other hosts' four GPUs cannot
    hold 5). The job ends exact, every sample once. The times are printed beside their bounds."""
    report, hold = home / "r.json", home / "hold"
    hold.touch()   # paced until the grow after the partition is in
    job = sj.submit(example_argv(report, epochs=16, sleep=0.3, hold=hold), "--workers", "2:5")
    running = wait_for(sj, job["id"], lambda j: step_of(j) >= 5 and j["world_size"] == 5, "five workers")
    (cut,) = [w for w in running["workers"] if w["host"] == "gpu03"]
    with partition(group_pids(os.getpgid(cut["pid"]))) as heal:
        began = time.monotonic()
        after = wait_for(sj, job["id"], lambda j: j["generation"] > running["generation"] and j["world_size"] == 4
                         and cut["wid"] not in {w["wid"] for w in live_members(j)},
                         "the job to go on without the partitioned worker", every_s=0.5)
        print(f"the job went on without gpu03's worker {time.monotonic() - began:.1f} s into the partition "
              f"(bound: heartbeat_timeout_s 3 + a formation)")
        assert step_of(after) >= step_of(running)
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - began)))   # the partition lasts its 30 s
        heal()
        healed = time.monotonic()
        ended = wait_for(sj, job["id"], lambda j: next(w for w in j["workers"] if w["wid"] == cut["wid"])["state"]
                         not in ("starting", "running", "leaving"), "the partitioned worker to end")
        gone = next(w for w in ended["workers"] if w["wid"] == cut["wid"])
        print(f"the partitioned worker ended {time.monotonic() - healed:.1f} s after the heal, exit "
              f"{gone['exit_code']} (TCP's retransmission back-off after 30 s of drops, then its fence)")
    scale(sj, job["id"], 5)
    grown = sj.json("status", str(job["id"]))
    back = [w for w in live_members(grown) if w["host"] == "gpu03"]
    assert len(live_members(grown)) == 5 and back and cut["wid"] not in {w["wid"] for w in back}, grown
    hold.unlink()
    done = sj.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded" and done["restarts"] == 0, done
    r = json.loads(report.read_text())
    assert_matches_reference(r, reference(tmp_path_factory, 16))
    assert world_sizes(r)[-3:] == [5, 4, 5]
