"""An in-place job whose every run dies by the same fault at the same place (SIGSEGV in its
last step, as a sharded job's gather did on a GPU) is restarted from its checkpoint while
that gets it further, and failed once three runs in a row started from the same step: with
the signal's exit code and a reason that says so, never restarted without end. Real
coordinator and workers on the local pool (policy rule: tests/policy/test_outcomes.py)."""

from __future__ import annotations

import sys

import pytest

from tests import TESTS
from tests.conftest import GpuflexCLI, cleanup_jobs

pytestmark = pytest.mark.e2e   # jobs of real workers and coordinators

SCRIPT = str(TESTS / "fakes" / "crash_in_last_step.py")


@pytest.fixture
def cli(home):
    cfg = home / "g.toml"
    # 40 steps of 0.2 s: the first run checkpoints on its way; a restart from the newest
    # checkpoint reaches the last step in less than the 5 s interval, so writes no newer one
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
                   "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 5\nheartbeat_timeout_s = 3\n\n"
                   f'[[hosts]]\nname = "local"\ngpus = "cpu:2"\nworkdir = "{home}/work"\n')
    c = GpuflexCLI(home, cfg)
    yield c
    cleanup_jobs(c, home / "g.db")


def test_a_fault_at_the_same_place_every_run_fails_the_job_after_three_runs_from_one_step(cli):
    job = cli.submit([sys.executable, SCRIPT, "0.2"], "--workers", "1:2")   # in place (a fixed size is a gang)
    done = cli.wait_final(job["id"], 400)
    events = cli.json("events", str(job["id"]))
    assert done["state"] == "failed" and done["exit_code"] == 139, (done, events)
    starts = [e["data"]["timings"]["step"] for e in events if e["kind"] == "formed"]
    requeues = [e["data"]["cause"] for e in events if e["kind"] == "state" and e["data"].get("cause")]
    told = [(e["kind"], e["message"]) for e in events]
    assert len(starts) >= 3 and starts[0] == 0 and len(set(starts[-3:])) == 1 and starts[-1] > 0, (starts, told)
    assert requeues and set(requeues) == {"fault"} and len(requeues) == len(starts) - 1, requeues
    reason = done.get("exit_reason") or ""
    assert "killed by signal 11 (exit code 139)" in reason, reason
    assert f"its last 3 runs each restarted from the checkpoint at step {starts[-1]}" in reason, reason


def test_a_restart_job_that_segfaults_every_run_is_relaunched_five_times_then_fails(cli):
    """A restart job's runs name no step: its fault relaunches are bounded by count
    (outcomes.FAULT_RELAUNCHES in a row), so a script that crashes by a signal every run
    ends failed with the signal's exit code, after six runs."""
    segv = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    job = cli.submit([sys.executable, "-c", segv], "--workers", "1:2", "--elastic", "restart")
    done = cli.wait_final(job["id"], 300)
    events = cli.json("events", str(job["id"]))
    told = [(e["kind"], e["message"]) for e in events]
    assert done["state"] == "failed" and done["exit_code"] == 139, (done, told)
    requeues = [e["data"]["cause"] for e in events if e["kind"] == "state" and e["data"].get("cause")]
    assert requeues == ["fault"] * 5 and done["restarts"] == 5, told
    reason = done.get("exit_reason") or ""
    assert "killed by signal 11 (exit code 139)" in reason and "relaunched 5 times in a row" in reason, told
