"""gpuflex.control.reads, the service's read side: without the ops lock, the pool or a
refresh, over a database as it is (the jobs' own listings: tests/control/test_views.py,
tests/cli/test_status_cmd.py)."""

from __future__ import annotations

import pytest

from gpuflex.config import parse_config
from gpuflex.control import access
from gpuflex.control.reads import Reads
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.pool import Pool
from gpuflex.control.service import JobService
from gpuflex.control.access import NotReaderError
from gpuflex.errors import UnknownJobError
from tests.conftest import db_dump
from tests.fakes.hosts import FakeHost, World


@pytest.fixture
def reads(tmp_path, monkeypatch):
    """Two jobs of alice's, queued (the one GPU is its owner's), read through a Reads of
    their own."""
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    world = World(gpus_per_host=1)
    world.blocked = {("pool", 0)}
    monkeypatch.setattr(access, "caller", lambda: "alice")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    for name in ("first", "second"):
        svc.submit(SubmitRequest(argv=["true"], name=name, workdir=str(tmp_path)))
    yield Reads(cfg, svc.sessions)
    svc.close()


def test_a_job_by_id_or_name_and_an_unknown_one(reads, tmp_path):
    before = db_dump(tmp_path / "g.db")
    assert reads.job(1, events=False).name == "first" and reads.job("second").id == 2
    with pytest.raises(UnknownJobError):
        reads.job("third")
    assert [j.id for j in reads.listing().jobs] == [1, 2]
    assert db_dump(tmp_path / "g.db") == before   # a read writes nothing


def test_another_user_sees_the_job_but_not_its_output(reads, monkeypatch):
    monkeypatch.setattr(access, "caller", lambda: "bob")
    assert reads.job(1).user == "alice"
    with pytest.raises(NotReaderError):
        reads.check_reader(1, "logs")
