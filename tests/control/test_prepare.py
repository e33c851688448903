"""gpuflex.control.prepare: a job's per-host preparation asked once per host per run, its
request on stdin (never on a command line), a failure that says "cannot start" with the
host, the exit code and the last lines. The host is a fake transport here; the host side
(gpuflex.hosts.envsetup) runs for real in tests/e2e/test_job_envs.py."""

from __future__ import annotations

import json

import pytest

from gpuflex.config import load_config
from gpuflex.control import prepare
from gpuflex.control.executor import Ops
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from gpuflex.errors import TransportError
from gpuflex.hosts.transport import CommandResult
from gpuflex.jobenv import JobEnv
from gpuflex.states import JobState
from tests.conftest import write_config


class FakeHost:
    """Answers `python -m gpuflex.hosts.envsetup` with `reply`; keeps what it was asked."""

    def __init__(self, host, reply: dict) -> None:
        self.host, self.reply, self.calls = host, reply, []

    def run(self, argv, *, input=None, timeout=None):
        self.calls.append((argv, json.loads(input)))
        return CommandResult(0, json.dumps({"ok": self.reply}) + "\n", "")

    def close(self) -> None:
        pass


OK = {"returncode": 0, "timed_out": False, "seconds": 0.5, "tail": "done", "missing": [], "log": "/w/env-setup.log"}


@pytest.fixture
def lab(home):
    svc = JobService(load_config(str(write_config(home))))
    yield svc
    svc.close()


def _prepare(svc, reply: dict, **env) -> tuple[FakeHost, Job, Ops]:
    host = svc.config.host("local")
    fake = FakeHost(host, reply)
    svc.pool._transports["local"] = fake
    s = svc.sessions()
    job = Job(token="tok", name="j", state=JobState.QUEUED, argv=["python", "t.py"], workdir="/src",
              env={"LR": "3"}, submit_env={"PATH": "/bin", "TOKEN": "secret-ish"}, min_workers=1, max_workers=1,
              gpus_per_worker=1, user="u", socket_dir="/tmp/gpuflex-run1", **env)
    s.add(job)
    s.flush()
    return fake, job, Ops(svc.config, svc.pool, s)


def test_once_per_host_per_run_with_the_environment_on_stdin(lab):
    fake, job, ops = _prepare(lab, OK, venv="/envs/a", env_setup="make deps")
    host = lab.config.host("local")
    prepare.prepare_host(ops, job, host)
    prepare.prepare_host(ops, job, host)   # a second worker of the run on this host
    assert len(fake.calls) == 1
    argv, req = fake.calls[0]
    assert argv == [host.python, "-m", "gpuflex.hosts.envsetup"]   # nothing of the job on the command line
    assert req["argv"] == ["sh", "-c", "make deps"] and req["cwd"] == "/src" and req["clean_env"] is True
    assert req["env"]["TOKEN"] == "secret-ish" and req["env"]["LR"] == "3"
    assert req["env"]["PATH"] == "/envs/a/bin:/bin" and req["check"] == ["/envs/a/bin/python"]
    assert req["log"].endswith("/jobs/tok/env-setup.log")
    job.socket_dir = "/tmp/gpuflex-run2"   # a new run (a restart) prepares again
    prepare.prepare_host(ops, job, host)
    assert len(fake.calls) == 2
    ready = [e for e in job.events if e.kind == prepare.READY]
    assert ready and ready[-1].data["run"] == "/tmp/gpuflex-run2" and ready[-1].data["tail"] == "done"


def test_a_job_without_environment_options_asks_nothing(lab):
    fake, job, ops = _prepare(lab, OK, conda="torch2")   # conda run says for itself what is missing
    prepare.prepare_host(ops, job, lab.config.host("local"))
    assert fake.calls == []


def test_a_failed_setup_cannot_start_naming_host_code_and_last_lines(lab):
    failed = {**OK, "returncode": 3, "tail": "Collecting torch\nERROR: no network"}
    fake, job, ops = _prepare(lab, failed, env_setup="pip install torch")
    with pytest.raises(TransportError) as err:
        prepare.prepare_host(ops, job, lab.config.host("local"))
    assert str(err.value) == ("local: cannot start the job: --env-setup exited with code 3 (all of it: "
                              "local:/w/env-setup.log); its last lines:\nCollecting torch\nERROR: no network")
    event = [e for e in job.events if e.kind == prepare.FAILED][-1]
    assert event.message.startswith("local: cannot start the job") and event.data["exit_code"] == 3


@pytest.mark.parametrize("env, reply, says", [
    (JobEnv(venv="/envs/a"), {**OK, "returncode": None, "missing": ["/envs/a/bin/python"]},
     "cannot start the job: --venv /envs/a has no bin/python there"),
    (JobEnv(venv="/e", env_setup="x"), {**OK, "missing": ["/e/bin/python"]}, "no bin/python there (after --env-setup)"),
    (JobEnv(python="/p/py"), {**OK, "returncode": None, "missing": ["/p/py"]}, "--python /p/py is not an executable"),
    (JobEnv(env_setup="sleep 9999"), {**OK, "returncode": -9, "timed_out": True, "tail": ""},
     f"--env-setup was killed after {prepare.SETUP_TIMEOUT_S:.0f} s (all of it: h:/w/env-setup.log) (no output)"),
])
def test_what_fails_a_host(env, reply, says):
    assert says in prepare.failed(env, "h", reply)
    assert prepare.failed(env, "h", OK) is None


def test_ready_says_what_was_done():
    assert prepare.ready_text(JobEnv(venv="/e", env_setup="x"), "h", OK) == \
        "h ready: --env-setup exited 0 in 0.5 s (output: h:/w/env-setup.log), /e/bin/python found"
