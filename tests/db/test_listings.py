"""gpuflex.db.listings: the keyset pages behind status and acct, read straight from the
database (their views and commands: tests/control/test_views.py, tests/control/test_acct.py)."""

from __future__ import annotations

from gpuflex.db import listings
from gpuflex.db.engine import open_database
from gpuflex.states import JobState
from tests.cli.test_status_cmd import record_jobs

MIX = ["succeeded", "queued", "failed", "running", "cancelled"]


def test_pages_below_a_cursor_count_and_chain_with_no_job_lost(config_path, db_path):
    ids = record_jobs(config_path, MIX * 3)
    sessions = open_database(f"sqlite:///{db_path}")
    with sessions() as s:
        where = listings.page_where(states=[JobState.SUCCEEDED, JobState.FAILED])
        ended = [i for i, state in zip(ids, MIX * 3) if state in ("succeeded", "failed")]
        assert listings.jobs_count(s, where) == len(ended) == 6
        first = listings.job_ids_page(s, where, limit=4)
        rest = listings.job_ids_page(s, where, below=first[-1], limit=4)
        assert first + rest == sorted(ended, reverse=True)
        assert [j.id for j in listings.jobs_page(s, where, below=first[-1], oldest_first=True)] == sorted(rest)
        assert listings.ended_count(s) == 9   # succeeded, failed and cancelled
    sessions.kw["bind"].dispose()
