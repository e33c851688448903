"""gpuflex.cli.doctor_cmd: the doctor's table, and its exit code (the checks themselves run
against real sshd hosts in tests/e2e/ssh/test_doctor.py)."""

from __future__ import annotations

import json

import pytest

from gpuflex.cli import doctor_cmd
from gpuflex.policy.doctor_facts import Finding, Verdict
from tests.clirun import invoke

HEALTHY = [Finding("gpu01", "ssh", Verdict.OK, "reachable"), Finding("gpu01", "disk", Verdict.WARN, "9 GB free")]
SICK = HEALTHY + [Finding("gpu02", "python", Verdict.FAIL, "no torch", fix="pip install torch"),
                  Finding("gpu02", "nccl", Verdict.SKIP, "no CUDA")]


@pytest.fixture
def findings(monkeypatch):
    """The doctor's findings, as run_doctor would give them, without asking any host."""
    given = {}

    def run_doctor(config, hosts, pg_port=None):
        given.update(hosts=hosts, pg_port=pg_port)
        return given["findings"]

    monkeypatch.setattr(doctor_cmd, "run_doctor", run_doctor)
    return given


def test_a_healthy_pool_exits_0_with_a_table_and_no_fix_column(home, config_path, findings):
    findings["findings"] = HEALTHY
    r = invoke(home, config_path, "doctor")
    assert r.exit_code == 0
    assert "FIX" not in r.stdout and "gpu01" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "1 ok, 1 warn, 0 fail, 0 skip"
    assert findings["hosts"] is None


def test_a_failed_check_exits_1_and_shows_its_fix(home, config_path, findings):
    findings["findings"] = SICK
    r = invoke(home, config_path, "doctor", "gpu02", "--pg-port", "29600")
    assert r.exit_code == 1
    assert "FIX" in r.stdout and "pip install torch" in r.stdout
    assert (findings["hosts"], findings["pg_port"]) == (["gpu02"], 29600)


def test_json_lists_every_finding(home, config_path, findings):
    findings["findings"] = SICK
    r = invoke(home, config_path, "doctor", "--json")
    assert r.exit_code == 1
    assert json.loads(r.stdout) == [f.as_dict() for f in SICK]
