"""The prepared GPU check (benchmarks/gpu_check.py) and what it needs of the runtime:
its CPU dry run (fake nvidia-smi, CPU tensors) goes through the same flow as on a GPU, and
the backend a worker picks (several workers may share one GPU over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

from gpuflex.control.launch import submit_environment
from gpuflex.elastic.membership.collectives import group_backend, pick_backend
from gpuflex.elastic.protocol.env import BACKEND
from tests import REPO as ROOT



@pytest.mark.parametrize("env,device,want", [
    ({}, "cpu", "gloo"),
    ({}, "cuda", "nccl"),                           # a worker with its own GPU
    ({BACKEND: "gloo"}, "cuda", "gloo"),            # workers sharing one GPU
    ({BACKEND: " NCCL "}, "cuda", "nccl"),
])
def test_the_backend_is_nccl_on_a_gpu_unless_the_job_asks_for_gloo(monkeypatch, env, device, want):
    monkeypatch.delenv(BACKEND, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert pick_backend(torch.device(device)) == want


@pytest.mark.parametrize("value,device,says", [
    ("mpi", "cpu", "expected one of gloo, nccl"),
    ("nccl", "cpu", "needs a GPU"),
])
def test_a_backend_that_cannot_work_is_named(monkeypatch, value, device, says):
    monkeypatch.setenv(BACKEND, value)
    with pytest.raises(ValueError, match=says):
        pick_backend(torch.device(device))


def test_nccl_groups_carry_cpu_tensors_over_gloo_beside_it():
    assert group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert group_backend("gloo") == "gloo"


def test_the_backend_knob_reaches_the_workers_from_the_submitter():
    assert submit_environment({BACKEND: "gloo", "GPUFLEX_CONFIG": "/x"}, {}) == {BACKEND: "gloo"}


def test_the_gpu_check_dry_run_captures_the_probe_and_matches_a_standalone_run(tmp_path):
    """The check's first two parts on CPU: nvidia-smi's answers (the fake's, idle and with a
    holder process) captured and parsed, `gpuflex hosts` turning busy with the holder, the
    doctor on that host, and
    a one-worker job equal bit for bit to the standalone run, with checkpoints written."""
    out = tmp_path / "out"
    env = {**os.environ, "GPUFLEX_CHECK_WORK": str(tmp_path / "work")}
    env.pop("GPUFLEX_CONFIG", None)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(out), "--cpu-dry-run",
                        "--parts", "smi,nccl1"], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["environment"]["dry_run"] is True
    smi = res["smi"]
    assert smi["ok"] and [v[1] for v in smi["verdicts"]["busy"]] == ["busy"]
    assert [v[1] for v in smi["verdicts"]["idle"]] == ["free"]
    doctor = smi["idle"]["doctor"]   # the doctor on the same host: the GPU found, CUDA not (a CPU torch)
    assert doctor["exit"] == 0 and doctor["checks"]["nvidia-smi"][0] == "ok" and doctor["checks"]["gpus"][0] == "ok"
    assert doctor["checks"]["cuda"][0] == "warn"
    one = res["nccl1"]
    assert one["ok"] and one["bitwise_equal"] and one["exactly_once"] and one["checkpoint_files"]
    with tarfile.open(out / "gpu_check_files.tar.gz") as tar:
        names = tar.getnames()
    assert "files/samples/busy.apps.txt" in names and "files/samples/idle.gpus.txt" in names
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log", "gpu_check_files.tar.gz"]


def test_the_gpu_check_refuses_an_unknown_part(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(tmp_path), "--parts", "smi,nope"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown part(s) nope" in p.stderr and "Traceback" not in p.stderr
