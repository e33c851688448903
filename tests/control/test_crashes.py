"""A worker that crashes is a bug, not a fault: by default the job fails at once, with the
worker, its host and the last lines of its traceback in `status` and `events`; with
`submit --retries N` it restarts from its checkpoint instead, and a restarted job never
ends as a plain "succeeded". Signals and lost hosts stay elastic faults.

The control side on simulated hosts (tests/fakes/hosts.py) first, then end to end on the
local pool through the CLI, with tests/fakes/liveness_job.py raising on one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpuflex.cli import render
from gpuflex.config import parse_config
from gpuflex.control import launch
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from gpuflex.elastic.protocol.keys import STORE_LOST_EXIT
from gpuflex.states import JobState as J
from gpuflex.states import WorkerState as W
from tests import TESTS
from tests.conftest import GpuflexCLI, cleanup_jobs, db_dump
from tests.fakes.hosts import FakeHost, World
from tests.cli.test_bad_input import check_unchanged, run_fast, seeded  # noqa: F401 (fixtures)


# ---- the control side, on simulated hosts ---------------------------------------------------
@pytest.fixture
def sim(tmp_path):
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    yield world, svc
    svc.close()


def start(world: World, svc: JobService, tmp_path, retries: int = 0) -> tuple[int, str]:
    """A 1:3 job running on 3 workers."""
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=3,
                                      workdir=str(tmp_path), retries=retries))
    with svc.sessions() as s:
        token = svc.get(s, job_id).token
    form_all(world, svc, token)
    info = svc.job(job_id, events=False)
    assert (info.state, info.world_size) == (J.RUNNING, 3)
    return job_id, token


def form_all(world: World, svc: JobService, token: str) -> None:
    """The simulated coordinator forms its first generation from the workers spawned so
    far: ask it for all of the run's workers."""
    world.jobs[token].desired = sorted(w for w, p in world.workers(token).items() if p.alive)
    svc.refresh()


def test_a_crashed_worker_s_error_is_the_last_line_of_its_log_read_through_its_host(tmp_path):
    """A plain script leaves no crashed record: its log's tail is all there is. The tail is
    read through the host's transport; its size asked with a seek far past the end came
    back EINVAL on ext4, so every such crash said only "exit code 1"."""
    from gpuflex.config import HostConfig
    from gpuflex.control.observe import log_tail
    from gpuflex.db.models import Worker
    from gpuflex.hosts.transport import LocalTransport

    log = tmp_path / "worker-1.log"
    log.write_text("step 1\n" * 5000 + 'Traceback (most recent call last):\n  File "lt.py", line 21, in <module>\n'
                   "IndexError: list index out of range\n")

    class OneHost:
        def transport(self, name: str) -> LocalTransport:
            return LocalTransport(HostConfig(name=name))

    tail = log_tail(OneHost(), Worker(wid=1, host="local", log_path=str(log)), lines=3)
    assert tail == ("Traceback (most recent call last):", '  File "lt.py", line 21, in <module>',
                    "IndexError: list index out of range")


def test_a_worker_exiting_with_an_error_fails_the_job_at_once_and_stops_the_others(sim, tmp_path):
    world, svc = sim
    job_id, token = start(world, svc, tmp_path)
    world.end(world.workers(token)[1], 1)
    svc.refresh()
    info = svc.job(job_id)
    assert (info.state, info.exit_code) == (J.FAILED, 1)
    # no log to read on a simulated host: the exit code is all there is to say
    assert info.exit_reason == "worker 1 on pool crashed (exit code 1): exit code 1"
    assert [(w.wid, w.state) for w in info.workers] == [(0, W.EXITED), (1, W.FAILED), (2, W.EXITED)]
    assert not any(p.alive for p in world.procs.values())        # the others and the coordinator
    crash = [e for e in info.events if e.kind == "crash"]
    assert [e.message for e in crash] == ["worker 1 on pool crashed: exit code 1"]
    assert crash[0].data["host"] == "pool" and crash[0].data["exit_code"] == 1
    assert info.last_crash["wid"] == 1 and info.restarts == 0


@pytest.mark.parametrize("rc", [None, -9, 3], ids=["no-exit-record", "sigkill", "evicted"])
def test_a_signal_a_lost_process_or_an_eviction_is_a_fault_the_job_rides_out(sim, tmp_path, rc):
    world, svc = sim
    job_id, token = start(world, svc, tmp_path)
    world.end(world.workers(token)[1], rc)
    svc.refresh()
    svc.refresh()
    info = svc.job(job_id)
    assert info.state is J.RUNNING and info.world_size == 2
    assert not [e for e in info.events if e.kind == "crash"]


def test_with_retries_a_crash_restarts_the_job_until_they_are_spent(sim, tmp_path):
    world, svc = sim
    job_id, token = start(world, svc, tmp_path, retries=1)
    world.end(world.workers(token)[1], 1)
    svc.refresh()                                    # requeued, and placed again at once
    form_all(world, svc, token)
    info = svc.job(job_id)
    assert (info.state, info.restarts, info.retries) == (J.RUNNING, 1, 1)
    queued = [e for e in info.events if e.kind == "state" and e.message.startswith("queued")]
    assert [e.message for e in queued] == ["queued: worker 1 on pool crashed: exit code 1; restart 1 of 1"]
    assert queued[0].data["cause"] == "crash" and queued[0].data["restarts"] == 1

    world.end(world.workers(token)[4], 2)            # the second run's wids are 3, 4, 5
    svc.refresh()
    info = svc.job(job_id)
    assert (info.state, info.exit_code, info.restarts) == (J.FAILED, 2, 1)
    assert info.exit_reason == "failed after 1 restart(s): worker 4 on pool crashed (exit code 2): exit code 2"
    assert info.events[-1].message == \
        "failed after 1 restart(s): worker 4 on pool crashed (exit code 2): exit code 2"


def test_faults_do_not_spend_retries_and_a_restarted_job_never_succeeds_plainly(sim, tmp_path):
    world, svc = sim
    job_id, token = start(world, svc, tmp_path)      # --retries 0
    world.end(world.coordinator(token), None)        # the store dies: a fault
    for w in world.workers(token).values():
        world.end(w, STORE_LOST_EXIT)
    svc.refresh()
    form_all(world, svc, token)
    assert (svc.job(job_id).state, svc.job(job_id).restarts) == (J.RUNNING, 1)
    for wid in (3, 4, 5):
        world.end(world.workers(token)[wid], 0)
    svc.refresh()
    info = svc.job(job_id)
    assert (info.state, info.restarts) == (J.SUCCEEDED, 1)
    assert info.events[-1].message == "succeeded after 1 restart(s): all workers exited 0"
    assert info.exit_reason == "succeeded after 1 restart(s): all workers exited 0"


@pytest.mark.parametrize("value,fragment", [("-1", "--retries -1"), ("1001", "--retries 1001")])
def test_bad_retries_are_refused_and_change_nothing(run_fast, seeded, db_path, value, fragment):  # noqa: F811
    check_unchanged(run_fast, seeded, db_path, ["submit", "--retries", value, "--", "true"],
                    fragment, "from 0 to 1000")


def test_retries_that_are_not_a_number_are_refused_and_change_nothing(run_fast, seeded, db_path):  # noqa: F811
    before = db_dump(db_path)
    code, out, err = run_fast(seeded, "submit", "--retries", "two", "--", "true")
    assert code == 2 and "Traceback" not in out + err and "--retries" in err
    assert db_dump(db_path) == before


# ---- end to end on the local pool -----------------------------------------------------------
JOB = str(TESTS / "fakes" / "liveness_job.py")
ARGS = ["--hidden", "32", "--global-batch-size", "48", "--seed", "4"]
RAISE_AT = 12
DEADLINE_S = 300


@pytest.fixture
def lp(home):
    """The CLI over 3 CPU slots, 1 s checkpoints, a 3 s heartbeat timeout."""
    cfg = home / "g.toml"
    cfg.write_text(
        f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
        "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 1\nheartbeat_timeout_s = 3\n\n"
        f'[[hosts]]\nname = "local"\ngpus = "cpu:3"\nworkdir = "{home}/work"\n')
    cli = GpuflexCLI(home, cfg)
    yield cli
    cleanup_jobs(cli, home / "g.db")


def crashing(report: Path) -> list[str]:
    """3 epochs of 43 steps; worker 1 raises ZeroDivisionError at step RAISE_AT."""
    return [sys.executable, JOB, *ARGS, "--epochs", "3", "--step-sleep", "0.05", "--raise-at", str(RAISE_AT),
            "--raise-wid", "1", "--report", str(report)]


def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref") / "ref.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    subprocess.run([sys.executable, JOB, *ARGS, "--epochs", "3", "--report", str(out)], check=True, env=env,
                   timeout=300)
    return json.loads(out.read_text())


def test_an_exception_on_one_rank_fails_the_job_with_its_traceback_and_no_one_trains_below_min(lp, home):
    report = home / "r.json"
    job = lp.submit(crashing(report), "--workers", "3")
    done = lp.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "failed", done
    assert done["exit_code"] == 1 and done["restarts"] == 0 and done["retries"] == 0
    reason = done["exit_reason"]
    assert reason.startswith("worker 1 on local crashed"), reason
    assert "ZeroDivisionError: division by zero" in reason
    assert "print(1 / 0)" in reason                       # a line of its traceback
    assert done["last_crash"]["wid"] == 1 and done["last_crash"]["host"] == "local"
    table = lp.ok("status", str(job["id"])).stdout
    assert "worker 1 on local crashed" in table and "ZeroDivisionError: division by zero" in table
    events = lp.ok("events", str(job["id"])).stdout
    assert "worker 1 on local crashed: ZeroDivisionError: division by zero" in events
    # the survivors stopped where the crash left them (rank 0 wrote its report when it was
    # stopped): no step at a world size below MIN (3), none past the crash
    log = json.loads(report.read_text())["step_log"]
    assert [s for s, _, _ in log] == list(range(RAISE_AT)), log
    assert {ws for _, _, ws in log} == {3}, log


def test_with_retries_1_the_job_restarts_once_and_matches_the_reference(lp, home, tmp_path_factory):
    report = home / "r.json"
    job = lp.submit(crashing(report), "--workers", "3", "--retries", "1")
    done = lp.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded", done
    assert done["restarts"] == 1 and done["retries"] == 1
    assert done["exit_reason"] == "succeeded after 1 restart(s): all workers exited 0"
    events = lp.json("events", str(job["id"]))
    restarts = [e for e in events if e["kind"] == "state" and e["data"].get("cause") == "crash"]
    assert len(restarts) == 1 and "worker 1 on local crashed: ZeroDivisionError" in restarts[0]["message"]
    assert restarts[0]["message"].endswith("restart 1 of 1")
    assert events[-1]["message"] == "succeeded after 1 restart(s): all workers exited 0"
    r, ref = json.loads(report.read_text()), reference(tmp_path_factory)
    assert r["steps"] == ref["steps"]
    got, want = torch.tensor(r["params"]), torch.tensor(ref["params"])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    assert [s for s, _, _ in r["step_log"]] == list(range(ref["steps"])), "a step was lost or repeated"


# ---- what the coordinator is told, and what status shows of a wait ---------------------------
def test_the_coordinator_is_started_with_the_job_s_minimum_and_the_failure_limit(sim, tmp_path):
    world, svc = sim
    job = Job(id=7, token="t0k", secret="s", min_workers=2, max_workers=4, socket_dir="/tmp/gpuflex-x")
    argv = launch.coordinator_spec(svc.config, svc.config.hosts[0], job, 29500, [0, 1]).argv
    assert argv[argv.index("--min-workers") + 1] == "2"
    assert argv[argv.index("--max-failures") + 1] == str(svc.config.jobs.max_same_failures)


def test_status_shows_who_the_members_wait_for_and_events_keep_each_change(sim, tmp_path, monkeypatch):
    world, svc = sim
    job_id, token = start(world, svc, tmp_path)
    waiting: list = []
    plain = FakeHost.control_request

    def with_waiting(self, path, message, timeout=5.0):
        reply = plain(self, path, message, timeout)
        return {**reply, "waiting": list(waiting)} if message.get("op") == "status" else reply

    monkeypatch.setattr(FakeHost, "control_request", with_waiting)
    since = time.time() - 42
    waiting[:] = [{"wid": 1, "for": [0], "since": since, "phase": "boundary"},
                  {"wid": 2, "for": [0], "since": since + 1, "phase": "boundary"}]
    svc.refresh()
    svc.refresh()                                # the same wait read again: no new event
    info = svc.job(job_id)
    assert [dict(w) for w in info.waiting] == [{"wid": 1, "for": [0], "phase": "boundary", "since": since},
                                               {"wid": 2, "for": [0], "phase": "boundary", "since": since + 1}]
    text = render.waiting_text(info.waiting, now=since + 42)
    assert text == "waiting for worker 0 (boundary) 42 s"
    assert render.job_json(info)["waiting"][0]["for"] == [0]
    waits = [e for e in info.events if e.kind == "waiting"]
    assert [e.message for e in waits] == ["worker 1 waits for worker 0 (boundary); "
                                          "worker 2 waits for worker 0 (boundary)"]
    waiting[:] = []
    svc.refresh()
    info = svc.job(job_id)
    assert info.waiting == () and info.events[-1].message == "no member is waiting any more"
