"""The job service: every CLI command is a thin wrapper over one of these methods.

A service owns a session factory and a pool. Mutating operations run under the
database's "ops" lock (gpuflex.db.locks), so concurrent gpuflex commands (and cron ticks)
do not place the same job twice. The work itself is done below it: placing and
reconciling in gpuflex.control.lifecycle, resizing in gpuflex.control.scaling, the
actions in gpuflex.control.executor, each given an `Ops` (config, pool, session).
Reads come back as plain records (gpuflex.control.views) for the CLI to render; they
are the read side, gpuflex.control.reads, which the service extends.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from typing import Iterator

from sqlalchemy.orm import Session, sessionmaker

from gpuflex.config import Config, HostConfig
from gpuflex.control import access, intents, interactive, journal, lifecycle, notify, resume, scaling, verbs, views
from gpuflex.control.executor import Ops
from gpuflex.control.launch import check_image, pack_code, submit_environment
from gpuflex.control.pool import Pool
from gpuflex.control.reads import Reads
from gpuflex.db import queries
from gpuflex.db.engine import open_database
from gpuflex.db.locks import database_lock
from gpuflex.db.models import Job
from gpuflex.errors import UsageError
from gpuflex.control.probes import record_probes
from gpuflex.control.requests import SubmitRequest
from gpuflex.hosts.probe import collect_probes
from gpuflex.jobenv import check_local
from gpuflex.jobspec import parse_time, split_mode
from gpuflex.policy.placement import devices_per_worker
from gpuflex.states import JobState


class JobService(Reads):
    """The commands: the reads (gpuflex.control.reads) and what changes jobs. `pool`
    defaults to one over the registry's transports; tests and benchmarks give one with a
    fake transport factory."""

    def __init__(self, config: Config, sessions: sessionmaker[Session] | None = None,
                 pool: Pool | None = None) -> None:
        super().__init__(config, sessions or open_database(config.database_url))
        self._own_engine = sessions is None
        self.pool = pool or Pool(config)
        self.progress: dict[int, dict] = {}  # job id -> the coordinator's last progress report
        self.forming: dict[int, dict | None] = {}   # job id -> the generation it forms now, if any
        self.outbox = notify.Outbox(self.sessions)   # webhooks of committed moves, not posted yet

    def close(self) -> None:
        self.notify()
        self.outbox.close()
        self.pool.close()
        if self._own_engine:   # its pooled connections closed now, not when collected
            self.sessions.kw["bind"].dispose()

    @contextlib.contextmanager
    def locked(self) -> Iterator[Session]:
        """A session under the database's "ops" lock (gpuflex.db.locks), committed on success;
        then, the lock released, the webhooks of what it committed are posted."""
        with database_lock(self.config.database_url, "ops").held(), self.sessions.begin() as session:
            intents.settle(self.config, self.pool, session)   # runs of commands that died mid-start
            yield session
        self.notify()

    def notify(self) -> None:
        """Post the webhooks of the moves committed so far (gpuflex.control.notify)."""
        self.outbox.deliver(self.config.notify.events, journal.record)

    def ops(self, session: Session) -> Ops:
        """What the actions need, for the transaction of `session`."""
        return Ops(self.config, self.pool, session)

    # ---- the periodic work every command does first ----------------------------
    def collect_probes(self):
        """Probe the GPU hosts (not CPU-slot hosts) in parallel, outside the lock."""
        return collect_probes(self.pool)

    def record_probes(self, session: Session, results) -> None:
        record_probes(self.pool, session, results, self.config.harvest)

    def refresh(self, probe: bool = False) -> None:
        """Read reality (workers, coordinators; GPUs too with `probe`) and start queued
        jobs that now fit."""
        results = self.collect_probes() if probe else {}
        with self.locked() as session:
            ops = self.ops(session)
            self.pool.sync_hosts(session)
            self.record_probes(session, results)
            active = queries.jobs(session, queries.ACTIVE)
            # another user's processes on hosts reached as each user: their exit records
            # and sockets are theirs alone, so they are reconciled by their owner's commands
            for job in [j for j in active if access.reaches(self.config, j)]:
                status = lifecycle.reconcile(ops, job)
                if status is not None and status.progress:
                    self.progress[job.id] = status.progress
                    kept = views.seen_progress(status.progress, time.time())   # for other users' commands
                    if kept is not None and (job.progress or {}).get("step") != kept["step"]:
                        job.progress = kept
                else:   # none this time (a new run, a silent coordinator): no older report stands for it
                    self.progress.pop(job.id, None)
                if status is not None:
                    self.forming[job.id] = status.forming
            session.flush()
            lifecycle.place_queued(ops)
            lifecycle.sweep_socket_dirs(ops, active)

    # ---- commands ----------------------------------------------------------------
    def submit(self, req: SubmitRequest) -> int:
        resume_from = resume.checked(self.config, req.resume_from, req.elastic_mode)   # before any probe
        workdir = os.path.abspath(os.path.expanduser(req.workdir or os.getcwd()))
        job_env = req.job_env.absolute(os.getcwd())
        if all(h.is_local for h in self.config.hosts):   # issue 33: remote hosts are checked at launch
            check_local(job_env)
        code = pack_code(self.config, req.sync, workdir)   # over the cap: refused, nothing recorded
        check_image(self.config, req.image)   # an image this machine's engine lacks: the same
        results = self.collect_probes()
        with self.locked() as session:
            self.pool.sync_hosts(session)
            self.record_probes(session, results)
            self.check_pool_can_hold(session, req)   # bad input: the transaction is undone
            self.check_after(session, req.after.ids)
            environ = os.environ if req.environ is None else req.environ
            limit = req.time_limit_s
            if limit is None and self.config.jobs.default_time is not None:
                limit = parse_time(self.config.jobs.default_time, "default_time")
            indices = req.array.indices if req.array is not None else (None,)
            jobs = []
            for index in indices:
                job = Job(
                    token=secrets.token_hex(6), name=req.name or os.path.basename(req.argv[0]),
                    state=JobState.QUEUED, argv=list(req.argv), workdir=workdir, env=dict(req.env),
                    submit_env=submit_environment(environ, req.env),
                    min_workers=req.min_workers, max_workers=req.max_workers,
                    gpus_per_worker=req.gpus_per_worker, priority=req.priority, harvest=req.harvest,
                    retries=req.retries, elastic=req.elastic_mode, time_limit_s=limit, resume_from=resume_from,
                    split=split_mode(req.split, req.elastic_mode), after=list(req.after.afterok) or None,
                    dependency=req.after.extra(), requeue=req.requeue,
                    notify_url=req.notify or self.config.notify.url,
                    sources=dict(req.sources) if req.sources is not None else None,
                    array_index=index, array_limit=req.array.limit if req.array is not None else None,
                    user=access.caller(), sync=bool(req.sync), code_sha256=code,
                    python=job_env.python, venv=job_env.venv, conda=job_env.conda, env_setup=job_env.env_setup,
                    image=req.image,
                )
                session.add(job)
                session.flush()
                if req.array is not None:
                    job.array_id = jobs[0].id if jobs else job.id   # an array is named by its first job
                jobs.append(job)
                journal.record(session, job, "submitted", f"submitted: {' '.join(job.argv)}",
                               workers=f"{job.min_workers}:{job.max_workers}",
                               **({"array_id": job.array_id, "array_index": index} if req.array else {}))
            lifecycle.place_queued(self.ops(session))
            return jobs[0].id

    def session_host(self, gpus: int) -> HostConfig:
        """The host an interactive session of `gpus` devices would get now (nothing
        written; interactive.Full when none). Queued jobs that fit are started first."""
        self.refresh(probe=True)
        with self.locked() as session:
            return self.config.host(interactive.where(self.ops(session), gpus))

    def open_session(self, argv: list[str], gpus: int, time_limit_s: float | None,
                     pgid: int, host: str | None = None) -> interactive.Session:
        """Record an interactive session (gpuflex.control.interactive) for the command
        whose group is `pgid` (started on `host` when given), on devices free now;
        interactive.Full, with nothing written, when there are none. Queued jobs that
        fit are started first (a refresh; devices probed unless `host` was just chosen)."""
        self.refresh(probe=host is None)
        with self.locked() as session:
            return interactive.open_session(self.ops(session), argv, gpus, time_limit_s, pgid, host)

    def open_alloc(self, gpus: int, time_limit_s: float | None) -> interactive.Session:
        """Record an allocation (gpuflex.control.interactive.open_alloc): devices held by
        a sleeper until `time_limit_s` or a cancel; interactive.Full as for a session."""
        self.refresh(probe=True)
        with self.locked() as session:
            return interactive.open_alloc(self.ops(session), gpus, time_limit_s)

    def check_after(self, session: Session, after: tuple[int, ...]) -> None:
        """UsageError for an --after id that names no job (before anything is written)."""
        for ref in after:
            if queries.job(session, ref) is None:
                raise UsageError(f"--after {ref}: there is no job {ref}.", hint="Run 'gpuflex status' to list jobs.")

    def check_pool_can_hold(self, session: Session, req: SubmitRequest) -> None:
        """UsageError when the configured pool could never hold the job's MIN workers, all
        hosts free: CPU slots, listed GPUs, and for `gpus = "all"` the GPUs the host's
        probes found (a host never probed yet might hold any number: no refusal)."""
        fits, parts = 0, []
        for h in self.config.hosts:
            slots = h.cpu_slots is not None
            if slots:
                devices = h.cpu_slots
            elif isinstance(h.gpus, list):
                devices = len(h.gpus)
            else:
                row = queries.host(session, h.name)
                devices = sum(1 for g in row.gpus if g.kind == "gpu") if row is not None else 0
                if not devices:
                    return
            fits += devices // devices_per_worker(req.gpus_per_worker, slots)
            parts.append(f"{h.name}: {devices} {'slots' if slots else 'GPUs'}")
        if fits < req.min_workers:
            raise UsageError(f"--workers {req.min_workers}:{req.max_workers} with --gpus-per-worker "
                             f"{req.gpus_per_worker} can never start: the pool holds at most {fits} such "
                             f"worker(s) ({', '.join(parts)}); lower MIN or add hosts.")

    def cancel(self, ref: str) -> list[views.JobInfo]:
        """Cancel a job; an array's id (a plain id that is an array's, as Slurm's scancel
        reads it), or a name whose newest job is one of an array's, cancels every job of the
        array not ended yet (`5_3`, or the id of a job other than the array's first: that
        one). Returns the jobs cancelled. Only the owner or an admin may
        (gpuflex.control.access)."""
        self.check_may_change(ref, "cancel", names=True)
        with self.locked() as session:
            array = self.array_of(session, ref, names=True)
            jobs = [j for j in array if not j.state.final] if array else [self.get(session, ref)]
            if not jobs or jobs[0].state.final:
                what = f"array {array[0].array_id}: every job" if array else f"job {jobs[0].id}"
                raise UsageError(f"{what} is already {'ended' if array else jobs[0].state}; nothing to cancel.")
            ops = self.ops(session)
            verbs.cancel(ops, jobs)
            lifecycle.place_queued(ops)
            return views.job_infos(jobs)

    def cancel_many(self, refs: list[str], user: str | None = None, states: list[JobState] | None = None,
                    name: str | None = None) -> list[views.JobInfo]:
        """`cancel` of several jobs and/or filters (gpuflex.control.verbs): the jobs `refs`
        name that the filters keep, or with no refs the caller's (or `user`'s) jobs not
        ended that the filters keep. Every job is checked before any is cancelled: an
        unknown or ended one named, or one the caller may not change, refuses the whole
        command. Returns the jobs cancelled ([] when the filters match none)."""
        verbs.check_cancellable_states(states)
        with self.locked() as session:
            if refs:
                named = self._resolve(session, refs)
                for job in named:
                    if job.state.final:
                        raise UsageError(f"job {job.id} is already {job.state}; nothing cancelled.")
                jobs = verbs.filtered(named, user, states, name)
            else:
                jobs = verbs.matching(session, user or access.caller(), states, name)
            verbs.check_may_change(self.config, jobs, "cancel")
            if not jobs:   # the filters matched none: nothing written
                return []
            ops = self.ops(session)
            verbs.cancel(ops, jobs)
            lifecycle.place_queued(ops)
            return views.job_infos(jobs)

    def _resolve(self, session: Session, refs: list[str], states=verbs.CANCELLABLE) -> list[Job]:
        return verbs.resolve(refs, lambda r: self.array_of(session, r, names=True), lambda r: self.get(session, r),
                             states)

    def _change(self, refs: list[str], verb: str, act, states=verbs.CANCELLABLE) -> list[str]:
        """Resolve `refs` (an array: its jobs in `states`), check the caller may `verb`
        each, `act(ops, jobs)` (lines to print), then place the queue: all under one lock,
        nothing written on a refusal."""
        with self.locked() as session:
            jobs = self._resolve(session, refs, states)
            verbs.check_may_change(self.config, jobs, verb)
            ops = self.ops(session)
            lines = act(ops, jobs)
            session.flush()
            lifecycle.place_queued(ops)
            return lines

    def hold(self, refs: list[str]) -> list[str]:
        """Hold queued jobs (gpuflex.control.verbs.hold)."""
        return self._change(refs, "hold", lambda ops, jobs: verbs.hold(ops.session, jobs), [JobState.QUEUED])

    def release(self, refs: list[str]) -> list[str]:
        """Release held jobs; they start when they fit (gpuflex.control.verbs.release)."""
        return self._change(refs, "release", lambda ops, jobs: verbs.release(ops.session, jobs), [JobState.QUEUED])

    def update(self, refs: list[str], time_limit_s: float | None, priority: int | None) -> list[str]:
        """Change queued or running jobs' time limit and priority (gpuflex.control.verbs.update)."""
        return self._change(refs, "update", lambda ops, jobs: verbs.update(ops.session, jobs, time_limit_s, priority))

    def requeue(self, refs: list[str], hold: bool = False) -> list[str]:
        """Stop running jobs as preemption does and queue them again (gpuflex.control.verbs.requeue)."""
        return self._change(refs, "requeue", lambda ops, jobs: verbs.requeue(ops, jobs, hold),
                            [JobState.RUNNING, JobState.SCALING])

    def scale(self, ref: str, n: int) -> views.JobInfo:
        """Resize a running job. A grow commits its steps one by one under the ops lock
        (the newcomers' rows, each process group, the membership request: see
        scaling.grow_in_steps), so a `gpuflex scale` killed midway leaves nothing the
        database does not know; the next command's reconcile ends what it left. Only the
        owner or an admin may (gpuflex.control.access)."""
        self.check_scale(ref, n)
        results = self.collect_probes()
        with database_lock(self.config.database_url, "ops").held():
            with self.sessions.begin() as session:
                intents.settle(self.config, self.pool, session)
                self.record_probes(session, results)
                job_id = self.get(session, ref).id
            scaling.scale_in_steps(self.sessions.begin, self.config, self.pool, job_id, n)
        self.notify()
        return self.job(job_id, events=False)

    def watch_leavers(self, job_id: int, bound_s: float) -> tuple[int, ...]:
        """Record the job's leavers' ends as their processes exit, for `bound_s` at most
        (gpuflex.policy.leavers); the leavers still leaving then, left to the next refresh."""
        return scaling.watch_leavers(self.sessions, self.config, self.pool, job_id, self.refresh,
                                     time.monotonic() + bound_s)
