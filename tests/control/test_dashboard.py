"""gpuflex.control.dashboard: the range a page asks for, and the pool's timeline computed
from the workers' spans and the reclaim events (the rest of what it reads is views' and
acct's, tested with them, and each page through tests/web/test_app.py)."""

from __future__ import annotations

import pytest

from gpuflex.config import load_config
from gpuflex.control import dashboard
from gpuflex.control.service import JobService
from gpuflex.db.models import Event
from gpuflex.errors import UsageError
from tests.conftest import write_config
from tests.control.test_acct import add_job

NOW = 1_800_000_000.0


def test_the_window_reads_a_range_or_since_and_until():
    w = dashboard.window({}, NOW)
    assert (w.since, w.until, w.label) == (NOW - 86400, NOW, "1d")
    assert dashboard.window({"range": "7d"}, NOW).since == NOW - 7 * 86400
    w = dashboard.window({"since": "2h", "until": "1h"}, NOW)
    assert (w.since, w.until) == (NOW - 7200, NOW - 3600)
    assert dashboard.window({"since": "3h"}, NOW).until == NOW


@pytest.mark.parametrize("params, words", [
    ({"range": "1y"}, "range='1y'"), ({"since": "soon"}, "since 'soon'"), ({"since": "1h", "until": "2h"}, "until="),
    ({"range": "1d", "until": "1h"}, "choose one"), ({"page": "2"}, "unknown parameter 'page'"),
])
def test_a_bad_window_is_a_usage_error(params, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        dashboard.window(params, NOW)


def test_the_timeline_splits_the_pools_device_time_into_busy_and_idle_and_counts_reclaims(home):
    """4 slots; one worker holds 2 of them for the second half of a 2 h window: the first
    column is all idle, the second half busy. A reclaim event falls in the second."""
    config = load_config(str(write_config(home, slots=4)))
    svc = JobService(config)
    try:
        svc.refresh()
        with svc.sessions.begin() as s:
            j = add_job(s, "t1", "alice", "x", "succeeded", NOW - 7200, NOW, [("local", [0, 1], NOW - 3600, NOW)])
            j.events.append(Event(time=NOW - 600, kind="reclaim", message="r", data={}, count=1))
        with svc.sessions() as s:
            data = dashboard.pool(s, config, dashboard.Window(NOW - 7200, NOW, "2h"), buckets=2)
    finally:
        svc.close()
    first, second = data["timeline"]
    assert data["capacity"] == 4
    assert (first["busy"], first["idle"], first["reclaimed"]) == (0.0, 1.0, 0)
    assert (second["busy"], second["harvested"], second["idle"], second["reclaimed"]) == (0.5, 0.0, 0.5, 1)


def test_a_job_s_history_and_progress_are_read_only_for_who_may_read_it(home):
    """Its owner gets the world sizes, the marks and the coordinator's shares; another
    user gets none of them, and the coordinator is not even asked."""
    config = load_config(str(write_config(home, slots=4)))
    svc = JobService(config)
    asked = []

    def progress(job):
        asked.append(job.id)
        return {"workers": {"0": {"share": 40, "samples_per_s": 120.0, "relative": 1.0}}}

    try:
        svc.refresh()
        with svc.sessions.begin() as s:
            add_job(s, "t1", "alice", "x", "running", NOW - 600, None, [("local", [0], NOW - 500, None)],
                    [(NOW - 500, {"state": "running", "world_size": 1}),
                     (NOW - 300, {"members": [0], "ok": True})])
        with svc.sessions() as s:
            mine = dashboard.job(s, 1, lambda owner: owner == "alice", progress)
            theirs = dashboard.job(s, 1, lambda owner: False, progress)
            assert dashboard.job(s, 2, lambda owner: True, progress) is None
    finally:
        svc.close()
    assert mine["readable"] and mine["world"][0] == (NOW - 500, 1) and mine["marks"][0].kind == "scale"
    assert mine["split"][0] == {"share": 40, "samples_per_s": 120.0, "relative": 1.0}
    assert asked == [1]   # once, for the owner's view
    assert (theirs["readable"], theirs["world"], theirs["marks"], theirs["split"]) == (False, [], [], {})
