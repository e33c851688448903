"""Webhooks (`submit --notify URL`, `[notify]`): posted once per move a user hears of, only
after the command's transaction committed; a receiver that fails or is not there never
fails a command; a bad URL is refused before anything is written.

The receiver is a real HTTP server on 127.0.0.1 in a thread of the test.
"""

from __future__ import annotations

import http.server
import json
import secrets
import socket
import threading

import pytest

from gpuflex.config import load_config, parse_config
from gpuflex.control import journal, notify
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from gpuflex.states import JobState
from tests.conftest import GpuflexCLI, cleanup_jobs, db_dump, py, write_config
from tests.fakes.hosts import FakeHost, World
from tests.cli.test_cli import make_cli


class Receiver:
    """An HTTP server on 127.0.0.1 that keeps every POST (path, headers, raw body) and
    answers `status`."""

    def __init__(self) -> None:
        self.posts: list[dict] = []
        self.status = 200
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.posts.append({"path": self.path, "type": self.headers.get("Content-Type"), "raw": body})
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def bodies(self, path: str) -> list[dict]:
        return [json.loads(p["raw"]) for p in self.posts if p["path"] == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the rules, without processes --------------------------------------------------------
@pytest.mark.parametrize("target,cause,expected", [
    (JobState.SUCCEEDED, None, "succeeded"),
    (JobState.FAILED, None, "failed"),
    (JobState.TIMEOUT, None, "timeout"),
    (JobState.CANCELLED, None, "cancelled"),
    (JobState.QUEUED, "preempted", "preempted"),      # a higher-priority job took the GPUs
    (JobState.QUEUED, "requeue", "preempted"),        # the harvest tick gave them back to the owner
    (JobState.QUEUED, "store-lost", None),            # a fault: the job goes on by itself
    (JobState.QUEUED, "crash", None),
    (JobState.RUNNING, None, None),
    (JobState.SCALING, None, None),
])
def test_which_moves_are_told(target, cause, expected):
    assert notify.event_of(target, cause) == expected


@pytest.fixture
def service(home):
    svc = JobService(load_config(str(write_config(home))))
    yield svc
    svc.outbox.close()
    svc.pool.close()


def add_job(svc: JobService, url: str | None, state: JobState = JobState.RUNNING) -> int:
    with svc.sessions.begin() as session:
        job = Job(token=f"t0k3n{secrets.token_hex(4)}", name="j", state=state, argv=["x"], workdir="/", env={"TOKEN": "hush"},
                  min_workers=1, max_workers=1, gpus_per_worker=1, user="alice", notify_url=url)
        session.add(job)
        session.flush()
        return job.id


def test_a_rolled_back_move_posts_nothing_and_a_committed_one_posts_once(service, receiver):
    job_id = add_job(service, receiver.url + "/hook")
    with pytest.raises(RuntimeError):
        with service.sessions.begin() as session:
            journal.set_state(session, session.get(Job, job_id), JobState.FAILED, "boom", exit_code=1)
            raise RuntimeError("the command failed after the move")
    assert service.outbox.take() == []
    with service.sessions.begin() as session:
        journal.set_state(session, session.get(Job, job_id), JobState.SUCCEEDED, "all workers exited 0",
                          exit_code=0)
    service.notify()
    service.notify()   # nothing left: at most once
    (body,) = receiver.bodies("/hook")
    assert body["job"] == job_id and body["event"] == body["state"] == "succeeded"
    assert body["exit_code"] == 0 and body["user"] == "alice" and body["reason"] == "succeeded: all workers exited 0"
    assert receiver.posts[0]["type"] == "application/json"
    raw = receiver.posts[0]["raw"].decode()
    assert "hush" not in raw and "secret" not in raw and "t0k3n" not in raw
    with service.sessions() as session:
        kinds = [e.kind for e in session.get(Job, job_id).events]
    assert kinds.count("notified") == 1 and "notify-failed" not in kinds


def test_only_the_configured_events_are_posted(home, receiver):
    cfg = write_config(home, extra='\n[notify]\nevents = ["failed"]\n')
    svc = JobService(load_config(str(cfg)))
    try:
        ok, bad = add_job(svc, receiver.url + "/ok"), add_job(svc, receiver.url + "/bad")
        with svc.locked() as session:
            journal.set_state(session, session.get(Job, ok), JobState.SUCCEEDED, "done", exit_code=0)
            journal.set_state(session, session.get(Job, bad), JobState.FAILED, "exit 3", exit_code=3)
        # locked() posts once its transaction committed and its lock is released
        assert receiver.bodies("/ok") == []
        assert [b["exit_code"] for b in receiver.bodies("/bad")] == [3]
    finally:
        svc.close()


def test_a_receiver_that_never_answers_is_given_up_after_the_timeout():
    with socket.socket() as s:   # listens (the kernel accepts the connection) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        note = notify.Note(1, "failed", f"http://127.0.0.1:{s.getsockname()[1]}/x", {"job": 1})
        ((_, why),) = notify.post_all([note], timeout_s=0.5)
    assert why is not None and "timed out" in why


def test_a_receiver_that_refuses_is_recorded_as_failed(service, receiver):
    receiver.status = 500
    job_id = add_job(service, receiver.url + "/x?token=abc")
    with service.sessions.begin() as session:
        journal.set_state(session, session.get(Job, job_id), JobState.TIMEOUT, "time limit 0:01:00 reached")
    service.notify()
    assert len(receiver.posts) == 1
    with service.sessions() as session:
        (ev,) = [e for e in session.get(Job, job_id).events if e.kind == "notify-failed"]
    assert "HTTP 500" in ev.message and ev.data["event"] == "timeout"
    assert "token=abc" not in ev.message   # the URL's path and query may hold its secret


def test_a_preempted_job_posts_preempted_from_the_submit_that_preempted_it(tmp_path, receiver):
    """On a simulated 4-GPU host (tests/fakes/hosts.py): a --requeue job holding every GPU
    is stopped and requeued by a higher-priority submit, which posts its webhook."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    try:
        def submit(lo, **kw):
            return svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=lo, max_workers=lo,
                                            workdir=str(tmp_path), **kw))

        low = submit(4, requeue=True, notify=receiver.url + "/low")
        assert receiver.posts == []   # started: nobody is told
        high = submit(2, priority=10)
        assert svc.job(low).state is JobState.QUEUED
        (body,) = receiver.bodies("/low")
        assert (body["job"], body["event"], body["state"]) == (low, "preempted", "queued")
        assert body["reason"] == f"queued: preempted by job {high} (priority 10)" and body["restarts"] == 1
    finally:
        svc.close()


# ---- real CLI runs -----------------------------------------------------------------------
def test_jobs_that_end_post_once_and_an_unreachable_url_fails_nothing(home, receiver):
    """Three tiny jobs at once: a success to --notify's URL, a failure to [notify] url (the
    default), a success whose URL nobody listens on."""
    dead = f"http://127.0.0.1:{closed_port()}/gone"
    cfg = write_config(home, extra=f'\n[notify]\nurl = "{receiver.url}/default"\n')
    gf = GpuflexCLI(home, cfg)
    try:
        ok = gf.submit(py("print('fine')"), "--notify", receiver.url + "/ok", "--env", "API_KEY=hush")
        bad = gf.submit(py("import sys; sys.exit(3)"))
        lost = gf.submit(py("pass"), "--notify", dead)
        states = {n: gf.wait_final(j["id"])["state"] for n, j in (("ok", ok), ("bad", bad), ("lost", lost))}
        assert states == {"ok": "succeeded", "bad": "failed", "lost": "succeeded"}
        for _ in range(2):   # later commands post nothing again
            p = gf("status", "--json")
            assert p.returncode == 0 and "Traceback" not in p.stderr
        (body,) = receiver.bodies("/ok")
        assert (body["job"], body["event"], body["exit_code"], body["name"]) == (ok["id"], "succeeded", 0, ok["name"])
        assert body["started_at"] <= body["ended_at"] and body["array_id"] is None
        assert b"hush" not in receiver.posts[0]["raw"]
        (body,) = receiver.bodies("/default")
        assert (body["job"], body["event"], body["state"]) == (bad["id"], "failed", "failed")
        assert body["exit_code"] == 3 and "3" in body["reason"]
        assert {p["path"] for p in receiver.posts} == {"/ok", "/default"}
        events = {e["kind"] for e in gf.json("events", str(lost["id"]))}
        assert "notify-failed" in events and "notified" not in events
        assert "notified" in {e["kind"] for e in gf.json("events", str(ok["id"]))}
    finally:
        cleanup_jobs(gf, home / "g.db")


@pytest.mark.parametrize("url", ["ftp://example.org/x", "http://", "example.org/hook", "http://a b/",
                                 "http://x/\x01", "https://x:99999/", "file:///etc/passwd", "http://x/" + "a" * 3000])
def test_a_bad_webhook_url_exits_2_with_one_line_and_changes_nothing(home, config_path, url):
    cli = make_cli("clirunner", home, config_path)
    assert cli("status").code == 0
    before = db_dump(home / "g.db")
    r = cli("submit", "--notify", url, "--", "python", "-c", "pass")
    assert r.code == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: --notify") and len(r.stderr.strip().splitlines()) == 1
    assert db_dump(home / "g.db") == before


def test_a_bad_notify_table_names_the_key(home):
    cfg = write_config(home, extra='\n[notify]\nurl = "gopher://x"\n')
    r = make_cli("clirunner", home, cfg)("status")
    assert r.code == 2 and "notify.url" in r.stderr and "http" in r.stderr
