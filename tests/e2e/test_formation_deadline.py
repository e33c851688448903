"""Formation has a deadline (issue 16, item 2), on the local pool with real processes: a
3-worker job whose first worker is killed with SIGKILL while it starts up (before it
imports torch, so before it ever beat or joined) must not hang. With MIN 2 the first
generation is formed without it and the job succeeds, equal to the standalone run; with
MIN 3 the job is requeued with a reason that names the worker and the phase, and the
restarted job succeeds."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gpuflex.cli.render import clock, forming_text
from tests.conftest import GpuflexCLI, cleanup_jobs
from tests.e2e.test_elastic_jobs import ARGS, DEADLINE_S, EXAMPLE, assert_matches_reference, reference

pytestmark = pytest.mark.e2e   # jobs of real workers and coordinators

FORMATION_S = 10

# The job's script: the first worker to start writes its pid and sleeps (a host slow to
# start: CUDA init, imports); the test kills it there. Every other start runs the example.
WRAPPER = """\
import os, runpy, sys, time
marker = sys.argv[1]
try:
    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
except FileExistsError:
    fd = None
if fd is not None and os.environ.get("GPUFLEX_WORKER_ID") == "0":
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(600)
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture
def fj(home):
    """CLI with a short formation timeout: 4 CPU slots, 1 s checkpoints."""
    cfg = home / "g.toml"
    cfg.write_text(
        f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
        "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 1\nheartbeat_timeout_s = 3\n"
        f"formation_timeout_s = {FORMATION_S}\n\n"
        f'[[hosts]]\nname = "local"\ngpus = "cpu:4"\nworkdir = "{home}/work"\n')
    cli = GpuflexCLI(home, cfg)
    yield cli
    cleanup_jobs(cli, home / "g.db")


def submit_with_a_slow_first_worker(cli: GpuflexCLI, home: Path, workers: str) -> tuple[dict, int]:
    """Submit the job; kill -9 worker 0 while it sleeps at start. Returns (job, its pid)."""
    wrapper, marker, report = home / "wrapper.py", home / "first.pid", home / "r.json"
    wrapper.write_text(WRAPPER)
    job = cli.submit([sys.executable, str(wrapper), str(marker), EXAMPLE, *ARGS, "--epochs", "2",
                      "--report", str(report)], "--workers", workers, "--elastic", "inplace")
    end = time.monotonic() + 60
    while not (marker.exists() and marker.read_text()):
        if time.monotonic() > end:
            pytest.fail("worker 0 never started: " + cli("logs", str(job["id"])).stdout[-2000:])
        time.sleep(0.2)
    pid = int(marker.read_text())
    os.kill(pid, signal.SIGKILL)
    return job, pid


def messages(cli: GpuflexCLI, job_id: int) -> str:
    return "\n".join(e["message"] for e in cli.json("events", str(job_id)))


def test_a_worker_killed_before_it_joined_is_left_out_when_min_still_holds(fj, home, tmp_path_factory):
    job, _ = submit_with_a_slow_first_worker(fj, home, "2:3")
    done = fj.wait_final(job["id"], DEADLINE_S)
    log = messages(fj, job["id"])
    assert done["state"] == "succeeded", (done, log)
    assert "worker(s) [0] did not become ready" in log and "starting generation 1" in log, log
    assert done["restarts"] == 0
    assert_matches_reference(json.loads((home / "r.json").read_text()), reference(tmp_path_factory, 2))


def test_a_worker_killed_before_it_joined_requeues_the_job_when_min_would_not_hold(fj, home, tmp_path_factory):
    job, _ = submit_with_a_slow_first_worker(fj, home, "3")
    done = fj.wait_final(job["id"], DEADLINE_S)
    log = messages(fj, job["id"])
    assert done["state"] == "succeeded" and done["restarts"] == 1, (done, log)
    assert ("worker(s) [0] did not become ready within" in log
            and "starting generation 1: 2 worker(s) left, below the job's minimum of 3" in log), log
    assert_matches_reference(json.loads((home / "r.json").read_text()), reference(tmp_path_factory, 2))


@pytest.mark.parametrize("forming,text", [
    (None, ""),
    ({"generation": 1, "since": 1000.0, "waiting_for": [0], "phase": "starting"},
     "forming generation 1 since {at} (12 s), waiting for worker 0 (starting)"),
    ({"generation": 4, "since": 1000.0, "waiting_for": [2, 5], "phase": "joining"},
     "forming generation 4 since {at} (12 s), waiting for workers 2, 5 (joining)"),
    ({"generation": 4, "since": None, "waiting_for": [], "phase": ""}, "forming generation 4"),
    ({"generation": "4"}, ""),
])
def test_status_says_which_generation_is_forming_since_when_and_for_whom(forming, text):
    assert forming_text(forming, now=1012.0) == text.format(at=clock(1000.0))
