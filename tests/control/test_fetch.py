"""gpuflex.control.fetch's decisions before any host is asked: PATH's checks and which
hosts a job is fetched from (the copying: tests/cli/test_fetch_cmd.py)."""

from __future__ import annotations

import pytest

from gpuflex.config import load_config
from gpuflex.control import access
from gpuflex.control.fetch import check_path, fetch, hosts_of
from gpuflex.hosts.transport import LocalTransport
from gpuflex.control.views import JobInfo, WorkerInfo
from gpuflex.errors import UsageError
from gpuflex.states import JobState, WorkerState
from tests.conftest import write_config


@pytest.mark.parametrize("path, normal", [("out/", "out"), ("./out//a.pt", "out/a.pt"), (".", ".")])
def test_a_relative_path_is_normalized(path, normal):
    assert check_path(path) == normal


@pytest.mark.parametrize("path", ["", "/etc/passwd", "~/x", "..", "out/../../x", "a\0b"])
def test_a_path_leaving_the_jobs_directory_is_refused(path):
    with pytest.raises(UsageError):
        check_path(path)


def job(*hosts: str, workdir: str = "/w", user: str = "u") -> JobInfo:
    workers = tuple(WorkerInfo(i, i, h, (i,), None, WorkerState.EXITED, 1, 0, "l", None) for i, h in enumerate(hosts))
    return JobInfo(id=4, name="j", state=JobState.SUCCEEDED if hosts else JobState.QUEUED, user=user, argv=("x",),
                   workdir=workdir, env={}, min_workers=1, max_workers=1, target_workers=1, world_size=1,
                   generation=1, gpus_per_worker=1, priority=0, harvest=False, restarts=0, queue_reason=None,
                   exit_code=None, exit_reason=None, created_at=0.0, started_at=None, ended_at=None,
                   workers=workers)


def test_every_host_a_worker_ran_on_once_in_order_or_the_one_asked_for():
    assert hosts_of(job("b", "a", "b"), None) == ["b", "a"]
    assert hosts_of(job("b", "a"), "a") == ["a"]
    with pytest.raises(UsageError, match="did not run on c; its hosts: b, a"):
        hosts_of(job("b", "a"), "c")
    with pytest.raises(UsageError, match="never run"):
        hosts_of(job(), None)


class BothHere:
    """A pool whose every host is this machine (both "hosts" read the same directory)."""

    def __init__(self, config):
        self.config = config

    def transport(self, name):
        return LocalTransport(self.config.host(name))


def test_several_hosts_each_get_their_own_directory_unless_one_is_chosen(home):
    config = load_config(str(write_config(home, extra='\n[[hosts]]\nname = "far"\naddress = "far.lab"\n'
                                                      'gpus = "cpu:2"\n')))
    ran = home / "ran"
    (ran / "out").mkdir(parents=True)
    (ran / "out" / "a.txt").write_text("a")
    two = job("local", "far", workdir=str(ran), user=access.caller())
    got = fetch(config, BothHere(config), two, "out/a.txt", None, str(home / "back"))
    assert [(f.host, f.dest, f.files) for f in got] == [("local", str(home / "back/local/a.txt"), 1),
                                                        ("far", str(home / "back/far/a.txt"), 1)]
    assert (home / "back/far/a.txt").read_text() == "a"
    got = fetch(config, BothHere(config), two, "out", "far", str(home / "one"))
    assert [(f.host, f.dest) for f in got] == [("far", str(home / "one/out"))]
    assert (home / "one/out/a.txt").read_text() == "a"
    with pytest.raises(UsageError, match="local: out/b.txt is not in .*; far: out/b.txt is not in"):
        fetch(config, BothHere(config), two, "out/b.txt", None, str(home / "none"))
    assert not (home / "none").exists()
