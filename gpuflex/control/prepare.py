"""A job's per-host preparation (issue 33): `--env-setup CMD` run, and the interpreter that
--venv or --python names checked, on a host before its first worker of each run starts.

Once per host per run: the run is the job's socket directory (fresh for each run), and an
`env-ready` event naming the host and the run says it was done, so a newcomer of a resize
on a host the run already prepared starts at once, and one on a new host prepares that
host. It runs through the transport (`python -m gpuflex.hosts.envsetup`, the request on its
stdin), the same on the local host and over SSH, while the launching command waits.

A failure (the setup's non-zero exit or timeout, or a missing venv) is a TransportError
saying "cannot start": the launch fails at once and the job fails (control/lifecycle.py),
since launching again would run the same setup with the same result; its `env-setup`
event and the job's exit reason name the host, the exit code and the output's last lines.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from gpuflex.config import HostConfig
from gpuflex.control import journal
from gpuflex.control import launch as L
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.elastic.protocol.env import JOB_ID
from gpuflex.errors import TransportError
from gpuflex.jobenv import JobEnv, setup_request

SETUP_TIMEOUT_S = 1800.0   # --env-setup's limit (a pip install of a torch stack takes minutes)
READY, FAILED = "env-ready", "env-setup"
RECENT = 256   # env-ready events read back: one per host per run


def setup_log(host: HostConfig, job: Job) -> str:
    """Where a host keeps the job's --env-setup output (every run's, appended)."""
    return posixpath.join(L.job_dir(host, job), "env-setup.log")


def needed(job: Job) -> bool:
    env = JobEnv.of(job)
    return env.env_setup is not None or bool(env.checks())


def done(ops, job: Job, host: str) -> bool:
    """Whether this run of the job has prepared `host` already."""
    return any(e.data.get("host") == host and e.data.get("run") == job.socket_dir
               for e in queries.recent_events(ops.session, job.id, [READY], RECENT))


def prepare_host(ops, job: Job, host: HostConfig) -> None:
    """Prepare `host` for the job's workers if this run has not (see the module's doc)."""
    if not needed(job) or done(ops, job, host.name):
        return
    env = JobEnv.of(job)
    environ = {**(job.submit_env or {}), **job.env, JOB_ID: str(job.id)}
    req = setup_request(env, cwd=L.worker_cwd(ops.config, host, job), environ=environ,
                        clean_env=job.submit_env is not None, log=setup_log(host, job), timeout_s=SETUP_TIMEOUT_S)
    t = ops.pool.transport(host)
    res = t.run([host.python, "-m", "gpuflex.hosts.envsetup"], input=json.dumps(req),
                timeout=host.command_timeout_s + SETUP_TIMEOUT_S)
    reply = _reply(host, res)
    failure = failed(env, host.name, reply)
    data = {"host": host.name, "run": job.socket_dir, "exit_code": reply.get("returncode"),
            "seconds": reply.get("seconds"), "log": reply.get("log"), "tail": reply.get("tail")}
    if failure is not None:
        journal.record(ops.session, job, FAILED, f"{host.name}: {failure}", **data)
        raise TransportError(host.name, failure)   # "HOST: cannot start the job: ..."
    journal.record(ops.session, job, READY, ready_text(env, host.name, reply), **data)


def _reply(host: HostConfig, res) -> dict[str, Any]:
    try:
        reply = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        said = (res.stderr or res.stdout).strip()[-300:] or f"exit {res.returncode}"
        raise TransportError(host.name, f"--env-setup: the host's gpuflex.hosts.envsetup failed: {said}") from None
    if "error" in reply:
        raise TransportError(host.name, f"--env-setup: {reply['error']}")
    return reply["ok"]


def failed(env: JobEnv, host: str, reply: dict[str, Any]) -> str | None:
    """Why the preparation failed on `host` (the caller puts the host's name first), else
    None. Says "cannot start" (no retry: control/lifecycle.py)."""
    rc, tail = reply.get("returncode"), (reply.get("tail") or "").strip()
    last = f"; its last lines:\n{tail}" if tail else " (no output)"
    where = f"(all of it: {host}:{reply.get('log')})"
    if reply.get("timed_out"):
        return f"cannot start the job: --env-setup was killed after {SETUP_TIMEOUT_S:.0f} s {where}{last}"
    if rc not in (None, 0):
        return f"cannot start the job: --env-setup exited with code {rc} {where}{last}"
    if reply.get("missing"):
        what = f"--venv {env.venv} has no bin/python" if env.venv is not None else \
            f"--python {env.python} is not an executable file"
        after = " (after --env-setup)" if env.env_setup is not None else ""
        return f"cannot start the job: {what} there{after}"
    return None


def ready_text(env: JobEnv, host: str, reply: dict[str, Any]) -> str:
    said = [f"--env-setup exited 0 in {reply.get('seconds')} s (output: {host}:{reply.get('log')})"] \
        if env.env_setup is not None else []
    said += [f"{p} found" for p in env.checks()]
    return f"{host} ready: " + ", ".join(said)
