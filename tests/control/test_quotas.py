"""gpuflex.control.quotas: fair share's facts read from the database (the rules are
gpuflex.policy.fairshare's, tests/policy/test_fairshare.py; the jobs it gates, tests/control/test_quota_jobs.py)."""

from __future__ import annotations

import time

import pytest

from gpuflex.config import load_config
from gpuflex.control import quotas
from gpuflex.control.executor import Ops
from gpuflex.control.service import JobService
from gpuflex.db.models import Job, Worker
from gpuflex.errors import UsageError
from gpuflex.states import JobState, WorkerState
from tests.conftest import write_config

HOUR = 3600.0


@pytest.fixture
def lab(home):
    """A pool with a 2-GPU default quota, where alice's running job holds 2 GPUs for an hour
    and her earlier job held 1 for an hour that ended an hour ago; bob holds nothing."""
    svc = JobService(load_config(str(write_config(home, extra="\n[quota]\ndefault_gpus = 2\nhalf_life_h = 1\n"))))
    now = time.time()
    with svc.sessions.begin() as s:
        running = Job(token="t-run", name="run", state=JobState.RUNNING, argv=["true"], workdir=str(home), env={},
                      min_workers=2, max_workers=2, gpus_per_worker=1, user="alice", world_size=2,
                      started_at=now - HOUR)
        for wid in range(2):
            running.workers.append(Worker(wid=wid, rank=wid, host="local", gpus=[wid], state=WorkerState.RUNNING,
                                          started_at=now - HOUR, log_path=f"{home}/w{wid}.log", exit_path=""))
        done = Job(token="t-done", name="done", state=JobState.SUCCEEDED, argv=["true"], workdir=str(home), env={},
                   min_workers=1, max_workers=1, gpus_per_worker=1, user="alice", world_size=1, exit_code=0,
                   started_at=now - 2 * HOUR, ended_at=now - HOUR)
        done.workers.append(Worker(wid=0, rank=0, host="local", gpus=[2], state=WorkerState.EXITED, exit_code=0,
                                   started_at=now - 2 * HOUR, ended_at=now - HOUR, log_path=f"{home}/d.log",
                                   exit_path=""))
        s.add_all([running, done])
    yield svc, now
    svc.close()


def test_a_users_quota_counts_the_devices_their_running_jobs_hold(lab):
    svc, _ = lab
    with svc.sessions.begin() as s:
        ops = Ops(svc.config, svc.pool, s)
        assert quotas.quota_of(ops, "alice") == quotas.fairshare.Quota("alice", 2, 2)
        assert quotas.quota_of(ops, "bob") == quotas.fairshare.Quota("bob", 2, 0)


def test_a_grow_over_the_quota_is_refused_before_anything_changes(lab):
    svc, _ = lab
    with svc.sessions.begin() as s:
        ops = Ops(svc.config, svc.pool, s)
        job = s.query(Job).filter_by(token="t-run").one()
        with pytest.raises(UsageError, match=f"job {job.id}: cannot grow by 1: alice holds 2 of their 2 GPUs"):
            quotas.refuse_over_quota(ops, job, 1)


def test_usage_is_decayed_gpu_hours_per_user(lab):
    svc, now = lab
    with svc.sessions.begin() as s:
        used = quotas.usage(Ops(svc.config, svc.pool, s), now)
    # half-life 1 h: the running hour of 2 GPUs weighs more than the older hour of 1
    assert set(used) == {"alice"}
    expected = quotas.fairshare.usage([quotas.fairshare.Hold("alice", now - HOUR, None, 2),
                                       quotas.fairshare.Hold("alice", now - 2 * HOUR, now - HOUR, 1)], now, 1)
    assert used["alice"] == pytest.approx(expected["alice"])
    assert 1.0 < used["alice"] < 3.0


def test_without_a_quota_nobody_has_a_limit(home):
    svc = JobService(load_config(str(write_config(home))))
    try:
        with svc.sessions.begin() as s:
            assert quotas.quota_of(Ops(svc.config, svc.pool, s), "alice") == quotas.fairshare.Quota("alice", None, 0)
    finally:
        svc.close()
