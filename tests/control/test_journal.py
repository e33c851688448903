"""Repeated events are one row with a count, and `status` reads a few rows whatever a
job's history holds: the real journal, DB and service (on simulated hosts), with the SQL
counted by SQLAlchemy event listeners, never timed."""

from __future__ import annotations

import contextlib
import time

import pytest
from sqlalchemy import event, insert

from gpuflex.cli import render
from gpuflex.config import parse_config
from gpuflex.control import journal
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.db.models import Event, Job
from gpuflex.states import JobState as J
from tests.fakes.hosts import FakeHost, World


@pytest.fixture
def svc(tmp_path):
    """The service over a simulated 4-GPU host whose processes start at once."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    service = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    yield service
    service.close()


def running_job(svc: JobService, tmp_path) -> int:
    job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=2,
                                      workdir=str(tmp_path)))
    svc.refresh()
    assert svc.job(job_id, events=False).state is J.RUNNING
    return job_id


def rows(svc: JobService, job_id: int) -> list[tuple[str, str, int]]:
    return [(e.kind, e.message, e.count) for e in svc.job(job_id).events]


def test_five_thousand_identical_events_are_one_row_with_their_count_and_last_time(svc, tmp_path):
    job_id = running_job(svc, tmp_path)
    before = len(svc.job(job_id).events)
    start = time.time()
    with svc.locked() as s:
        job = svc.get(s, job_id)
        for g in range(5000):
            journal.record(s, job, "rollback", f"generation {g + 2}: state checksums differ across members; "
                                               "rolled back", generation=g + 2)
    events = svc.job(job_id).events
    assert len(events) == before + 1
    last = events[-1]
    assert (last.kind, last.count) == ("rollback", 5000)
    assert last.message == "generation 5001: state checksums differ across members; rolled back"
    assert last.data == {"generation": 5001}            # the newest details
    assert start <= last.time <= last.last_time <= time.time()


def test_only_a_repeat_of_the_last_event_is_counted_and_state_changes_never_are(svc, tmp_path):
    job_id = running_job(svc, tmp_path)
    with svc.locked() as s:
        job = svc.get(s, job_id)
        for message in ("a", "a", "b", "a", "a", "a"):
            journal.record(s, job, "host-unreachable", message)
        journal.record(s, job, "fault", "a")             # another kind: its own row
        journal.record(s, job, "worker", "worker 1 on pool was lost")
        journal.record(s, job, "worker", "worker 2 on pool was lost")   # other numbers are not set aside
        journal.set_state(s, job, J.SCALING, "resize to 3 requested")
        journal.set_state(s, job, J.RUNNING, "world size 2 at generation 1")
        journal.set_state(s, job, J.SCALING, "resize to 3 requested")
        journal.set_state(s, job, J.RUNNING, "world size 2 at generation 1")
    assert rows(svc, job_id)[-10:] == [
        ("host-unreachable", "a", 2), ("host-unreachable", "b", 1), ("host-unreachable", "a", 3),
        ("fault", "a", 1), ("worker", "worker 1 on pool was lost", 1), ("worker", "worker 2 on pool was lost", 1),
        ("state", "scaling: resize to 3 requested", 1), ("state", "running: world size 2 at generation 1", 1),
        ("state", "scaling: resize to 3 requested", 1), ("state", "running: world size 2 at generation 1", 1)]


def test_events_show_the_count_and_the_last_time(svc, tmp_path):
    job_id = running_job(svc, tmp_path)
    with svc.locked() as s:
        job = svc.get(s, job_id)
        for _ in range(3):
            journal.record(s, job, "host-unreachable", "pool: connection refused")
    info = svc.job(job_id)
    e = info.events[-1]
    assert render.event_json(e)["count"] == 3 and render.event_json(e)["last_time"] == e.last_time
    table = render.events_table(info, [e])
    cell = table.columns[2]._cells[0]
    assert cell == f"pool: connection refused (x3, last {time.strftime('%H:%M:%S', time.localtime(e.last_time))})"
    assert render.event_json(info.events[0])["count"] == 1 and info.events[0].last_time is None


@contextlib.contextmanager
def counted(svc: JobService):
    """Statements issued and Event rows loaded while the block runs."""
    engine = svc.sessions.kw["bind"]
    seen = {"statements": 0, "events_loaded": 0, "event_selects": []}

    def on_execute(conn, cursor, statement, params, context, executemany):
        seen["statements"] += 1
        if "FROM events" in statement:
            seen["event_selects"].append(statement)

    def on_load(target, context):
        seen["events_loaded"] += 1

    event.listen(engine, "before_cursor_execute", on_execute)
    event.listen(Event, "load", on_load)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
        event.remove(Event, "load", on_load)


def status_reads(svc: JobService, job_id: int) -> dict:
    """What `gpuflex status ID` (and the listing) read: a refresh, the job, all jobs."""
    with counted(svc) as seen:
        svc.refresh()
        render.job_json(svc.job(job_id, events=False))
        render.jobs_table(svc.jobs(), svc.progress)
    return seen


def add_history(svc: JobService, job_id: int, n: int) -> None:
    """`n` distinct old events (a long history: nothing to coalesce), in one insert."""
    with svc.locked() as s:
        t0 = svc.get(s, job_id).started_at
        s.execute(insert(Event), [{"job_id": job_id, "time": t0 + i * 1e-6, "kind": kind, "message": f"{kind} {i}",
                                   "data": {"generation": 1, "wid": i % 2, "count": i}, "count": 1}
                                  for i in range(n) for kind in [("scale", "checkpoint-failed", "worker")[i % 3]]])


def test_status_reads_a_few_rows_whatever_the_job_s_history_holds(svc, tmp_path):
    small, big = running_job(svc, tmp_path), running_job(svc, tmp_path)
    add_history(svc, small, 20)
    add_history(svc, big, 20_000)
    status_reads(svc, big)                      # the first refresh after the inserts settles what it records
    few, many = status_reads(svc, small), status_reads(svc, big)
    assert many["statements"] == few["statements"]        # the same queries, whatever the history
    # a handful per job shown (its newest state and generation events), not its history
    assert many["events_loaded"] == few["events_loaded"] <= 25
    # no query reads a job's events unbounded: each is limited or an aggregate
    for sql in many["event_selects"]:
        assert "LIMIT" in sql or "max(" in sql or "sum(" in sql, sql
