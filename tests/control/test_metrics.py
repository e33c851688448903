"""`gpuflex metrics`: the Prometheus text format, read back with prometheus_client's own
parser, against a database seeded here (hosts, GPUs with verdicts, workers holding them,
jobs of several users and states, generation, restart and reclaim events)."""

from __future__ import annotations

import math
import os
import secrets
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuflex.config import load_config
from gpuflex.control import metrics
from gpuflex.db.engine import open_database
from gpuflex.db.models import Event, Gpu, Host, Job, Worker
from gpuflex.states import JobState, WorkerState
from tests import REPO as ROOT
from tests.conftest import db_dump, gpuflex_script, write_config
from tests.cli.test_cli import make_cli

HOSTS = '''
[[hosts]]
name = "gpu1"
address = "local"
gpus = [0, 1, 2, 3]
owner = "bob"

[[hosts]]
name = "gpu2"
address = "local"
gpus = [0, 1]
'''


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, every sample of the exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: dict, metric: str, **labels: str) -> float | None:
    return got.get((metric, frozenset(labels.items())))


@pytest.fixture
def seeded(home):
    """The config (two GPU hosts and the CPU-slot host "local") and a database holding:
    job a (alice, running on gpu1:0, scaled), b (bob, running on 2 slots, restarted),
    c (alice, succeeded), d (alice, failed), e (carol, queued); gpu2 failed its probe."""
    cfg = load_config(str(write_config(home, extra=HOSTS)))
    sessions = open_database(cfg.database_url)
    with sessions.begin() as s:
        gpu1 = Host(name="gpu1", address="local", owner="bob", reachable=True, last_probe_at=1000.0)
        gpu1.gpus = [Gpu(index=i, kind="gpu", verdict=v, idle_streak=0)
                     for i, v in enumerate(["idle", "owner", "idle", "busy"])]
        gpu2 = Host(name="gpu2", address="local", reachable=False, last_error="connection refused",
                    last_probe_at=1001.0)
        gpu2.gpus = [Gpu(index=i, kind="gpu", verdict="unknown", idle_streak=0) for i in range(2)]
        local = Host(name="local", address="local")
        local.gpus = [Gpu(index=i, kind="slot") for i in range(4)]
        s.add_all([gpu1, gpu2, local])

        def job(name, user, state, world=0, restarts=0):
            j = Job(token=secrets.token_hex(6), name=name, state=state, argv=["x"], workdir="/", env={},
                    min_workers=1, max_workers=4, gpus_per_worker=1, user=user, world_size=world,
                    restarts=restarts)
            s.add(j)
            return j

        def worker(j, wid, host, devices):
            j.workers.append(Worker(wid=wid, rank=wid, host=host, gpus=devices, state=WorkerState.RUNNING,
                                    log_path="/l", exit_path="/e"))

        a = job("a", "alice", JobState.RUNNING, world=1)
        worker(a, 0, "gpu1", [0])
        b = job("b", "bob", JobState.SCALING, world=2, restarts=1)
        b.progress = {"step": 7, "at": 900.0}   # as bob's last command read it: no live report here
        worker(b, 0, "local", [0])
        worker(b, 1, "local", [1])
        job("c", "alice", JobState.SUCCEEDED)
        job("d", "alice", JobState.FAILED)
        job("e", "carol", JobState.QUEUED)
        s.flush()

        def event(j, kind, **data):
            s.add(Event(job=j, time=500.0, kind=kind, message=kind, data=data, count=1))

        event(a, "formed", timings={"total": 1.5, "verify": 0.02})
        event(a, "scale", timings={"detect": 0.01, "copy": 0.2, "total": 0.5})
        event(a, "scale", timings={"detect": 0.03, "copy": 0.4, "total": 2.0, "bogus": "x"})
        event(b, "restart", down_s=3.0, old_size=2, new_size=3)
        event(a, "reclaim", method="shrink", latency_s=2.0, within_deadline=True)
        event(b, "reclaim", method="requeue", latency_s=40.0, within_deadline=False)
        event(a, "reclaim", method="shrink", latency_s=None, within_deadline=False)
        ids = {j.name: j.id for j in (a, b)}
    return cfg, sessions, ids


def test_the_exposition_matches_the_database(seeded):
    cfg, sessions, ids = seeded
    progress = {ids["a"]: {"samples_per_s": 123.5, "step": 40}}
    text = metrics.exposition(sessions, cfg, progress, now=10_000.0)
    got = samples(text)
    assert "# HELP gpuflex_jobs " in text and "# TYPE gpuflex_reclaim_latency_seconds histogram" in text

    jobs = {dict(k)["state"] + "/" + dict(k)["user"]: v for (n, k), v in got.items() if n == "gpuflex_jobs"}
    assert jobs == {"running/alice": 1, "scaling/bob": 1, "succeeded/alice": 1, "failed/alice": 1,
                    "queued/carol": 1}

    a = {"job_id": str(ids["a"]), "name": "a", "user": "alice"}
    b = {"job_id": str(ids["b"]), "name": "b", "user": "bob"}
    assert value(got, "gpuflex_job_world_size", **a) == 1 and value(got, "gpuflex_job_world_size", **b) == 2
    assert value(got, "gpuflex_job_samples_per_second", **a) == 123.5
    assert value(got, "gpuflex_job_step", **a) == 40
    assert value(got, "gpuflex_job_samples_per_second", **b) is None   # no report: no sample
    assert value(got, "gpuflex_job_step", **b) == 7                     # the step bob's command last read
    assert value(got, "gpuflex_job_restarts_total", **b) == 1
    assert not any(dict(k).get("name") in ("c", "d", "e") for _, k in got)   # only running jobs per job

    gpus = {tuple(dict(k)[x] for x in ("host", "verdict", "holder")): v
            for (n, k), v in got.items() if n == "gpuflex_gpus"}
    assert gpus == {("gpu1", "idle", "job"): 1, ("gpu1", "owner", "owner"): 1, ("gpu1", "idle", "free"): 1,
                    ("gpu1", "busy", "owner"): 1, ("gpu2", "unknown", "unknown"): 2}
    assert value(got, "gpuflex_cpu_slots", host="local", holder="job") == 2
    assert value(got, "gpuflex_cpu_slots", host="local", holder="free") == 2
    assert value(got, "gpuflex_host_probe_error", host="gpu2") == 1
    assert value(got, "gpuflex_host_probe_error", host="gpu1") == 0
    assert value(got, "gpuflex_host_probe_error", host="local") is None   # never probed
    assert value(got, "gpuflex_host_last_probe_timestamp_seconds", host="gpu2") == 1001.0

    ph = "gpuflex_scale_phase_seconds"
    assert value(got, ph + "_count", kind="scale", phase="copy") == 2
    assert math.isclose(value(got, ph + "_sum", kind="scale", phase="copy"), 0.6)
    assert value(got, ph + "_bucket", kind="scale", phase="copy", le="0.25") == 1
    assert value(got, ph + "_bucket", kind="scale", phase="copy", le="+Inf") == 2
    assert value(got, ph + "_count", kind="formed", phase="total") == 1
    assert value(got, ph + "_sum", kind="restart", phase="down") == 3.0
    assert value(got, ph + "_count", kind="scale", phase="bogus") is None   # not a duration

    rl = "gpuflex_reclaim_latency_seconds"
    assert value(got, rl + "_count", method="shrink") == 1 and value(got, rl + "_sum", method="shrink") == 2.0
    assert value(got, rl + "_bucket", method="requeue", le="30.0") == 0
    assert value(got, rl + "_bucket", method="requeue", le="60.0") == 1
    assert value(got, "gpuflex_reclaims_total", method="shrink", outcome="within_deadline") == 1
    assert value(got, "gpuflex_reclaims_total", method="shrink", outcome="failed") == 1
    assert value(got, "gpuflex_reclaims_total", method="requeue", outcome="late") == 1
    for (name, _labels) in got:
        assert name.startswith("gpuflex_")


def test_the_command_prints_the_format_and_changes_nothing_without_refresh(home, seeded):
    cfg, _sessions, _ids = seeded
    before = db_dump(home / "g.db")
    r = make_cli("clirunner", home, home / "g.toml")("metrics", "--no-refresh")
    assert r.code == 0, r.stderr
    got = samples(r.stdout)
    assert value(got, "gpuflex_jobs", state="queued", user="carol") == 1
    assert value(got, "gpuflex_gpus", host="gpu1", verdict="busy", holder="owner") == 1
    assert db_dump(home / "g.db") == before


def test_the_command_refreshes_first_like_status(home, config_path):
    cli = make_cli("clirunner", home, config_path)
    r = cli("metrics")
    assert r.code == 0, r.stderr
    got = samples(r.stdout)
    # the refresh mirrored the configured pool into the database: its 4 slots are listed
    assert value(got, "gpuflex_cpu_slots", host="local", holder="free") == 4
    assert not any(n == "gpuflex_jobs" for n, _ in got)


def test_the_cron_example_writes_a_whole_file_by_rename(home, config_path):
    """The crontab line of examples/cron/gpuflex-metrics.crontab, its paths pointed at this
    test's, run by /bin/sh as cron would: gpuflex.prom parses, no temporary file is left."""
    line = next(x for x in (ROOT / "examples/cron/gpuflex-metrics.crontab").read_text().splitlines()
                if x.startswith("* * * * * "))
    collector = home / "textfile_collector"
    collector.mkdir()
    (home / ".local/state/gpuflex").mkdir(parents=True)
    command = (line.removeprefix("* * * * * ")
               .replace("$HOME/.venvs/gpuflex/bin/gpuflex", gpuflex_script())
               .replace("$HOME/.config/gpuflex/gpuflex.toml", str(config_path))
               .replace("/var/lib/node_exporter/textfile_collector", str(collector)))
    p = subprocess.run(["/bin/sh", "-c", command], env={**os.environ, "HOME": str(home)}, cwd=home,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr + (home / ".local/state/gpuflex/metrics.log").read_text()
    assert [f.name for f in collector.iterdir()] == ["gpuflex.prom"]
    got = samples((collector / "gpuflex.prom").read_text())
    assert value(got, "gpuflex_cpu_slots", host="local", holder="free") == 4


def test_without_prometheus_client_the_command_says_what_to_install(home, config_path):
    """A GPU host's --no-deps install has no prometheus_client: one error line, exit 2."""
    code = ("import sys; sys.modules['prometheus_client'] = None; from gpuflex.cli import main; "
            "sys.argv = ['gpuflex', 'metrics']; main()")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HOME": str(home),
                       "GPUFLEX_CONFIG": str(config_path)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == ["error: gpuflex metrics needs the prometheus_client package, which is not "
                                     "installed; pip install prometheus_client (a dependency of gpuflex on the "
                                     "control host)."]


@pytest.fixture
def timed(home):
    """Jobs with known times on gpu1 (owner bob: harvested) and the slot host "local":
    a (alice) waited 100 s, held 2 GPUs for an hour and succeeded; b (bob) waited 10 s,
    held a slot for an hour and failed; c (alice) is queued; d (carol) waited 1000 s and
    holds a GPU since 9000. a was scaled once (0.5 s stall) and had a fault without timings."""
    cfg = load_config(str(write_config(home, extra=HOSTS)))
    sessions = open_database(cfg.database_url)
    with sessions.begin() as s:
        gpu1 = Host(name="gpu1", address="local", owner="bob")
        gpu1.gpus = [Gpu(index=i, kind="gpu", idle_streak=0) for i in range(4)]
        local = Host(name="local", address="local")
        local.gpus = [Gpu(index=i, kind="slot") for i in range(4)]
        s.add_all([gpu1, local])

        def job(name, user, state, created, ended=None, spans=()):
            j = Job(token=secrets.token_hex(6), name=name, state=state, argv=["x"], workdir="/", env={},
                    min_workers=1, max_workers=4, gpus_per_worker=1, user=user, created_at=created,
                    ended_at=ended)
            for wid, (host, devices, start, end) in enumerate(spans):
                j.workers.append(Worker(wid=wid, rank=wid, host=host, gpus=devices, started_at=start, ended_at=end,
                                        state=WorkerState.EXITED if end else WorkerState.RUNNING,
                                        log_path="/l", exit_path="/e"))
            s.add(j)
            return j

        a = job("a", "alice", JobState.SUCCEEDED, 1000.0, 4700.0, [("gpu1", [0, 1], 1100.0, 4700.0)])
        job("b", "bob", JobState.FAILED, 2000.0, 5610.0, [("local", [0], 2010.0, 5610.0)])
        job("c", "alice", JobState.QUEUED, 3000.0)
        job("d", "carol", JobState.RUNNING, 8000.0, None, [("gpu1", [2], 9000.0, None)])
        s.flush()
        s.add(Event(job=a, time=2000.0, kind="scale", message="scale", data={"timings": {"total": 0.5}}, count=1))
        s.add(Event(job=a, time=2100.0, kind="fault", message="fault", data={"ok": False}, count=1))
    return cfg, sessions


def test_every_state_waits_run_times_device_hours_and_scale_events(timed):
    cfg, sessions = timed
    got = samples(metrics.exposition(sessions, cfg, {}, now=12_600.0))

    states = {dict(k)["state"]: v for (n, k), v in got.items() if n == "gpuflex_jobs_in_state"}
    assert states == {"queued": 1, "running": 1, "scaling": 0, "succeeded": 1, "failed": 1, "cancelled": 0,
                      "timeout": 0}

    qw = "gpuflex_job_queue_wait_seconds"
    assert value(got, qw + "_sum", user="alice") == 100 and value(got, qw + "_count", user="alice") == 1
    assert value(got, qw + "_sum", user="bob") == 10 and value(got, qw + "_bucket", user="bob", le="15.0") == 1
    assert value(got, qw + "_bucket", user="bob", le="5.0") == 0
    assert value(got, qw + "_sum", user="carol") == 1000   # running: it waited, it has no run time yet
    rt = "gpuflex_job_run_seconds"
    assert value(got, rt + "_sum", user="alice", state="succeeded") == 3600
    assert value(got, rt + "_sum", user="bob", state="failed") == 3600
    assert not any(n.startswith(rt) and dict(k).get("user") == "carol" for n, k in got)

    dh, h = "gpuflex_device_seconds_total", 3600
    assert value(got, dh, user="alice", device="gpu") == 2 * h and value(got, dh, user="alice", device="cpu-slot") == 0
    assert value(got, dh, user="bob", device="gpu") == 0 and value(got, dh, user="bob", device="cpu-slot") == h
    assert value(got, dh, user="carol", device="gpu") == h
    hv = "gpuflex_harvested_gpu_seconds_total"
    assert (value(got, hv, user="alice"), value(got, hv, user="bob"), value(got, hv, user="carol")) == (2 * h, 0, h)

    events = {dict(k)["kind"]: v for (n, k), v in got.items() if n == "gpuflex_scale_events_total"}
    assert events == {"formed": 0, "scale": 1, "fault": 1, "rollback": 0, "restart": 0}
    st = "gpuflex_scale_stall_seconds"
    assert value(got, st + "_sum", kind="scale") == 0.5 and value(got, st + "_count", kind="fault") == 0
    assert value(got, st + "_count", kind="restart") == 0   # present, 0: a rate over it is defined

    later = samples(metrics.exposition(sessions, cfg, {}, now=16_200.0))   # carol's GPU an hour more
    assert value(later, dh, user="carol", device="gpu") == 2 * h and value(later, hv, user="carol") == 2 * h
    for key, v in got.items():   # counters and histograms never go down
        if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
            assert later[key] >= v, key


def test_an_empty_database_has_every_state_at_zero_and_no_user_series(home):
    cfg = load_config(str(write_config(home)))
    got = samples(metrics.exposition(open_database(cfg.database_url), cfg, {}, now=1.0))
    assert {dict(k)["state"] for (n, k) in got if n == "gpuflex_jobs_in_state"} == {s.value for s in JobState}
    assert not any(v for (n, _k), v in got.items() if n == "gpuflex_jobs_in_state")
    assert not any(n.startswith(("gpuflex_device_seconds", "gpuflex_job_queue_wait")) for n, _k in got)
