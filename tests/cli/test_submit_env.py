"""`submit --python/--venv/--conda/--env-setup` in-process (issue 33): refusals exit 2 with
nothing recorded, the options flow from the command line, `#GPUFLEX` lines and task files
alike, and `status` shows them. Each job waits `--after` a job that can never start, so no
process is started; the preparation on a host is tests/control/test_prepare.py's and
tests/e2e/test_job_envs.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuflex.config import load_config
from gpuflex.control import access
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from tests.clirun import invoke
from tests.conftest import db_dump, write_config


@pytest.fixture
def pool(home) -> Path:
    """The config; job 1 is queued forever (5 workers on 4 slots), for --after to wait on."""
    cfg = write_config(home)
    svc = JobService(load_config(str(cfg)))
    with svc.sessions.begin() as s:
        s.add(Job(token="t0", name="big", state="queued", argv=["true"], workdir="/", env={},
                  min_workers=5, max_workers=5, gpus_per_worker=1, user=access.caller()))
    svc.close()
    return cfg


@pytest.fixture
def venv(home) -> Path:
    d = home / "envs" / "a"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("#!/bin/sh\nexec python3 \"$@\"\n")
    os.chmod(d / "bin" / "python", 0o755)
    return d


@pytest.mark.parametrize("args, says", [
    (["--venv", "envs/a", "--conda", "torch2"], "--venv and --conda: give at most one of --python, --venv and "
                                                "--conda"),
    (["--python", "/usr/bin/python3", "--", "torchrun", "t.py"], "--python replaces a command's first word python "
                                                                 "or python3; this command starts with 'torchrun'"),
    (["--venv", "nowhere"], "--venv '{home}/nowhere' is not a directory"),
    (["--venv", "envs"], "--venv '{home}/envs' has no bin/python"),
    (["--python", "./nopython"], "--python '{home}/nopython' is not an executable file"),
    (["--conda", "a b"], "--conda 'a b' is not an environment name"),
    (["--env-setup", " "], "--env-setup is empty"),
])
def test_bad_environments_are_refused_with_nothing_recorded(home, pool, venv, args, says):
    before = db_dump(home / "g.db")
    argv = args if "--" in args else [*args, "--", "python", "t.py"]
    r = invoke(home, pool, "submit", "--after", "1", *argv)
    assert r.exit_code == 2, r.stdout + r.stderr
    assert says.format(home=home) in r.stderr and "Traceback" not in r.stderr
    assert db_dump(home / "g.db") == before


def test_a_directive_and_the_command_line_that_clash_are_refused_naming_the_line(home, pool, venv):
    (home / "train.sh").write_text("#!/bin/sh\n#GPUFLEX --venv envs/a\npython t.py\n")
    before = db_dump(home / "g.db")
    r = invoke(home, pool, "submit", "--after", "1", "--conda", "torch2", "train.sh")
    assert r.exit_code == 2 and "train.sh line 2: --venv and --conda: give at most one" in r.stderr, r.stderr
    assert db_dump(home / "g.db") == before


def test_the_options_are_recorded_and_shown_from_every_layer(home, pool, venv):
    r = invoke(home, pool, "submit", "--json", "--after", "1", "--venv", "envs/a", "--env-setup", "make deps",
               "--", "python", "t.py")
    job = json.loads(r.stdout)
    assert (job["venv"], job["python"], job["conda"], job["env_setup"]) == (str(venv), None, None, "make deps")
    assert job["sources"]["venv"] == job["sources"]["env_setup"] == "command line"
    shown = invoke(home, pool, "status", str(job["id"])).stdout
    assert f"environment: venv {venv}; env-setup: make deps" in shown
    (home / "task.toml").write_text('[job]\npython = "python3.11"\nenv_setup = "true"\nafter = [1]\n'
                                    'run = "python t.py"\n')
    job = json.loads(invoke(home, pool, "submit", "--json", "task.toml").stdout)
    assert (job["python"], job["env_setup"], job["sources"]["python"]) == ("python3.11", "true", "task file")
    (home / "train.sh").write_text("#!/bin/sh\n#GPUFLEX --conda torch2 --after 1\npython t.py\n")
    job = json.loads(invoke(home, pool, "submit", "--json", "train.sh").stdout)
    assert (job["conda"], job["sources"]["conda"]) == ("torch2", "#GPUFLEX")


def test_a_venv_a_setup_makes_is_not_checked_at_submit(home, pool):
    r = invoke(home, pool, "submit", "--json", "--after", "1", "--venv", ".venv", "--env-setup",
               "python3 -m venv .venv", "--", "python", "t.py")
    assert r.exit_code == 0 and json.loads(r.stdout)["venv"] == str(home / ".venv"), r.stderr


def test_logs_setup_is_refused_where_there_is_no_setup_output(home, pool):
    job = json.loads(invoke(home, pool, "submit", "--json", "--after", "1", "--", "python", "t.py").stdout)
    r = invoke(home, pool, "logs", str(job["id"]), "--setup")
    assert r.exit_code == 2 and f"job {job['id']} has no --env-setup output (it has no --env-setup)" in r.stderr
    job = json.loads(invoke(home, pool, "submit", "--json", "--after", "1", "--env-setup", "true", "--",
                            "python", "t.py").stdout)
    r = invoke(home, pool, "logs", str(job["id"]), "--setup")   # queued: no host ran it yet
    assert r.exit_code == 2 and "(no host ran it yet)" in r.stderr
    r = invoke(home, pool, "logs", str(job["id"]), "--setup", "--worker", "0")
    assert r.exit_code == 2 and "give it without --worker" in r.stderr
