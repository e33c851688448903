"""Interactive sessions (issue 33): `gpuflex run`, whose command runs in the foreground on
its caller's terminal, recorded as a job of its owner (kind "interactive").

A session is placed like a job (its owner's quota, the free devices of the local hosts)
but never waits: a pool that cannot hold it now refuses it (`Full`), with nothing
recorded. Its one worker row stands for the command that `gpuflex run` forked before
asking (blocked until told to go, so its process group is recorded with the job, in the
same transaction: no command ever sees the row without its group). The command is the
leader of its own group: `gpuflex cancel` signals that group as it signals any worker's.
When it ends, `gpuflex run` writes the worker's exit record (as a supervisor does) and
reconciles; a `gpuflex run` killed outright takes its command with it (the terminal's
hang-up), and the next command's reconcile finds the group gone without a record: lost.

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
import time

from gpuflex.control import access, executor, intents, journal, queueing
from gpuflex.control import launch as L
from gpuflex.control.executor import Ops
from gpuflex.db.models import Job, Worker
from gpuflex.elastic.protocol import env as env_contract
from gpuflex.errors import UsageError
from gpuflex.hosts.transport import SpawnSpec
from gpuflex.policy.placement import Placement, place
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


def choose(ops: Ops, gpus: int) -> Placement:
    """Where a session of `gpus` devices goes now: a local host only (its command runs
    here, on the caller's terminal)."""
    local = {h.name for h in ops.config.hosts if h.is_local}
    free = [h for h in queueing.room(ops).free if h.name in local]
    return place(free, 1, 1, gpus)


def open_session(ops: Ops, argv: list[str], gpus: int, time_limit_s: float | None, pgid: int) -> Session:
    """Record a running interactive job of the caller for the command whose group is
    `pgid`, on devices free now; `Full` (nothing written) when there are none, or when
    the caller's quota would be exceeded."""
    job, w = _record(ops, "gpuflex run", INTERACTIVE, argv, gpus, time_limit_s)
    w.pid, w.pgid = pgid, pgid
    return _session(ops, job, w)


def open_alloc(ops: Ops, gpus: int, time_limit_s: float | None) -> Session:
    """Record a running allocation of the caller (`gpuflex alloc`): its worker is a
    sleeper under a supervisor, as any worker (which keeps its time limit and writes its
    exit record), until the limit or a cancel; `Full` as for a session."""
    host = next((h for h in ops.config.hosts if h.is_local), None)
    argv = [host.python if host is not None else "python3", *SLEEPER]
    job, w = _record(ops, "gpuflex alloc", ALLOC, argv, gpus, time_limit_s)
    job.name = "alloc"
    host = ops.config.host(w.host)
    # noted before the sleeper spawns: a command killed before its commit leaves no
    # process the database does not know (gpuflex.control.intents ends it)
    intents.note(ops.config.database_url, job.id, job.socket_dir, [host.name])
    spawned = ops.pool.transport(host).spawn(SpawnSpec(
        argv=argv, cwd=L.job_dir(host, job), env={env_contract.JOB_ID: str(job.id)}, log=w.log_path,
        exit_path=w.exit_path, private_dirs=[L.job_dir(host, job)], socket_dir=job.socket_dir,
        deadline=L.run_deadline(job), grace_s=ops.config.jobs.cancel_grace_s))
    w.pid, w.pgid = spawned.pid, spawned.pgid
    return _session(ops, job, w)


def _record(ops: Ops, verb: str, kind: str, argv: list[str], gpus: int,
            time_limit_s: float | None) -> tuple[Job, Worker]:
    """The running job of `kind` and its one worker row (no process recorded yet)."""
    if not any(h.is_local for h in ops.config.hosts):
        raise UsageError(f"{verb} needs a local host in the pool (its devices are used from this "
                         "machine); none is configured.")
    job = Job(token=secrets.token_hex(6), name=os.path.basename(argv[0]) or kind, state=JobState.QUEUED,
              argv=list(argv), workdir=os.getcwd(), env={}, submit_env=None, min_workers=1, max_workers=1,
              gpus_per_worker=gpus, priority=0, harvest=False, retries=0, elastic=None,
              time_limit_s=time_limit_s, kind=kind, user=access.caller())
    over = queueing.over_quota(ops, job)
    if over is not None:
        raise Full(f"{verb}: not started, {over}.")
    p = choose(ops, gpus)
    if not p.ok:
        raise Full(f"{verb}: not started, no local host has {gpus} free device(s) now "
                   f"({p.reason or 'the pool is full'}); try again later, or submit a job to wait.")
    a = p.assignments[0]
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
                   w.exit_path, L.run_deadline(job), ops.config.jobs.cancel_grace_s)


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
