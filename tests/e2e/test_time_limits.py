"""The queue with real processes on the local pool (issue 11 items 4-6), tiny commands only:
a time limit, a preemption, a dependency chain with a failure, an array under its cap.
(Cancelling an array, preemption by shrinking and the status table of an array are
checked on simulated hosts in tests/policy/test_preemption.py.)

Every check reads the job's rows and events, never the clock: the cap of an array is
checked from the runs' start and end as the database recorded them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuflex.hosts.hostops import group_alive
from tests.conftest import db_rows, wait_for

ENDED = ("succeeded", "failed", "cancelled", "timeout")
DEADLINE_S = 180


def until(gf, job_id: int, state: str) -> dict:
    """The job once it is in `state`; the test fails if it ends in another."""
    def reached(job: dict) -> bool:
        if job["state"] in ENDED and job["state"] != state:
            pytest.fail(f"job {job_id} ended {job['state']}, not {state}: {job}")
        return job["state"] == state

    return wait_for(gf, job_id, reached, state, DEADLINE_S)


def kinds(gf, job_id: int) -> list[tuple[str, str]]:
    return [(e["kind"], e["message"]) for e in gf.json("events", str(job_id))]


def gated(path: Path) -> str:
    """A shell loop that waits (at most 120 s) for `path` to exist."""
    return f"for i in $(seq 1200); do [ -e {path} ] && break; sleep 0.1; done"


def test_a_run_past_its_time_limit_gets_sigterm_then_ends_timeout_with_nothing_left(gf, home, db_path):
    script = "trap 'echo TERM seen; sleep 60' TERM; echo started; sleep 120 & wait; echo not reached"
    job = gf.submit(["bash", "-c", script], "--time", "3s", "--name", "limited")
    assert job["time_limit_s"] == 3 and 0 <= job["time_left_s"] <= 3
    done = until(gf, job["id"], "timeout")
    assert done["exit_reason"] == "time limit 00:00:03 reached" and done["time_left_s"] is None
    events = kinds(gf, job["id"])
    assert ("time-limit", "time limit 00:00:03 reached") in events
    assert events[-1] == ("state", "timeout: time limit 00:00:03 reached")
    log = gf.ok("logs", str(job["id"])).stdout
    assert "started" in log and "TERM seen" in log and "not reached" not in log
    # the trap's sleep outlived the grace: it was killed with the rest of the group
    pgids = [r[0] for r in db_rows(db_path, "SELECT pgid FROM workers WHERE job_id = ?", (job["id"],))]
    assert pgids and all(pgids) and not any(group_alive(p) for p in pgids)
    assert db_rows(db_path, "SELECT store_pgid FROM jobs WHERE id = ?", (job["id"],)) == [(None,)]


def test_a_higher_priority_job_preempts_a_requeue_job_which_runs_again_after(gf, home):
    starts = home / "starts.txt"
    low = gf.submit(["bash", "-c", f"echo start >> {starts}; trap 'exit 0' TERM; sleep 300 & wait"],
                    "--workers", "4", "--requeue", "--name", "low")
    wait_for(gf, low["id"], lambda j: starts.exists() and len(starts.read_text().split()) == 4, "low started",
             DEADLINE_S)
    go = home / "go"
    high = gf.submit(["bash", "-c", gated(go)], "--workers", "2", "--priority", "10", "--name", "high")
    assert high["state"] == "running", high
    assert high["queue_reason"] is None
    low_now = gf.json("status", str(low["id"]))
    assert (low_now["state"], low_now["restarts"]) == ("queued", 1)
    assert any(k == "preempted" and f"preempted by job {high['id']} (priority 10)" in m
               for k, m in kinds(gf, low["id"]))
    assert ("preempting", f"preempting job {low['id']} (requeued)") in kinds(gf, high["id"])
    assert "waiting for 4 free slots" in low_now["queue_reason"]
    go.touch()
    until(gf, high["id"], "succeeded")
    until(gf, low["id"], "running")
    wait_for(gf, low["id"], lambda j: len(starts.read_text().split()) == 8, "low restarted", DEADLINE_S)


def test_a_failed_dependency_cancels_the_chain_below_it_in_one_command(gf, home, db_path):
    go = home / "go"
    a = gf.submit(["bash", "-c", f"{gated(go)}; exit 3"], "--name", "a")
    b = gf.submit(["true"], "--after", str(a["id"]), "--name", "b")
    c = gf.submit(["true"], "--after", str(b["id"]), "--name", "c")
    assert (b["state"], b["queue_reason"]) == ("queued", f"waiting for job {a['id']} (running)")
    assert (c["state"], c["queue_reason"]) == ("queued", f"waiting for job {b['id']} (queued)")
    go.touch()
    wait_for(gf, a["id"], lambda j: j["state"] == "failed", "a failed", DEADLINE_S)
    # the command that saw a fail cancelled b and then c: no other command ran since
    rows = db_rows(db_path, "SELECT id, state, exit_reason FROM jobs WHERE id IN (?, ?) ORDER BY id",
                   (b["id"], c["id"]))
    assert rows == [(b["id"], "cancelled", f"job {a['id']} failed"),
                    (c["id"], "cancelled", f"job {b['id']} was cancelled")]
    late = gf("submit", "--after", str(a["id"]), "--", "true")   # too late: cancelled at once, exit 1
    assert late.returncode == 1 and late.stdout.strip() == f"job {c['id'] + 1} (true) cancelled: job {a['id']} failed"


def test_an_array_runs_at_most_its_cap_and_each_job_knows_its_index(gf, home, db_path):
    p = gf.ok("submit", "--array", "0-5%2", "--name", "sweep", "--",
              "sh", "-c", 'echo "$GPUFLEX_ARRAY_ID $GPUFLEX_ARRAY_INDEX" > "out-$GPUFLEX_ARRAY_INDEX"')
    assert p.stdout.strip() == "array 1: jobs 1-6 (6 jobs, at most 2 running)"
    queued = gf.json("status", "1_5")
    assert (queued["array_id"], queued["array_index"], queued["id"]) == (1, 5, 6)
    assert queued["queue_reason"] == "waiting for a slot of array 1: 2 of at most 2 running"
    assert "array 1" in gf.ok("status").stdout
    end = time.monotonic() + 4 * DEADLINE_S
    while {j["state"] for j in gf.json("status")} != {"succeeded"}:
        assert time.monotonic() < end, gf.json("status")
        time.sleep(1.0)
    assert sorted((home / f"out-{i}").read_text().split() for i in range(6)) == [["1", str(i)] for i in range(6)]
    runs = db_rows(db_path, "SELECT started_at, ended_at FROM jobs WHERE array_id = 1")
    at_most = max(sum(1 for s, e in runs if s <= t < e) for t, _ in runs)
    assert at_most == 2   # the cap was used, and never passed

