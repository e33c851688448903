"""Jobs on the SSH pool: three real sshd hosts on 127.0.0.2-4, each with two fake GPUs.

The elastic example placed across the hosts and resized 2 -> 5 -> 3 ends exactly as its
standalone reference; cancel across hosts leaves no process; sshd stopped under a running
job gives a per-host error and the job goes on; a host that reboots (sshd and its workers
gone, then sshd back) has its workers marked lost while the job goes on on the others, and
is used again by a grow.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from gpuflex.hosts.hostops import group_alive
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows
from tests.sshbed import _stop, host_toml, restart_sshd, ssh_hosts  # noqa: F401
from tests.e2e.test_elastic_jobs import (DEADLINE_S, assert_matches_reference, example_argv, live_members,
                                     reference, scale, step_of, wait_for, world_sizes)


@pytest.fixture
def sj(ssh_hosts, home):
    bed = ssh_hosts
    bed.reset_smi()
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
                   "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 2\nheartbeat_timeout_s = 3\n\n"
                   + "\n".join(host_toml(h, bed) for h in bed.hosts))
    cli = GpuflexCLI(home, cfg)
    yield cli
    for h in bed.hosts:   # a test may have stopped an sshd
        if h.proc is None or h.proc.poll() is not None:
            restart_sshd(bed, h)
    cleanup_jobs(cli, home / "g.db")


def hosts_of(job: dict) -> set[str]:
    return {w["host"] for w in live_members(job)}


def test_example_across_three_hosts_resized_2_5_3(sj, tmp_path_factory, home):
    report, hold = home / "r.json", home / "hold"
    # long enough that the last resize lands before the end even when starting 3 newcomers
    # takes tens of seconds on a loaded host (10 epochs once ended first): the pace is held
    # until the last resize is in, then the job runs out at full speed
    hold.touch()
    job = sj.submit(example_argv(report, epochs=24, sleep=0.05, hold=hold), "--workers", "2:5")
    assert {w["host"] for w in job["workers"]} == {"gpu01", "gpu02", "gpu03"}
    scale(sj, job["id"], 2)
    two = wait_for(sj, job["id"], lambda j: step_of(j) >= 5 and len(live_members(j)) == 2, "2 workers")
    assert hosts_of(two) == {"gpu01"}          # fewest hosts first: both GPUs of one host
    scale(sj, job["id"], 5)
    five = sj.json("status", str(job["id"]))
    assert hosts_of(five) == {"gpu01", "gpu02", "gpu03"}
    gpus = [(w["host"], tuple(w["gpus"])) for w in live_members(five)]
    assert len(set(gpus)) == 5                 # never two workers on one GPU
    scale(sj, job["id"], 3)
    hold.unlink()
    done = sj.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded", done
    r = json.loads(report.read_text())
    assert_matches_reference(r, reference(tmp_path_factory, 24))
    order = world_sizes(r)
    assert order[-3:] == [2, 5, 3]
    logs = sj.ok("logs", str(job["id"]), "--worker", "0").stdout
    assert "generation" in logs


def test_sshd_stopped_under_a_running_job_then_a_cancel_across_hosts_leaves_no_process(sj, ssh_hosts, home):
    """One job run for both (the suite's time): five workers over three hosts; gpu03's sshd
    stopped under it changes nothing but what `status`, `events` and `hosts` say, and the job
    trains on in its generation once sshd is back; then a cancel across the hosts leaves no
    process and every device free."""
    job = sj.submit(example_argv(home / "r.json", epochs=50, sleep=0.05), "--workers", "5")
    running = wait_for(sj, job["id"], lambda j: step_of(j) >= 3, "training on five GPUs")
    h3 = ssh_hosts.host("gpu03")
    _stop(h3.proc)
    h3.proc = None
    st = sj("status", str(job["id"]), "--json")
    assert st.returncode == 0 and "Traceback" not in st.stderr
    now = json.loads(st.stdout)
    assert now["state"] in ("running", "scaling")
    # the workers on gpu03 are still training: nothing was marked lost on a mere ssh outage
    assert [w["state"] for w in now["workers"] if w["host"] == "gpu03"] == ["running"]
    ev = sj.json("events", str(job["id"]))
    assert any(e["kind"] == "host-unreachable" and e["data"]["host"] == "gpu03" for e in ev)
    hosts = sj("hosts", "--json")
    assert hosts.returncode == 0
    by_name = {h["name"]: h for h in json.loads(hosts.stdout)}
    assert by_name["gpu03"]["reachable"] is False and by_name["gpu03"]["error"]
    assert by_name["gpu01"]["reachable"] is True
    restart_sshd(ssh_hosts, h3)
    back = sj.json("status", str(job["id"]))
    later = wait_for(sj, job["id"], lambda j: step_of(j) >= step_of(back) + 5, "training on after sshd is back")
    assert later["state"] == "running" and len(live_members(later)) == 5
    assert running["generation"] == later["generation"]   # no fault: the job never lost a worker

    sj.ok("cancel", str(job["id"]))
    done = sj.json("status", str(job["id"]))
    assert done["state"] == "cancelled"
    assert {w["host"] for w in done["workers"]} == {"gpu01", "gpu02", "gpu03"}
    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers")]
    store = db_rows(home / "g.db", "SELECT store_pgid FROM jobs")[0][0]
    assert len(pgids) == 5 and store is None
    assert not any(group_alive(p) for p in pgids)
    holders = [d["holder"] for h in sj.json("hosts") for d in h["devices"]]
    assert holders and all(h is None for h in holders)


def test_a_rebooted_host_loses_its_workers_the_job_goes_on_and_the_host_is_used_again(
        sj, ssh_hosts, tmp_path_factory, home):
    """A host "rebooted": its sshd and every process of the job there killed, sshd back once
    the job has gone on without it. Its workers are written off (`lost`, a new generation
    of the others), the host answers again, and a grow back to 5 places newcomers on it:
    the other hosts' four GPUs alone cannot hold 5. The job ends exact, every sample once."""
    report, hold = home / "r.json", home / "hold"
    hold.touch()   # paced until the grow after the reboot is in: newcomers start slowly under load
    job = sj.submit(example_argv(report, epochs=16, sleep=0.3, hold=hold), "--workers", "2:5")
    running = wait_for(sj, job["id"], lambda j: step_of(j) >= 5 and j["world_size"] == 5, "five workers")
    h3 = ssh_hosts.host("gpu03")
    doomed = [w for w in running["workers"] if w["host"] == "gpu03"]
    _stop(h3.proc)                       # the host goes down: no ssh, and its processes are gone
    h3.proc = None
    for w in doomed:
        os.killpg(os.getpgid(w["pid"]), signal.SIGKILL)
    down = time.monotonic()
    after = wait_for(sj, job["id"], lambda j: j["generation"] > running["generation"]
                     and all(w["state"] == "lost" for w in j["workers"] if w["host"] == "gpu03"),
                     "the job to go on without gpu03")
    print(f"gpu03's workers written off {time.monotonic() - down:.1f} s after it went down "
          f"(bound: heartbeat_timeout_s 3 + a poll)")
    assert after["world_size"] == 5 - len(doomed)
    restart_sshd(ssh_hosts, h3)          # the host is back up
    scale(sj, job["id"], 5)
    grown = sj.json("status", str(job["id"]))
    back = [w for w in live_members(grown) if w["host"] == "gpu03"]
    assert len(live_members(grown)) == 5 and back, grown
    assert not {w["wid"] for w in back} & {w["wid"] for w in doomed}   # newcomers, not the lost ones
    hold.unlink()
    done = sj.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded", done
    r = json.loads(report.read_text())
    assert_matches_reference(r, reference(tmp_path_factory, 16))
    assert world_sizes(r)[-3:] == [5, 5 - len(doomed), 5]
