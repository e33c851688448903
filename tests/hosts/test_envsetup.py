"""gpuflex.hosts.envsetup, the host side of a job's preparation (issue 33): the checks of
what the workers need, the output's tail, and a setup past its limit killed with what it
started. A whole --env-setup through a job: tests/e2e/test_job_envs.py."""

from __future__ import annotations

import os
import stat
import time

import pytest

from gpuflex.hosts import envsetup
from gpuflex.hosts.hostops import group_alive


def test_without_a_setup_only_the_checks_run(tmp_path):
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    os.chmod(py, 0o755)
    (tmp_path / "plain").write_text("")   # a file, not executable
    log = tmp_path / "jobs" / "t" / "env-setup.log"
    reply = envsetup.prepare({"argv": None, "log": str(log),
                              "check": [str(py), str(tmp_path / "plain"), str(tmp_path / "none")]})
    assert reply["missing"] == [str(tmp_path / "plain"), str(tmp_path / "none")]
    assert reply["returncode"] is None and reply["tail"] == "" and reply["log"] == str(log)
    assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700 and stat.S_IMODE(log.stat().st_mode) == 0o600


def test_the_tail_is_this_runs_last_lines(tmp_path):
    log = tmp_path / "l"
    log.write_text("an earlier run\n" + "".join(f"line {i}\n" for i in range(30)))
    start = len("an earlier run\n")
    assert envsetup._tail(str(log), start).splitlines() == [f"line {i}" for i in range(20, 30)]
    assert envsetup._tail(str(log), log.stat().st_size) == ""


@pytest.mark.e2e   # runs sh
def test_a_setup_past_its_limit_is_killed_with_its_children(tmp_path):
    log = tmp_path / "l"
    reply = envsetup.prepare({"argv": ["sh", "-c", "echo $$ > group; echo started; sleep 60 & wait"],
                              "cwd": str(tmp_path), "env": {"PATH": os.environ["PATH"]}, "clean_env": True,
                              "log": str(log), "timeout_s": 1, "check": []})
    assert reply["timed_out"] and reply["returncode"] == -9, reply
    assert reply["tail"] == "started\ngpuflex: env-setup killed after 1 s"
    group = int((tmp_path / "group").read_text())   # sh's own: its session's group
    end = time.monotonic() + 10   # SIGKILL was sent to the group; its members die at once, or nearly
    while group_alive(group) and time.monotonic() < end:
        time.sleep(0.05)
    assert not group_alive(group), "the setup's background child outlived the kill"
