"""The database matches the processes (issue 16, item 8), on simulated hosts
(tests/fakes/hosts.py): a grow killed at any point after its spawn leaves no process the
database does not know and no worker id given twice; a refused resize stops its
newcomers; a leaver that never leaves stops blocking later grows.

The simulated coordinator's status gains its desired set, as the real one reports it,
and a worker's control socket takes "stop" as the real runtime does while it waits to
join (it exits)."""

from __future__ import annotations

import sqlite3

import pytest

from gpuflex.config import parse_config
from gpuflex.control import executor, lifecycle, scaling
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.db import queries
from gpuflex.db.locks import database_lock
from gpuflex.elastic.protocol.env import CONTROL
from gpuflex.errors import JobError
from gpuflex.states import WorkerState as W
from tests.fakes.hosts import FakeHost, World, two_hosts


class Killed(BaseException):
    """The command dies here (as by SIGKILL: no clean-up of ours runs)."""


@pytest.fixture
def sim(tmp_path, monkeypatch):
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    plain = FakeHost.control_request

    def control_request(self, path, message, timeout=5.0):
        if not path.endswith("coord.sock"):
            if message.get("op") == "stop":
                for p in world.workers().values():
                    if p.alive and p.env.get(CONTROL) == path:
                        world.end(p, 0)
            return {"ok": True}
        reply = plain(self, path, message, timeout)
        if message.get("op") == "status":
            with world.lock:
                reply["desired"] = list(world.jobs[world.coordinator_for(path).token].desired)
        return reply

    def coordinator_for(path):
        return next(p for p in world.procs.values() if p.coordinator and p.socket_dir == path.rsplit("/", 1)[0])

    world.coordinator_for = coordinator_for
    monkeypatch.setattr(FakeHost, "control_request", control_request)
    db = tmp_path / "g.db"
    cfg = parse_config({"database": {"url": f"sqlite:///{db}"}, "jobs": {"cancel_grace_s": 2},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    yield world, svc, db
    svc.close()


def one_worker_job(world: World, svc: JobService, tmp_path) -> int:
    world.blocked = {("pool", 1), ("pool", 2), ("pool", 3)}
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=4,
                                      workdir=str(tmp_path)))
    world.blocked = set()
    svc.refresh(probe=True)
    return job_id


def rows(svc: JobService, job_id: int) -> dict[int, tuple[W, int | None]]:
    """wid -> (state, process group) of the job's worker rows."""
    with svc.sessions() as s:
        return {w.wid: (w.state, w.pgid) for w in queries.job(s, job_id).workers}


def token(svc: JobService, job_id: int) -> str:
    with svc.sessions() as s:
        return queries.job(s, job_id).token


def unknown_processes(world: World, svc: JobService, job_id: int) -> list[int]:
    """Worker ids of live simulated processes with no live row of that id and group."""
    tok = token(svc, job_id)
    live = {(wid, pgid) for wid, (state, pgid) in rows(svc, job_id).items() if not state.final}
    return sorted(p.wid for p in world.procs.values()
                  if p.alive and not p.coordinator and p.token == tok and (p.wid, p.pgid) not in live)


def in_steps(svc: JobService, job_id: int, n: int) -> None:
    with database_lock(svc.config.database_url, "ops").held():
        scaling.scale_in_steps(svc.sessions.begin, svc.config, svc.pool, job_id, n)


def test_a_grow_killed_before_its_request_is_reconciled_and_no_id_is_given_twice(sim, tmp_path, monkeypatch):
    world, svc, _ = sim
    job_id = one_worker_job(world, svc, tmp_path)
    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(executor, "ask_membership", lambda *a, **k: (_ for _ in ()).throw(Killed()))
        in_steps(svc, job_id, 3)
    assert rows(svc, job_id)[1][0] is W.STARTING and rows(svc, job_id)[2][0] is W.STARTING
    assert unknown_processes(world, svc, job_id) == []        # every process has its row
    svc.refresh()                                             # the coordinator never heard of 1 and 2
    assert {w: s for w, (s, _) in rows(svc, job_id).items()} == {0: W.RUNNING, 1: W.STOPPED, 2: W.STOPPED}
    assert [w for w, p in world.workers(token(svc, job_id)).items() if p.alive] == [0]
    in_steps(svc, job_id, 2)
    assert sorted(rows(svc, job_id)) == [0, 1, 2, 3]          # the next newcomer is 3, not 1 again
    svc.refresh()
    assert rows(svc, job_id)[3][0] is W.RUNNING and unknown_processes(world, svc, job_id) == []
    assert svc.job(job_id).world_size == 2


def test_a_grow_killed_between_spawn_and_record_stops_the_unrecorded_process(sim, tmp_path, monkeypatch):
    world, svc, _ = sim
    job_id = one_worker_job(world, svc, tmp_path)
    launch = scaling.launch

    def launch_then_die(ops, job, w):
        launch(ops, job, w)
        raise Killed()

    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(scaling, "launch", launch_then_die)
        in_steps(svc, job_id, 2)
    assert rows(svc, job_id)[1] == (W.STARTING, None)        # the row, not its group
    assert [w for w, p in world.workers(token(svc, job_id)).items() if p.alive] == [0, 1]
    svc.refresh()
    assert rows(svc, job_id)[1][0] is W.STOPPED
    assert [w for w, p in world.workers(token(svc, job_id)).items() if p.alive] == [0]


def test_a_refused_resize_stops_its_newcomers(sim, tmp_path, monkeypatch):
    world, svc, _ = sim
    job_id = one_worker_job(world, svc, tmp_path)
    answered = FakeHost.control_request

    def busy(self, path, message, timeout=5.0):
        if message.get("op") == "resize":
            return {"ok": False, "error": "coordinator busy"}
        return answered(self, path, message, timeout)

    monkeypatch.setattr(FakeHost, "control_request", busy)
    with pytest.raises(JobError, match="coordinator busy"):
        in_steps(svc, job_id, 3)
    assert {w: s for w, (s, _) in rows(svc, job_id).items()} == {0: W.RUNNING, 1: W.STOPPED, 2: W.STOPPED}
    assert [e.kind for e in svc.job(job_id).events][-1] == "workers-stopped"
    with pytest.raises(JobError, match="coordinator busy"):
        svc.scale(str(job_id), 2)                             # the CLI's way: in steps too
    assert {w: s for w, (s, _) in rows(svc, job_id).items()} == {
        0: W.RUNNING, 1: W.STOPPED, 2: W.STOPPED, 3: W.STOPPED}   # a fresh id, its row kept and ended
    assert [w for w, p in world.workers(token(svc, job_id)).items() if p.alive] == [0]
    assert unknown_processes(world, svc, job_id) == []


def test_a_leaver_that_never_leaves_is_stopped_and_no_longer_blocks_a_grow(sim, tmp_path, monkeypatch):
    world, svc, db = sim
    job_id = one_worker_job(world, svc, tmp_path)
    svc.scale(str(job_id), 4)
    svc.refresh()
    assert svc.job(job_id).world_size == 4
    world.hang = 1.0                                          # leavers ignore the shrink
    svc.scale(str(job_id), 3)
    svc.refresh()
    assert rows(svc, job_id)[3][0] is W.LEAVING and world.workers(token(svc, job_id))[3].alive
    with pytest.raises(JobError, match="cannot grow"):
        svc.scale(str(job_id), 4)                             # its GPU is still held
    svc.refresh()                                             # not yet past the bound: left alone
    assert rows(svc, job_id)[3][0] is W.LEAVING
    with sqlite3.connect(db) as con:                          # the shrink was asked long ago
        con.execute("UPDATE events SET time = time - ?, last_time = last_time - ? "
                    "WHERE kind IN ('scale-request', 'state')", (lifecycle.LEAVE_BOUND_S + 1,) * 2)
    svc.refresh()
    assert rows(svc, job_id)[3][0] is W.STOPPED
    assert not world.workers(token(svc, job_id))[3].alive
    svc.scale(str(job_id), 4)
    assert sorted(rows(svc, job_id)) == [0, 1, 2, 3, 4] and rows(svc, job_id)[4][0] is W.STARTING


def test_a_newcomer_the_coordinator_rejected_is_left_to_end_itself_not_taken_for_a_stray():
    """After a rollback the coordinator rejects the newcomer (it exits 3 with its reason): a
    worker the coordinator knows is not the database's to kill; one it never heard of is."""
    from gpuflex.elastic.protocol.wire import parse_status
    from gpuflex.policy.lifecycle import JobFacts, Observation, ProcSeen, WorkerFacts
    from gpuflex.policy.reconcile import strays
    from gpuflex.states import JobState

    workers = tuple(WorkerFacts(w, "h", W.STARTING if w >= 3 else W.RUNNING, pgid=100 + w) for w in range(5))
    job = JobFacts(id=1, state=JobState.RUNNING, min_workers=1, workers=workers)
    seen = Observation(procs={w: ProcSeen(alive=True) for w in range(5)}, coordinator=parse_status(
        {"desired": [0, 1, 2], "members": [0, 1, 2], "known": [0, 1, 2, 4]}))
    assert [w.wid for w in strays(job, seen, asked_before=0)] == [3]


def test_a_run_stopped_while_its_coordinators_host_does_not_answer_is_ended_there_once_it_does(tmp_path):
    # the 2-hour soak: a job ended while the host of its coordinator and a worker did not
    # answer; the stop could not reach them, and they ran on after the host came back
    from gpuflex.control import intents

    world, svc = two_hosts(tmp_path)
    cfg = svc.config
    try:
        job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=2, max_workers=2,
                                          workdir=str(tmp_path)))
        on_a = [p for p in world.procs.values() if p.host == "a"]
        assert {p.coordinator for p in on_a} == {True, False} and all(p.alive for p in world.procs.values())
        world.down.add("a")
        svc.cancel(str(job_id))
        assert svc.job(job_id).state.final
        coordinator = next(p for p in on_a if p.coordinator)
        assert coordinator.alive                                   # a did not answer: it runs on
        assert not any(p.alive for p in world.procs.values() if p.host == "b")
        (entry,) = intents._read(intents.intents_path(cfg.database_url))
        assert entry["job"] == job_id and entry["hosts"] == ["a"] and entry["stop"] is True
        svc.refresh()                                              # a still down: kept for later
        assert coordinator.alive and len(intents._read(intents.intents_path(cfg.database_url))) == 1
        world.down.discard("a")
        svc.refresh()                                              # the next command once a answers
        assert not any(p.alive for p in world.procs.values())
        assert intents._read(intents.intents_path(cfg.database_url)) == []
    finally:
        svc.close()
