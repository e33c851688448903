"""A job whose command cannot be started fails at once instead of retrying forever."""

from __future__ import annotations

from gpuflex.hosts.hostops import group_alive
from tests.conftest import db_rows


def test_a_command_that_cannot_start_fails_the_job(gf, db_path):
    p = gf("submit", "--workers", "2", "--", "/nonexistent/program", "--flag")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "cannot start '/nonexistent/program'" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr
    job = gf.json("status", "1")
    assert job["state"] == "failed"
    gf.ok("status")   # a later command does not try to launch it again
    assert db_rows(db_path, "SELECT count(*) FROM events WHERE kind = 'launch-failed'") == [(0,)]
    pgids = [r[0] for r in db_rows(db_path, "SELECT pgid FROM workers WHERE pgid IS NOT NULL")]
    pgids += [r[0] for r in db_rows(db_path, "SELECT store_pgid FROM jobs WHERE store_pgid IS NOT NULL")]
    assert not any(group_alive(p) for p in pgids)
