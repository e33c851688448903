"""`gpuflex fetch` in-process (issue 33) on the local host: what it refuses (one line, exit
2, nothing copied) and a file and a directory copied back, links out of the job's
directory left there. The host side is gpuflex.hosts.gather, called in-process for the
local host; over SSH, tests/e2e/ssh/test_sync_ssh.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpuflex.cli import fetch_cmd
from gpuflex.config import load_config
from gpuflex.control import access
from gpuflex.control.service import JobService
from gpuflex.db.models import Job, Worker
from tests.clirun import invoke
from tests.conftest import write_config


@pytest.fixture
def setup(home) -> tuple[Path, Path]:
    """Job 1 ran in `ran/` on the local host (the caller's); job 2 never ran; job 3 is
    another user's."""
    cfg = write_config(home)
    ran = home / "ran"
    (ran / "out" / "sub").mkdir(parents=True)
    (ran / "out" / "model.pt").write_bytes(b"weights")
    (ran / "out" / "sub" / "log.txt").write_text("step 1\n")
    (home / "secret").write_text("not the job's\n")
    (ran / "out" / "leak").symlink_to(home / "secret")
    (ran / "escape").symlink_to(home / "secret")
    svc = JobService(load_config(str(cfg)))
    svc.refresh()
    with svc.sessions.begin() as s:
        for name, user, state in (("ran", access.caller(), "succeeded"), ("wait", access.caller(), "queued"),
                                  ("theirs", "someone-else", "succeeded")):
            job = Job(token=name, name=name, state=state, argv=["true"], workdir=str(ran), env={},
                      min_workers=1, max_workers=1, gpus_per_worker=1, user=user, created_at=time.time())
            if state != "queued":
                job.workers.append(Worker(wid=0, rank=0, host="local", gpus=[0], state="exited", exit_code=0,
                                          log_path=str(home / "w.log"), exit_path=str(home / "w.exit")))
            s.add(job)
    svc.close()
    return cfg, home / "back"


def refused(r, *fragments: str) -> None:
    assert r.exit_code == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.parametrize("args, said", [
    (("1", "/etc/passwd"), "not an absolute one"),
    (("1", "~/x"), "not an absolute one"),
    (("1", "out/../../secret"), "'..' would leave"),
    (("9", "out"), "no job '9'"),
    (("2", "out"), "has never run (queued)"),
    (("3", "out"), "belongs to someone-else; only someone-else or an admin ([access] admins) may read its files."),
    (("1", "out", "--host", "far"), "did not run on far; its hosts: local"),
    (("1", "nothere"), "nothere is not in"),
    (("1", "escape"), "outside the job's directory"),
])
def test_refusals_are_one_line_and_copy_nothing(setup, args, said):
    cfg, back = setup
    r = invoke(cfg.parent, cfg, "fetch", *args, "--to", str(back))
    refused(r, said)
    assert not back.exists()


def test_a_file_and_a_directory_come_back_without_the_link_leaving_the_job(setup):
    cfg, back = setup
    r = invoke(cfg.parent, cfg, "fetch", "1", "out/model.pt", "--to", str(back))
    assert r.exit_code == 0, r.stderr
    assert (back / "model.pt").read_bytes() == b"weights"
    r = invoke(cfg.parent, cfg, "fetch", "1", "out/", "--to", str(back))
    assert r.exit_code == 0, r.stderr
    assert "local: 2 file(s) to" in r.stdout and "left out leak: a link leaving the job's directory" in r.stderr
    assert (back / "out" / "sub" / "log.txt").read_text() == "step 1\n"
    assert sorted(os.listdir(back / "out")) == ["model.pt", "sub"]


def test_help_gives_an_example():
    assert "Example: gpuflex fetch 3 out/model.pt" in (fetch_cmd.fetch.__doc__ or "")


def test_a_host_that_cannot_be_reached_is_one_line_and_exit_1(home):
    cfg = write_config(home, extra='\n[[hosts]]\nname = "far"\naddress = "127.0.0.1"\nport = 1\n'
                                   'gpus = "cpu:2"\nconnect_timeout_s = 2\n')
    svc = JobService(load_config(str(cfg)))
    svc.refresh()
    with svc.sessions.begin() as s:
        job = Job(token="t", name="far", state="failed", argv=["true"], workdir="/x", env={}, min_workers=1,
                  max_workers=1, gpus_per_worker=1, user=access.caller(), created_at=time.time())
        job.workers.append(Worker(wid=0, rank=0, host="far", gpus=[0], state="lost", log_path="l", exit_path="e"))
        s.add(job)
    svc.close()
    r = invoke(home, cfg, "fetch", "1", "out", "--to", str(home / "back"))
    assert r.exit_code == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "far" in r.stderr and "refused" in r.stderr
