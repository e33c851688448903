"""benchmarks/soak_faults.py's end check of process groups: a recorded group id counts as
left running only while a process of that group is the soak's (pids wrap around within an
hour's soak, so the id alone may name another program's group by then)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import soak_faults  # noqa: E402

pytestmark = pytest.mark.e2e   # it starts processes


def test_a_group_is_ours_only_while_one_of_its_processes_names_the_soak(tmp_path):
    mine = subprocess.Popen(["sh", "-c", f"sleep 30; : {tmp_path}"], start_new_session=True)
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert soak_faults.our_group_alive(mine.pid, tmp_path)
        assert not soak_faults.our_group_alive(other.pid, tmp_path)       # alive, not the soak's
        assert not soak_faults.our_group_alive(mine.pid, tmp_path / "x")  # another soak's directory
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
    assert not soak_faults.our_group_alive(mine.pid, tmp_path)            # gone
