"""gpuflex.control.intents: a run noted before its first spawn is forgotten once its job
records it, and ended on its hosts otherwise (a fake pool here: no processes;
tests/control/test_launch_intents_fake_hosts.py kills real commands half-way)."""

from __future__ import annotations

import json
import stat

import pytest

from gpuflex.config import load_config
from gpuflex.control import intents
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from gpuflex.errors import DatabaseError, TransportError
from tests.conftest import write_config


class Host:
    def __init__(self, pool: "Pool", name: str) -> None:
        self.pool, self.name = pool, name

    def hostop(self, op, request):
        if self.name in self.pool.down:
            raise TransportError(self.name, "unreachable")
        self.pool.ended.append((self.name, op, request["socket_dir"]))
        return [4242]


class Pool:
    """The pool's transport per host: `end-run` answered, or TransportError for a host in `down`."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, str, str]] = []
        self.down: set[str] = set()

    def transport(self, host):
        return Host(self, host.name)


@pytest.fixture
def svc(home):
    cfg = write_config(home, extra='\n[[hosts]]\nname = "far"\naddress = "far.lab"\ngpus = [0]\n')
    service = JobService(load_config(str(cfg)))
    yield service
    service.close()


def entries(svc) -> list[dict]:
    path = intents.intents_path(svc.config.database_url)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_file_sits_beside_a_sqlite_database_owner_only(svc, home):
    intents.note(svc.config.database_url, 7, "/s/7", ["local", "far", "local"])
    path = intents.intents_path(svc.config.database_url)
    assert path == home / ("g.db" + intents.SUFFIX)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert entries(svc) == [{"job": 7, "socket_dir": "/s/7", "hosts": ["far", "local"]}]


def test_a_server_database_gets_a_file_in_the_users_state_directory(home):
    path = intents.intents_path("postgresql+psycopg://u@db.lab/gpuflex")
    assert path.parent == home / ".local/state/gpuflex" and path.name.startswith("launches-")
    assert path != intents.intents_path("postgresql+psycopg://u@db.lab/other")


def test_a_committed_run_is_forgotten_and_an_uncommitted_one_ended(svc, home):
    with svc.sessions.begin() as s:
        s.add(Job(token="t1", name="j", state="running", argv=["true"], workdir=str(home), env={}, min_workers=1,
                  max_workers=1, gpus_per_worker=1, user="u", world_size=1, socket_dir="/s/1"))
    url = svc.config.database_url
    intents.note(url, 1, "/s/1", ["local"])           # committed: the job records this run
    intents.note(url, 1, "/s/1-old", ["local"])       # an earlier try of the same job, never committed
    intents.note(url, 2, "/s/2", ["local", "far"])    # a job that never made it into the database
    pool = Pool()
    with svc.sessions.begin() as s:
        ended = intents.settle(svc.config, pool, s)
    assert [e["socket_dir"] for e in ended] == ["/s/1-old", "/s/2"]
    assert sorted(pool.ended) == [("far", "end-run", "/s/2"), ("local", "end-run", "/s/1-old"),
                                  ("local", "end-run", "/s/2")]
    assert not intents.intents_path(url).exists()


def test_a_host_that_cannot_be_reached_keeps_its_entry_for_the_next_command(svc):
    intents.note(svc.config.database_url, 3, "/s/3", ["local", "far", "gone-from-config"])
    pool = Pool()
    pool.down.add("far")
    with svc.sessions.begin() as s:
        assert intents.settle(svc.config, pool, s) == []
    assert entries(svc) == [{"job": 3, "socket_dir": "/s/3", "hosts": ["far"]}]
    pool.down.clear()
    with svc.sessions.begin() as s:
        assert [e["job"] for e in intents.settle(svc.config, pool, s)] == [3]


def test_garbage_lines_are_skipped(svc):
    path = intents.intents_path(svc.config.database_url)
    path.write_text('not json\n[1]\n{"job": "x", "socket_dir": "/s", "hosts": []}\n')
    intents.note(svc.config.database_url, 4, "/s/4", ["local"])
    with svc.sessions.begin() as s:
        assert [e["job"] for e in intents.settle(svc.config, Pool(), s)] == [4]


def test_a_launch_that_cannot_be_noted_is_one_database_error_before_anything_spawns(tmp_path):
    """A full disk (or any write error) beside the database: the run is not started."""
    url = f"sqlite:///{tmp_path}/g.db"
    intents.intents_path(url).mkdir()   # a directory where the file goes: the write fails
    with pytest.raises(DatabaseError, match=r"cannot note the launch of job 3 in .*g\.db\.launches: .*; "
                                            "the job was not started"):
        intents.note(url, 3, "/tmp/s", ["local"])
