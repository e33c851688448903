"""Interactive sessions (issue 33): `gpuflex run`, whose command runs in the foreground on
its caller's terminal, recorded as a job of its owner (kind "interactive").

A session is placed like a job (its owner's quota, the free devices of the pool's hosts,
local or SSH) but never waits: a pool that cannot hold it now refuses it (`Full`), with nothing
recorded. `where` names its host first (nothing written), so that `gpuflex run` can start
the command there: forked here for a local host, for an SSH host under
gpuflex.hosts.attach, a supervisor started over the SSH connection. Its one worker row
stands for that command, started before asking (blocked until told to go, so its process group is recorded with the job, in the
same transaction: no command ever sees the row without its group). The command is the
leader of its own group: `gpuflex cancel` signals that group as it signals any worker's.
When it ends, `gpuflex run` writes the worker's exit record (as a supervisor does) and
reconciles (on an SSH host the supervisor writes it there); a `gpuflex run` killed
outright takes its command with it (the terminal's hang-up; on an SSH host, the
supervisor's, when the connection is gone), and the next command's reconcile finds the
group gone, with or without a record.

An allocation (`gpuflex alloc`, kind "alloc") is the same job with a sleeper for its
worker, started under a supervisor like any worker (`open_alloc`): it holds the devices
until its time limit or `gpuflex cancel`, and its owner uses them from any process they
start with the environment `alloc` prints (processes gpuflex does not track).

Such a job has no coordinator: `reconcile` here replaces the lifecycle policy for it. It
is never preempted (gpuflex.policy.preemption: Victim.pinned) nor yielded or requeued
by harvest (gpuflex.policy.harvest: JobView.pinned); its time limit is kept by `gpuflex
run` itself (SIGTERM, [jobs] cancel_grace_s, SIGKILL), and by any reconcile past the
deadline and the grace, should `gpuflex run` be stopped.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import time

from gpuflex.control import access, executor, intents, journal, queueing
from gpuflex.control import launch as L
from gpuflex.control.executor import Ops
from gpuflex.db.models import Job, Worker
from gpuflex.elastic.protocol import env as env_contract
from gpuflex.errors import UsageError
from gpuflex.hosts.transport import SpawnSpec
from gpuflex.policy.placement import Assignment, Placement, place
from gpuflex.states import JobState, WorkerState

INTERACTIVE = "interactive"
ALLOC = "alloc"
KINDS = (INTERACTIVE, ALLOC)
# what an allocation's worker runs: nothing, until its time limit or a cancel
SLEEPER = ["-c", "import signal; signal.pause()"]


class Full(UsageError):
    """The pool cannot hold the session now (or its owner's quota would be exceeded)."""


@dataclasses.dataclass(frozen=True)
class Session:
    """What `gpuflex run` needs once the session is recorded."""

    job_id: int
    host: str
    devices: tuple[int, ...]
    slots: bool
    env: dict[str, str]          # CUDA_VISIBLE_DEVICES (or GPUFLEX_SLOTS) and the job's id
    exit_path: str
    deadline: float | None
    grace_s: float
    login: str | None = None     # how to reach the host ("ssh ..."); None: a local host


def session_env(job_id: int, devices: tuple[int, ...], slots: bool) -> dict[str, str]:
    """The variables the session's command gets: its devices as a worker's (a CPU-slot
    host: GPUFLEX_SLOTS, and no GPU at all), and its job's id."""
    listed = ",".join(map(str, devices))
    env = {env_contract.JOB_ID: str(job_id)}
    if slots:
        env.update({env_contract.SLOTS: listed, "CUDA_VISIBLE_DEVICES": ""})
    else:
        env.update({"CUDA_VISIBLE_DEVICES": listed, env_contract.GPUS: listed})
    return env


def choose(ops: Ops, gpus: int, host: str | None = None) -> Placement:
    """Where a session of `gpus` devices goes now, by the placement rules of a job's one
    worker (any host, local or SSH; only `host` when given)."""
    free = [h for h in queueing.room(ops).free if host is None or h.name == host]
    return place(free, 1, 1, gpus)


def where(ops: Ops, gpus: int) -> str:
    """The host a session of `gpus` devices of the caller would get now (nothing
    written); `Full` as `open_session`."""
    return _placed(ops, "gpuflex run", _job("gpuflex run", INTERACTIVE, ["run"], gpus, None), None).host


def open_session(ops: Ops, argv: list[str], gpus: int, time_limit_s: float | None, pgid: int,
                 host: str | None = None) -> Session:
    """Record a running interactive job of the caller for the command whose group is
    `pgid` (on `host`, where it was started, when given), on devices free now; `Full`
    (nothing written) when there are none, or when the caller's quota would be exceeded."""
    job, w = _record(ops, "gpuflex run", INTERACTIVE, argv, gpus, time_limit_s, host)
    w.pid, w.pgid = pgid, pgid
    return _session(ops, job, w)


def open_alloc(ops: Ops, gpus: int, time_limit_s: float | None) -> Session:
    """Record a running allocation of the caller (`gpuflex alloc`): its worker is a
    sleeper under a supervisor, as any worker (which keeps its time limit and writes its
    exit record), until the limit or a cancel; `Full` as for a session."""
    job, w = _record(ops, "gpuflex alloc", ALLOC, ["python3", *SLEEPER], gpus, time_limit_s)
    host = ops.config.host(w.host)
    argv = [host.python, *SLEEPER]   # the python of the host it got
    job.name, job.argv = "alloc", argv
    # noted before the sleeper spawns: a command killed before its commit leaves no
    # process the database does not know (gpuflex.control.intents ends it)
    intents.note(ops.config.database_url, job.id, job.socket_dir, [host.name])
    spawned = ops.pool.transport(host).spawn(SpawnSpec(
        argv=argv, cwd=L.job_dir(host, job), env={env_contract.JOB_ID: str(job.id)}, log=w.log_path,
        exit_path=w.exit_path, private_dirs=[L.job_dir(host, job)], socket_dir=job.socket_dir,
        deadline=L.run_deadline(job), grace_s=ops.config.jobs.cancel_grace_s))
    w.pid, w.pgid = spawned.pid, spawned.pgid
    return _session(ops, job, w)


def _job(verb: str, kind: str, argv: list[str], gpus: int, time_limit_s: float | None) -> Job:
    return Job(token=secrets.token_hex(6), name=os.path.basename(argv[0]) or kind, state=JobState.QUEUED,
               argv=list(argv), workdir=os.getcwd(), env={}, submit_env=None, min_workers=1, max_workers=1,
               gpus_per_worker=gpus, priority=0, harvest=False, retries=0, elastic=None,
               time_limit_s=time_limit_s, kind=kind, user=access.caller())


def _placed(ops: Ops, verb: str, job: Job, host: str | None) -> Assignment:
    """The one assignment of `job` now, or `Full` (the owner's quota, or no room)."""
    over = queueing.over_quota(ops, job)
    if over is not None:
        raise Full(f"{verb}: not started, {over}.")
    p = choose(ops, job.gpus_per_worker, host)
    if not p.ok:
        on = f"{host} no longer has" if host is not None else "no host has"
        raise Full(f"{verb}: not started, {on} {job.gpus_per_worker} free device(s) now "
                   f"({p.reason or 'the pool is full'}); try again later, or submit a job to wait.")
    return p.assignments[0]


def _record(ops: Ops, verb: str, kind: str, argv: list[str], gpus: int,
            time_limit_s: float | None, host: str | None = None) -> tuple[Job, Worker]:
    """The running job of `kind` and its one worker row (no process recorded yet)."""
    job = _job(verb, kind, argv, gpus, time_limit_s)
    a = _placed(ops, verb, job, host)
    ops.session.add(job)
    ops.session.flush()
    job.started_at = time.time()
    job.socket_dir = L.new_socket_dir()   # a session's is never created: it has no control sockets
    journal.record(ops.session, job, "submitted", f"{kind}: {' '.join(argv)}", workers="1:1")
    w = executor.reserve_worker(ops, job, 1, a, 0)
    journal.set_state(ops.session, job, JobState.RUNNING, f"{kind} on {a.host}", world_size=1)
    job.world_size = job.target_workers = 1
    return job, w


def _session(ops: Ops, job: Job, w: Worker) -> Session:
    ops.session.flush()
    host = ops.config.host(w.host)
    slots = host.cpu_slots is not None
    devices = tuple(w.gpus)
    return Session(job.id, w.host, devices, slots, session_env(job.id, devices, slots),
                   w.exit_path, L.run_deadline(job), ops.config.jobs.cancel_grace_s, login(host))


def login(host) -> str | None:
    """The ssh command that reaches an SSH host as gpuflex does (None: a local host)."""
    if host.is_local:
        return None
    where = f"{host.user}@{host.address}" if host.user else host.address
    return shlex.join(["ssh", *(["-p", str(host.port)] if host.port != 22 else []), where])


def reconcile(ops: Ops, job: Job) -> None:
    """A session's reconcile (it has no coordinator): ended when its command's exit record
    is there (succeeded on 0, failed otherwise, timed out when `gpuflex run` ended it at
    the limit), lost when its group is gone without one; past its deadline and the grace
    with the group alive (`gpuflex run` stopped), its processes are stopped: timed out."""
    workers = list(job.live_workers)
    if not workers:
        return
    w = workers[0]
    host = ops.config.host(w.host)
    st = ops.pool.transport(host).status([(w.pgid, w.exit_path)])[0]
    deadline = L.run_deadline(job)
    if st.exit is not None:
        rc = st.returncode if st.returncode is not None else 1
        if st.exit.get("time_limit"):
            end(ops, job, JobState.TIMEOUT, rc, f"reached its time limit ({job.time_limit_s:g} s)")
        else:
            end(ops, job, JobState.SUCCEEDED if rc == 0 else JobState.FAILED, rc, f"its command exited with {rc}")
    elif not st.alive:
        journal.end_worker(ops.session, job, w, WorkerState.LOST, None)
        end(ops, job, JobState.FAILED, 1, "its command vanished without an exit record (gpuflex run was killed)")
    elif deadline is not None and time.time() > deadline + ops.config.jobs.cancel_grace_s:
        end(ops, job, JobState.TIMEOUT, 124, f"reached its time limit ({job.time_limit_s:g} s)")


def end(ops: Ops, job: Job, state: JobState, rc: int, reason: str) -> None:
    """Stop what is left of the session's group and record its end."""
    executor.stop_processes(ops, job)
    job.exit_code, job.exit_reason = rc, reason
    journal.set_state(ops.session, job, state, reason, exit_code=rc)
