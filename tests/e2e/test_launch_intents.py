"""A command killed while it starts a job leaves no process the database does not know
(issue 16 item 8): the run was noted before its first spawn, and the next command ends it.

Real processes on the local pool; the starting command is killed at the failpoint
`start.spawned` (its processes are up, its transaction not committed)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from gpuflex.hosts.hostops import GROUP_MARK, group_alive
from tests.conftest import db_rows, py

MARK = "gpuflex-intents-test"


def _intents(db_path: Path) -> list[dict]:
    path = Path(str(db_path) + ".launches")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _groups(socket_dir: str) -> list[int]:
    return [int(e.name[len(GROUP_MARK):]) for e in os.scandir(socket_dir) if e.name.startswith(GROUP_MARK)]


def _gone(pgids: list[int], within_s: float = 10) -> bool:
    end = time.monotonic() + within_s
    while any(group_alive(g) for g in pgids) and time.monotonic() < end:
        time.sleep(0.05)
    return not any(group_alive(g) for g in pgids)


def test_a_submit_killed_before_it_committed_leaves_a_run_the_next_command_ends(gf, db_path):
    killed = gf("submit", "--workers", "2", "--", *py(f"import time; time.sleep(300)  # {MARK}"),
                env=gf.env(GPUFLEX_FAILPOINTS="start.spawned=kill"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "failpoint start.spawned kill" in killed.stderr
    assert db_rows(db_path, "SELECT id FROM jobs") == []          # the submit never committed
    [intent] = _intents(db_path)
    pgids = _groups(intent["socket_dir"])
    assert len(pgids) == 3 and all(group_alive(g) for g in pgids)   # coordinator + 2 workers, unknown to the DB
    try:
        assert gf.json("status") == []
        assert _gone(pgids), "the uncommitted run's processes are still alive"
        assert not os.path.exists(intent["socket_dir"])
        assert _intents(db_path) == []
    finally:
        for g in pgids:
            if group_alive(g):
                os.killpg(g, signal.SIGKILL)


def test_a_committed_run_is_forgotten_not_ended(gf, db_path):
    job = gf.submit(py(f"import time; time.sleep(300)  # {MARK}"), "--workers", "1")
    assert job["state"] == "running"
    [intent] = _intents(db_path)
    pgids = _groups(intent["socket_dir"])
    assert gf.json("status", str(job["id"]))["state"] == "running"
    assert _intents(db_path) == []
    assert all(group_alive(g) for g in pgids)
    gf.ok("cancel", str(job["id"]))
    assert _gone(pgids)
