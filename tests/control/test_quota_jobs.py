"""Quotas and fair share on real commands (issue 14): a job held by its owner's quota
starts when the other job ends; an elastic job starts at the size its quota leaves and a
scale past it is refused (exit 2, nothing changed); harvest grows the least-used user's
job first, within quotas; a job whose training finished is never grown.

The CLI test runs the console script on the local CPU-slot pool (a restart job of `sleep`
and a job of `true`); the harvest tests run the real service on simulated hosts
(tests/fakes/hosts.py), no processes.
"""

from __future__ import annotations

import json
import time

import pytest

from gpuflex.config import parse_config
from gpuflex.control import access, harvest, harvest_inputs
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.db.models import Event, Job, Worker
from gpuflex.elastic.protocol.wire import parse_status
from gpuflex.errors import UsageError
from tests.conftest import GpuflexCLI, cleanup_jobs, db_dump, write_config
from tests.fakes.hosts import FakeHost, World


def test_a_job_over_quota_waits_then_starts_when_the_other_ends_and_a_scale_over_it_is_refused(home):
    cfg = write_config(home, extra="\n[quota]\ndefault_gpus = 2\n")
    gf = GpuflexCLI(home, cfg)
    try:
        first = gf.submit(["sleep", "600"], "--elastic", "restart", "--workers", "1:3")
        assert (first["state"], len(first["workers"])) == ("running", 2)     # MAX 3, the quota leaves 2
        second = gf.submit(["true"], "--workers", "1")
        assert second["state"] == "queued"
        assert "holds 2 of their 2 GPUs ([quota]); this job needs 1" in second["queue_reason"]

        before = db_dump(home / "g.db")
        p = gf("scale", str(first["id"]), "3")
        assert p.returncode == 2, p.stdout + p.stderr
        assert "[quota]" in p.stderr and "Traceback" not in p.stderr
        assert len([line for line in p.stderr.splitlines() if line.strip()]) == 1
        after = db_dump(home / "g.db")
        assert after["jobs"] == before["jobs"] and after["workers"] == before["workers"]

        gf.ok("cancel", str(first["id"]))                       # the quota is free: the second starts
        assert gf.wait_final(second["id"])["state"] == "succeeded"
    finally:
        cleanup_jobs(gf, home / "g.db")


# ---- harvest on simulated hosts -----------------------------------------------------------
def simulated(tmp_path, quota: dict, admins: tuple[str, ...] = ()) -> tuple[World, JobService]:
    """One 4-GPU host owned by "owner" whose processes start and leave at once."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    # one shared account on the host ([[hosts]] user): any user's command starts anyone's job
    host = {"name": "pool", "address": "10.9.1.1", "workdir": "/w", "owner": "owner", "user": "gpuflex"}
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "harvest": {"idle_samples": 1, "reclaim_deadline_s": 10}, "quota": quota,
                        "access": {"admins": list(admins)}, "hosts": [host]}, "<test>")
    return world, JobService(cfg, pool=Pool(cfg, lambda h: FakeHost(h, world)))


def start_on(world: World, svc: JobService, tmp_path, gpu: int, user: str | None = None) -> int:
    """An in-place --harvest job of 1..4 workers, started on GPU `gpu` alone; owned by
    `user` (None: the caller, who may scale it)."""
    world.blocked = {("pool", i) for i in range(4) if i != gpu}
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=4,
                                      workdir=str(tmp_path), harvest=True))
    world.blocked = set()
    if user is not None:
        with svc.sessions.begin() as s:
            svc.get(s, job_id).user = user
    return job_id


def gpus_of(svc: JobService, job_id: int) -> list[int]:
    return sorted(d for w in svc.job(job_id).workers if not w.state.final for d in w.gpus)


def used_before(svc: JobService, user: str, gpus: int, hours: float) -> None:
    """A finished job of `user` that held `gpus` GPUs for `hours` until a minute ago."""
    now = time.time()
    with svc.sessions.begin() as s:
        old = Job(token=f"old{user}"[:12], name="old", state="succeeded", argv=["true"], workdir="/w", env={},
                  min_workers=1, max_workers=1, gpus_per_worker=gpus, user=user, created_at=now - hours * 3600,
                  started_at=now - hours * 3600, ended_at=now - 60)
        old.workers.append(Worker(wid=0, host="pool", gpus=list(range(gpus)), state="exited", log_path="/w/l",
                                  exit_path="/w/e", started_at=now - hours * 3600, ended_at=now - 60))
        s.add(old)


def test_the_queue_starts_the_least_used_users_job_first_among_equal_priorities(tmp_path):
    world, svc = simulated(tmp_path, {"half_life_h": 24})
    try:
        world.blocked = {("pool", i) for i in range(4)}            # the owner holds every GPU
        first = svc.submit(SubmitRequest(argv=["python3", "a.py"], workdir=str(tmp_path)))
        second = svc.submit(SubmitRequest(argv=["python3", "b.py"], workdir=str(tmp_path)))
        with svc.sessions.begin() as s:
            svc.get(s, first).user, svc.get(s, second).user = "heavy", "light"
        used_before(svc, "heavy", 4, 10)
        used_before(svc, "light", 1, 1)
        world.blocked = {("pool", i) for i in range(1, 4)}         # one GPU comes free
        svc.refresh(probe=True)
        assert (svc.job(first).state, svc.job(second).state) == ("queued", "running")   # the newer job first
    finally:
        svc.close()


@pytest.mark.parametrize("exempt, started", [(True, True), (False, False)])
def test_an_admin_is_held_by_no_quota_while_admins_are_exempt(tmp_path, exempt, started):
    world, svc = simulated(tmp_path / str(exempt), {"default_gpus": 0, "admins_exempt": exempt},
                           admins=(access.caller(),))
    try:
        job_id = svc.submit(SubmitRequest(argv=["python3", "a.py"], workdir=str(tmp_path)))
        info = svc.job(job_id)
        assert (info.state == "running") is started
        if not started:
            assert info.queue_reason.endswith("holds 0 of their 0 GPUs ([quota]); this job needs 1")
    finally:
        svc.close()


def test_harvest_grows_the_least_used_users_job_first_and_each_only_up_to_its_quota(tmp_path):
    world, svc = simulated(tmp_path, {"default_gpus": 2, "half_life_h": 24})
    try:
        heavy = start_on(world, svc, tmp_path, 0, "heavy")
        light = start_on(world, svc, tmp_path, 1, "light")
        used_before(svc, "heavy", 4, 10)
        harvest.run_tick(svc)
        # the old rule (fewest harvested GPUs, then the older job) would grow job `heavy` onto GPU 2
        assert (gpus_of(svc, light), gpus_of(svc, heavy)) == ([1, 2], [0, 3])
        harvest.run_tick(svc)
        assert (gpus_of(svc, light), gpus_of(svc, heavy)) == ([1, 2], [0, 3])   # both at their quota of 2
    finally:
        svc.close()


def test_a_job_whose_training_finished_is_neither_harvested_nor_scaled(tmp_path, monkeypatch):
    world, svc = simulated(tmp_path, {})
    try:
        job_id = start_on(world, svc, tmp_path, 0)
        monkeypatch.setattr(harvest_inputs, "coordinator_status", lambda *a: parse_status({"finished": True, "desired": [0]}))
        harvest.run_tick(svc)
        assert gpus_of(svc, job_id) == [0]
        with pytest.raises(UsageError, match="has finished training"):
            svc.scale(str(job_id), 2)
        assert gpus_of(svc, job_id) == [0]
        monkeypatch.setattr(harvest_inputs, "coordinator_status", lambda *a: parse_status({"finished": False, "desired": [0]}))
        harvest.run_tick(svc)   # the same job, not finished: grown onto the three idle GPUs
        assert gpus_of(svc, job_id) == [0, 1, 2, 3]
    finally:
        svc.close()


# ---- report --by user ----------------------------------------------------------------------
def test_report_by_user_sums_used_and_harvested_gpu_hours_inside_the_window(home):
    from typer.testing import CliRunner

    from gpuflex.cli import app
    from gpuflex.config import load_config
    from gpuflex.db.models import Host

    cfg = write_config(home)   # its "local" host is CPU slots: no GPU-hours, slot-hours
    svc = JobService(load_config(str(cfg)))
    now = time.time()
    try:
        svc.refresh()
        with svc.sessions.begin() as s:
            s.add_all([Host(name="owned", address="10.0.0.8", owner="prof"), Host(name="lab", address="10.0.0.9")])
            for i, (user, workers) in enumerate([
                    ("alice", [("owned", [0, 1], now - 7200, now - 3600),    # 2 GPUs x 1 h, harvested
                               ("lab", [0], now - 1800, None)]),             # 0.5 h, still held
                    ("bob", [("lab", [1, 2, 3], now - 5 * 3600, now - 3 * 3600),   # 1 h inside 4 h
                             ("local", [0, 1], now - 3600, None)]),          # CPU slots
                    ("carol", [("lab", [4], now - 3 * 86400, now - 2 * 86400)])]):  # before the window
                j = Job(token=f"u{i}", name=user, state="succeeded", argv=["x"], workdir="/", env={},
                        min_workers=1, max_workers=4, gpus_per_worker=1, user=user)
                for wid, (host, gpus, start, end) in enumerate(workers):
                    j.workers.append(Worker(wid=wid, host=host, gpus=gpus, state="running" if end is None else "exited",
                                            log_path="l", exit_path="e", started_at=start, ended_at=end))
                s.add(j)
    finally:
        svc.close()

    def run(*args: str) -> str:
        r = CliRunner().invoke(app, ["--config", str(cfg), "report", "--since", "4h", *args], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        return r.stdout

    data = json.loads(run("--by", "user", "--json"))
    want = [{"user": "bob", "gpu_hours": pytest.approx(3.0, abs=0.01), "harvested_gpu_hours": 0.0,
             "slot_hours": pytest.approx(2.0, abs=0.01)},
            {"user": "alice", "gpu_hours": pytest.approx(2.5, abs=0.01),
             "harvested_gpu_hours": pytest.approx(2.0, abs=0.01), "slot_hours": 0.0}]
    assert data["by_user"] == want
    assert json.loads(run("--json"))["by_user"] == want          # in every --json report
    csv = run("--by", "user", "--csv").splitlines()
    assert csv[0] == "user,gpu_hours,harvested_gpu_hours,slot_hours"
    assert [line.split(",")[0] for line in csv[1:]] == ["bob", "alice"]
    assert csv[2].startswith("alice,2.5") and csv[2].endswith(",2.0,0.0")
    text = run("--by", "user")
    assert "GPU-hours and slot-hours by user" in text and "carol" not in text
    cells = [line.replace("\u2502", " ").split() for line in text.splitlines()]
    assert [c for c in cells if c[:1] in (["alice"], ["bob"])] == [["bob", "3.00", "0.00", "2.00"],
                                                                   ["alice", "2.50", "2.00", "0.00"]]
    bad = CliRunner().invoke(app, ["--config", str(cfg), "report", "--by", "group"])
    assert bad.exit_code == 2 and "--by 'group': expected host or user" in bad.output


def test_report_by_user_counts_slot_hours_on_a_pool_of_cpu_slots(home):
    """Quotas and fair share count a CPU-slot pool's slots; so does `report --by user`: a
    finished job's workers, each slot held from its start to its end."""
    from tests.conftest import db_rows, py

    cfg = write_config(home)   # one local host of 4 CPU slots, no GPU
    cli = GpuflexCLI(home, cfg)
    try:
        job = cli.submit(py("import time; time.sleep(1)"), "--workers", "2")
        assert cli.wait_final(job["id"])["state"] == "succeeded"
    finally:
        cleanup_jobs(cli, home / "g.db")
    held = db_rows(home / "g.db", "SELECT started_at, ended_at, gpus FROM workers WHERE job_id = ?", (job["id"],))
    slot_hours = sum((end - start) * len(json.loads(gpus)) for start, end, gpus in held) / 3600
    assert len(held) == 2 and slot_hours > 0
    rows = cli.json("report", "--by", "user")["by_user"]
    assert rows == [{"user": access.caller(), "gpu_hours": 0.0, "harvested_gpu_hours": 0.0,
                     "slot_hours": pytest.approx(slot_hours, abs=1e-4)}]
    text = cli.ok("report", "--by", "user").stdout
    assert "slot-hours by user" in text and "GPU-hours" not in text and access.caller() in text
    assert "SLOT-HOURS" in text and "HARVESTED" not in text


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_fair_share_and_report_queries_agree_on_both_backends(backend, tmp_path, request):
    from gpuflex.control import report
    from gpuflex.db import queries
    from gpuflex.db.engine import open_database
    from gpuflex.states import JobState

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path}/g.db"
    sessions = open_database(url)
    now = time.time()
    with sessions.begin() as s:
        for i, (user, state, workers) in enumerate([
                ("alice", "running", [("h", [0, 1], now - 3600, None, "running"),
                                      ("h", [2], now - 7200, now - 3600, "exited")]),
                ("bob", "succeeded", [("h", [3], now - 5400, now - 1800, "exited")]),
                ("bob", "queued", [])]):
            j = Job(token=f"q{i}", name=user, state=state, argv=["x"], workdir="/", env={}, min_workers=1,
                    max_workers=4, gpus_per_worker=len(workers[0][1]) if workers else 1, user=user)
            for wid, (host, gpus, start, end, wstate) in enumerate(workers):
                j.workers.append(Worker(wid=wid, host=host, gpus=gpus, state=wstate, log_path="l", exit_path="e",
                                        started_at=start, ended_at=end))
            s.add(j)
        s.flush()
        queued = queries.queued_jobs(s)[0]
        s.add(Event(job=queued, kind="launch-failed", message="m", time=now - 100, last_time=now - 5))
    with sessions() as s:
        assert queries.held_by_user(s) == {"alice": 2}
        assert queries.job_counts(s) == {(JobState.RUNNING, "alice"): 1, (JobState.SUCCEEDED, "bob"): 1,
                                         (JobState.QUEUED, "bob"): 1}
        assert queries.with_event_since(s, [queued.id], "launch-failed", now - 30) == {queued.id}
        assert queries.with_event_since(s, [queued.id], "launch-failed", now) == set()
        assert sorted((u, e is None, n) for u, _, e, n in queries.usage_since(s, now - 2000)) == \
            [("alice", True, 2), ("bob", False, 1)]   # alice's worker ended an hour ago is left out
        by_user = report.by_user(s, now - 4 * 3600, now, {"h"}, set())
        assert [(r["user"], round(r["gpu_hours"], 2), round(r["harvested_gpu_hours"], 2)) for r in by_user] == \
            [("alice", 3.0, 3.0), ("bob", 1.0, 1.0)]
    sessions.kw["bind"].dispose()
