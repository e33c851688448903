"""Harvesting end to end on real sshd hosts with the fake nvidia-smi and the real elastic
example: idle after idle_samples ticks, growth onto idle GPUs (never a zombie one), our own
worker is not foreign, the owner's return shrinks the job within the deadline, below MIN
the job is requeued, and a host that goes down does not stop the tick for the others.

Few and lean on purpose: every elastic worker imports torch (2-3 s on a small machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from tests import REPO
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows
from tests.sshbed import default_gpus, host_toml, ssh_bed, ssh_hosts, start_bed  # noqa: F401 (fixtures)

EXAMPLE = str(REPO / "examples" / "elastic_mlp.py")
DEADLINE_S = 20
SETTINGS = (f"[harvest]\ninterval_s = 5\nidle_samples = 2\nreclaim_deadline_s = {DEADLINE_S}\n\n"
            "[jobs]\ncheckpoint_interval_s = 1\nheartbeat_timeout_s = 3\ncancel_grace_s = 10\n\n")


def gpu(host, index: int, util: float = 0, mem: float = 0) -> dict:
    return {**default_gpus(host.name)[index], "utilization": util, "memory_used": mem}


def proc(host, index: int, pid: int, mem: float = 4000) -> dict:
    return {"gpu_uuid": default_gpus(host.name)[index]["uuid"], "pid": pid, "used_memory": mem}


class Cli:
    """The CLI in-process (no interpreter start per call) with this test's config."""

    def __init__(self, config: Path) -> None:
        self.config = config

    def __call__(self, *args: str):
        r = CliRunner().invoke(app, ["--config", str(self.config), *args], env={"COLUMNS": "200"})
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception
        return r

    def json(self, *args: str):
        cut = args.index("--") if "--" in args else len(args)
        r = self(*args[:cut], "--json", *args[cut:])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    def tick(self) -> dict:
        return self.json("harvest")


@pytest.fixture
def hv(ssh_bed, home):
    """gpu01 (owner alice, GPUs 0 and 1) and gpu02 (no owner, GPU 0) with a fresh DB."""
    cfg = home / "gpuflex.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home / "g.db"}"\n\n' + SETTINGS
                   + host_toml(ssh_bed.host("gpu01"), ssh_bed, owner="alice")
                   + host_toml(ssh_bed.host("gpu02"), ssh_bed, gpus=[0]))
    yield Cli(cfg)
    cleanup_jobs(GpuflexCLI(home, cfg), home / "g.db")


def wait_job(cli: Cli, job_id: int, pred, what: str, deadline_s: float = 180) -> dict:
    end = time.monotonic() + deadline_s
    while True:
        job = cli.json("status", str(job_id))
        if pred(job):
            return job
        if job["state"] in ("succeeded", "failed", "cancelled") or time.monotonic() > end:
            pytest.fail(f"job {job_id}: gave up waiting for {what}: {json.dumps(job)[:3000]}")
        time.sleep(0.5)


def live(job: dict) -> list[dict]:
    return [w for w in job["workers"] if w["state"] in ("starting", "running", "leaving")]


def verdicts(home: Path, host: str) -> list[tuple]:
    return db_rows(home / "g.db", "SELECT gpus.\"index\", verdict, idle_streak FROM gpus JOIN hosts "
                                  "ON hosts.id = gpus.host_id WHERE hosts.name = ? ORDER BY 1", (host,))


def test_grow_onto_idle_gpus_then_give_them_back(hv, ssh_bed, home):
    g1, g2 = ssh_bed.host("gpu01"), ssh_bed.host("gpu02")
    # gpu01:0 holds zombie memory (no process listed); gpu01:1 is in use by its owner
    g1.set_smi(gpus=[gpu(g1, 0, mem=30000), gpu(g1, 1, util=90, mem=100)])
    job = hv.json("submit", "--name", "hv", "--harvest", "--workers", "1:3", "--", sys.executable, EXAMPLE,
                  "--hidden", "16", "--epochs", "500", "--step-sleep", "0.05")
    assert job["state"] == "running" and [w["host"] for w in job["workers"]] == ["gpu02"]

    g1.set_smi(gpus=[gpu(g1, 0, mem=30000), gpu(g1, 1)])  # the owner leaves
    first = hv.tick()
    assert [a for a in first["plan"] if a["action"] == "grow"] == [] and first["actions"] == []
    assert verdicts(home, "gpu01") == [(0, "zombie", 0), (1, "owner", 1)]
    second = hv.tick()                                     # idle_samples = 2 quiet probes
    assert verdicts(home, "gpu01") == [(0, "zombie", 0), (1, "idle", 2)]
    assert [(a["action"], a["ok"], a["gpus"]) for a in second["actions"]] == [("grow", True, [["gpu01", 1]])]
    grown = wait_job(hv, job["id"], lambda j: j["state"] == "running" and j["world_size"] == 2,
                     "the newcomer on gpu01:1 to join")
    newcomer = next(w for w in live(grown) if w["host"] == "gpu01")
    assert newcomer["gpus"] == [1]

    # our own worker busy on the GPU is not its owner: nothing is yielded, and the zombie
    # GPU is still not grown onto although the job is below MAX
    g1.set_smi(gpus=[gpu(g1, 0, mem=30000), gpu(g1, 1, util=95, mem=4000)],
               processes=[proc(g1, 1, newcomer["pid"])])
    third = hv.tick()
    assert third["plan"] == [] and third["actions"] == [], third
    assert verdicts(home, "gpu01")[1][1] == "idle"
    view = {h["name"]: h for h in hv.json("hosts")}["gpu01"]["devices"]
    assert view[0]["verdict"] == "zombie" and "zombie memory (30000 MiB used, no process listed)" == view[0]["holder"]

    owner = subprocess.Popen(["sleep", "300"])            # a real pid: `ps` gives its user
    try:
        g1.set_smi(gpus=[gpu(g1, 0, mem=30000), gpu(g1, 1, util=99, mem=12000)],
                   processes=[proc(g1, 1, newcomer["pid"]), proc(g1, 1, owner.pid, 8000)])
        fourth = hv.tick()
        (reclaim,) = [a for a in fourth["actions"] if a["action"] == "reclaim"]
        assert (reclaim["host"], reclaim["gpu"], reclaim["ok"]) == ("gpu01", 1, True), fourth
        assert reclaim["method"] in ("shrink", "sigkill") and reclaim["latency_s"] <= DEADLINE_S
        after = hv.json("status", str(job["id"]))
        assert [w["host"] for w in live(after)] == ["gpu02"]   # gpu01:1 holds no worker of ours
        events = [e for e in hv.json("events", str(job["id"])) if e["kind"] == "reclaim"]
        assert len(events) == 1 and events[0]["data"]["latency_s"] <= events[0]["data"]["deadline_s"] == DEADLINE_S
        assert {"host", "gpu", "latency_s", "deadline_s", "method"} <= set(events[0]["data"])

        # the owner of gpu02 (no owner configured: anybody) shows up on the last worker's
        # GPU: below MIN, so the job is checkpointed and requeued
        wait_job(hv, job["id"], lambda j: j["state"] == "running" and j["world_size"] == 1, "the shrink")
        g2.set_smi(gpus=[gpu(g2, 0, util=80, mem=9000)], processes=[proc(g2, 0, owner.pid, 9000)])
        fifth = hv.tick()
        kinds = [(a["action"], a.get("method")) for a in fifth["actions"]]
        assert ("reclaim", "requeue") in kinds or ("reclaim", "sigkill") in kinds, fifth
        assert ("requeue", None) in kinds
        queued = hv.json("status", str(job["id"]))
        assert queued["state"] == "queued" and queued["restarts"] == 1 and live(queued) == []
        ok = [e["data"] for e in hv.json("events", str(job["id"])) if e["kind"] == "reclaim"]
        assert all(d["latency_s"] <= d["deadline_s"] for d in ok) and len(ok) == 2

        report = hv.json("report", "--since", "1h")
        assert [r["host"] for r in report["by_host"]] == ["gpu01"] and report["gpu_hours"] > 0
        assert report["reclaims"]["count"] == 2 and report["reclaims"]["max_s"] <= DEADLINE_S
    finally:
        owner.kill()
        owner.wait()


def test_a_reclaim_with_every_core_busy_frees_the_gpu_by_its_deadline(hv, ssh_bed, home):
    """The control host saturated (a `while True: pass` per core) while a tick reclaims a
    grown worker: the reclaim's clock starts with the tick, and the worker is gone (by
    /proc, beyond what the fake nvidia-smi is told) within the deadline by that clock."""
    g1 = ssh_bed.host("gpu01")
    g1.set_smi(gpus=[gpu(g1, 0, mem=30000), gpu(g1, 1, util=90, mem=100)])   # zombie; its owner's
    job = hv.json("submit", "--name", "hv", "--harvest", "--workers", "1:2", "--", sys.executable, EXAMPLE,
                  "--hidden", "16", "--epochs", "500", "--step-sleep", "0.05")
    g1.set_smi(gpus=[gpu(g1, 0, mem=30000), gpu(g1, 1)])                      # the owner leaves
    hv.tick()
    grown = hv.tick()
    assert [(a["action"], a["ok"]) for a in grown["actions"]] == [("grow", True)], grown
    joined = wait_job(hv, job["id"], lambda j: j["state"] == "running" and j["world_size"] == 2,
                      "the newcomer on gpu01:1 to join")
    newcomer = next(w for w in live(joined) if w["host"] == "gpu01")
    busy: list[subprocess.Popen] = []
    owner = subprocess.Popen(["sleep", "300"])
    try:
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
        g1.set_smi(gpus=[gpu(g1, 0, mem=30000), gpu(g1, 1, util=99, mem=12000)],
                   processes=[proc(g1, 1, newcomer["pid"]), proc(g1, 1, owner.pid, 8000)])
        out = hv.tick()
        (reclaim,) = [a for a in out["actions"] if a["action"] == "reclaim"]
        assert reclaim["ok"] and reclaim["clock_from"] == out["time"], out
        assert reclaim["latency_s"] <= reclaim["deadline_s"] == DEADLINE_S
        assert not Path(f"/proc/{newcomer['pid']}/status").exists() or \
            "State:\tZ" in Path(f"/proc/{newcomer['pid']}/status").read_text()
        (event,) = [e for e in hv.json("events", str(job["id"])) if e["kind"] == "reclaim"]
        assert event["data"]["clock_from"] == out["time"] and event["data"]["latency_s"] == reclaim["latency_s"]
        assert event["time"] >= out["time"] + reclaim["latency_s"]
    finally:
        for p in busy:
            p.kill()
            p.wait()
        owner.kill()
        owner.wait()


def test_a_host_down_during_a_tick_does_not_stop_the_others(hv, ssh_bed, home, tmp_path):
    extra = start_bed(tmp_path / "extra", n=1, first_octet=6, names=["gpu09"])
    try:
        hv.config.write_text(hv.config.read_text() + host_toml(extra.hosts[0], extra, owner="bob"))
        assert hv.tick()["hosts"] == [{"host": "gpu01", "ok": True, "error": None},
                                      {"host": "gpu02", "ok": True, "error": None},
                                      {"host": "gpu09", "ok": True, "error": None}]
        extra.stop()
        r = hv("harvest", "--json")
        assert r.exit_code == 0, r.output
        hosts = {h["host"]: h for h in json.loads(r.stdout)["hosts"]}
        assert hosts["gpu01"]["ok"] and hosts["gpu02"]["ok"]
        assert not hosts["gpu09"]["ok"] and hosts["gpu09"]["error"].startswith("gpu09: ")
        assert verdicts(home, "gpu01") == [(0, "idle", 2), (1, "idle", 2)]   # went on for the others
        assert [v for _, v, _ in verdicts(home, "gpu09")] == ["unknown", "unknown"]
        text = hv("harvest")
        assert text.exit_code == 0 and "1 failed" in text.output and "gpu09: " in text.output
    finally:
        extra.stop()
