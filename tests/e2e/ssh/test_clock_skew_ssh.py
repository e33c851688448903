"""Host clocks 10 minutes off on the sshd test bed (issue 28): gpu03's sessions see a clock
10 minutes ahead of this (the control) host's, gpu02's one 10 minutes behind. One job with
workers on both, under a time limit, shrunk by a harvest reclaim on the way: the hosts
probe up, the reclaim frees its GPU within its deadline, the time limit ends the run at
the control host's deadline (not 10 minutes early, not 10 minutes late), and every time
the database records (the workers' ends) is on the control host's clock.

The skew is tests/fakes/clockshift.c, built here with the C compiler and preloaded into
the host's SSH sessions by its sshd (`SetEnv LD_PRELOAD=...`) and into the job's workers
(`--env LD_PRELOAD=...`; their environment is otherwise the submitter's), with the offset in
the host's HOME: every process gpuflex starts there (hostops, the supervisors, the workers)
reads the shifted wall clock; monotonic clocks, sleeps and timed waits are the kernel's, as
on a real host whose clock is off. (Debian's libfaketime hangs or fails Python's waits: see
the shim.) Skipped without a C compiler (`make test` installs one as root where missing).
The bed is this module's own: its sshd are restarted with the setting and stopped with the
module."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import REPO
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows, wait_for
from tests.sshbed import SshBed, SshdHost, default_gpus, host_toml, restart_sshd, ssh_hosts  # noqa: F401

SHIM = REPO / "tests" / "fakes" / "clockshift.c"
EXAMPLE = str(REPO / "examples" / "elastic_mlp.py")
SKEW = {"gpu03": 600, "gpu02": -600}    # seconds each host's clock is off
TIME_LIMIT_S = 35
RECLAIM_S = 20


def build_shim(out: Path) -> Path:
    """tests/fakes/clockshift.c as a shared object in `out`; skips without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the clock shim (make test installs gcc as root)")
    so = out / "clockshift.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(so), str(SHIM), "-ldl"], check=True,
                   capture_output=True, timeout=60)
    return so


def skew_clock(bed: SshBed, h: SshdHost, shim: Path, offset_s: int) -> None:
    """Restart `h`'s sshd so that its sessions see a wall clock `offset_s` off (read by the
    shim from the host's HOME). sshd takes only the first SetEnv line: LD_PRELOAD joins the
    bed's own (HOME)."""
    (h.dir / "home" / "clock-offset-s").write_text(f"{offset_s}\n")
    cfg = h.dir / "sshd_config"
    home = f"SetEnv HOME={h.dir / 'home'}"
    text = cfg.read_text()
    assert home in text
    cfg.write_text(text.replace(home, f"{home} LD_PRELOAD={shim}"))
    restart_sshd(bed, h)


def host_offset(bed: SshBed, h: SshdHost) -> float:
    """How far the host's python's time.time() is from ours, seen through its sshd."""
    before = time.time()
    r = subprocess.run(["ssh", "-i", str(bed.user_key), "-o", f"UserKnownHostsFile={bed.known_hosts}",
                        "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-p", str(h.port), h.address,
                        f"{sys.executable} -c 'import time; print(time.time())'"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.split()[-1]) - (before + time.time()) / 2


@pytest.fixture
def skewed(ssh_hosts, home, tmp_path_factory):
    """The module's bed with gpu02 behind and gpu03 ahead, a CLI for those two (gpu02's one
    GPU, gpu03's two, a 20 s reclaim deadline), and the shim's path. Skipped without a C
    compiler or the ssh client."""
    if shutil.which("ssh") is None:
        pytest.skip("the OpenSSH client is not installed (it reads the hosts' clocks)")
    shim = build_shim(tmp_path_factory.mktemp("clockshift"))
    bed = ssh_hosts
    for name, offset in SKEW.items():
        skew_clock(bed, bed.host(name), shim, offset)
    for name, offset in SKEW.items():
        seen = host_offset(bed, bed.host(name))
        print(f"{name}: time.time() {seen:+.2f} s from ours (set {offset:+d} s)")
        assert abs(seen - offset) < 30, f"{name}'s clock is not skewed: the test would prove nothing"
    bed.reset_smi()
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
                   f"[harvest]\ninterval_s = 5\nidle_samples = 2\nreclaim_deadline_s = {RECLAIM_S}\n\n"
                   "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 2\nheartbeat_timeout_s = 3\n\n"
                   + host_toml(bed.host("gpu02"), bed, gpus=[0]) + host_toml(bed.host("gpu03"), bed))
    cli = GpuflexCLI(home, cfg)
    yield cli, shim
    cleanup_jobs(cli, home / "g.db")


def ends(home: Path, bed: SshBed, job_id: int) -> dict[int, dict]:
    """wid -> the worker's host, `ended_at` as the database has it, and its exit record as the
    host wrote it (the bed's hosts share this disk; `~` is the host's own HOME)."""
    out = {}
    for wid, host, ended_at, exit_path in db_rows(home / "g.db", "SELECT wid, host, ended_at, exit_path "
                                                  "FROM workers WHERE job_id = ?", (job_id,)):
        if exit_path.startswith("~"):
            exit_path = str(bed.host(host).dir / "home") + exit_path[1:]
        record = json.loads(Path(exit_path).read_text()) if Path(exit_path).exists() else None
        out[wid] = {"host": host, "ended_at": ended_at, "record": record}
    return out


def live(job: dict) -> list[dict]:
    return [w for w in job["workers"] if w["state"] in ("starting", "running", "leaving")]


def test_hosts_10_minutes_ahead_and_behind_keep_the_time_limit_the_reclaim_and_the_records(
        skewed, ssh_hosts, home):
    (sj, shim), bed = skewed, ssh_hosts
    hosts = {h["name"]: h for h in sj.json("hosts")}
    assert set(hosts) == {"gpu02", "gpu03"} and all(h["reachable"] for h in hosts.values()), hosts

    submitted = time.time()
    job = sj.submit([sys.executable, EXAMPLE, "--hidden", "16", "--epochs", "100000", "--step-sleep", "0.05"],
                    "--harvest", "--workers", "2:3", "--time", f"{TIME_LIMIT_S}s", "--env", f"LD_PRELOAD={shim}")
    assert sorted(w["host"] for w in live(job)) == ["gpu02", "gpu03", "gpu03"], job
    running = wait_for(sj, job["id"], lambda j: j["state"] == "running" and j["world_size"] == 3
                       and (j.get("step") or 0) >= 1, "three workers training")
    for w in live(running):   # the workers too read their host's clock: the shim, and their host's HOME
        environ = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
        assert f"LD_PRELOAD={shim}".encode() in environ, w
        assert f"HOME={bed.host(w['host']).dir / 'home'}".encode() in environ, w
    deadline = running["started_at"] + TIME_LIMIT_S

    # gpu03's owner takes its GPU 1: the tick (on our clock) shrinks the job off it
    g3 = bed.host("gpu03")
    (taken,) = [w for w in live(running) if w["host"] == "gpu03" and w["gpus"] == [1]]
    owner = subprocess.Popen(["sleep", "300"])
    try:
        g3.set_smi(gpus=[default_gpus("gpu03")[0], {**default_gpus("gpu03")[1], "utilization": 99,
                                                     "memory_used": 12000}],
                   processes=[{"gpu_uuid": default_gpus("gpu03")[1]["uuid"], "pid": owner.pid, "used_memory": 8000}])
        tick = sj.json("harvest")
        (reclaim,) = [a for a in tick["actions"] if a["action"] == "reclaim"]
        print(f"reclaim of gpu03:1: {reclaim['method']} in {reclaim['latency_s']} s (deadline {RECLAIM_S} s)")
        assert (reclaim["host"], reclaim["gpu"], reclaim["ok"]) == ("gpu03", 1, True), tick
        assert reclaim["latency_s"] <= reclaim["deadline_s"] == RECLAIM_S
        shrunk = wait_for(sj, job["id"], lambda j: j["state"] == "running" and j["world_size"] == 2
                          and len(live(j)) == 2, "the shrink to two workers")
        assert sorted(w["host"] for w in live(shrunk)) == ["gpu02", "gpu03"]
        gone = ends(home, bed, job["id"])[taken["wid"]]
        assert tick["time"] <= gone["ended_at"] <= time.time(), gone   # our clock, not gpu03's
    finally:
        owner.kill()
        owner.wait()

    # the time limit: both supervisors end their worker at our deadline, on their own clocks
    done = sj.wait_final(job["id"], 180)
    print(f"time limit {TIME_LIMIT_S} s: the run ended {done['ended_at'] - running['started_at']:.1f} s after "
          f"it started (bound: the limit, then cancel_grace_s 10 and a status call)")
    assert done["state"] == "timeout" and done["exit_reason"] == f"time limit 00:00:{TIME_LIMIT_S} reached", done
    last = {wid: e for wid, e in ends(home, bed, job["id"]).items() if wid != taken["wid"]}
    assert sorted(e["host"] for e in last.values()) == ["gpu02", "gpu03"]
    for wid, e in last.items():
        record = e["record"]
        assert record is not None, (wid, e)
        print(f"worker {wid} on {e['host']}: ended {e['ended_at'] - deadline:+.1f} s from the deadline by "
              f"our clock, {record['ended_at'] - deadline:+.1f} s by its host's")
        assert record.get("time_limit") is True, (wid, e)   # its own supervisor ended it
        assert deadline <= e["ended_at"] <= done["ended_at"] <= time.time(), (wid, e, done)
        # the record is the host's clock (the skew was in force); the database has ours
        assert abs(record["ended_at"] - e["ended_at"] - SKEW[e["host"]]) < 30, (wid, e)
    assert submitted <= running["started_at"] <= deadline

    hosts = {h["name"]: h for h in sj.json("hosts")}
    assert all(h["reachable"] for h in hosts.values()), hosts
