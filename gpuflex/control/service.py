"""The job service: every CLI command is a thin wrapper over one of these methods.

A service owns a session factory and a pool. Mutating operations run under the
database's "ops" lock (gpuflex.db.locks), so concurrent gpuflex commands (and cron ticks)
do not place the same job twice. The work itself is done below it: placing and
reconciling in gpuflex.control.lifecycle, resizing in gpuflex.control.scaling, the
actions in gpuflex.control.executor, each given an `Ops` (config, pool, session).
Reads come back as plain records (gpuflex.control.views) for the CLI to render.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
from typing import Any, Iterator, Mapping

from sqlalchemy.orm import Session, sessionmaker

from gpuflex.config import Config, check_webhook_url
from gpuflex.control import access, executor, intents, journal, lifecycle, notify, report, resume, scaling, views
from gpuflex.control.executor import Ops
from gpuflex.control.launch import submit_environment
from gpuflex.control.pool import Pool
from gpuflex.db import queries
from gpuflex.db.engine import open_database
from gpuflex.db.locks import database_lock
from gpuflex.db.models import Job
from gpuflex.errors import UnknownJobError, UsageError
from gpuflex.control.probes import record_probes
from gpuflex.hosts.probe import collect_probes
from gpuflex.jobspec import ArraySpec, check_torchrun, elastic_mode, parse_time, split_mode
from gpuflex.policy.placement import devices_per_worker
from gpuflex.states import JobState

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ID = re.compile(r"[0-9]+")   # ASCII only: str.isdigit() takes '²', which int() refuses
_ARRAY_REF = re.compile(r"([0-9]+)_([0-9]+)")
MAX_RETRIES = 1000
# Every count the CLI takes lands in an INTEGER column, 32 bits wide in PostgreSQL (and
# 64 in SQLite): bounds at the edge so a typo is a clear refusal, never an OverflowError.
INT_MAX = 2**31 - 1
MAX_WORKERS = 65536
MAX_GPUS_PER_WORKER = 4096   # config.MAX_CPU_SLOTS: no host holds more devices


def parse_count(option: str, value: int, low: int, high: int = INT_MAX) -> int:
    """`value` if it is an int in [low, high]; UsageError naming the option and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{option} {value!r}: give a whole number from {low} to {high}.")
    return value


def check_text(what: str, text: str, *, shown: bool = True) -> str:
    """`text` if the database can store it and a process can be given it: UTF-8 (the
    shell hands Python bytes that are not UTF-8 as surrogate escapes, which no column
    or JSON document can hold, and storing them re-encoded would run a different
    command) and no NUL byte (execve cannot pass one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what}{f' {text!r}' if shown else ''} holds bytes that are not UTF-8 (at "
                         f"{e.start}); gpuflex stores commands, paths and variables as UTF-8 text.") from None
    if "\0" in text:
        raise UsageError(f"{what}{f' {text!r}' if shown else ''} holds a NUL byte.")
    return text


@dataclasses.dataclass(frozen=True)
class SubmitRequest:
    argv: list[str]
    name: str | None = None
    min_workers: int = 1
    max_workers: int = 1
    gpus_per_worker: int = 1
    priority: int = 0
    harvest: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    workdir: str | None = None
    retries: int = 0   # restarts allowed after a worker crashed (a bug); faults never count
    # issue 11: --elastic as given (None: inplace for MIN < MAX, a fixed gang otherwise),
    # --time in seconds (None: [jobs] default_time, else none), --after ids, --array,
    # --requeue (a higher-priority job may stop and requeue it)
    elastic: str | None = None
    time_limit_s: float | None = None
    after: tuple[int, ...] = ()
    array: ArraySpec | None = None
    requeue: bool = False
    notify: str | None = None   # --notify: the webhook URL (None: [notify] url, if any)
    split: str | None = None    # --split speed|even (issue 12; None: speed for an in-place job)
    resume_from: str | None = None   # --resume-from PATH as given (issue 13; see control/resume.py)
    # the submitter's environment, recorded for every worker (launch.submit_environment
    # drops what belongs to the session); None: this process's
    environ: Mapping[str, str] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.argv or not self.argv[0].strip():
            raise UsageError("no command to run; put it after '--', e.g. gpuflex submit -- python train.py.")
        for i, arg in enumerate(self.argv):
            check_text(f"the command's argument {i}", arg)
        if self.min_workers < 1 or self.max_workers < self.min_workers:
            raise UsageError(f"bad worker range {self.min_workers}:{self.max_workers}.")
        parse_count("--workers", self.max_workers, 1, MAX_WORKERS)
        if self.gpus_per_worker < 1:   # 0 would be a worker that holds nothing: never placed, never counted
            raise UsageError(f"--gpus-per-worker {self.gpus_per_worker}: a worker holds at least 1 GPU "
                             "(or CPU slot).")
        parse_count("--gpus-per-worker", self.gpus_per_worker, 1, MAX_GPUS_PER_WORKER)
        parse_count("--priority", self.priority, -INT_MAX, INT_MAX)
        for key, value in self.env.items():
            check_text(f"--env {key}=...", value, shown=False)
        if self.workdir is not None:
            check_text("--workdir", self.workdir)
        if self.name is not None and not _NAME.fullmatch(self.name):
            raise UsageError(f"--name {self.name!r}: use letters, digits, '.', '_' or '-' (at most 64).")
        if self.name is not None and (self.name.isdigit() or _ARRAY_REF.fullmatch(self.name)):
            raise UsageError(f"--name {self.name!r}: a name of digits only would read as a job id "
                             f"(or ID_INDEX as an array's job); add a letter (e.g. run-{self.name}).")
        if self.workdir is not None and not os.path.isdir(os.path.expanduser(self.workdir)):
            raise UsageError(f"--workdir {self.workdir!r} is not a directory.")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) \
                or not 0 <= self.retries <= MAX_RETRIES:
            raise UsageError(f"--retries {self.retries!r}: give a number of restarts from 0 to {MAX_RETRIES}.")
        split_mode(self.split, elastic_mode(self.elastic, self.min_workers, self.max_workers))
        check_torchrun(self.argv, self.gpus_per_worker)
        if self.notify is not None:
            check_webhook_url(self.notify)

    @property
    def elastic_mode(self) -> str | None:
        """'inplace', 'restart' or None (a fixed gang): see gpuflex.jobspec.elastic_mode."""
        return elastic_mode(self.elastic, self.min_workers, self.max_workers)


def parse_workers(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' -> (min, max); raises UsageError naming the value."""
    m = re.fullmatch(r"\s*([0-9]+)\s*(?::\s*([0-9]+)\s*)?", text)
    if not m:
        raise UsageError(f"--workers {text!r} is not N or MIN:MAX (e.g. 2 or 1:4).")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise UsageError(f"--workers {text!r}: at least 1 worker is needed.")
    if hi < lo:
        raise UsageError(f"--workers {text!r}: MAX ({hi}) is below MIN ({lo}); write MIN:MAX.")
    if hi > MAX_WORKERS:
        raise UsageError(f"--workers {text!r}: at most {MAX_WORKERS} workers.")
    return lo, hi


@dataclasses.dataclass(frozen=True)
class ArrayRef:
    """`5_3`: index 3 of the array 5 (Slurm's way of naming an array's task)."""

    array_id: int
    index: int


def _id(text: str) -> int:
    if len(text) > 10 or int(text) > INT_MAX:   # no such row can exist; the driver would overflow
        raise UsageError(f"job id {text[:20]}{'...' if len(text) > 20 else ''}: job ids go from 1 "
                         f"to {INT_MAX}.", hint="Run 'gpuflex status' to list jobs.")
    return int(text)


def parse_ref(ref: str | int) -> int | str | ArrayRef:
    """A job reference as the id (int), the array task (`5_3`: ArrayRef) or the name (str)
    it can be, checked before any database is opened; UnknownJobError for what can be
    none of them."""
    text = str(ref).strip()
    if _ID.fullmatch(text):
        return _id(text)
    m = _ARRAY_REF.fullmatch(text)
    if m:
        return ArrayRef(_id(m.group(1)), _id(m.group(2)))
    if _NAME.fullmatch(text):
        return text
    raise UnknownJobError(text)


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--env {item!r} has no '='; write --env KEY=VALUE.")
        if not _ENV_KEY.fullmatch(key):
            raise UsageError(f"--env {key}=...: {key!r} is not a valid variable name.")  # never the value
        env[key] = value
    return env


class JobService:
    """The commands. `pool` defaults to one over the registry's transports; tests and
    benchmarks give one with a fake transport factory."""

    def __init__(self, config: Config, sessions: sessionmaker[Session] | None = None,
                 pool: Pool | None = None) -> None:
        self.config = config
        self.sessions = sessions or open_database(config.database_url)
        self.pool = pool or Pool(config)
        self.progress: dict[int, dict] = {}  # job id -> the coordinator's last progress report
        self.forming: dict[int, dict | None] = {}   # job id -> the generation it forms now, if any
        self.outbox = notify.Outbox(self.sessions)   # webhooks of committed moves, not posted yet

    def close(self) -> None:
        self.notify()
        self.outbox.close()
        self.pool.close()

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

    # ---- reads -------------------------------------------------------------------
    def get(self, session: Session, ref: str | int) -> Job:
        """A job by id or name (the newest of that name); UnknownJobError otherwise."""
        key = parse_ref(ref)
        if isinstance(key, ArrayRef):
            job = queries.array_job(session, key.array_id, key.index)
        else:
            job = queries.job(session, key) if isinstance(key, int) else queries.newest_job_named(session, key)
        if job is None:
            raise UnknownJobError(str(ref).strip())
        return job

    def job(self, ref: str | int, *, events: bool = True) -> views.JobInfo:
        """One job with its workers (and its events), as a plain record."""
        with self.sessions() as session:
            return views.job_info(self.get(session, ref), events=events)

    def jobs(self, owner: str | None = None) -> list[views.JobInfo]:
        """Every job with its workers, by id; only `owner`'s when given."""
        return self.listing(owner).jobs

    def listing(self, owner: str | None = None, states: list[JobState] | None = None,
                ended: int | None = None) -> views.Listing:
        """The jobs `status` lists (views.listing): those not ended and the `ended` newest
        ended ones (all when None); only `owner`'s and those in `states` when given."""
        with self.sessions() as session:
            return views.listing(session, owner, states, ended)

    def check_owner_name(self, name: str) -> str:
        """`name` for `status --user` (gpuflex.control.access.check_user): a unix user, or
        the owner of a job here; UsageError otherwise."""
        with self.sessions() as session:
            return access.check_user(name, lambda: queries.owners(session))

    def check_may_change(self, ref: str | int, verb: str) -> None:
        """NotOwnerError (gpuflex.control.access) unless the caller owns the job `ref`
        names (every job of an array not ended yet, for an array's id) or is an admin. An
        ended job is left to the command, which says it cannot change. Read before any
        command writes: an owner never changes, so no lock is needed."""
        with self.sessions() as session:
            key = parse_ref(ref)
            array = queries.array_jobs(session, key) if isinstance(key, int) else []
            for job in array or [self.get(session, ref)]:
                if not job.state.final:
                    access.check_owner(self.config, job, verb)

    def hosts(self) -> list[dict[str, Any]]:
        """Hosts, their devices, the last probe's figures and who holds each device."""
        with self.sessions() as session:
            return views.pool_view(self.config, session)

    def report(self, since: float) -> dict[str, Any]:
        """`gpuflex report` from `since` until now (gpuflex.control.report)."""
        with self.sessions() as session:
            return report.build(session, since)

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
                if status is not None and status.get("progress"):
                    self.progress[job.id] = status["progress"]
                if status is not None:
                    self.forming[job.id] = status.get("forming")
            session.flush()
            lifecycle.place_queued(ops)
            lifecycle.sweep_socket_dirs(ops, active)

    # ---- commands ----------------------------------------------------------------
    def submit(self, req: SubmitRequest) -> int:
        resume_from = resume.checked(self.config, req.resume_from, req.elastic_mode)   # before any probe
        workdir = os.path.abspath(os.path.expanduser(req.workdir or os.getcwd()))
        results = self.collect_probes()
        with self.locked() as session:
            self.pool.sync_hosts(session)
            self.record_probes(session, results)
            self.check_pool_can_hold(session, req)   # bad input: the transaction is undone
            self.check_after(session, req.after)
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
                    split=split_mode(req.split, req.elastic_mode), after=list(req.after) or None, requeue=req.requeue,
                    notify_url=req.notify or self.config.notify.url,
                    array_index=index, array_limit=req.array.limit if req.array is not None else None,
                    user=access.caller(),
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
        reads it) cancels every job of the array not ended yet (`5_3`: one of them).
        Returns the jobs cancelled. Only the owner or an admin may (gpuflex.control.access)."""
        self.check_may_change(ref, "cancel")
        with self.locked() as session:
            key = parse_ref(ref)
            array = queries.array_jobs(session, key) if isinstance(key, int) else []
            jobs = [j for j in array if not j.state.final] if array else [self.get(session, ref)]
            if not jobs or jobs[0].state.final:
                what = f"array {key}: every job" if array else f"job {jobs[0].id}"
                raise UsageError(f"{what} is already {'ended' if array else jobs[0].state}; nothing to cancel.")
            ops = self.ops(session)
            for job in jobs:
                if job.state is JobState.QUEUED:   # nothing runs: no process to stop
                    journal.set_state(session, job, JobState.CANCELLED, "cancelled by user")
                else:
                    executor.stop_job(ops, job, JobState.CANCELLED, "cancelled by user")
            lifecycle.place_queued(ops)
            return views.job_infos(jobs)

    def scale(self, ref: str, n: int) -> views.JobInfo:
        """Resize a running job. A grow commits its steps one by one under the ops lock
        (the newcomers' rows, each process group, the membership request: see
        scaling.grow_in_steps), so a `gpuflex scale` killed midway leaves nothing the
        database does not know; the next command's reconcile ends what it left. Only the
        owner or an admin may (gpuflex.control.access)."""
        self.check_may_change(ref, "scale")
        results = self.collect_probes()
        with database_lock(self.config.database_url, "ops").held():
            with self.sessions.begin() as session:
                intents.settle(self.config, self.pool, session)
                self.record_probes(session, results)
                job_id = self.get(session, ref).id
            scaling.scale_in_steps(self.sessions.begin, self.config, self.pool, job_id, n)
        self.notify()
        return self.job(job_id, events=False)
