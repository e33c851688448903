"""gpuflex.hosts.terminal's deadline and hang-up bookkeeping, without processes (the
signals go to a group that does not exist). Sessions that run:
tests/e2e/test_interactive_sessions.py, tests/e2e/ssh/test_interactive_ssh.py."""

from __future__ import annotations

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
