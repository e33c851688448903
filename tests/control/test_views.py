"""views.paged and views.listing_page (`status --all`, `status --json`): acct's keyset pages
over every job, read a chunk at a time. Jobs are recorded straight through the models."""

from __future__ import annotations

import pytest

from gpuflex.config import load_config
from gpuflex.control import access, views
from gpuflex.control.service import JobService
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.states import JobState
from tests.cli.test_status_cmd import record_jobs

MIX = ["succeeded", "queued", "failed", "running", "cancelled"]


@pytest.fixture
def svc(config_path, monkeypatch):
    monkeypatch.setattr(queries, "CHUNK", 3)   # a page of a few jobs crosses several chunks
    service = JobService(load_config(str(config_path)))
    yield service
    service.close()


def walk(svc: JobService, limit: int, **filters) -> list[list[int]]:
    """Every page's ids, following each page's cursor until the last."""
    pages, cursor = [], None
    while True:
        with svc.paged(filters.get("owner"), filters.get("states"), limit, cursor) as page:
            ids = [j.id for j in page.jobs]
        assert ids == sorted(ids)   # a page lists oldest first, as status does
        pages.append(ids)
        if page.next_cursor is None:
            return pages
        assert page.next_cursor == ids[0]   # the next page starts below the oldest shown
        cursor = page.next_cursor


@pytest.mark.parametrize("limit", [1, 4, 7, 100])
def test_pages_chained_by_their_cursor_list_every_job_once_newest_page_first(config_path, svc, limit):
    ids = record_jobs(config_path, MIX * 5, history=True)
    pages = walk(svc, limit)
    assert [i for p in reversed(pages) for i in p] == ids
    assert all(len(p) == limit for p in pages[:-1]) and 0 < len(pages[-1]) <= limit
    firsts = [p[0] for p in pages]
    assert firsts == sorted(firsts, reverse=True)


def test_more_counts_the_jobs_the_later_pages_hold(config_path, svc):
    ids = record_jobs(config_path, MIX * 4)
    cursor, seen = None, 0
    while True:
        with svc.paged(None, None, 6, cursor) as page:
            seen += len(list(page.jobs))
        if page.next_cursor is None:
            assert page.more == 0 and seen == len(ids)
            return
        assert page.more == len(ids) - seen
        cursor = page.next_cursor


def test_filters_page_in_the_database(config_path, svc):
    me = access.caller()
    ids = record_jobs(config_path, MIX * 6, owners=[me, "alice-30"])
    owner = {i: [me, "alice-30"][n % 2] for n, i in enumerate(ids)}
    state = {i: MIX[n % len(MIX)] for n, i in enumerate(ids)}
    pages = walk(svc, 4, owner="alice-30", states=[JobState.FAILED, JobState.QUEUED])
    assert [i for p in reversed(pages) for i in p] == [
        i for i in ids if owner[i] == "alice-30" and state[i] in ("failed", "queued")]


def test_every_job_streamed_equals_the_whole_listing(config_path, svc):
    record_jobs(config_path, MIX * 3, history=True)
    with svc.paged(None, None, 0, None) as page:
        streamed = list(page.jobs)
    assert page.next_cursor is None and page.more == 0
    assert streamed == svc.listing().jobs   # crashes and waits too, chunk boundaries or not
    assert any(j.last_crash for j in streamed) and any(j.waiting for j in streamed)


def test_a_job_recorded_between_pages_shifts_no_page(config_path, svc):
    ids = record_jobs(config_path, ["succeeded"] * 9)
    with svc.paged(None, None, 4, None) as page:
        first = [j.id for j in page.jobs]
    record_jobs(config_path, ["queued"])
    with svc.paged(None, None, 4, page.next_cursor) as second:
        assert [j.id for j in second.jobs] == ids[1:5] and first == ids[5:]


def test_an_empty_page_and_a_cursor_below_every_job(config_path, svc):
    with svc.paged(None, None, 5, None) as page:
        assert list(page.jobs) == [] and page.next_cursor is None
    ids = record_jobs(config_path, ["succeeded"] * 3)
    with svc.paged(None, None, 5, ids[0]) as page:
        assert list(page.jobs) == [] and page.next_cursor is None


def test_a_table_page_counts_all_of_an_arrays_jobs(config_path, svc):
    ids = record_jobs(config_path, ["succeeded"] * 6)
    with svc.sessions.begin() as s:
        for n, i in enumerate(ids):
            job = s.get(Job, i)
            job.array_id, job.array_index = ids[0], n
    shown = svc.listing_page(None, None, 2, None)
    assert [j.id for j in shown.jobs] == ids[-2:] and shown.next_cursor == ids[-2] and shown.more == 4
    assert shown.arrays == {ids[0]: {JobState.SUCCEEDED: 6}}


def test_records_are_the_callers_view(config_path, svc):
    """Another user's crash comes without its traceback, as in every listing."""
    record_jobs(config_path, ["failed"], owners=["alice-30"], history=True)
    with svc.sessions.begin() as s:
        job = s.get(Job, 1)
        crash = next(e for e in job.events if e.kind != "state")
        crash.data = {**crash.data, "traceback": "secret output"}
    with svc.paged(None, None, 0, None) as page:
        (one,) = list(page.jobs)
    assert one.last_crash and "traceback" not in one.last_crash
    assert views.without_output(one) == one


def test_the_kept_progress_is_numbers_only_and_needs_a_whole_step():
    record = {"step": 12, "epoch": 1, "samples_per_s": 80.5, "world_size": 3, "loss": 0.25,
              "workers": {"0": {"share": 8}}, "checkpoint_error": "x" * 10_000}
    assert views.seen_progress(record, 5.0) == {"step": 12, "epoch": 1, "samples_per_s": 80.5,
                                                "world_size": 3, "at": 5.0}
    assert views.seen_progress({"step": 3, "epoch": float("nan"), "samples_per_s": True}, 1.0) == \
        {"step": 3, "at": 1.0}
    for bad in (None, [], {"step": "12"}, {"step": 1.5}, {"step": -1}, {"epoch": 2}):
        assert views.seen_progress(bad, 1.0) is None, bad


def test_another_users_status_shows_the_step_the_owners_last_command_read(tmp_path, monkeypatch):
    from gpuflex.cli import render
    from gpuflex.config import parse_config
    from gpuflex.control.pool import Pool
    from tests.control.test_throughput import report
    from tests.control.test_split import submit
    from tests.fakes.hosts import FakeHost, World

    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=2)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"},
                        "hosts": [{"name": "a", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    monkeypatch.setattr(access, "caller", lambda: "ann")
    owner = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    try:
        job_id, token = submit(world, owner, tmp_path)
        report(world, token, 40.0, 999.0)              # step 40
        owner.refresh()
        with owner.sessions() as s:
            kept = dict(queries.job(s, job_id).progress)
        assert kept["step"] == 40 and kept["samples_per_s"] == 40.0 and kept["at"] > 0
        monkeypatch.setattr(access, "caller", lambda: "bob")   # bob's command cannot ask ann's coordinator
        other = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
        try:
            report(world, token, 40.0, 1000.0, step=41)
            other.refresh()
            assert job_id not in other.progress
            info = other.job(job_id)
            shown = render.job_json(info, progress=other.progress.get(job_id))
            assert shown["step"] == 40 and shown["progress"] is None and shown["progress_seen"]["step"] == 40
        finally:
            other.close()
        # a new run has no step until it reports one: the last run's is not shown as its step
        # (the fault matrix waited for "step >= 1 after the restart" and got the old run's)
        monkeypatch.setattr(access, "caller", lambda: "ann")
        owner.requeue([str(job_id)])
        with owner.sessions() as s:
            assert queries.job(s, job_id).progress is None
        world.progress.pop(token)   # the new run's coordinator has no progress yet
        owner.refresh()
        info = owner.job(job_id)
        assert info.restarts == 1 and render.job_json(info, progress=owner.progress.get(job_id))["step"] is None
    finally:
        owner.close()
