"""gpuflex.hosts.terminal's deadline and hang-up bookkeeping, without processes (the
signals go to a group that does not exist). Sessions that run:
tests/e2e/test_interactive_sessions.py, tests/e2e/ssh/test_interactive_ssh.py."""

from __future__ import annotations

import json
import time

from gpuflex.hosts import terminal

NO_GROUP = 2**22 + 12345   # above Linux's pid_max default: no process group has it


def fresh(orphaned=None) -> dict:
    return {"timed_out": False, "term_at": None, "orphaned": orphaned}


def test_a_caller_gone_hangs_the_command_up_without_calling_it_a_time_limit():
    state = fresh(lambda: True)
    terminal._keep_deadline(NO_GROUP, None, 5.0, state)
    assert state["term_at"] is not None and state["timed_out"] is False


def test_the_deadline_ends_it_as_a_time_limit_and_a_caller_still_there_changes_nothing():
    state = fresh(lambda: False)
    terminal._keep_deadline(NO_GROUP, time.time() + 3600, 5.0, state)
    assert state["term_at"] is None
    terminal._keep_deadline(NO_GROUP, time.time() - 1, 5.0, state)
    assert state["term_at"] is not None and state["timed_out"] is True


def test_the_exit_record_of_a_path_under_the_home_lands_in_the_home(tmp_path, monkeypatch):
    """The built-in workdir is ~/.local/state/gpuflex/work: `gpuflex run` on the local pool
    wrote its exit record to a literal '~' directory (FileNotFoundError, a traceback)
    before write_exit expanded it, as the supervisor expands a spawn spec's paths."""
    monkeypatch.setenv("HOME", str(tmp_path))
    terminal.write_exit("~/work/jobs/abc/worker-0.exit", 3, timed_out=True)
    record = json.loads((tmp_path / "work/jobs/abc/worker-0.exit").read_text())
    assert (record["returncode"], record["time_limit"]) == (3, True)
    assert (tmp_path / "work/jobs/abc").stat().st_mode & 0o777 == 0o700
