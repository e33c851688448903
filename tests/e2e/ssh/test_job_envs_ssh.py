"""Per-job environments over SSH (issue 33): --env-setup runs on the host through the SSH
transport (its request on stdin) and may make the --venv the workers then run in; a
--venv the host lacks fails the job at launch, naming the host (submit cannot check a
remote host's paths)."""

from __future__ import annotations

import json

import pytest

from tests.sshbed import one_host_cli, ssh_hosts  # noqa: F401

PROBE = "import shutil, sys; print('prefix', sys.prefix); print('which', shutil.which('python'))"


@pytest.fixture
def one_host(ssh_hosts, home):
    yield from one_host_cli(ssh_hosts, home)


def test_a_setup_makes_the_venv_the_workers_run_in_and_a_missing_venv_fails(one_host, home):
    cli, host = one_host
    venv = home / "made-on-host"
    job = cli.submit(["python", "-c", PROBE], "--venv", str(venv), "--env-setup",
                     f"python3 -m venv --without-pip --system-site-packages {venv} && echo made it")
    done = cli.wait_final(job["id"])
    assert done["state"] == "succeeded", done
    out = cli.ok("logs", str(job["id"])).stdout
    assert f"prefix {venv}" in out and f"which {venv}/bin/python" in out, out
    ready = [e for e in cli.json("events", str(job["id"])) if e["kind"] == "env-ready"]
    assert [e["data"]["host"] for e in ready] == [host.name] and ready[0]["data"]["tail"] == "made it"

    p = cli("submit", "--json", "--venv", str(home / "not-there"), "--", "python", "-c", "print(1)")
    assert p.returncode == 1, p.stderr   # accepted at submit (a remote host), failed at its launch
    failed = cli.wait_final(json.loads(p.stdout)["id"])
    assert failed["state"] == "failed" and failed["exit_reason"] == (
        f"{host.name}: cannot start the job: --venv {home}/not-there has no bin/python there"), failed
