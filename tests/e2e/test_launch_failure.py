"""A job whose command cannot be started fails at once instead of retrying forever."""

from __future__ import annotations

import os
import pwd

import pytest

from gpuflex.hosts.hostops import group_alive
from gpuflex.hosts.supervisor import spawn
from tests.conftest import db_rows


def test_a_command_that_cannot_start_fails_the_job(gf, db_path):
    p = gf("submit", "--workers", "2", "--", "/nonexistent/program", "--flag")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "cannot start '/nonexistent/program'" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr
    assert "RuntimeError" not in p.stdout and "hostops" not in p.stdout   # the host's words, for a person
    job = gf.json("status", "1")
    assert job["state"] == "failed"
    gf.ok("status")   # a later command does not try to launch it again
    assert db_rows(db_path, "SELECT count(*) FROM events WHERE kind = 'launch-failed'") == [(0,)]
    pgids = [r[0] for r in db_rows(db_path, "SELECT pgid FROM workers WHERE pgid IS NOT NULL")]
    pgids += [r[0] for r in db_rows(db_path, "SELECT store_pgid FROM jobs WHERE store_pgid IS NOT NULL")]
    assert not any(group_alive(p) for p in pgids)


@pytest.mark.e2e   # spawn forks its supervisor
def test_a_directory_the_host_cannot_see_names_user_directory_and_sync(tmp_path):
    """Issue 33: a worker's directory this host's user cannot read (here: not there at all)
    is said so, with the user, the directory and --sync; not just "cannot start './mine.sh'"."""
    gone = tmp_path / "not-shared"
    with pytest.raises(RuntimeError) as err:
        spawn({"argv": ["./mine.sh"], "cwd": str(gone), "env": {}, "log": str(tmp_path / "w.log"),
               "exit_path": str(tmp_path / "w.exit")})
    text = str(err.value)
    assert text.startswith(f"cannot start './mine.sh': user {pwd.getpwuid(os.getuid()).pw_name} "
                           f"cannot read the job's directory {gone} (No such file or directory)")
    assert "--sync" in text   # "cannot start" stays: the launch fails at once, no retry
