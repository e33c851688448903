"""`gpuflex metrics --serve` scraped by a real Prometheus (tests/prombed.py) on loopback:
a PromQL query's answer is the database's count of jobs by state, and follows a job added
while the exporter runs (so no scrape holds a lock a writer waits on); promtool accepts the
scraped text; SIGTERM and Ctrl-C end the exporter with one line (exit 0 and 130)."""

from __future__ import annotations

import os
import secrets
import signal
import sqlite3
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from gpuflex.config import load_config
from gpuflex.db.engine import open_database
from gpuflex.db.models import Gpu, Host, Job, Worker
from gpuflex.states import JobState, WorkerState
from tests import prombed
from tests.conftest import gpuflex_script, write_config

pytestmark = pytest.mark.e2e

DEADLINE_S = 90


@pytest.fixture
def prometheus_ready():
    reason = prombed.missing_reason()
    if reason is not None:
        if os.geteuid() == 0:
            pytest.fail(f"{reason}: run make test, or apt-get install prometheus")
        pytest.skip(reason)


def seed(url: str) -> None:
    """Jobs of three users in five states; alice's running one and both succeeded ones
    have a worker on the slot host (an ended one held its slot 360 s)."""
    sessions = open_database(url)
    with sessions.begin() as s:
        local = Host(name="local", address="local")
        local.gpus = [Gpu(index=i, kind="slot") for i in range(4)]
        s.add(local)
        now = time.time()
        for i, (user, state) in enumerate([("alice", JobState.RUNNING), ("alice", JobState.SUCCEEDED),
                                           ("bob", JobState.SUCCEEDED), ("bob", JobState.FAILED),
                                           ("carol", JobState.QUEUED), ("carol", JobState.CANCELLED)]):
            j = Job(token=secrets.token_hex(6), name=f"j{i}", state=state, argv=["x"], workdir="/", env={},
                    min_workers=1, max_workers=1, gpus_per_worker=1, user=user, created_at=now - 600,
                    ended_at=now - 60 if state.final else None)
            if state in (JobState.RUNNING, JobState.SUCCEEDED):
                j.workers.append(Worker(wid=0, rank=0, host="local", gpus=[i], started_at=now - 500,
                                        ended_at=now - 140 if state.final else None, log_path="/l", exit_path="/e",
                                        state=WorkerState.EXITED if state.final else WorkerState.RUNNING))
            s.add(j)
    sessions.kw["bind"].dispose()


def by_state(db: Path) -> dict[str, int]:
    """Every state's job count, as the database has it (0 for a state no job is in)."""
    con = sqlite3.connect(str(db), timeout=30)
    try:
        counts = dict(con.execute("SELECT state, count(*) FROM jobs GROUP BY state"))
    finally:
        con.close()
    return {s.value: counts.get(s.value, 0) for s in JobState}


def serve(home: Path, config: Path, port: int) -> subprocess.Popen:
    """An exporter on 127.0.0.1:port, once it answers a scrape."""
    log = open(home / f"exporter-{port}.log", "wb")
    p = subprocess.Popen([gpuflex_script(), "metrics", "--serve", "--bind", f"127.0.0.1:{port}"],
                         env={**os.environ, "HOME": str(home), "GPUFLEX_CONFIG": str(config)},
                         stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and p.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5):
                return p
        except OSError:
            time.sleep(0.2)
    p.kill()
    p.wait()
    pytest.fail(f"the exporter did not answer: {(home / f'exporter-{port}.log').read_text()}")


def poll(prom: prombed.Prometheus, query: str, want: dict[str, int]) -> dict[str, int]:
    """The query's answer (state -> value) once it equals `want`, or the last one at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    got: dict[str, int] = {}
    while time.monotonic() < deadline:
        got = {r["metric"].get("state", ""): int(float(r["value"][1])) for r in prom.query(query)}
        if got == want:
            break
        time.sleep(0.5)
    return got


def test_prometheus_scrapes_every_state_as_the_database_counts_it(home, prometheus_ready):
    config = write_config(home)
    db = home / "g.db"
    seed(load_config(str(config)).database_url)
    ports = [prombed.free_port(), prombed.free_port()]
    exporters: list[subprocess.Popen] = []
    prom = None
    try:
        exporters = [serve(home, config, port) for port in ports]
        prom = prombed.start(home / "prometheus", [f"127.0.0.1:{ports[0]}"])
        query = "sum by (state) (gpuflex_jobs_in_state)"
        want = by_state(db)
        assert want["scaling"] == 0 and want["timeout"] == 0 and want["succeeded"] == 2
        assert poll(prom, query, want) == want
        # bob's ended job held a slot for 360 s (report --by user's count); alice's still runs
        held = 'gpuflex_device_seconds_total{user="bob",device="cpu-slot"}'
        assert poll(prom, held, {"": 360}) == {"": 360}

        # a writer while the exporter is scraped every second: a scrape's read takes
        # milliseconds, so only a transaction held between scrapes would make it time out
        con = sqlite3.connect(str(db), timeout=5)
        try:
            for _ in range(3):
                with con:
                    con.execute("UPDATE jobs SET state = 'timeout' WHERE name = 'j5'")
                time.sleep(0.4)
        finally:
            con.close()
        want = by_state(db)
        assert want["timeout"] == 1 and want["cancelled"] == 0
        assert poll(prom, query, want) == want

        with urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/metrics", timeout=10) as r:
            text = r.read()
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr

        assert all(p.poll() is None for p in exporters), "an exporter died while serving"
        for p, signum in zip(exporters, (signal.SIGTERM, signal.SIGINT)):
            p.send_signal(signum)
        assert [p.wait(timeout=60) for p in exporters] == [0, 130]
        for port, last in zip(ports, ("stopped (SIGTERM)", "stopped (Ctrl-C)")):
            lines = (home / f"exporter-{port}.log").read_text().splitlines()
            assert lines[0].startswith(f"serving metrics on http://127.0.0.1:{port}/metrics"), lines
            assert lines[1:] == [last], lines
    finally:
        if prom is not None:
            prom.stop()
        for p in exporters:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
