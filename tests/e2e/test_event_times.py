"""An event is dated when the thing happened, not when a command noticed it (issue 26).

What a job's coordinator or workers record (a generation published and formed, a worker's
exit) reaches the database only when a later gpuflex command reads it; the event keeps the
time their record gives (`time`) beside the time it was written (`recorded_at`). What a
run has recorded already is told by `recorded_at`, so a coordinator's clock behind or
ahead of this host's never makes a generation be recorded twice.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from gpuflex.config import parse_config
from gpuflex.control import executor, observe
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.elastic.protocol.wire import parse_status
from gpuflex.policy.lifecycle import Observation, ProcSeen, Record, decide
from gpuflex.states import JobState as J
from tests import REPO
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows, write_config
from tests.fakes.hosts import FakeHost, World

EXAMPLE = str(REPO / "examples" / "elastic_mlp.py")
HOUR = 3600.0


@pytest.fixture
def svc(tmp_path):
    """The service over a simulated 4-GPU host whose processes start at once."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    service = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    yield service
    service.close()


def test_a_coordinators_clock_behind_or_ahead_dates_the_event_and_never_repeats_it(svc, tmp_path):
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=2,
                                      workdir=str(tmp_path)))
    svc.refresh()
    behind = time.time() - HOUR   # a coordinator an hour behind: before this run even started
    history = [{"kind": "initial", "generation": 1, "verified": True, "message": "formed", "created": behind}]
    status = {"generation": 1, "members": [0], "history": history,
              "waiting": [{"wid": 0, "for": [1], "since": time.time() + HOUR, "phase": "boundary"}]}   # ahead
    with svc.locked() as s:
        job = svc.get(s, job_id)
        assert job.state is J.RUNNING and job.started_at > behind
        seen = Observation({0: ProcSeen(True, None)}, coordinator=parse_status(status))
        noticed = time.time()
        actions = decide(observe.facts(job), seen)
        assert [(a.kind, a.at) for a in actions if isinstance(a, Record)] == [
            ("formed", behind), ("waiting", status["waiting"][0]["since"])]
        executor.apply(svc.ops(s), job, actions)
        s.flush()
        # recorded for this run, though dated before it started: the next look records nothing
        assert observe.facts(job).recorded == {1}
        assert not [a for a in decide(observe.facts(job), seen) if isinstance(a, Record) and a.kind == "formed"]
    events = {e.kind: e for e in svc.job(job_id).events}
    formed, waiting = events["formed"], events["waiting"]
    assert formed.time == behind and formed.recorded_at >= noticed
    assert noticed <= waiting.time == waiting.recorded_at   # a time ahead of now is taken as now


def test_a_jobs_formation_and_exits_are_dated_by_its_coordinator_and_workers_not_the_command(home):
    """A short in-place job runs to its end with no gpuflex command looking; the command
    run after it records what happened, each at its own time: the formation when the
    coordinator published it (before rank 0's first step), each worker's exit when its
    exit record says."""
    cfg = write_config(home)
    cli = GpuflexCLI(home, cfg)
    report = home / "report.json"
    try:
        job = cli.submit([sys.executable, EXAMPLE, "--epochs", "1", "--hidden", "16", "--report", str(report)],
                         "--workers", "1:2")
        assert job["state"] == "running"
        end = time.monotonic() + 300
        while not _report(report):     # the job trains and ends; no command reads it meanwhile
            assert time.monotonic() < end, cli("logs", str(job["id"])).stdout[-3000:]
            time.sleep(0.5)
        steps = _report(report)["step_log"]
        while len([r for r in map(_report, (home / "work").rglob("worker-*.exit")) if r]) < 2:
            assert time.monotonic() < end     # the workers' exit records (their supervisors write them)
            time.sleep(0.2)
        noticed = time.time()
        events = cli.json("events", str(job["id"]))
    finally:
        cleanup_jobs(cli, home / "g.db")
    formed = [e for e in events if e["kind"] == "formed"]
    assert len(formed) == 1, events
    e = formed[0]
    assert e["time"] == e["data"]["created"]                   # the coordinator's record
    assert e["time"] <= steps[0][1] < noticed <= e["recorded_at"]   # before the first step, long before noticed
    ends = dict(db_rows(home / "g.db", "SELECT wid, ended_at FROM workers WHERE job_id = ?", (job["id"],)))
    exits = [e for e in events if e["kind"] == "worker"]
    assert sorted(x["data"]["wid"] for x in exits) == [0, 1]
    for x in exits:
        assert x["time"] == ends[x["data"]["wid"]] < noticed <= x["recorded_at"]


def _report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
