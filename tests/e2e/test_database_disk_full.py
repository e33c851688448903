"""The control host's database disk full (issue 28 point 5): a SQLite database on a small
tmpfs, filled to the last block. `submit` and a harvest tick either complete or fail with one
line (exit 2, naming the full disk), nothing recorded is lost, the running job goes on, and
once space is freed the database is whole and the next command works.

Two states of a full disk: another command still has the database open (its WAL file
exists: a write fails as SQLite's "database or disk is full"), and no one has (SQLite cannot
create its WAL: every command, a read too, fails to open it)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from gpuflex.hosts.hostops import group_alive
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows, tmpfs, write_config

import pytest

pytestmark = pytest.mark.e2e   # a job of a real `sleep`, on a tmpfs mounted by the test


def fill(directory: Path) -> None:
    """Write a file in `directory` until its disk is full."""
    fd = os.open(directory / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 1 << 12, 1 << 9):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)


def one_line_or_done(p, *fragments: str) -> None:
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    if p.returncode != 0:
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: "), p.stderr
        for f in fragments:
            assert f in p.stderr, p.stderr


def test_a_full_database_disk_fails_submit_and_harvest_in_one_line_and_loses_nothing(home):
    with tmpfs(home / "db", "4m") as d:
        db = d / "g.db"
        cfg = write_config(home, slots=1)
        cfg.write_text(cfg.read_text().replace(f"sqlite:///{home}/g.db", f"sqlite:///{db}"))
        gf = GpuflexCLI(home, cfg)
        try:
            job = gf.submit(["sleep", "300"], "--workers", "1")
            ((pgid,),) = db_rows(db, "SELECT pgid FROM workers")
            jobs_before = db_rows(db, "SELECT id, state FROM jobs")
            holder = sqlite3.connect(db)   # another command reading: the WAL stays
            holder.execute("SELECT count(*) FROM jobs").fetchall()
            fill(d)
            p = gf("submit", "--", "sleep", "300")   # queued (the one slot is busy): its commit fails
            one_line_or_done(p, "is full")
            assert p.returncode == 2, p.stdout
            for args in (["harvest"], ["status"]):
                one_line_or_done(gf(*args), "is full")
            holder.close()   # no one has it open: SQLite cannot even create its WAL now
            for args in (["submit", "--", "sleep", "300"], ["harvest"], ["status"]):
                p = gf(*args)
                one_line_or_done(p, "is full")
            assert group_alive(pgid)   # the running job goes on
            (d / "fill").unlink()
            assert db_rows(db, "PRAGMA integrity_check") == [("ok",)]
            assert db_rows(db, "SELECT id, state FROM jobs") == jobs_before   # nothing lost, nothing half-written
            assert gf.json("status", str(job["id"]))["state"] == "running" and group_alive(pgid)
            gf.ok("submit", "--", "true")   # the next command works
        finally:
            cleanup_jobs(gf, db)
