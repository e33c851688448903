"""Real worker processes on the local host: success, failure, queueing, and cancel.

Each job starts a coordinator (it imports torch) and its workers as detached process
groups; the `gf` fixture cancels what is left and kills stray groups at teardown. Tests
poll `gpuflex status ID --json` with a generous deadline and never assert on timing.
"""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.hosts.hostops import group_alive
from tests.conftest import FINAL_STATES, JOB_DEADLINE_S, db_rows, py

JOB_FIELDS = {"id", "name", "state", "min_workers", "max_workers", "world_size", "generation", "workers"}
WORKER_FIELDS = {"rank", "host", "gpus", "pid", "state"}


def assert_contract(job: dict) -> None:
    assert set(job) >= JOB_FIELDS
    for w in job["workers"]:
        assert set(w) >= WORKER_FIELDS


def wait_for_log(gf, job_id: int, needles: list[str]) -> str:
    end = time.monotonic() + JOB_DEADLINE_S
    while True:
        out = gf.ok("logs", str(job_id)).stdout
        if all(n in out for n in needles):
            return out
        if time.monotonic() > end:
            pytest.fail(f"job {job_id}: {needles} not all in its log after {JOB_DEADLINE_S} s:\n{out}")
        time.sleep(0.3)


def all_devices_free(gf) -> bool:
    return all(d["holder"] is None for h in gf.json("hosts") for d in h["devices"])


def test_two_workers_succeed_and_their_output_is_in_the_logs(gf, db_path):
    code = "import os; print('hello from rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"
    job = gf.submit(py(code), "--workers", "2", "--name", "hello")
    assert job["state"] == "running" and job["name"] == "hello"
    assert [w["rank"] for w in job["workers"]] == [0, 1]

    done = gf.wait_final(job["id"])
    assert_contract(done)
    assert (done["state"], done["exit_code"]) == ("succeeded", 0)
    assert (done["min_workers"], done["max_workers"], done["world_size"], done["generation"]) == (2, 2, 2, 0)
    assert [(w["rank"], w["host"], w["state"], w["exit_code"]) for w in done["workers"]] == [
        (0, "local", "exited", 0), (1, "local", "exited", 0)]
    devices = [d for w in done["workers"] for d in w["gpus"]]
    assert len(devices) == 2 and len(set(devices)) == 2
    assert all(isinstance(w["pid"], int) and w["pid"] > 0 for w in done["workers"])

    out = gf.ok("logs", str(job["id"])).stdout
    assert "[w0] hello from rank 0 of 2" in out
    assert "[w1] hello from rank 1 of 2" in out
    one = gf.ok("logs", "hello", "--worker", "1").stdout
    assert one.strip() == "hello from rank 1 of 2"

    listing = gf.json("status")
    assert isinstance(listing, list) and [j["id"] for j in listing] == [job["id"]]
    assert_contract(listing[0])
    assert listing[0]["state"] == "succeeded"
    # the coordinator was stopped with the job, and the slots are free again
    assert db_rows(db_path, "SELECT store_pgid FROM jobs") == [(None,)]
    assert all_devices_free(gf)
    kinds = [e["kind"] for e in gf.json("events", str(job["id"]))]
    assert kinds[0] == "submitted" and kinds.count("worker") == 2 and kinds[-1] == "state"


def test_a_failing_command_fails_the_job_with_its_exit_code(gf, home, config_path):
    """Driven in-process through CliRunner, with real worker processes."""
    env = {"HOME": str(home), "GPUFLEX_CONFIG": str(config_path), "COLUMNS": "200"}
    runner = CliRunner()

    def cli(*args: str) -> str:
        r = runner.invoke(app, list(args), env=env)
        assert r.exit_code == 0, (r.output, r.exception)
        return r.stdout

    job = json.loads(cli("submit", "--json", "--", *py("import sys; print('about to fail'); sys.exit(3)")))
    end = time.monotonic() + JOB_DEADLINE_S
    while (st := json.loads(cli("status", str(job["id"]), "--json")))["state"] not in FINAL_STATES:
        assert time.monotonic() < end, st
        time.sleep(0.3)
    assert (st["state"], st["exit_code"]) == ("failed", 3)
    assert st["workers"][0]["state"] == "failed" and st["workers"][0]["exit_code"] == 3
    assert "exit code 3" in st["exit_reason"]
    assert "about to fail" in cli("logs", str(job["id"]))
    assert "failed with exit code 3" in cli("events", str(job["id"]))


def test_a_job_that_does_not_fit_waits_and_starts_once_the_other_frees_its_slots(gf, home):
    flag = home / "release"
    hold = ("import os, time\n"
            f"while not os.path.exists({str(flag)!r}): time.sleep(0.1)\n"
            "print('released')")
    first = gf.submit(py(hold), "--workers", "2", "--name", "holder")
    assert first["state"] == "running"

    second = gf.submit(py("import os; print('second', os.environ['RANK'])"), "--workers", "3",
                       "--name", "waiter")
    assert second["state"] == "queued"
    assert second["workers"] == [] and second["world_size"] == 0
    assert second["queue_reason"] == "waiting for 3 free slots on local (2 free now)"
    listing = {j["name"]: j for j in gf.json("status")}
    assert listing["waiter"]["state"] == "queued"
    assert "waiting for 3 free slots on local" in gf.ok("status", "waiter").stdout

    flag.write_text("")
    done = gf.wait_final(first["id"])  # this refresh, or a later one, also places the waiter
    assert done["state"] == "succeeded"
    waiter = gf.json("status", str(second["id"]))
    assert waiter["state"] in ("running", "succeeded")
    assert waiter["queue_reason"] is None
    assert len(waiter["workers"]) == 3
    # a slot is a worker's: the waiter (3 of 4 slots) starts once one of the holder's two
    # workers has ended, which may be before the other ends and the holder with it
    ends = [e["time"] for e in gf.json("events", str(first["id"])) if e["kind"] == "worker"]
    assert len(ends) == 2
    first_end = min(ends)
    assert waiter["started_at"] >= first_end
    waiter = gf.wait_final(second["id"])
    assert (waiter["state"], waiter["exit_code"]) == ("succeeded", 0)
    assert sorted(w["rank"] for w in waiter["workers"]) == [0, 1, 2]
    assert len({d for w in waiter["workers"] for d in w["gpus"]}) == 3
    kinds = [e["kind"] for e in gf.json("events", str(second["id"]))]
    assert kinds.index("queued") < kinds.index("state")


def test_cancel_stops_every_process_group_of_the_job(gf, db_path):
    # rank 0 ignores SIGTERM (so cancel must escalate to SIGKILL after the grace period);
    # rank 1 has a child process in its group (so the whole group must go, not just the pid)
    code = ("import os, signal, subprocess, sys, time\n"
            "if os.environ['RANK'] == '0': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "else: subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print('ready', os.environ['RANK'], flush=True)\n"
            "time.sleep(600)")
    job = gf.submit(py(code), "--workers", "2", "--name", "sleeper")
    assert job["state"] == "running"
    wait_for_log(gf, job["id"], ["ready 0", "ready 1"])

    workers = db_rows(db_path, "SELECT wid, pid, pgid FROM workers WHERE job_id = ? ORDER BY wid", (job["id"],))
    (store_pgid,) = db_rows(db_path, "SELECT store_pgid FROM jobs WHERE id = ?", (job["id"],))[0]
    assert len(workers) == 2 and store_pgid is not None
    status = gf.json("status", str(job["id"]))
    assert [w["pid"] for w in status["workers"]] == [pid for _, pid, _ in workers]
    pgids = [pgid for _, _, pgid in workers] + [store_pgid]
    assert len(set(pgids)) == 3
    assert all(group_alive(g) for g in pgids)

    out = gf.ok("cancel", str(job["id"])).stdout
    assert out.strip() == f"job {job['id']} cancelled"
    assert [g for g in pgids if group_alive(g)] == []

    st = gf.json("status", str(job["id"]))
    assert st["state"] == "cancelled"
    assert [w["state"] for w in st["workers"]] == ["stopped", "stopped"]
    assert db_rows(db_path, "SELECT store_pgid FROM jobs WHERE id = ?", (job["id"],)) == [(None,)]
    assert all_devices_free(gf)
    again = gf("cancel", str(job["id"]))
    assert again.returncode == 2 and "already cancelled" in again.stderr


def test_logs_follow_stops_cleanly_on_ctrl_c(gf):
    import signal
    import subprocess

    code = "import time; print('first line', flush=True); time.sleep(600)"
    job = gf.submit(py(code), "--workers", "1")
    wait_for_log(gf, job["id"], ["first line"])
    p = subprocess.Popen([gf.script, "logs", str(job["id"]), "--follow"], env=gf.env(), cwd=gf.home,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()
    finally:
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=60)
    assert first == "first line\n" and rest == ""
    assert p.returncode == 0 and err == ""
    assert gf.json("status", str(job["id"]))["state"] == "running"   # only the follow ended
