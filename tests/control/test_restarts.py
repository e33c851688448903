"""Restart-elastic jobs (`--elastic restart`, gpuflex.control.restarts): every resize is a
stop of the whole gang and a relaunch at the new size; a fixed gang is never resized.

The control side runs on simulated hosts (tests/fakes/hosts.py: the real service, DB,
policy and executor, no processes); one real job on the local pool runs
examples/restart/ddp_ckpt.py through 2 -> 3 -> 1 and ends equal to a fixed-size run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuflex.config import parse_config
from gpuflex.control import access, harvest
from gpuflex.control.pool import Pool
from gpuflex.control.restarts import RESTART_KIND
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.errors import UsageError
from gpuflex.states import JobState as J
from gpuflex.states import WorkerState as W
from tests import REPO
from tests.conftest import GpuflexCLI, cleanup_jobs, db_dump, py, wait_for, write_config
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
    assert [(p.env["RANK"], p.env["GPUFLEX_RESTART_COUNT"], p.env["TORCHELASTIC_RESTART_COUNT"])
            for p in world.workers(token).values() if p.alive] == [("0", "1", "1"), ("1", "1", "1"), ("2", "1", "1")]

    svc.scale(str(job_id), 1)
    info = svc.job(job_id)
    assert (info.state, info.restarts) == (J.RUNNING, 2)
    assert live(svc, job_id) == [(5, (0,))]                            # the newest workers go
    assert world.workers(token)[5].env["GPUFLEX_RESTART_COUNT"] == "2"
    events = restarts_of(svc, job_id)
    assert [(e["old_size"], e["new_size"], e["cause"], e["restarts"]) for e in events] == [
        (2, 3, "scale 2 -> 3", 1), (3, 1, "scale 3 -> 1", 2)]
    assert all(0 <= e["down_s"] < 30 for e in events)
    states = [e.message for e in info.events if e.kind == "state"]
    assert "queued: restarting at 3 worker(s) (was 2): scale 2 -> 3" in states
    asked = [(e.message, e.data.get("by")) for e in info.events if e.kind == "scale-request"]
    assert asked == [(f"restart at {n} worker(s) requested by {access.caller()}", access.caller()) for n in (3, 1)]

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


# ---- a real restart job on the local pool ---------------------------------------------
EXAMPLE = str(REPO / "examples" / "restart" / "ddp_ckpt.py")
ARGS = ["--hidden", "32", "--global-batch-size", "64", "--seed", "3", "--epochs", "8", "--ckpt-every", "4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fixed_size_run(tmp_path: Path) -> dict:
    """The same script at one fixed world size (2 processes, never restarted)."""
    port = free_port()
    out, procs = tmp_path / "ref.json", []
    for rank in range(2):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEX_", "TORCHELASTIC_"))},
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, EXAMPLE, *ARGS, "--ckpt-dir", str(tmp_path / "ref-ckpt"),
                                       "--report", str(out)], env=env))
    for p in procs:
        assert p.wait(timeout=300) == 0
    return json.loads(out.read_text())


def steps(path: Path) -> list[tuple[int, int]]:
    """(step, world) of each line rank 0 appended to the steps file."""
    if not path.exists():
        return []
    return [(int(s), int(w)) for s, _, w in (ln.split() for ln in path.read_text().splitlines() if ln.strip())]


def test_a_restart_job_scaled_2_3_1_ends_equal_to_a_fixed_size_run_and_a_gang_is_not_scaled(
        home, db_path, tmp_path):
    cli = GpuflexCLI(home, write_config(home, slots=3, grace_s=20))
    try:
        gang = cli.submit(py("import time; time.sleep(600)"), "--workers", "1")   # holds 1 of the 3 slots
        before = db_dump(db_path)
        p = cli("scale", str(gang["id"]), "2")
        assert p.returncode == 2 and "Traceback" not in p.stderr
        assert p.stderr.strip().splitlines() == [
            f"error: job {gang['id']} runs 1 worker(s) as a gang: a fixed gang cannot be resized; submit with "
            "--elastic restart or inplace and --workers MIN:MAX."]
        assert db_dump(db_path) == before

        log, report, hold = tmp_path / "steps.log", tmp_path / "report.json", tmp_path / "hold"
        hold.touch()   # a step a second until both resizes are done, whatever the load
        job = cli.submit([sys.executable, EXAMPLE, *ARGS, "--step-sleep", "1", "--sleep-while", str(hold),
                          "--ckpt-dir", str(tmp_path / "ckpt"), "--steps-file", str(log), "--report", str(report)],
                         "--elastic", "restart", "--workers", "1:3", "--env", "OMP_NUM_THREADS=1")
        assert (job["elastic"], len(job["workers"])) == ("restart", 2)
        cli.ok("cancel", str(gang["id"]))
        jid = str(job["id"])
        wait_for(cli, job["id"], lambda j: len(steps(log)) >= 3, "3 steps at 2 workers")
        cli.ok("scale", jid, "3")
        wait_for(cli, job["id"], lambda j: sum(1 for _, w in steps(log) if w == 3) >= 3, "3 steps at 3 workers")
        cli.ok("scale", jid, "1")
        hold.unlink()
        final = cli.wait_final(job["id"], deadline_s=300)
        assert (final["state"], final["restarts"]) == ("succeeded", 2), final
    finally:
        cleanup_jobs(cli, db_path)

    events = cli.json("events", jid)
    restarts = [e["data"] for e in events if e["kind"] == RESTART_KIND]
    assert [(r["old_size"], r["new_size"], r["cause"]) for r in restarts] == [(2, 3, "scale 2 -> 3"),
                                                                              (3, 1, "scale 3 -> 1")]
    assert all(r["down_s"] > 0 for r in restarts)
    got = json.loads(report.read_text())
    assert [(r["restart_count"], r["world_size"]) for r in got["runs"]] == [(0, 2), (1, 3), (2, 1)]
    assert 0 < got["runs"][1]["from_step"] < got["runs"][2]["from_step"] < got["steps"]
    worlds = [w for _, w in steps(log)]
    assert [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w] == [2, 3, 1]
    ref = fixed_size_run(tmp_path)
    assert got["steps"] == ref["steps"] == 256
    a, b = torch.tensor(got["params"]), torch.tensor(ref["params"])
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
