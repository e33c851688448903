"""Interactive sessions on the control side (gpuflex.control.interactive), with no process:
the session's command is stood for by a process group id (one that exists: this test's
own, never signalled here: no test cancels it or gives it a deadline; one that does not:
a group id no process has) and its exit record written by hand."""

from __future__ import annotations

import os

import pytest

from gpuflex.config import parse_config
from gpuflex.control import interactive
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.db import queries
from gpuflex.hosts import terminal
from gpuflex.states import JobState

NO_GROUP = 2**22 + 12345   # above Linux's pid_max default: no process group has it


@pytest.fixture(params=[None])
def svc(tmp_path, request):
    quota = {"quota": {"default_gpus": request.param}} if request.param else {}
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 1}, **quota,
                        "hosts": [{"name": "local", "address": "local", "gpus": "cpu:4",
                                   "workdir": str(tmp_path / "work")}]}, "<test>")
    service = JobService(cfg)
    yield service
    service.close()


def jobs(svc: JobService) -> list:
    with svc.sessions() as session:
        return [(j.id, j.kind, j.state) for j in queries.jobs(session, list(JobState))]


def test_the_environment_names_the_devices_as_a_workers_does():
    assert interactive.session_env(7, (0, 2), slots=False) == {
        "GPUFLEX_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,2", "GPUFLEX_GPUS": "0,2"}
    assert interactive.session_env(7, (1,), slots=True) == {
        "GPUFLEX_JOB_ID": "7", "GPUFLEX_SLOTS": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_a_session_holds_its_devices_and_one_that_does_not_fit_records_nothing(svc):
    first = svc.open_session(["bash"], 2, None, os.getpgrp())
    assert (first.job_id, first.host, first.devices, first.slots) == (1, "local", (0, 1), True)
    info = svc.job(1)
    assert (info.kind, info.state, info.world_size, info.workers[0].pid) == ("interactive", JobState.RUNNING, 1,
                                                                            os.getpgrp())
    with pytest.raises(interactive.Full, match="no host has 3 free device"):
        svc.open_session(["bash"], 3, None, NO_GROUP)
    assert jobs(svc) == [(1, "interactive", JobState.RUNNING)]


@pytest.mark.parametrize("svc", [3], indirect=True)
def test_a_session_counts_toward_its_owners_quota(svc):
    """[quota] default_gpus = 3: a session of 2 leaves 1, as a job of 2 would."""
    svc.open_session(["bash"], 2, None, os.getpgrp())
    with pytest.raises(interactive.Full, match=r"holds 2 of their 3 GPUs \(\[quota\]\)"):
        svc.open_session(["bash"], 2, None, NO_GROUP)
    assert jobs(svc) == [(1, "interactive", JobState.RUNNING)]


def test_a_batch_job_waits_for_a_sessions_devices_and_never_preempts_it(svc, tmp_path):
    svc.open_session(["bash"], 3, None, os.getpgrp())   # this test's group: alive
    req = SubmitRequest(argv=["sleep", "1"], gpus_per_worker=2, priority=100, requeue=True, workdir=str(tmp_path))
    job_id = svc.submit(req)
    assert svc.job(job_id).state is JobState.QUEUED
    assert svc.job(1).state is JobState.RUNNING
    assert not [e for e in svc.job(1, events=True).events if e.kind == "preempted"]


@pytest.mark.parametrize("rc,timed_out,state", [(0, False, JobState.SUCCEEDED), (3, False, JobState.FAILED),
                                                 (143, True, JobState.TIMEOUT)])
def test_the_exit_record_ends_the_session_and_frees_its_devices(svc, rc, timed_out, state):
    s = svc.open_session(["bash"], 4, 60.0 if timed_out else None, NO_GROUP)
    terminal.write_exit(s.exit_path, rc, timed_out)
    svc.refresh()
    info = svc.job(s.job_id)
    assert (info.state, info.exit_code) == (state, rc)
    assert svc.open_session(["bash"], 4, None, NO_GROUP).job_id == s.job_id + 1   # all 4 free again


def test_a_session_whose_command_vanished_without_a_record_failed(svc):
    s = svc.open_session(["bash"], 1, None, NO_GROUP)
    svc.refresh()
    info = svc.job(s.job_id)
    assert info.state is JobState.FAILED and "gpuflex run was killed" in info.exit_reason


def test_requeue_refuses_a_session(svc):
    s = svc.open_session(["bash"], 1, None, os.getpgrp())
    with pytest.raises(Exception, match="interactive session: it cannot be requeued"):
        svc.requeue([str(s.job_id)])
    assert svc.job(s.job_id).state is JobState.RUNNING


def test_an_ssh_hosts_login_is_the_ssh_command_gpuflex_uses():
    from gpuflex.config import HostConfig
    assert interactive.login(HostConfig(name="gpu01", address="10.0.0.5", port=2222, user="me", gpus="all")) \
        == "ssh -p 2222 me@10.0.0.5"
    assert interactive.login(HostConfig(name="gpu02", address="gpu02.lab", gpus="all")) == "ssh gpu02.lab"
    assert interactive.login(HostConfig(name="local", address="local", gpus="cpu:2")) is None
