"""A harvest tick under `[harvest] policy = "throughput"` (issue 32) on simulated hosts
(tests/fakes/hosts.py; the real service, DB, plan and scaling, no processes): a job that
scales poorly gives a worker back so a queued job starts, and each decision is an
"allocation" event with its reason."""

from __future__ import annotations

import time

from gpuflex.config import parse_config
from gpuflex.control import access, harvest, throughput
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.db.models import Event
from gpuflex.policy.throughput import Model
from gpuflex.states import JobState
from gpuflex.states import WorkerState as W
from tests.fakes.hosts import FakeHost, World


def simulated(tmp_path, policy: str) -> tuple[World, JobService]:
    """One 4-GPU host owned by "owner"; processes start and leave at once."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    host = {"name": "pool", "address": "10.9.1.1", "workdir": "/w", "owner": "owner", "user": "gpuflex"}
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "harvest": {"idle_samples": 1, "reclaim_deadline_s": 10, "policy": policy},
                        "hosts": [host]}, "<test>")
    return world, JobService(cfg, pool=Pool(cfg, lambda h: FakeHost(h, world)))


def measured(svc: JobService, job_id: int, model: Model, *sizes: int) -> None:
    with svc.sessions.begin() as s:
        job = svc.get(s, job_id)
        for n in sizes:
            job.events.append(Event(kind=throughput.KIND, message="measured", time=time.time(), count=1,
                                    data={"world": n, "hosts": 1, "samples_per_s": model.throughput(n),
                                          "readings": 3}))


def submit(svc: JobService, tmp_path, user: str, lo: int = 1, hi: int = 4) -> int:
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=lo, max_workers=hi,
                                      workdir=str(tmp_path), harvest=True))
    with svc.sessions.begin() as s:
        svc.get(s, job_id).user = user
    return job_id


def allocation_events(svc: JobService, job_id: int) -> list[Event]:
    return [e for e in svc.job(job_id).events if e.kind == throughput.DECIDED]


def test_a_poorly_scaling_job_gives_a_worker_back_so_a_queued_one_starts(tmp_path):
    world, svc = simulated(tmp_path, "throughput")
    try:
        big = submit(svc, tmp_path, "ann")
        with svc.sessions() as s:
            token = svc.get(s, big).token
        world.jobs[token].desired = sorted(world.workers(token))
        svc.refresh()
        svc.refresh()
        assert len([w for w in svc.job(big).workers if w.state is W.RUNNING]) == 4
        measured(svc, big, Model(1.0, 0.2), 3, 4)          # 4 workers no faster than 3
        waiting = submit(svc, tmp_path, "bob")
        assert svc.job(waiting).state is JobState.QUEUED
        harvest.run_tick(svc)
        (e,) = allocation_events(svc, big)
        assert e.message.startswith(f"job {big} 4->3: one fewer worker") and f"job {waiting} needs 1" in e.message
        assert e.data["resized"] is True
        harvest.run_tick(svc)                                # the leaver is gone: the queued job starts
        assert svc.job(waiting).state in (JobState.RUNNING, JobState.SCALING)
        assert len(allocation_events(svc, big)) == 2 and "resized less than" in allocation_events(svc, big)[-1].message
    finally:
        svc.close()


def test_the_fair_policy_keeps_todays_behaviour_and_records_no_allocation(tmp_path):
    world, svc = simulated(tmp_path, "fair")
    try:
        big = submit(svc, tmp_path, "ann")
        measured(svc, big, Model(1.0, 0.2), 3, 4)
        waiting = submit(svc, tmp_path, "bob")
        harvest.run_tick(svc)
        assert svc.job(waiting).state is JobState.QUEUED and allocation_events(svc, big) == []
    finally:
        svc.close()


def test_a_job_with_too_few_measurements_is_left_at_its_size_unless_fair_share_asks_and_its_events_say_why(
        tmp_path):
    world, svc = simulated(tmp_path, "throughput")
    try:
        big = submit(svc, tmp_path, "ann")
        with svc.sessions() as s:
            token = svc.get(s, big).token
        world.jobs[token].desired = sorted(world.workers(token))
        svc.refresh()
        svc.refresh()
        measured(svc, big, Model(1.0, 0.2), 4)               # one size only: no model
        mine = submit(svc, tmp_path, "ann")                  # ann's own job waits: no share to even out
        harvest.run_tick(svc)
        assert len([w for w in svc.job(big).workers if w.state is W.RUNNING]) == 4
        assert svc.job(mine).state is JobState.QUEUED
        (e,) = allocation_events(svc, big)
        assert e.message == (f"job {big} stays at 4: too few measurements: 2 world sizes needed "
                             "(measured at 4 worker(s) only)")
        assert e.data["resized"] is False
        # bob's job: bob is below his share and ann above hers, which a shrink asks no measurement for
        waiting = submit(svc, tmp_path, "bob")
        harvest.run_tick(svc)
        e = allocation_events(svc, big)[-1]
        assert e.message == (f"job {big} 4->3: ann is above their share and job {waiting} of bob, below theirs, "
                             "needs 1 (its scaling not measured yet)") and e.data["resized"] is True
        harvest.run_tick(svc)                                # the leaver is gone: bob's job starts, not ann's
        assert svc.job(waiting).state in (JobState.RUNNING, JobState.SCALING)
        assert svc.job(mine).state is JobState.QUEUED
    finally:
        svc.close()


def test_under_throughput_a_harvest_job_starts_at_its_owners_fair_share_not_its_max(tmp_path, monkeypatch):
    # 4 GPUs: ann's gang holds 2, bob's 3-worker gang waits; ann's harvest job 1:4 fits on
    # the other 2, but ann's fair share of the 4 (bob could use 3 of them) is 2, which her
    # gang already holds: it starts at its MIN, where the fair policy starts it at 2
    def as_user(user, req):
        monkeypatch.setattr(access, "caller", lambda: user)
        return svc.submit(req)

    for policy, size in (("throughput", 1), ("fair", 2)):
        world, svc = simulated(tmp_path / policy, policy)
        try:
            as_user("ann", SubmitRequest(argv=["python3", "train.py"], min_workers=2, max_workers=2,
                                         workdir=str(tmp_path)))
            waiting = as_user("bob", SubmitRequest(argv=["python3", "train.py"], min_workers=3, max_workers=3,
                                                   workdir=str(tmp_path)))
            assert svc.job(waiting).state is JobState.QUEUED
            grower = as_user("ann", SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=4,
                                                  workdir=str(tmp_path), harvest=True))
            live = [w for w in svc.job(grower).workers if w.state in (W.STARTING, W.RUNNING)]
            assert len(live) == size, policy
            assert svc.job(waiting).state is JobState.QUEUED
            said = [e.message for e in allocation_events(svc, grower)]
            assert said == ([f"job {grower} started with 1 of its MAX 4 worker(s): ann's fair share of the "
                             "pool is 2.0 device(s), of which they held 2; the throughput policy grows it as its "
                             "measurements show gains"] if policy == "throughput" else []), said
        finally:
            svc.close()
