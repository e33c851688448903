"""gpuflex.control.fetch's decisions before any host is asked: PATH's checks and which
hosts a job is fetched from (the copying: tests/cli/test_fetch_cmd.py)."""

from __future__ import annotations

import pytest

from gpuflex.control.fetch import check_path, hosts_of
from gpuflex.control.views import JobInfo, WorkerInfo
from gpuflex.errors import UsageError
from gpuflex.states import JobState, WorkerState


@pytest.mark.parametrize("path, normal", [("out/", "out"), ("./out//a.pt", "out/a.pt"), (".", ".")])
def test_a_relative_path_is_normalized(path, normal):
    assert check_path(path) == normal


@pytest.mark.parametrize("path", ["", "/etc/passwd", "~/x", "..", "out/../../x", "a\0b"])
def test_a_path_leaving_the_jobs_directory_is_refused(path):
    with pytest.raises(UsageError):
        check_path(path)


def job(*hosts: str) -> JobInfo:
    workers = tuple(WorkerInfo(i, i, h, (i,), None, WorkerState.EXITED, 1, 0, "l", None) for i, h in enumerate(hosts))
    return JobInfo(id=4, name="j", state=JobState.SUCCEEDED if hosts else JobState.QUEUED, user="u", argv=("x",),
                   workdir="/w", env={}, min_workers=1, max_workers=1, target_workers=1, world_size=1,
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
