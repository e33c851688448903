"""gpuflex.db.locks on SQLite (file locks; the PostgreSQL advisory locks: tests/e2e/test_postgres.py):
a wait longer than WAIT_NOTE_S says who holds the lock, and a command's lock names the command."""

from __future__ import annotations

import logging
import os
import re
import threading

from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.db import locks
from gpuflex.db.locks import FileLock
from tests.cli.test_status_cmd import record_jobs


def test_a_long_wait_for_a_lock_says_who_holds_it_then_takes_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(locks, "WAIT_NOTE_S", 0.3)
    monkeypatch.setattr(locks, "ACTOR", ["scale"])
    holder, waiter = FileLock(tmp_path / "g.db.ops.lock", "ops"), FileLock(tmp_path / "g.db.ops.lock", "ops")
    assert holder.acquire()
    got = threading.Event()

    def wait() -> None:
        with waiter.held():
            got.set()

    with caplog.at_level(logging.WARNING, logger="gpuflex.db.locks"):
        t = threading.Thread(target=wait)
        t.start()
        deadline = threading.Event()
        for _ in range(100):   # the note comes after 0.3 s of waiting: up to 10 s on a loaded machine
            if any("waiting" in r.getMessage() for r in caplog.records):
                break
            deadline.wait(0.1)
        assert not got.is_set()   # still waiting
        holder.release()
        t.join(timeout=30)
    assert got.is_set()
    [note] = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert re.fullmatch(rf"waiting 0 s so far for the database's ops lock, held by scale pid {os.getpid()}, "
                        r"since \d\d:\d\d:\d\d", note), note


def test_a_short_wait_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gpuflex.db.locks"):
        with FileLock(tmp_path / "x.lock").held():
            pass
    assert not caplog.records


def test_the_ops_lock_a_command_held_names_the_command(home, config_path, db_path):
    [queued] = record_jobs(config_path, ["queued"])   # asks for more slots than there are: nothing starts
    env = {"HOME": str(home), "GPUFLEX_CONFIG": str(config_path), "COLUMNS": "200"}
    r = CliRunner().invoke(app, ["cancel", str(queued)], env=env)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert locks.ACTOR == []   # cleared as the command ended
    text = (db_path.parent / "g.db.ops.lock").read_text()
    assert re.fullmatch(rf"cancel pid {os.getpid()}, since \d\d:\d\d:\d\d", text), text


def test_a_lock_file_of_the_database_knows_its_purpose(tmp_path):
    url = f"sqlite:///{tmp_path / 'g.db'}"
    assert [locks.database_lock(url, p).purpose for p in ("migration", "ops", "harvest")] == \
        ["migration", "ops", "harvest"]
    assert FileLock(tmp_path / "x.lock").purpose == "database"
