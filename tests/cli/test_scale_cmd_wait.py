"""`gpuflex scale --wait` ends within its --timeout and says why a resize ended short (issue
16): the real CLI command and service, on simulated hosts (tests/fakes/hosts.py)."""

from __future__ import annotations

import threading

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.cli.common import Context
from gpuflex.config import parse_config
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.states import JobState as J
from tests.fakes.hosts import FakeHost, World

LEFT_OUT = "stopped beating while it warmed up, before it was ready"
NEVER = "neither beat nor became ready within 60 s of being wanted"


@pytest.fixture
def sim(tmp_path, monkeypatch):
    """A job of one worker (of 1..2) running on a simulated host whose newcomers take a
    minute to warm up; every command's service is this one."""
    world = World(warmup_s=60.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    monkeypatch.setattr(Context, "service", lambda self: svc)
    world.warmup_s, world.blocked = 0.0, {("pool", 1), ("pool", 2), ("pool", 3)}   # room for one
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=2,
                                      workdir=str(tmp_path)))
    world.blocked = set()
    svc.refresh()
    world.warmup_s = 60.0
    assert (svc.job(job_id, events=False).state, svc.job(job_id, events=False).world_size) == (J.RUNNING, 1)
    yield world, svc, job_id
    svc.close()


def scale(job_id: int, n: int, *extra: str):
    r = CliRunner().invoke(app, ["scale", str(job_id), str(n), "--wait", *extra], env={"COLUMNS": "300"})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


@pytest.mark.parametrize("killed,why,end", [(True, LEFT_OUT, "lost"), (False, NEVER, "stopped")],
                         ids=["killed-warming-up", "stuck-before-its-first-beat"])
def test_a_resize_whose_newcomer_is_left_out_ends_the_wait_naming_the_worker_its_host_and_the_phase(
        sim, monkeypatch, killed, why, end):
    """The coordinator left the newcomer out (it died warming up, or never started): the
    job is back to running at its size, scale --wait says so at once instead of waiting out
    --timeout, and a newcomer still running (stuck) is stopped, its devices freed."""
    world, svc, job_id = sim
    answer = FakeHost.control_request

    def coordinator(self, path, message, timeout=5.0):
        reply = answer(self, path, message, timeout)
        if path.endswith("coord.sock") and message.get("op") == "resize":
            if killed:
                world.end(world.workers()[1], None)          # kill -9 while it warms up
            job = next(iter(world.jobs.values()))
            job.desired = [w for w in job.desired if w != 1]
            job.left_out = [{"n": 1, "wid": 1, "reason": why, "phase": "warm-up", "generation": 1, "at": 0}]
        elif path.endswith("coord.sock") and message.get("op") == "status":
            reply["left_out"] = getattr(next(iter(world.jobs.values())), "left_out", [])
        return reply

    monkeypatch.setattr(FakeHost, "control_request", coordinator)
    r = scale(job_id, 2, "--timeout", "600")
    assert r.exit_code == 1, r.output
    assert f"job {job_id}: the resize to 2 ended at 1 worker(s): worker 1 on pool left out of the resize " \
           f"(warm-up): {why}" in r.stderr
    job = svc.job(job_id)
    assert job.state is J.RUNNING and job.world_size == 1
    assert [e.data["host"] for e in job.events if e.kind == "left-out"] == ["pool"]
    assert [(w.wid, w.state.value) for w in job.workers] == [(0, "running"), (1, end)]
    assert not world.workers()[1].alive


@pytest.mark.parametrize("blocked", ["before-the-request", "while-waiting"])
def test_scale_wait_ends_at_its_timeout_while_a_refresh_still_waits(sim, monkeypatch, blocked):
    """A refresh that waits (for the database's lock, a slow host) no longer holds the
    command past --timeout, whether it is the one before the request or one of the wait's:
    each is waited for only as long as the time left, and the command returns while that
    refresh is still waiting."""
    world, svc, job_id = sim
    gate, state = threading.Event(), {"scaled": False, "returned": False}
    refresh, resize = svc.refresh, svc.scale

    def slow_refresh(*args, **kwargs):
        if blocked == "while-waiting" and not state["scaled"]:
            return refresh(*args, **kwargs)
        gate.wait(120)
        state["returned"] = True

    def scaled(*args, **kwargs):
        out = resize(*args, **kwargs)
        state["scaled"] = True
        return out

    monkeypatch.setattr(svc, "refresh", slow_refresh)
    monkeypatch.setattr(svc, "scale", scaled)
    try:
        r = scale(job_id, 2, "--timeout", "2")
        still_waiting = not state["returned"]
    finally:
        gate.set()
    assert r.exit_code == 1 and f"job {job_id}: the resize to 2 did not finish within 2 s" in r.stderr
    assert still_waiting
    assert state["scaled"] is (blocked == "while-waiting")   # blocked before it: nothing was asked


def test_a_shrinks_wait_ends_once_its_leaver_has_exited(sim):
    """scale --wait of a shrink returns when the leaver is gone, its device free for the
    next command (a grow right after it used to find the slot still held)."""
    world, svc, job_id = sim
    world.warmup_s = 0.0
    svc.scale(job_id, 2)
    for _ in range(20):
        svc.refresh()
        if (svc.job(job_id, events=False).state, svc.job(job_id, events=False).world_size) == (J.RUNNING, 2):
            break
    world.leave_s = (2.0, 2.0)                          # the leaver takes 2 s to exit after the switch
    r = scale(job_id, 1, "--timeout", "120")
    assert r.exit_code == 0, r.output
    assert [(w.wid, w.state.value) for w in svc.job(job_id).workers] == [(0, "running"), (1, "exited")]
