"""Scaling and the lifecycle on simulated hosts (tests/fakes/hosts.py), given to the service
through the pool's transport factory: the real service, DB, policy and executor, no
processes, no SSH."""

from __future__ import annotations

import signal

import pytest

from gpuflex.config import parse_config
from gpuflex.control import access, executor, scaling
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.elastic.protocol.keys import STORE_LOST_EXIT
from gpuflex.policy.placement import Assignment
from gpuflex.states import JobState as J
from gpuflex.states import WorkerState as W
from gpuflex.errors import UsageError
from tests.conftest import db_dump
from tests.fakes.hosts import FakeHost, World


@pytest.fixture
def sim(tmp_path):
    """A 4-GPU host "pool" in a World whose processes start and leave at once."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    made = []

    def transports(host):
        made.append(host.name)
        return FakeHost(host, world)

    svc = JobService(cfg, pool=Pool(cfg, transports))
    yield world, svc, made
    svc.close()


def one_worker_job(world: World, svc: JobService, tmp_path) -> tuple[int, str]:
    """A 1:4 job started on GPU 0 alone (the owner holds 1-3 while it is placed), then the
    owner leaves and a probe sees GPUs 1-3 free."""
    world.blocked = {("pool", 1), ("pool", 2), ("pool", 3)}
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=4,
                                      workdir=str(tmp_path)))
    world.blocked = set()
    svc.refresh(probe=True)
    with svc.sessions() as s:
        return job_id, svc.get(s, job_id).token


def workers(svc: JobService, job_id: int) -> list[tuple[int, W, tuple[int, ...], int | None]]:
    return [(w.wid, w.state, w.gpus, w.rank) for w in svc.job(job_id).workers]


def test_the_pool_makes_its_transports_with_the_factory_it_was_given(sim, tmp_path):
    world, svc, made = sim
    one_worker_job(world, svc, tmp_path)
    assert made == ["pool"]                     # one transport per host, made once
    assert len(world.workers()) == 1 and len(world.jobs) == 1


def test_grow_spawns_a_newcomer_on_the_given_devices_and_asks_the_coordinator(sim, tmp_path):
    world, svc, _ = sim
    job_id, token = one_worker_job(world, svc, tmp_path)
    assert workers(svc, job_id) == [(0, W.RUNNING, (0,), 0)]
    with svc.locked() as s:
        new = scaling.grow(svc.ops(s), svc.get(s, job_id), [Assignment("pool", (2,))], why="test")
        assert [w.wid for w in new] == [1]
    proc = world.workers(token)[1]
    assert proc.gpus == [2] and proc.env["GPUFLEX_WORKER_ID"] == "1"
    assert world.jobs[token].desired == [0, 1]
    info = svc.job(job_id)
    assert (info.state, info.target_workers) == (J.SCALING, 2)
    assert info.events[-1].message == "scaling: grow to 2 worker(s): test requested"
    svc.refresh()                              # the coordinator formed generation 2
    info = svc.job(job_id)
    assert (info.state, info.world_size, info.generation) == (J.RUNNING, 2, 2)
    assert workers(svc, job_id) == [(0, W.RUNNING, (0,), 0), (1, W.RUNNING, (2,), 1)]


def test_retire_lets_the_given_workers_leave_and_the_job_settles_without_them(sim, tmp_path):
    world, svc, _ = sim
    job_id, token = one_worker_job(world, svc, tmp_path)
    with svc.locked() as s:
        scaling.grow(svc.ops(s), svc.get(s, job_id), [Assignment("pool", (1,)), Assignment("pool", (3,))])
    svc.refresh()
    assert [w[0] for w in workers(svc, job_id) if w[1] is W.RUNNING] == [0, 1, 2]
    with svc.locked() as s:
        scaling.retire(svc.ops(s), svc.get(s, job_id), [1], why="owner back")
    assert workers(svc, job_id)[1][1] is W.LEAVING
    assert world.jobs[token].desired == [0, 2]
    svc.refresh()
    info = svc.job(job_id)
    assert (info.state, info.world_size) == (J.RUNNING, 2)
    assert workers(svc, job_id) == [(0, W.RUNNING, (0,), 0), (1, W.EXITED, (1,), None), (2, W.RUNNING, (3,), 1)]
    assert not world.workers(token)[1].alive


def test_a_host_lost_right_after_a_shrink_requeues_the_job_though_a_leaver_had_exited_0(sim, tmp_path):
    """The 2-hour soak's job 716: shrunk 3 -> 1; before any command heard of the shrunk
    generation, the host took the kept worker, a leaver and the coordinator; the other
    leaver had exited 0. That leaver left, it did not finish: the job is requeued."""
    world, svc, _ = sim
    job_id, token = one_worker_job(world, svc, tmp_path)
    with svc.locked() as s:
        scaling.grow(svc.ops(s), svc.get(s, job_id), [Assignment("pool", (1,)), Assignment("pool", (3,))])
    svc.refresh()
    with svc.locked() as s:
        scaling.retire(svc.ops(s), svc.get(s, job_id), [1, 2], why="owner back")
    procs = world.workers(token)
    assert [(w[0], w[1]) for w in workers(svc, job_id)] == [(0, W.RUNNING), (1, W.LEAVING), (2, W.LEAVING)]
    world.end(procs[2], 0)
    for p in (procs[0], procs[1], world.coordinator(token)):
        world.end(p, None)
    svc.refresh()
    info = svc.job(job_id)
    assert (info.state, info.restarts) == (J.RUNNING, 1), [e.message for e in info.events]
    assert any(e.message.startswith("queued: worker 0 on pool was lost") and "no member is left" in e.message
               for e in info.events)


def test_retiring_every_worker_is_refused(sim, tmp_path):
    world, svc, _ = sim
    job_id, _ = one_worker_job(world, svc, tmp_path)
    with pytest.raises(Exception, match="cannot retire every worker"), svc.locked() as s:
        scaling.retire(svc.ops(s), svc.get(s, job_id), [0])
    assert workers(svc, job_id) == [(0, W.RUNNING, (0,), 0)]


def test_requeue_stops_every_process_and_queues_the_job(sim, tmp_path):
    world, svc, _ = sim
    job_id, token = one_worker_job(world, svc, tmp_path)
    with svc.locked() as s:
        executor.requeue(svc.ops(s), svc.get(s, job_id), "make room")
    info = svc.job(job_id)
    assert (info.state, info.restarts) == (J.QUEUED, 1)
    assert info.events[-1].message == "queued: make room"
    assert workers(svc, job_id) == [(0, W.EXITED, (0,), 0)]   # SIGTERM: it stopped at a step boundary
    assert not any(p.alive for p in world.procs.values())    # the coordinator too


def test_a_killed_worker_is_lost_and_the_job_goes_on_with_the_others(sim, tmp_path):
    world, svc, _ = sim
    job_id, token = one_worker_job(world, svc, tmp_path)
    with svc.locked() as s:
        scaling.grow(svc.ops(s), svc.get(s, job_id), [Assignment("pool", (1,))])
    svc.refresh()
    world.signal([world.workers(token)[1].pgid], signal.SIGKILL)
    svc.refresh()
    info = svc.job(job_id)
    assert [(w.wid, w.state, w.exit_code) for w in info.workers] == [(0, W.RUNNING, None), (1, W.LOST, None)]
    assert (info.state, info.world_size, info.generation) == (J.RUNNING, 1, 3)
    assert "worker 1 on pool was lost (killed, or its host is gone)" in [e.message for e in info.events]


@pytest.mark.parametrize("rc,state,exit_code", [(0, J.SUCCEEDED, 0), (3, J.FAILED, 3)])
def test_when_every_worker_has_exited_the_job_ends_and_its_coordinator_stops(sim, tmp_path, rc, state, exit_code):
    world, svc, _ = sim
    job_id, token = one_worker_job(world, svc, tmp_path)
    world.end(world.workers(token)[0], rc)
    svc.refresh()
    info = svc.job(job_id)
    assert (info.state, info.exit_code) == (state, exit_code)
    assert not any(p.alive for p in world.procs.values() if p.coordinator)


def test_a_lost_store_requeues_the_job_and_it_restarts_with_new_workers(sim, tmp_path):
    world, svc, _ = sim
    job_id, token = one_worker_job(world, svc, tmp_path)
    world.end(world.coordinator(token), None)  # the store dies (SIGKILL), its workers exit 75
    world.end(world.workers(token)[0], STORE_LOST_EXIT)
    svc.refresh()                              # requeued, and placed again in the same refresh
    info = svc.job(job_id)
    assert (info.state, info.restarts) == (J.RUNNING, 1)
    assert [(w.wid, w.state) for w in info.workers] == [(0, W.FAILED), (1, W.STARTING)]
    assert "queued: the job store on pool was lost in generation 1, steady; restarting from the last checkpoint" \
        in [e.message for e in info.events]
    assert world.workers(token)[1].alive and world.coordinator(token).alive   # a new coordinator


@pytest.mark.parametrize("workers_arg,n,fragment", [((1, 1), 2, "as a gang"), ((1, 4), 5, "1..4 workers; 5 is outside")])
def test_a_refused_scale_writes_nothing_not_even_the_probes(sim, tmp_path, workers_arg, n, fragment):
    """Refused before the refresh that every command does first, whose probe rows would
    otherwise be written by a command that changed nothing."""
    world, svc, _ = sim
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=workers_arg[0],
                                      max_workers=workers_arg[1], workdir=str(tmp_path)))
    before = db_dump(tmp_path / "g.db")
    with pytest.raises(UsageError, match=fragment):
        svc.scale(str(job_id), n)
    assert db_dump(tmp_path / "g.db") == before


def test_a_scale_names_who_asked_for_it_and_an_admins_says_admin(sim, tmp_path, monkeypatch):
    """`gpuflex scale` is a person's act, as cancel is: its event says who (an admin's
    "(admin)") and records `by`; a resize gpuflex decides itself (the grow above) names
    its reason instead."""
    world, svc, _ = sim
    monkeypatch.setattr(access, "caller", lambda: "alice")
    job_id, _ = one_worker_job(world, svc, tmp_path)
    svc.scale(str(job_id), 2)
    grow = svc.job(job_id).events[-1]
    assert (grow.message, grow.data.get("by")) == ("scaling: grow to 2 worker(s) requested by alice", "alice")
    svc.refresh()                              # generation 2 formed: running at 2
    monkeypatch.setattr(access, "is_admin", lambda config, user: user == "carol")
    monkeypatch.setattr(access, "reaches", lambda config, job: True)   # as through a shared [[hosts]] user
    monkeypatch.setattr(access, "caller", lambda: "carol")
    svc.scale(str(job_id), 1)
    shrink = svc.job(job_id).events[-1]
    assert (shrink.message, shrink.data.get("by")) == ("scaling: shrink to 1 worker(s) requested by carol (admin)",
                                                       "carol")
