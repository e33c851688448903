"""benchmarks/soak_faults.py's end check of process groups: a recorded group id counts as
left running only while a process of that group is the soak's (pids wrap around within an
hour's soak, so the id alone may name another program's group by then)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import soak_faults  # noqa: E402

pytestmark = pytest.mark.e2e   # it starts processes


def test_a_group_is_ours_only_while_one_of_its_processes_names_the_soak(tmp_path):
    (tmp_path / "job").mkdir()
    mine = subprocess.Popen(["sh", "-c", f"sleep 30; : {tmp_path}"], start_new_session=True)
    inside = subprocess.Popen(["sleep", "30"], cwd=tmp_path / "job", start_new_session=True)   # runs in it
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    named = subprocess.Popen(["sh", "-c", "sleep 30; : gpuflex.elastic.coordinator"], start_new_session=True)
    try:
        assert soak_faults.our_group_alive(mine.pid, tmp_path)
        assert soak_faults.our_group_alive(inside.pid, tmp_path)
        assert not soak_faults.our_group_alive(other.pid, tmp_path)       # alive, not the soak's
        assert not soak_faults.our_group_alive(named.pid, tmp_path)       # gpuflex, but another's (a test suite's)
        assert not soak_faults.our_group_alive(mine.pid, tmp_path / "x")  # another soak's directory
        # a group id recorded for a job that ended before this process started: pid reuse
        started = soak_faults.started_at(mine.pid)
        assert abs(started - time.time()) < 600, started
        assert soak_faults.our_group_alive(mine.pid, tmp_path, ended_at=started + 5)
        assert not soak_faults.our_group_alive(mine.pid, tmp_path, ended_at=started - 60)
    finally:
        for p in (mine, inside, other, named):
            p.kill()
            p.wait()
    assert not soak_faults.our_group_alive(mine.pid, tmp_path)            # gone


def test_the_one_line_rule_judges_the_error_lines_not_gpuflexs_notes():
    err = ("gpuflex: waiting 10 s so far for the database's ops lock, held by status pid 5811 on vm, since 21:06:56\n"
           "error: job 661 is succeeded; only running jobs can be scaled.\n\n")
    assert soak_faults.error_lines(err) == ["error: job 661 is succeeded; only running jobs can be scaled."]
    assert len(soak_faults.error_lines("error: one\n  a second line of it\n")) == 2
