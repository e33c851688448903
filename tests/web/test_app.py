"""gpuflex.web.app (and gpuflex.web.pages): the dashboard's four pages through Starlette's
in-process test client, on a database written straight through the models (no process,
no server): what each page shows, what another user's job hides, bad query parameters
as one line and HTTP 400, an unknown job as 404, and that no page writes the database.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from starlette.testclient import TestClient

from gpuflex.config import load_config
from gpuflex.control import access
from gpuflex.control.service import JobService
from gpuflex.db.models import Event, Host
from gpuflex.web.app import create_app
from tests.conftest import db_dump, write_config
from tests.control.test_acct import H, add_job

SECRET_TRACEBACK = "Traceback: the-secret-line"


@pytest.fixture
def lab(home, monkeypatch):
    """A pool with an owned host, jobs of the caller ("me") and of bob: the caller's scaled
    in place (a scale event with its phase timings, a fault), bob's failed with a crash
    whose traceback is his output, and one queued with a reason."""
    monkeypatch.setattr(access, "caller", lambda: "me")
    cfg = write_config(home)
    config = load_config(str(cfg))
    svc = JobService(config)
    now = time.time()
    svc.refresh()
    with svc.sessions.begin() as s:
        s.add(Host(name="owned", address="10.0.0.8", owner="prof"))
        mine = add_job(s, "m1", "me", "grow-me", "succeeded", now - 3 * H, now - 1 * H,
                       [("local", [0], now - 2.5 * H, now - 1 * H), ("local", [1], now - 2 * H, now - 1 * H)],
                       [(now - 2.5 * H, {"state": "running", "world_size": 1}),
                        (now - 2 * H, {"members": [0, 1], "ok": True, "timings": {"detect": 0.012, "agree": 0.034,
                                                                                   "total": 0.5}}),
                        (now - 1 * H, {"state": "succeeded"})])
        mine.events.append(Event(time=now - 1.5 * H, kind="fault", message="worker 1 lost, went on with 1",
                                 data={"members": [0], "ok": True}, count=1))
        bob = add_job(s, "b1", "bob", "bobs-run", "failed", now - 5 * H, now - 4 * H,
                      [("local", [2], now - 5 * H, now - 4 * H)], [(now - 5 * H, {"state": "running", "world_size": 1})],
                      exit_code=3)
        bob.events.append(Event(time=now - 4 * H, kind="crash", message="worker 0 crashed",
                                data={"wid": 0, "host": "local", "error": "boom", "traceback": SECRET_TRACEBACK},
                                count=1))
        bob.env = {"WANDB_KEY": "hunter2"}
        q = add_job(s, "q1", "bob", "waiting-one", "queued", now - 0.5 * H, None, [], exit_code=None)
        q.queue_reason = "needs 8 devices, the pool has 4 free"
    ids = {}
    with svc.sessions() as s:
        from gpuflex.db import queries
        for j in queries.jobs(s):
            ids[j.name] = j.id
    client = TestClient(create_app(config, svc.sessions, pool=svc.pool), raise_server_exceptions=True)
    yield client, ids, home / "g.db", svc
    svc.close()


def test_the_pool_page_shows_the_hosts_devices_and_a_timeline(lab):
    client, _ids, _db, _svc = lab
    r = client.get("/?range=1d")
    assert r.status_code == 200, r.text
    assert "<svg" in r.text and 'class="busy"' in r.text   # the caller's job held slots in the last day
    assert "<td>local</td>" in r.text and "slot 0" in r.text
    assert "viewing as me" in r.text


def test_the_queue_page_lists_jobs_with_their_reasons(lab):
    client, ids, _db, _svc = lab
    r = client.get("/queue")
    assert r.status_code == 200
    assert "needs 8 devices, the pool has 4 free" in r.text
    assert f'href="/jobs/{ids["grow-me"]}"' in r.text and "bobs-run" in r.text


def test_my_job_page_shows_its_world_size_events_and_phase_timings(lab):
    client, ids, _db, _svc = lab
    r = client.get(f"/jobs/{ids['grow-me']}")
    assert r.status_code == 200
    assert 'class="world"' in r.text and 'class="mark fault"' in r.text
    assert "worker 1 lost, went on with 1" in r.text
    assert "<td>12</td><td>34</td>" in r.text   # detect and agree, in ms


def test_another_users_job_shows_as_the_queue_shows_it(lab):
    client, ids, _db, _svc = lab
    r = client.get(f"/jobs/{ids['bobs-run']}")
    assert r.status_code == 200
    assert "bobs-run" in r.text and "failed" in r.text
    assert SECRET_TRACEBACK not in r.text and "hunter2" not in r.text and "WANDB_KEY" not in r.text
    assert "worker 0 crashed" not in r.text and "its owner's and the admins'" in r.text


def test_behind_a_proxy_the_viewer_is_the_header_s_user(lab):
    _client, ids, _db, svc = lab
    client = TestClient(create_app(svc.config, svc.sessions, user_header="X-Forwarded-User", pool=svc.pool))
    r = client.get(f"/jobs/{ids['bobs-run']}", headers={"X-Forwarded-User": "bob"})
    assert r.status_code == 200 and "viewing as bob" in r.text
    assert "worker 0 crashed" in r.text   # his own job's events
    r = client.get(f"/jobs/{ids['grow-me']}", headers={"X-Forwarded-User": "bob"})
    assert "worker 1 lost" not in r.text   # not his
    r = client.get("/queue")
    assert r.status_code == 401 and r.text.startswith("no X-Forwarded-User header")


def test_an_admin_reads_every_job(lab):
    _client, ids, _db, svc = lab
    admin = dataclasses.replace(svc.config, access=dataclasses.replace(svc.config.access, admins=("carol",)))
    client = TestClient(create_app(admin, svc.sessions, user_header="X-Forwarded-User", pool=svc.pool))
    r = client.get(f"/jobs/{ids['bobs-run']}", headers={"X-Forwarded-User": "carol"})
    assert "worker 0 crashed" in r.text


def test_the_accounting_page_sums_the_rows_per_user_and_host(lab):
    client, _ids, _db, _svc = lab
    r = client.get("/acct?range=7d")
    assert r.status_code == 200
    assert "2 jobs ended in this range" in r.text
    assert "me" in r.text and "bob" in r.text and "<svg" in r.text


@pytest.mark.parametrize("url, line", [
    ("/?range=2y", "range='2y': give one of 1d, 7d, 30d"),
    ("/acct?since=yesterday", "since 'yesterday': expected a duration"),
    ("/acct?since=1d&until=2d", "until= is not after since="),
    ("/acct?range=1d&since=2d", "range= and since=/until=: choose one."),
    ("/?colour=red", "unknown parameter 'colour'"),
    ("/queue?x=1", "unknown parameter 'x'"),
    ("/jobs/abc", "job 'abc': give a job id"),
])
def test_bad_query_parameters_are_one_line_and_400(lab, url, line):
    client, _ids, _db, _svc = lab
    r = client.get(url)
    assert r.status_code == 400, r.text
    assert line in r.text and r.text.count("\n") == 1


def test_an_unknown_job_is_404(lab):
    client, _ids, _db, _svc = lab
    r = client.get("/jobs/99999")
    assert r.status_code == 404 and r.text == "no job 99999.\n"


def test_no_page_writes_the_database(lab):
    client, ids, db, _svc = lab
    before = db_dump(db)
    for url in ("/", "/?range=7d", "/queue", f"/jobs/{ids['grow-me']}", f"/jobs/{ids['bobs-run']}", "/acct"):
        assert client.get(url).status_code == 200
    assert db_dump(db) == before
