"""What the lifecycle policy decides on and what it returns: a job and its workers as the
database knows them (`JobFacts`, `WorkerFacts`), what reading the hosts and the coordinator
gave (`Observation`, `ProcSeen`), and the actions (`EndWorker`, `Adopt`, `Record`,
`SetState`, `Requeue`, `Finish`) that gpuflex.control.executor writes. Plain data, no I/O;
the rules that judge them are gpuflex.policy.outcomes and gpuflex.policy.lifecycle."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Union

from gpuflex.elastic.protocol.wire import CoordinatorStatus
from gpuflex.states import JobState, WorkerState

INPLACE = "inplace"      # jobs.elastic of a job resized in place (gpuflex.jobspec.INPLACE)
RESTART = "restart"      # and of a restart-elastic one


# ---- the inputs ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WorkerFacts:
    """One worker as the DB knows it."""

    wid: int
    host: str
    state: WorkerState
    generation: int = 0
    started_at: float = 0.0
    exit_code: int | None = None
    ended_at: float | None = None
    pgid: int | None = None   # its process group (None: its start never recorded one)
    retired: bool = False     # a shrink asked it to leave (workers.retired_at)


@dataclasses.dataclass(frozen=True)
class JobFacts:
    """One running (or scaling) job as the DB knows it."""

    id: int
    state: JobState
    min_workers: int
    workers: tuple[WorkerFacts, ...]
    generation: int = 0
    world_size: int = 0
    started_at: float | None = None
    # generations whose formation is an event in this run (every one up to the newest is skipped)
    recorded: frozenset[int] = frozenset()
    forged_recorded: int = 0   # forged store records this run's events already report
    # wid -> the failed checkpoint writes of that worker this run's events already report
    checkpoint_failures_recorded: Mapping[int, int] = dataclasses.field(default_factory=dict)
    retries: int = 0           # restarts allowed after a crash or a gang's failure (submit --retries)
    restarts: int = 0          # restarts so far, for any cause
    crash_restarts: int = 0    # of which counted against --retries (RETRY_CAUSES)
    stop_restarts: int = 0     # of which after a stop from outside gpuflex (STOP_CAUSE)
    # who this run's last "waiting" event says waits: (wid, waited-for wids, phase)
    waiting: frozenset[tuple[int, tuple[int, ...], str]] = frozenset()
    elastic: str | None = INPLACE   # jobs.elastic: "inplace", "restart", or None (a fixed gang)
    left_out_recorded: int = 0  # the newest newcomer left out of a resize this run's events report (its n)
    store_host: str | None = None   # where its coordinator (the job store) runs
    deadline: float | None = None   # when the run reaches its time limit (None: no limit)
    # when the newest resize (or state change) was asked; read only while a leaver lives
    resize_asked_at: float | None = None
    # the step each of the job's newest runs (at most STUCK_RUNS) formed its first generation
    # at, oldest first: where it restarted from (None: a formation that named no step)
    run_start_steps: tuple[int | None, ...] = ()
    # the causes of its newest requeues (at most max(STUCK_RUNS - 1, FAULT_RELAUNCHES)), oldest first
    restart_causes: tuple[str, ...] = ()
    # when this run's first "crash-deferred" event was recorded: a gang's crash waiting for
    # a peer's host to answer (gpuflex.policy.outcomes.lost_peer); None: none
    crash_deferred_at: float | None = None

    @property
    def phase(self) -> str:
        """The phase the record says the job is in: "generation 1, forming" before its first
        generation formed, else "generation N, steady" or "generation N, resizing"."""
        if not self.generation:
            return "generation 1, forming"
        return f"generation {self.generation}, {'resizing' if self.state is JobState.SCALING else 'steady'}"

    @property
    def gang(self) -> bool:
        """Launched and judged as a whole (see the module's doc): all but in-place jobs."""
        return self.elastic != INPLACE


@dataclasses.dataclass(frozen=True)
class ProcSeen:
    """A worker's process group as its host saw it: alive, and its exit record if any."""

    alive: bool
    returncode: int | None = None
    ended_at: float | None = None
    exited: bool = False          # an exit record was found (the supervisor saw it end)


@dataclasses.dataclass(frozen=True)
class Observation:
    """What reading reality gave for one job."""

    procs: Mapping[int, ProcSeen]                 # wid -> its group, for hosts that answered
    unreachable: Mapping[str, str] = dataclasses.field(default_factory=dict)   # host -> error
    coordinator: CoordinatorStatus | None = None  # its status reply, parsed; None: it did not answer
    coordinator_alive: bool = True                # its process group runs (asked when it did not answer)
    coordinator_exit: int | None = None           # its exit code, once it ended and left a record
    # wid -> the last lines of the log of a worker that ended with a crash's exit code
    log_tails: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # the abort record the coordinator left in the run's directory ({reason, cause, at}),
    # read when it did not answer (it ended itself after ending the job)
    recorded_abort: Mapping[str, Any] | None = None
    # the last status reply the coordinator left there as it ended itself, read when it did
    # not answer and its process is gone: the generations it formed that no command heard of
    recorded_status: CoordinatorStatus | None = None


# ---- the actions --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EndWorker:
    wid: int
    state: WorkerState            # final
    exit_code: int | None = None
    ended_at: float | None = None  # None: now


@dataclasses.dataclass(frozen=True)
class Adopt:
    """The coordinator's generation and members (in rank order) into the job's record."""

    generation: int
    members: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Record:
    """An event (the journal makes one that repeats the job's last event a count there:
    a host that stays unreachable is one event, however many commands see it). `at`: when
    it happened, as the record it comes from says (the coordinator's or a worker's clock:
    `instant`); None: when the command noticed it."""

    kind: str
    message: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    at: float | None = None


@dataclasses.dataclass(frozen=True)
class SetState:
    target: JobState
    message: str


@dataclasses.dataclass(frozen=True)
class Requeue:
    """Stop what still runs (gracefully: the workers checkpoint) and queue the job again;
    `cause` ("crash", "below-min", "store-lost"...) goes with the restart's event."""

    reason: str
    cause: str = "requeue"


@dataclasses.dataclass(frozen=True)
class Finish:
    """End the job in `state`: stop what still runs (nothing, unless a crash or an abort
    ended it early) and the coordinator. `restarts`: the job's restarts so far, named in
    its final state event."""

    state: JobState               # SUCCEEDED or FAILED
    exit_code: int
    reason: str
    restarts: int = 0


Action = Union[EndWorker, Adopt, Record, SetState, Requeue, Finish]
