"""SQLAlchemy 2.0 typed models. The schema itself comes only from `migrations/`."""

from __future__ import annotations

import enum
import secrets
import time
from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, validates
from sqlalchemy.types import TypeDecorator

from gpuflex.states import JobState, WorkerState


def now() -> float:
    return time.time()


class Base(DeclarativeBase):
    pass


class StateType(TypeDecorator):
    """A `str` enum stored as its value in a VARCHAR, the type the migrations create (so
    the schema is unchanged); rows read back as enum members, and a plain string of a
    valid value is accepted on the way in."""

    impl = String
    cache_ok = True

    def __init__(self, states: type[enum.Enum], length: int) -> None:
        super().__init__(length)
        self.states = states

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return None if value is None else self.states(value).value

    def process_result_value(self, value: Any, dialect: Any) -> enum.Enum | None:
        return None if value is None else self.states(value)


class Host(Base):
    """A host of the pool, mirrored from the config at each command."""

    __tablename__ = "hosts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    address: Mapped[str] = mapped_column(String(255))
    owner: Mapped[str | None] = mapped_column(String(64))
    reachable: Mapped[bool | None] = mapped_column(Boolean)
    last_error: Mapped[str | None] = mapped_column(Text)
    last_probe_at: Mapped[float | None] = mapped_column(Float)
    gpus: Mapped[list["Gpu"]] = relationship(back_populates="host", cascade="all, delete-orphan",
                                             order_by="Gpu.index")


class Gpu(Base):
    """One schedulable device: a GPU, or a CPU slot on a `cpu:N` host (kind='slot')."""

    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("host_id", "index"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(8), default="gpu")
    uuid: Mapped[str | None] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(128))
    utilization_pct: Mapped[float | None] = mapped_column(Float)
    memory_used_mib: Mapped[float | None] = mapped_column(Float)
    memory_total_mib: Mapped[float | None] = mapped_column(Float)
    idle_streak: Mapped[int] = mapped_column(Integer, default=0)
    verdict: Mapped[str | None] = mapped_column(String(32))
    updated_at: Mapped[float | None] = mapped_column(Float)
    host: Mapped[Host] = relationship(back_populates="gpus")


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token: Mapped[str] = mapped_column(String(32), unique=True)
    # the key of the HMAC over what the job's members write to its store (workers and
    # coordinator get it in their environment, never on a command line); a secret: never
    # shown
    secret: Mapped[str] = mapped_column(String(64), default=lambda: secrets.token_hex(32))
    name: Mapped[str] = mapped_column(String(128))
    state: Mapped[JobState] = mapped_column(StateType(JobState, 16), index=True)
    argv: Mapped[list[str]] = mapped_column(JSON)
    workdir: Mapped[str] = mapped_column(Text)
    env: Mapped[dict[str, str]] = mapped_column(JSON)
    min_workers: Mapped[int] = mapped_column(Integer)
    max_workers: Mapped[int] = mapped_column(Integer)
    target_workers: Mapped[int | None] = mapped_column(Integer)
    gpus_per_worker: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    harvest: Mapped[bool] = mapped_column(Boolean, default=False)
    user: Mapped[str] = mapped_column(String(64))
    generation: Mapped[int] = mapped_column(Integer, default=0)
    world_size: Mapped[int] = mapped_column(Integer, default=0)
    queue_reason: Mapped[str | None] = mapped_column(Text)
    store_host: Mapped[str | None] = mapped_column(String(64))
    store_addr: Mapped[str | None] = mapped_column(String(255))
    store_port: Mapped[int | None] = mapped_column(Integer)
    store_pgid: Mapped[int | None] = mapped_column(Integer)
    checkpoint_dir: Mapped[str | None] = mapped_column(Text)
    # the current run's control-socket directory on each host (a fresh random name per
    # run, see gpuflex.control.launch.new_socket_dir); None before the first start
    socket_dir: Mapped[str | None] = mapped_column(String(255))
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    # restarts allowed after a worker crashed (a bug: an exception, a non-zero exit); faults
    # (signals, lost hosts) do not count against it
    retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # the submitter's environment, recorded at submit: every worker of the job gets it
    # (newcomers included); None for jobs submitted before migration 0005
    submit_env: Mapped[dict[str, str] | None] = mapped_column(JSON)
    # issue 11 (migration 0006): 'inplace' | 'restart' | None (a fixed gang, torchrun's
    # contract); the run's wall-clock limit; jobs that must succeed first; the array
    # (id of its first job), this job's index in it, the array's cap on running jobs;
    # whether a higher-priority job may stop and requeue it
    elastic: Mapped[str | None] = mapped_column(String(16))
    time_limit_s: Mapped[float | None] = mapped_column(Float)
    after: Mapped[list[int] | None] = mapped_column(JSON)
    array_id: Mapped[int | None] = mapped_column(Integer, index=True)
    array_index: Mapped[int | None] = mapped_column(Integer)
    array_limit: Mapped[int | None] = mapped_column(Integer)
    requeue: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    # where a webhook is posted when the job ends, fails, is preempted or times out
    # (`submit --notify`, else `[notify] url` at submit; migration 0007); None: nowhere
    notify_url: Mapped[str | None] = mapped_column(Text)
    # how an in-place job's global batch is divided: 'speed' (by measured worker speed) or
    # 'even' (`submit --split`; migration 0008); None: submitted before, runs even
    split: Mapped[str | None] = mapped_column(String(8))
    # the checkpoint directory of an earlier job that an in-place job's workers start from,
    # at whatever world size wrote it (`submit --resume-from`, absolute; migration 0009);
    # None: the job starts afresh
    resume_from: Mapped[str | None] = mapped_column(Text)
    # where each of submit's settings came from: {"workers": "#GPUFLEX", "time": "#SBATCH",
    # "name": "command line", ...} (issue 33, migration 0011); None: submitted before, or
    # not through the CLI
    sources: Mapped[dict[str, str] | None] = mapped_column(JSON)
    # issue 33 (migration 0012): a queued job the scheduler leaves alone until `gpuflex
    # release`; the --after kinds beyond afterok ({"afterany": [ids], "afternotok": [ids],
    # "singleton": true}, only those given; afterok's ids stay in `after`)
    held: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    dependency: Mapped[dict | None] = mapped_column(JSON)
    # issue 33 (migration 0013): `submit --sync` given (every host runs the sent copy), and
    # the packed submit directory's sha256 (gpuflex.hosts.sync); None: nothing packed
    sync: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    code_sha256: Mapped[str | None] = mapped_column(String(64))
    # issue 33 (migration 0014): None for a batch job, "interactive" (`gpuflex run`) or
    # "alloc" (`gpuflex alloc`): never preempted or harvested (policy.preemption.never_preempted)
    kind: Mapped[str | None] = mapped_column(String(16))
    # issue 33 (migration 0015): the job's environment (gpuflex.jobenv): `submit --python`
    # (a path or a name), `--venv` (a path on the hosts), `--conda` (a name), `--env-setup`
    # (a shell command run once per host per run); None: not given (every job before)
    python: Mapped[str | None] = mapped_column(Text)
    venv: Mapped[str | None] = mapped_column(Text)
    conda: Mapped[str | None] = mapped_column(String(128))
    env_setup: Mapped[str | None] = mapped_column(Text)
    # issue 33 (migration 0016): `submit --image`: the container image each worker runs in,
    # through its host's engine (gpuflex.hosts.container); None: on the host itself
    image: Mapped[str | None] = mapped_column(Text)
    # issue 28 (migration 0017): the coordinator's progress as the owner's last command read
    # it ({step, epoch, samples_per_s, world_size, at}); other users' commands show it
    progress: Mapped[dict | None] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float, default=now)
    started_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    exit_reason: Mapped[str | None] = mapped_column(Text)
    workers: Mapped[list["Worker"]] = relationship(back_populates="job", cascade="all, delete-orphan",
                                                   order_by="Worker.wid")
    events: Mapped[list["Event"]] = relationship(back_populates="job", cascade="all, delete-orphan",
                                                 order_by="Event.id")

    @property
    def live_workers(self) -> list["Worker"]:
        """Workers whose process has not ended."""
        return [w for w in self.workers if not w.state.final]

    @property
    def members(self) -> list["Worker"]:
        """Workers meant to be in the job now: alive and not retiring."""
        return [w for w in self.live_workers if w.state is not WorkerState.LEAVING]

    @validates("state")
    def _valid_job_state(self, _key: str, value: JobState | str) -> JobState:
        return JobState(value)


class Worker(Base):
    """One worker process. `wid` is stable for the process's life; `rank` changes per generation."""

    __tablename__ = "workers"
    __table_args__ = (UniqueConstraint("job_id", "wid"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    wid: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int | None] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(64))
    gpus: Mapped[list[int]] = mapped_column(JSON)
    pid: Mapped[int | None] = mapped_column(Integer)
    pgid: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[WorkerState] = mapped_column(StateType(WorkerState, 16))
    generation: Mapped[int] = mapped_column(Integer, default=0)
    log_path: Mapped[str] = mapped_column(Text)
    exit_path: Mapped[str] = mapped_column(Text)
    control_path: Mapped[str | None] = mapped_column(Text)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float, default=now)
    ended_at: Mapped[float | None] = mapped_column(Float)
    # issue 28 (migration 0018): when a shrink asked it to leave; its exit 0 after that is
    # its leaving, not the end of the training (gpuflex.policy.outcomes). NULL: never asked
    retired_at: Mapped[float | None] = mapped_column(Float)
    job: Mapped[Job] = relationship(back_populates="workers")

    @validates("state")
    def _valid_worker_state(self, _key: str, value: WorkerState | str) -> WorkerState:
        return WorkerState(value)


class Event(Base):
    """Every state change, scale and fault of a job, with its time and details.

    `time` is when it happened (for what a coordinator or worker recorded, the time its
    record gives: gpuflex.control.journal); `recorded_at` when gpuflex wrote the row (NULL:
    rows from before migration 0010, recorded at their `time`)."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    time: Mapped[float] = mapped_column(Float, default=now)
    recorded_at: Mapped[float | None] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # a repeated event is one row: how many times it happened, and when it last did
    count: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    last_time: Mapped[float | None] = mapped_column(Float)
    job: Mapped[Job] = relationship(back_populates="events")


class GpuSample(Base):
    """One probe of one GPU: the bounded history behind the idle verdicts and the
    foreign processes seen on it (kept per GPU up to gpuflex.hosts.probe.HISTORY_PER_GPU).

    `foreign_pids`: [{"pid": int, "user": str | None, "memory_mib": float | None}] for
    compute processes that are not gpuflex workers."""

    __tablename__ = "gpu_samples"
    __table_args__ = (Index("ix_gpu_samples_host_gpu_time", "host", "gpu_index", "time"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(64))
    gpu_index: Mapped[int] = mapped_column(Integer)
    uuid: Mapped[str | None] = mapped_column(String(64))
    time: Mapped[float] = mapped_column(Float, default=now)
    utilization_pct: Mapped[float | None] = mapped_column(Float)
    memory_used_mib: Mapped[float | None] = mapped_column(Float)
    memory_total_mib: Mapped[float | None] = mapped_column(Float)
    foreign_pids: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
