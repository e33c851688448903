"""gpuflex.cli.scale_cmd: `gpuflex scale`'s checks before it asks, and its bounded wait for
a refresh (real resizes: tests/cli/test_scale_cmd_wait.py and the elastic job tests)."""

from __future__ import annotations

import threading
import time

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app, scale_cmd
from gpuflex.cli.common import Context
from gpuflex.config import parse_config
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.policy import leavers
from gpuflex.states import WorkerState
from tests.clirun import invoke
from tests.fakes.hosts import FakeHost, World


def test_a_job_that_does_not_exist_is_refused_before_anything_is_asked(home, config_path):
    r = invoke(home, config_path, "scale", "7", "2")
    assert (r.exit_code, r.stderr) == (2, "error: no job '7'. Run 'gpuflex status' to list jobs.\n")


@pytest.mark.parametrize("args,message", [
    (["1", "0"], "error: N 0: give a whole number from 1 to 2147483647."),
    (["1", "2", "--timeout", "0.5"], "error: --timeout 0.5: give seconds from 1 to 86400."),
])
def test_bad_arguments_are_usage_errors(home, config_path, args, message):
    r = invoke(home, config_path, "scale", *args)
    assert (r.exit_code, r.stderr.strip()) == (2, message)


def test_work_within_the_deadline_returns_true_and_its_error_is_raised_here():
    assert scale_cmd._within(time.monotonic() + 5, lambda: None) is True

    def fails():
        raise RuntimeError("lock held")

    with pytest.raises(RuntimeError, match="lock held"):
        scale_cmd._within(time.monotonic() + 5, fails)


def test_work_past_the_deadline_is_left_running_and_false_returned():
    release = threading.Event()
    try:
        assert scale_cmd._within(time.monotonic() + 0.05, release.wait) is False
    finally:
        release.set()


@pytest.fixture
def two_workers(tmp_path, monkeypatch):
    """A job of two workers (of 1..2) on a simulated host (tests/fakes/hosts.py); every
    command's service is this one."""
    world = World(warmup_s=0.0, leave_s=(0.3, 0.3), gpus_per_host=2)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    monkeypatch.setattr(Context, "service", lambda self: svc)
    world.blocked = {("pool", 1)}   # room for one: the job starts at one and is grown
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=2,
                                      workdir=str(tmp_path)))
    world.blocked = set()
    svc.refresh(probe=True)
    svc.scale(job_id, 2)
    for _ in range(100):   # the second worker joins at the simulated coordinator's next switch
        svc.refresh()
        if list(_states(svc, job_id).values()) == [WorkerState.RUNNING] * 2:
            break
        time.sleep(0.1)
    assert list(_states(svc, job_id).values()) == [WorkerState.RUNNING] * 2
    yield world, svc, job_id
    svc.close()


def _scale(job_id: int, n: int):
    r = CliRunner().invoke(app, ["scale", str(job_id), str(n)], env={"COLUMNS": "300"})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


def _states(svc, job_id: int) -> dict[int, WorkerState]:
    """The workers' rows as the database holds them (read without a refresh)."""
    return {w.wid: w.state for w in svc.job(job_id, events=False).workers}


def test_a_shrink_records_its_leaver_s_end_once_the_leaver_exited_before_it_returns(two_workers):
    """Issue 28: the rows said `leaving` after the processes were gone, until the next
    command. The scale watches its leaver and records the end as soon as it exits."""
    world, svc, job_id = two_workers
    r = _scale(job_id, 1)
    assert r.exit_code == 0, r.output
    leaver = world.workers()[1]
    assert not leaver.alive   # the simulated leaver exited 0.3 s after the switch
    assert _states(svc, job_id)[1] is WorkerState.EXITED
    assert WorkerState.LEAVING not in _states(svc, job_id).values()


def test_a_leaver_that_outlives_the_watch_stays_leaving_and_is_named(two_workers, monkeypatch):
    """A leaver still running when the watch's bound ends keeps its `leaving` row (its process
    lives): the command says so and leaves its end to the next command."""
    world, svc, job_id = two_workers
    world.hang = 1.0   # the leaver ignores the shrink
    monkeypatch.setattr(leavers, "SCALE_WATCH_S", 1.0)
    r = _scale(job_id, 1)
    assert r.exit_code == 0, r.output
    assert "worker(s) 1 still leaving after 1 s; the next command records their end." in r.stdout
    assert world.workers()[1].alive and _states(svc, job_id)[1] is WorkerState.LEAVING


def test_ctrl_c_while_the_shrink_watches_its_leaver_is_one_line_and_exit_130(two_workers, monkeypatch):
    world, svc, job_id = two_workers

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(svc, "watch_leavers", interrupted)
    r = _scale(job_id, 1)
    assert (r.exit_code, r.stderr.strip()) == (130, "error: interrupted."), r.output
    assert _states(svc, job_id)[1] is WorkerState.LEAVING   # the shrink was asked: it goes on
