"""PostgreSQL restarted in the middle of a command (issue 28 point 5): `submit`, `scale` and
a harvest tick each complete or fail with one line, nothing half-written, and the next
command sees a consistent database.

The restart lands inside the command every run: the command is armed with a failpoint
(gpuflex.elastic.protocol.failpoints) that sleeps at a named place after its processes are
spawned and before its next transaction; the test waits for the failpoint's stderr line,
restarts the server (every connection dropped, the ops lock's too), and lets the command go
on. Its own cluster (tests/pgbed.py), so the session's is never restarted under other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuflex.hosts.hostops import group_alive
from tests import REPO, pgbed
from tests.e2e.test_postgres import rows
from tests.conftest import GpuflexCLI, write_config
from tests.e2e.test_harvest_cmd_local import fake_host
from tests.sshbed import default_gpus

pytestmark = [pytest.mark.postgres, pytest.mark.e2e]   # a server of its own, the CLI and its jobs

EXAMPLE = str(REPO / "examples" / "elastic_mlp.py")
PAUSE_S = 8   # the failpoint's sleep: time enough for a restart (about a second) on a loaded machine
LIVE = ("starting", "running", "leaving")


@pytest.fixture(scope="module")
def cluster():
    if pgbed.missing_reason():
        pytest.skip(pgbed.missing_reason())
    c = pgbed.start_cluster()
    yield c
    c.stop()


@pytest.fixture
def gf(home, cluster):
    url = cluster.database("restart")
    cfg = write_config(home, slots=2)
    cfg.write_text(cfg.read_text().replace(f"sqlite:///{home}/g.db", url))
    cli = GpuflexCLI(home, cfg)
    cli.ok("db", "upgrade")
    cli.url = url
    yield cli
    for job in cli.json("status", "--all"):
        if job["state"] in ("queued", "running", "scaling"):
            cli("cancel", str(job["id"]), timeout=60)
    for pgid, in rows(url, "SELECT pgid FROM workers WHERE pgid IS NOT NULL"):
        assert not group_alive(pgid), f"process group {pgid} left running"


def restarted_inside(gf: GpuflexCLI, cluster: pgbed.PgCluster, point: str, *args: str) -> tuple[int, str, str]:
    """Run `gpuflex ARGS` armed to sleep at `point`; restart the server while it sleeps
    there. (returncode, stdout, stderr)."""
    p = subprocess.Popen([gf.script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=gf.home, env=gf.env(GPUFLEX_FAILPOINTS=f"{point}=sleep:{PAUSE_S}"))
    try:
        seen = []
        for line in p.stderr:   # the failpoint's line comes before it sleeps
            seen.append(line)
            if line.startswith(f"failpoint {point} "):
                break
        else:
            pytest.fail(f"the command never reached {point}: {''.join(seen)}")
        cluster.restart()
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, "".join(seen[:-1]) + err


def assert_one_line_or_done(code: int, err: str) -> None:
    assert "Traceback" not in err, err
    if code != 0:
        assert code == 2, err
        assert len(err.strip().splitlines()) <= 2 and err.startswith("error: "), err   # the line, and its hint


def consistent(gf: GpuflexCLI) -> list[dict]:
    """The next command's view (a refresh, after the restart): every live row's process
    group alive, and no process group alive that the database does not know."""
    jobs = gf.json("status", "--all")
    for pgid, state in rows(gf.url, "SELECT pgid, state FROM workers WHERE pgid IS NOT NULL"):
        assert (state in LIVE) == group_alive(pgid), (pgid, state)
    return jobs


def running_with(marker: str) -> list[int]:
    """Pids of the processes whose command line holds `marker`."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def test_a_restart_while_submit_starts_its_job_fails_it_in_one_line_and_leaves_no_process(gf, cluster, home):
    marker = f"restarted-submit-{home.name}"
    code, out, err = restarted_inside(gf, cluster, "start.spawned", "submit", "--workers", "2", "--",
                                      sys.executable, "-c", "import time, sys; time.sleep(300)", marker)
    assert_one_line_or_done(code, err)
    assert code == 2 and "lost the connection" in err, err   # the commit of the start could not be made
    assert running_with(marker)   # its run was spawned before the commit failed
    assert consistent(gf) == []   # the job and its start were one transaction: neither was written
    # the next command ended the run the database never recorded (its launch intent)
    end = time.monotonic() + 60
    while running_with(marker) and time.monotonic() < end:
        time.sleep(0.2)
    assert running_with(marker) == []


def test_a_server_down_when_a_command_starts_is_one_line_within_the_connect_timeout(gf, cluster):
    cluster.run("pg_ctl", "-D", str(cluster.data), "-m", "immediate", "-w", "stop")
    try:
        for args in (["submit", "--", "true"], ["status"], ["harvest"]):
            p = gf(*args, timeout=60)   # libpq's connect timeout bounds it (gpuflex.db.url)
            assert_one_line_or_done(p.returncode, p.stderr)
            assert p.returncode == 2 and "cannot open the database" in p.stderr, p.stderr
    finally:
        cluster.restart()   # starts it again with the options it ran with
    assert gf.json("status", "--all") == []


def test_a_restart_between_a_grow_s_steps_fails_it_in_one_line_and_the_next_command_ends_its_newcomer(
        gf, cluster, home):
    hold = home / "hold"
    hold.touch()   # paced: the job trains on until the test is done with it
    job = gf.submit([sys.executable, EXAMPLE, "--epochs", "50", "--step-sleep", "0.2", "--sleep-while", str(hold)],
                    "--workers", "1:2")
    p = gf("scale", str(job["id"]), "1", "--wait", "--timeout", "240", timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    code, out, err = restarted_inside(gf, cluster, "scale.spawned", "scale", str(job["id"]), "2")
    assert_one_line_or_done(code, err)
    assert code == 2 and "lost the connection" in err, (out, err)   # the request's transaction could not begin
    after = consistent(gf)
    assert [j["state"] for j in after] == ["running"]
    newcomer = max(w["wid"] for w in after[0]["workers"])
    # the newcomer was spawned and recorded, but never asked for: the next command stopped it
    assert [w["state"] for w in after[0]["workers"] if w["wid"] == newcomer] == ["stopped"]
    pgid = rows(gf.url, f"SELECT pgid FROM workers WHERE wid = {newcomer}")[0][0]
    assert pgid is not None and not group_alive(pgid)   # its process ended too
    p = gf("scale", str(job["id"]), "2", "--wait", "--timeout", "240", timeout=300)   # the database goes on
    assert p.returncode == 0, p.stdout + p.stderr
    hold.unlink()


def test_a_restart_inside_a_harvest_tick_s_grow_fails_the_tick_in_one_line_and_the_next_tick_goes_on(
        home, cluster):
    """A --harvest job on GPU 0 of a fake-nvidia-smi host; GPU 1 turns idle, and the tick
    that grows onto it is restarted under between its newcomer's spawn and the request."""
    url = cluster.database("harvest")
    state, table = fake_host(home)
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "{url}"\n\n[harvest]\nidle_samples = 2\n\n'
                   "[jobs]\ncancel_grace_s = 2\n\n" + table)
    gf = GpuflexCLI(home, cfg)
    gf.url = url
    try:
        busy = default_gpus("box")
        busy[1].update(utilization=90, memory_used=20000)   # the owner works on GPU 1
        state.write_text(json.dumps({"gpus": busy, "processes": []}))
        gf.ok("harvest")
        gf.ok("harvest")                                    # GPU 0 idle
        job = gf.submit(["sleep", "300"], "--harvest", "--workers", "1:2")
        assert [w["gpus"] for w in job["workers"]] == [[0]]
        state.write_text(json.dumps({"gpus": default_gpus("box"), "processes": []}))
        gf.ok("harvest")                                    # GPU 1 idle once: not yet
        code, out, err = restarted_inside(gf, cluster, "scale.spawned", "harvest", "--json")
        assert_one_line_or_done(code, err)
        assert code == 2 and "lost the connection" in err, (out, err)
        after = consistent(gf)
        assert [j["state"] for j in after] == ["running"]
        # the newcomer the lost tick spawned and recorded, never asked for: stopped by the next command
        assert {w["wid"]: w["state"] for w in after[0]["workers"]}[1] == "stopped"
        newcomer_pgid = rows(url, "SELECT pgid FROM workers WHERE wid = 1")[0][0]
        assert newcomer_pgid is not None and not group_alive(newcomer_pgid)   # its process ended too
        tick = json.loads(gf.ok("harvest", "--json").stdout)   # the next tick grows on the restarted server
        assert [(a["action"], a["ok"], a["gpus"]) for a in tick["actions"]] == [("grow", True, [["box", 1]])], tick
    finally:
        for j in gf.json("status", "--all"):
            if j["state"] in ("queued", "running", "scaling"):
                gf("cancel", str(j["id"]), timeout=60)
