"""Restart-elastic jobs (`--elastic restart`, gpuflex.control.restarts): every resize is a
stop of the whole gang and a relaunch at the new size; a fixed gang is never resized.

The control side runs on simulated hosts (tests/fakes/hosts.py: the real service, DB,
policy and executor, no processes); one real job on the local pool runs
examples/restart/ddp_ckpt.py through 2 -> 3 -> 1 and ends equal to a fixed-size run.
"""

from __future__ import annotations

import pytest

from gpuflex.config import parse_config
from gpuflex.control import harvest
from gpuflex.control.pool import Pool
from gpuflex.control.restarts import RESTART_KIND
from gpuflex.control.service import JobService, SubmitRequest
from gpuflex.errors import UsageError
from gpuflex.states import JobState as J
from gpuflex.states import WorkerState as W
from tests.fakes.hosts import FakeHost, World


def simulated(tmp_path, owner: str | None = None) -> tuple[World, JobService]:
    """A 4-GPU host "pool" (owned by `owner`) whose processes start and leave at once."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    host = {"name": "pool", "address": "10.9.1.1", "workdir": "/w", **({"owner": owner} if owner else {})}
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "harvest": {"idle_samples": 1, "reclaim_deadline_s": 10}, "hosts": [host]}, "<test>")
    return world, JobService(cfg, pool=Pool(cfg, lambda h: FakeHost(h, world)))


@pytest.fixture
def sim(tmp_path):
    world, svc = simulated(tmp_path)
    yield world, svc
    svc.close()


def start(world: World, svc: JobService, tmp_path, on: int, lo: int, hi: int, **kw) -> tuple[int, str]:
    """A job of `lo`:`hi` workers started on GPUs 0..on-1 (the owner holds the rest while it
    is placed, then leaves)."""
    world.blocked = {("pool", i) for i in range(on, 4)}
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=lo, max_workers=hi,
                                      workdir=str(tmp_path), **kw))
    world.blocked = set()
    svc.refresh(probe=True)
    with svc.sessions() as s:
        return job_id, svc.get(s, job_id).token


def live(svc: JobService, job_id: int) -> list[tuple[int, tuple[int, ...]]]:
    return [(w.wid, w.gpus) for w in svc.job(job_id).workers if not w.state.final]


def restarts_of(svc: JobService, job_id: int) -> list[dict]:
    return [e.data for e in svc.job(job_id).events if e.kind == RESTART_KIND]


def test_scale_of_a_restart_job_stops_the_gang_and_starts_it_again_at_the_new_size(sim, tmp_path):
    world, svc = sim
    job_id, token = start(world, svc, tmp_path, 2, 1, 4, elastic="restart")
    first = world.coordinator(token)
    assert live(svc, job_id) == [(0, (0,)), (1, (1,))]

    svc.scale(str(job_id), 3)
    info = svc.job(job_id)
    assert (info.state, info.restarts, info.world_size) == (J.RUNNING, 1, 3)
    assert live(svc, job_id) == [(2, (0,)), (3, (1,)), (4, (2,))]      # the same devices first, one more
    assert [(w.wid, w.state) for w in info.workers[:2]] == [(0, W.EXITED), (1, W.EXITED)]  # stopped on SIGTERM
    assert not first.alive and world.coordinator(token) is not first   # a fresh coordinator
    assert world.coordinator(token).socket_dir != first.socket_dir
    assert [p.env["RANK"] for p in world.workers(token).values() if p.alive] == ["0", "1", "2"]

    svc.scale(str(job_id), 1)
    info = svc.job(job_id)
    assert (info.state, info.restarts) == (J.RUNNING, 2)
    assert live(svc, job_id) == [(5, (0,))]                            # the newest workers go
    events = restarts_of(svc, job_id)
    assert [(e["old_size"], e["new_size"], e["cause"], e["restarts"]) for e in events] == [
        (2, 3, "scale 2 -> 3", 1), (3, 1, "scale 3 -> 1", 2)]
    assert all(0 <= e["down_s"] < 30 for e in events)
    states = [e.message for e in info.events if e.kind == "state"]
    assert "queued: restarting at 3 worker(s) (was 2): scale 2 -> 3" in states

    svc.scale(str(job_id), 1)                                          # its size already: nothing
    assert svc.job(job_id).restarts == 2
    with pytest.raises(UsageError, match="takes 1..4 workers; 5 is outside"):
        svc.scale(str(job_id), 5)


def test_scale_of_a_fixed_gang_is_refused_and_changes_nothing(sim, tmp_path):
    world, svc = sim
    job_id, token = start(world, svc, tmp_path, 2, 2, 2)
    assert svc.job(job_id).elastic is None
    before = svc.job(job_id)
    with pytest.raises(UsageError, match="a fixed gang cannot be resized; submit with --elastic restart or "
                                         "inplace and --workers MIN:MAX"):
        svc.scale(str(job_id), 3)
    after = svc.job(job_id)
    assert (after.state, after.restarts, after.workers, len(after.events)) == \
        (before.state, before.restarts, before.workers, len(before.events))
    assert all(world.workers(token)[wid].alive for wid, _ in live(svc, job_id))


def test_harvest_reclaims_a_restart_job_by_a_restart_without_the_owners_gpu_then_grows_it(tmp_path):
    world, svc = simulated(tmp_path, owner="alice")
    try:
        job_id, token = start(world, svc, tmp_path, 2, 1, 4, elastic="restart", harvest=True)
        assert live(svc, job_id) == [(0, (0,)), (1, (1,))]
        world.blocked = {("pool", 1), ("pool", 3)}                     # alice is back on GPU 1 (and 3)
        tick = harvest.run_tick(svc)
        reclaim = [a for a in tick.actions if a["action"] == "reclaim"]
        assert [(a["gpu"], a["method"], a["within_deadline"]) for a in reclaim] == [(1, "restart", True)]
        assert [a["action"] for a in tick.actions if a["action"] == "restart"] == ["restart", "restart"]
        assert live(svc, job_id) == [(3, (0,)), (4, (2,))]               # grown onto idle GPU 2, never 1
        events = restarts_of(svc, job_id)
        assert [(e["old_size"], e["new_size"]) for e in events] == [(2, 1), (1, 2)]
        assert events[0]["cause"].startswith("reclaim: owner back on pool:1")
        assert events[1]["cause"] == "harvesting idle pool:2"
        info = svc.job(job_id)
        assert (info.state, info.restarts) == (J.RUNNING, 2)
        assert not world.workers(token)[1].alive
    finally:
        svc.close()
