"""GPU probe: nvidia-smi CSV parsing, verdicts, recorded history, and `gpuflex hosts` end to end
over real sshd hosts with the fake nvidia-smi."""

from __future__ import annotations

import json
import time
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.config import HarvestSettings, HostConfig, load_config
from gpuflex.control.probes import record_failure, record_probe
from gpuflex.db.engine import open_database
from gpuflex.db.models import Gpu, GpuSample as SampleRow, Host
from gpuflex.hosts.probe import (APP_QUERY, GPU_QUERY, ComputeApp, GpuSample, HostProbe, ProbeError, parse_apps, parse_gpus,
                                 parse_number, probe_host)
from gpuflex.hosts.transport import LocalTransport
from gpuflex.policy.gpus import verdict
from tests import TESTS
from tests.sshbed import FAKE_SMI, host_toml, ssh_bed, ssh_hosts, write_config  # noqa: F401 (fixtures)

SAMPLES = TESTS / "fakes" / "samples"
HARVEST = HarvestSettings(idle_util_pct=5, idle_memory_mib=512, idle_samples=3)


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


# ---- parsing recorded output ---------------------------------------------------------------
def test_parse_a_busy_four_gpu_host():
    gpus = parse_gpus(sample("a100x4.gpus.csv"))
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[0] == GpuSample(0, "GPU-2bd7d6a4-5c1e-8f4b-3b9e-7d1a0e6c4f21", "NVIDIA A100-SXM4-40GB",
                                100.0, 38012.0, 40960.0)
    assert parse_apps(sample("a100x4.apps.csv")) == [
        ComputeApp("GPU-2bd7d6a4-5c1e-8f4b-3b9e-7d1a0e6c4f21", 183422, 37998.0),
        ComputeApp("GPU-c41e9b3a-77d2-4e0c-a5f8-1b6d2e9c0f37", 190117, 1196.0)]


def test_parse_what_a_real_h200_printed_idle_and_with_a_process_holding_memory():
    """Captured by benchmarks/gpu_check.py on an H200 (driver 580.159.04, CUDA 13.0),
    2026-11-26: the probe's own two queries, before and while a foreign process held 2 GiB."""
    uuid = "GPU-4e47cace-df36-266d-ae06-a037853c4328"
    assert parse_gpus(sample("h200-idle.gpus.csv")) == [GpuSample(0, uuid, "NVIDIA H200", 0.0, 0.0, 143771.0)]
    assert parse_gpus(sample("h200-busy.gpus.csv")) == [GpuSample(0, uuid, "NVIDIA H200", 0.0, 2667.0, 143771.0)]
    assert parse_apps(sample("h200-busy.apps.csv")) == [ComputeApp(uuid, 583, 2658.0)]
    # the same queries with units and a header line: the header is skipped, units dropped
    assert parse_gpus(sample("h200-busy-units.gpus.csv")) == [GpuSample(0, uuid, "NVIDIA H200", 4.0, 2667.0, 143771.0)]
    assert parse_apps(sample("h200-busy-units.apps.csv")) == [ComputeApp(uuid, 583, 2658.0)]


def test_the_fake_heads_its_columns_as_the_real_h200_did(tmp_path):
    uuid = "GPU-4e47cace-df36-266d-ae06-a037853c4328"
    state = {"gpus": [{"index": 0, "uuid": uuid, "name": "NVIDIA H200", "utilization": 4, "memory_used": 2667,
                       "memory_total": 143771}],
             "processes": [{"gpu_uuid": uuid, "pid": 583, "used_memory": 2658}]}
    for query, name in ((f"--query-gpu={GPU_QUERY}", "h200-busy-units.gpus.csv"),
                        (f"--query-compute-apps={APP_QUERY}", "h200-busy-units.apps.csv")):
        p = run_fake(state, tmp_path, query, "--format=csv")
        assert p.returncode == 0 and p.stdout == sample(name), (p.stdout, sample(name))
    p = run_fake(state, tmp_path, "-L")
    assert p.stdout == sample("h200.list.txt")


@pytest.mark.parametrize("name,util,used,total", [
    ("h100-mig.gpus.csv", None, 11.0, 81559.0),      # MIG: utilization [N/A]
    ("gb10.gpus.csv", 0.0, None, None),              # unified memory: [N/A] memory
    ("v100-units.gpus.csv", 35.0, 1024.0, 16160.0),  # without nounits
    ("not-supported.gpus.csv", None, 172.0, 2000.0),  # [Not Supported]
])
def test_placeholders_become_none_never_zero(name, util, used, total):
    g = parse_gpus(sample(name))[0]
    assert (g.utilization_pct, g.memory_used_mib, g.memory_total_mib) == (util, used, total)


def test_no_gpus_and_no_processes():
    assert parse_gpus(sample("no-devices.txt")) == []
    assert parse_gpus("") == [] and parse_gpus("\n\n") == []
    assert parse_apps(sample("idle.apps.csv")) == []
    assert parse_apps(sample("h100-mig.apps.csv"))[0].used_memory_mib is None


def test_lines_that_are_not_rows_are_skipped():
    text = "WARNING: infoROM is corrupted at gpu 0000:81:00.0\n" + sample("a100x4.gpus.csv")
    assert len(parse_gpus(text)) == 4
    assert [parse_number(t) for t in ("7", " 7.5 ", "12 MiB", "[N/A]", "N/A", "", "[Unknown Error]", "x")] \
        == [7.0, 7.5, 12.0, None, None, None, None, None]


# ---- the fake answers like the real tool --------------------------------------------------
def run_fake(state: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    return subprocess.run([sys.executable, str(FAKE_SMI), "--state", str(path), *args],
                          capture_output=True, text=True)


def test_fake_nvidia_smi_speaks_the_real_csv(tmp_path):
    state = {"gpus": [{"index": 0, "uuid": "GPU-x", "name": "NVIDIA H100 80GB HBM3", "utilization": None,
                       "memory_used": 1024, "memory_total": 81559}],
             "processes": [{"gpu_uuid": "GPU-x", "pid": 42, "used_memory": 1000}]}
    r = run_fake(state, tmp_path, "--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total",
                 "--format=csv,noheader,nounits")
    assert r.stdout == "0, GPU-x, NVIDIA H100 80GB HBM3, [N/A], 1024, 81559\n"
    r = run_fake(state, tmp_path, "--query-gpu=memory.used,memory.free", "--format=csv")
    assert r.stdout == "memory.used [MiB], memory.free [MiB]\n1024 MiB, 80535 MiB\n"
    r = run_fake(state, tmp_path, "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits")
    assert parse_apps(r.stdout) == [ComputeApp("GPU-x", 42, 1000.0)]
    assert run_fake(state, tmp_path, "-L").stdout == "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)\n"
    r = run_fake({"no_devices": True}, tmp_path, "--query-gpu=index", "--format=csv")
    assert (r.returncode, r.stdout) == (6, "No devices were found\n")


def local_gpu_host(tmp_path: Path, state: dict, **kw) -> LocalTransport:
    (tmp_path / "smi.json").write_text(json.dumps(state))
    wrapper = tmp_path / "nvidia-smi"
    wrapper.write_text(f"#!/bin/sh\nexec '{sys.executable}' '{FAKE_SMI}' --state '{tmp_path / 'smi.json'}' \"$@\"\n")
    wrapper.chmod(0o755)
    return LocalTransport(HostConfig(name="box", nvidia_smi=str(wrapper), **kw))


def test_probe_host_learns_the_user_of_a_foreign_process(tmp_path):
    me = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    state = {"gpus": [{"index": 0, "uuid": "GPU-x", "name": "G", "utilization": 50, "memory_used": 9000,
                       "memory_total": 10000}],
             "processes": [{"gpu_uuid": "GPU-x", "pid": os.getpid(), "used_memory": 8000}]}
    p = probe_host(local_gpu_host(tmp_path, state))
    assert p.apps == (ComputeApp("GPU-x", os.getpid(), 8000.0),)
    assert p.proc(os.getpid()).user == me and p.proc(os.getpid()).pgid == os.getpgrp()


def test_probe_host_errors_name_the_host_and_the_cause(tmp_path):
    t = local_gpu_host(tmp_path, {"fail": "NVIDIA-SMI has failed because it couldn't communicate with the "
                                          "NVIDIA driver."})
    with pytest.raises(ProbeError, match=r"^box: .*nvidia-smi failed \(exit 9\): NVIDIA-SMI has failed"):
        probe_host(t)
    missing = LocalTransport(HostConfig(name="box", nvidia_smi="/nonexistent/nvidia-smi"))
    with pytest.raises(Exception, match=r"^box: "):
        probe_host(missing)
    assert probe_host(local_gpu_host(tmp_path, {"no_devices": True})).gpus == ()


# ---- verdicts -------------------------------------------------------------------------------
@pytest.mark.parametrize("owner,foreign,ours,quiet,streak,previous,expected", [
    (None, False, False, True, 0, None, ("free", 1)),
    (None, False, False, False, 4, "free", ("free", 0)),      # busy but nobody else's: still ours to use
    (None, True, False, True, 9, "free", ("busy", 0)),
    ("alice", False, False, True, 1, "owner", ("owner", 2)),  # quiet, not long enough yet
    ("alice", False, False, True, 2, "owner", ("idle", 3)),   # third quiet probe: harvestable
    ("alice", False, False, False, 5, "idle", ("owner", 0)),  # the owner is back
    ("alice", True, True, False, 5, "idle", ("busy", 0)),     # the owner started a process beside ours
    ("alice", False, True, False, 5, "idle", ("idle", 5)),    # only our worker keeps it busy
])
def test_verdict_table(owner, foreign, ours, quiet, streak, previous, expected):
    assert verdict(owner=owner, foreign=foreign, ours=ours, quiet=quiet, streak=streak,
                   previous=previous, harvest=HARVEST) == expected


# ---- recording ------------------------------------------------------------------------------
@pytest.fixture
def session(tmp_path):
    sessions = open_database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with sessions.begin() as s:
        yield s


def host_probe(t: float, util=0.0, apps=(), procs=()) -> HostProbe:
    return HostProbe("box", t, (GpuSample(0, "GPU-a", "G", util, 0.0, 80.0), GpuSample(1, "GPU-b", "G", 0.0, 0.0, 80.0)),
                     tuple(apps), tuple(procs))


def test_record_probe_updates_gpus_and_keeps_a_bounded_history(session):
    host = Host(name="box", address="10.0.0.1", owner="alice")
    session.add(host)
    cfg = HostConfig(name="box", address="10.0.0.1", owner="alice")
    for i in range(5):
        record_probe(session, host, cfg, host_probe(1000.0 + i), HARVEST, history=3)
    assert [(g.index, g.uuid, g.verdict, g.idle_streak) for g in host.gpus] == \
        [(0, "GPU-a", "idle", 5), (1, "GPU-b", "idle", 5)]
    times = session.scalars(select(SampleRow.time).where(SampleRow.gpu_index == 0).order_by(SampleRow.time))
    assert list(times) == [1002.0, 1003.0, 1004.0]
    assert session.scalar(select(func.count()).select_from(SampleRow)) == 6
    assert (host.reachable, host.last_error, host.last_probe_at) == (True, None, 1004.0)

    record_probe(session, host, cfg, host_probe(1005.0, apps=[ComputeApp("GPU-a", 77, 100.0)]), HARVEST)
    assert [g.verdict for g in host.gpus] == ["busy", "idle"]
    last = session.scalar(select(SampleRow).order_by(SampleRow.id.desc()).where(SampleRow.gpu_index == 0))
    assert last.foreign_pids == [{"pid": 77, "user": None, "memory_mib": 100.0}]

    record_failure(host, ProbeError("box", "nvidia-smi failed"))
    assert host.reachable is True and [g.verdict for g in host.gpus] == ["unknown", "unknown"]


def test_only_configured_gpus_are_recorded(session):
    host = Host(name="box", address="10.0.0.1")
    session.add(host)
    record_probe(session, host, HostConfig(name="box", address="10.0.0.1", gpus=[1]), host_probe(1.0), HARVEST)
    assert [g.index for g in session.scalars(select(Gpu))] == [1]


# ---- end to end over sshd --------------------------------------------------------------------
def test_gpuflex_hosts_json_over_three_sshd_hosts(ssh_bed, tmp_path):
    sleeper = subprocess.Popen(["sleep", "120"])  # a real pid, so `ps` finds its user
    me = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    try:
        g2 = ssh_bed.host("gpu02")
        g2.set_smi(gpus=[
            {"index": 0, "uuid": "GPU-g2-0", "name": "NVIDIA A100-SXM4-40GB", "utilization": 97,
             "memory_used": 30000, "memory_total": 40960},
            {"index": 1, "uuid": "GPU-g2-1", "name": "NVIDIA A100-SXM4-40GB", "utilization": None,
             "memory_used": 3, "memory_total": 40960}],
            processes=[{"gpu_uuid": "GPU-g2-0", "pid": sleeper.pid, "used_memory": 29000}])
        ssh_bed.host("gpu03").set_smi(gpus=[], no_devices=True)
        dead = ("[[hosts]]\nname = \"dead\"\naddress = \"127.0.0.9\"\nport = 9\n"
                f"known_hosts = {json.dumps(str(ssh_bed.known_hosts))}\nconnect_timeout_s = 2\n")
        cfg = write_config(ssh_bed, tmp_path / "gpuflex.toml", extra_hosts_toml=dead)
        res = CliRunner().invoke(app, ["--config", str(cfg), "hosts", "--json"])
        assert res.exit_code == 0, res.output
        view = {h["name"]: h for h in json.loads(res.stdout)}

        assert [(d["index"], d["utilization_pct"], d["memory_used_mib"], d["verdict"], d["holder"])
                for d in view["gpu01"]["devices"]] == [(0, 0.0, 0.0, "free", None), (1, 0.0, 0.0, "free", None)]
        busy, na = view["gpu02"]["devices"]
        assert (busy["utilization_pct"], busy["memory_used_mib"], busy["memory_total_mib"]) == (97.0, 30000.0, 40960.0)
        assert busy["verdict"] == "busy" and busy["model"] == "NVIDIA A100-SXM4-40GB"
        assert busy["foreign"] == [{"pid": sleeper.pid, "user": me, "memory_mib": 29000.0}]
        assert busy["holder"] == f"pid {sleeper.pid} ({me})"
        assert (na["utilization_pct"], na["verdict"], na["holder"]) == (None, "free", None)
        assert view["gpu03"]["reachable"] is True and view["gpu03"]["devices"] == []
        assert view["dead"]["reachable"] is False
        assert view["dead"]["error"] == "dead: SSH connection refused by 127.0.0.9:9"
        for name in ("gpu01", "gpu02", "gpu03"):
            assert view[name]["error"] is None

        # the free devices the placer sees follow the probe
        sessions = open_database(load_config(str(cfg)).database_url)
        from gpuflex.control.pool import Pool
        with sessions() as s:
            free = {h.name: h.devices for h in Pool(load_config(str(cfg))).free(s)}
        assert free == {"gpu01": (0, 1), "gpu02": (1,), "gpu03": ()}

        table = CliRunner().invoke(app, ["--config", str(cfg), "hosts"])
        assert table.exit_code == 0, table.output
        assert "unreachable" in table.output and str(sleeper.pid) in table.output
        assert "dead: SSH connection refused by 127.0.0.9:9" in table.output
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_placer_offers_free_and_idle_gpus_of_a_fresh_probe_only(session):
    from gpuflex.config import parse_config
    from gpuflex.control.pool import Pool

    cfg = parse_config({"hosts": [{"name": "box", "address": "10.0.0.1"},
                                  {"name": "owned", "address": "10.0.0.2", "owner": "alice"}]}, "<test>")
    pool = Pool(cfg)
    pool.sync_hosts(session)
    box, owned = session.scalars(select(Host).order_by(Host.name)).all()
    now = time.time()
    record_probe(session, box, cfg.host("box"),
                 host_probe(now, apps=[ComputeApp("GPU-b", 99, 10.0)]), cfg.harvest)
    record_probe(session, owned, cfg.host("owned"), host_probe(now, util=50.0), cfg.harvest)
    assert {h.name: h.devices for h in pool.free(session)} == {"box": (0,), "owned": ()}
    for _ in range(cfg.harvest.idle_samples):  # quiet long enough: GPU 1, then 0 too
        record_probe(session, owned, cfg.host("owned"), host_probe(now), cfg.harvest)
    assert {h.name: h.devices for h in pool.free(session)} == {"box": (0,), "owned": (0, 1)}
    box.last_probe_at = now - pool.probe_max_age_s - 1  # a stale probe places nothing
    assert {h.name: h.devices for h in pool.free(session)} == {"owned": (0, 1)}
