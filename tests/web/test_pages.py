"""gpuflex.web.pages: the reasons the queue gives (as `status` does) and the users' text
escaped in every page (a job named like markup stays text)."""

from __future__ import annotations

import dataclasses

from gpuflex.control.views import JobInfo, Listing
from gpuflex.states import JobState
from gpuflex.web import pages


def info(**changes) -> JobInfo:
    base = JobInfo(id=7, name="<script>alert(1)</script>", state=JobState.QUEUED, user="bob", argv=("x",),
                   workdir="/", env={}, min_workers=1, max_workers=2, target_workers=None, world_size=0,
                   generation=0, gpus_per_worker=1, priority=0, harvest=False, restarts=0,
                   queue_reason="needs 2 devices", exit_code=None, exit_reason=None, created_at=0.0,
                   started_at=None, ended_at=None, workers=())
    return dataclasses.replace(base, **changes)


def test_the_reason_is_status_s():
    assert pages.reason(info()) == "needs 2 devices"
    assert pages.reason(info(held=True)) == "held (gpuflex release)"
    assert pages.reason(info(state=JobState.RUNNING, waiting=({"for": [3], "phase": "copy"},))) == \
        "waiting for 3 (copy)"
    assert pages.reason(info(state=JobState.FAILED, exit_reason="worker 0 exited with 3")) == "worker 0 exited with 3"


def test_the_users_text_is_escaped():
    html = pages.queue_page(Listing([info()], older=4), "<me>")
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "viewing as &lt;me&gt;" in html and "4 older ended jobs not shown" in html
    html = pages.job_page({"info": info(), "readable": False, "world": [], "marks": [], "timings": [], "split": {}},
                          "me")
    assert "<script>" not in html and "bob's job" in html
