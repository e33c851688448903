"""The verbs on running jobs and --after's kinds carried out, with real `sleep` workers
(the `busy_slots` fixture's job 1 holds 3 of the 4 slots: marked e2e by tests/tiers.py).
The rules without processes are in tests/cli/test_verbs_cmd.py and
tests/policy/test_preemption.py."""

from __future__ import annotations

import json
import time

from tests import clirun
from tests.conftest import db_rows


def gf(home, config_path, *args: str):
    r = clirun.invoke(home, config_path, *args)
    assert r.exit_code == 0, f"gpuflex {' '.join(args)} -> {r.exit_code}\n{r.stdout}\n{r.stderr}"
    return r


def job(home, config_path, ref) -> dict:
    return json.loads(gf(home, config_path, "status", str(ref), "--json").stdout)


def test_requeue_with_hold_stops_a_running_job_and_release_starts_it_again(home, config_path, db_path, busy_slots):
    r = gf(home, config_path, "requeue", "1", "--hold")
    assert r.stdout.strip() == "job 1 requeued and held"
    one = job(home, config_path, 1)
    assert (one["state"], one["held"], one["restarts"], one["workers"][0]["state"]) == \
        ("queued", True, 1, "stopped")
    cause = db_rows(db_path, "SELECT data FROM events WHERE job_id = 1 AND kind = 'state' ORDER BY id")[-1][0]
    assert json.loads(cause)["cause"] == "requeued"
    assert gf(home, config_path, "release", "1").stdout.strip() == "job 1 released"
    assert job(home, config_path, 1)["state"] == "running"
    # running again: a hold is refused with one line, exit 2
    r = clirun.invoke(home, config_path, "hold", "1")
    assert r.exit_code == 2 and "job 1 is running: only a queued job can be held" in r.stderr


def test_a_lowered_time_limit_ends_the_running_job_at_its_new_deadline(home, config_path, busy_slots):
    r = gf(home, config_path, "update", "1", "--time", "1s", "--priority", "3")
    assert r.stdout.strip() == "job 1 updated: time limit none -> 00:00:01, priority 0 -> 3"
    raise_it = clirun.invoke(home, config_path, "update", "1", "--time", "1h")
    assert raise_it.exit_code == 2 and "can only be lowered" in raise_it.stderr
    end = time.monotonic() + 120
    while job(home, config_path, 1)["state"] != "timeout":   # past its deadline: the next command stops it
        assert time.monotonic() < end, job(home, config_path, 1)
        time.sleep(0.5)
    assert job(home, config_path, 1)["exit_reason"] == "time limit 00:00:01 reached"


def test_afterany_afternotok_and_singleton_wait_then_start_when_job_1_is_cancelled(home, config_path, busy_slots):
    """Each of them fits the free slot at once; only its dependency holds it back."""
    ids = {}
    for kind in ("afterany:1", "afternotok:1", "singleton"):
        r = gf(home, config_path, "submit", "--json", "--name", "busy", "--after", kind, "--", "sleep", "600")
        ids[kind] = json.loads(r.stdout)["id"]
    assert [job(home, config_path, i)["queue_reason"] for i in ids.values()] == [
        "waiting for job 1 (running) (afterany)", "waiting for job 1 (running) (afternotok)",
        "waiting for job 1 (running), job 2 (queued), job 3 (queued) of the same name 'busy' (singleton)"]
    gf(home, config_path, "cancel", "1")
    # afterany and afternotok both hold (job 1 was cancelled: not ok) and both start; the
    # singleton now waits for them, jobs of its name and owner
    got = {k: job(home, config_path, i)["state"] for k, i in ids.items()}
    assert got == {"afterany:1": "running", "afternotok:1": "running", "singleton": "queued"}


def test_afternotok_on_a_job_that_succeeded_is_cancelled_saying_why(home, config_path, busy_slots):
    done = json.loads(gf(home, config_path, "submit", "--json", "--", "true").stdout)["id"]
    end = time.monotonic() + 120
    while job(home, config_path, done)["state"] != "succeeded":
        assert time.monotonic() < end
        time.sleep(0.5)
    r = clirun.invoke(home, config_path, "submit", "--after", f"afternotok:{done}", "--", "true")
    assert r.exit_code == 1 and f"job {done} succeeded (afternotok:{done} waits for a failure)" in r.stdout
