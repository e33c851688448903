"""Job and worker states: `str` enums whose transitions are written down here."""

from __future__ import annotations

import enum

from gpuflex.errors import IllegalTransition


class _StrState(str, enum.Enum):
    """A state written as its value: in messages, JSON and the database alike."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class JobState(_StrState):
    """The life of a job.

    - QUEUED: recorded, waiting for MIN free slots/GPUs. -> RUNNING (placed), CANCELLED,
      FAILED (its command cannot be started at all).
    - RUNNING: workers are up. -> SCALING (a resize is under way), SUCCEEDED (all workers
      exited 0), FAILED (a worker failed and none can go on), CANCELLED, QUEUED (requeued:
      its store was lost or it fell below MIN; it restarts from its last checkpoint).
    - SCALING: a new generation was written; workers switch at a step boundary.
      -> RUNNING (switch seen or given up), SUCCEEDED, FAILED, CANCELLED, QUEUED.
    - TIMEOUT: the run reached its time limit (`--time`): SIGTERM, grace, SIGKILL. Final.
    - SUCCEEDED, FAILED, CANCELLED, TIMEOUT: final.
    """

    QUEUED = "queued"
    RUNNING = "running"
    SCALING = "scaling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"

    @property
    def final(self) -> bool:
        return self in _FINAL_JOB

    @property
    def active(self) -> bool:
        return self in (JobState.RUNNING, JobState.SCALING)

    def check_transition(self, target: "JobState") -> None:
        if target not in _JOB_MOVES[self]:
            raise IllegalTransition("job", self.value, target.value)


_FINAL_JOB = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT}
_JOB_MOVES: dict[JobState, set[JobState]] = {
    JobState.QUEUED: {JobState.RUNNING, JobState.CANCELLED, JobState.FAILED},
    JobState.RUNNING: {JobState.SCALING, JobState.SUCCEEDED, JobState.FAILED,
                       JobState.CANCELLED, JobState.QUEUED, JobState.TIMEOUT},
    JobState.SCALING: {JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED,
                       JobState.CANCELLED, JobState.QUEUED, JobState.TIMEOUT},
    JobState.SUCCEEDED: set(),
    JobState.FAILED: set(),
    JobState.CANCELLED: set(),
    JobState.TIMEOUT: set(),
}


class WorkerState(_StrState):
    """The life of one worker process.

    - STARTING: spawned, not yet seen in a generation. -> RUNNING, LEAVING (no longer
      wanted before it joined), EXITED, FAILED, LOST, STOPPED.
    - RUNNING: a member of the job's current generation.
      -> LEAVING (retired by a shrink), EXITED, FAILED, LOST, STOPPED.
    - LEAVING: asked to leave at the next step boundary. -> EXITED, FAILED, LOST, STOPPED.
    - EXITED: the process ended with code 0. Final.
    - FAILED: the process ended with a non-zero code or a signal. Final.
    - LOST: the process vanished without an exit record (SIGKILL, host gone). Final.
    - STOPPED: ended by gpuflex (cancel, requeue). Final.
    """

    STARTING = "starting"
    RUNNING = "running"
    LEAVING = "leaving"
    EXITED = "exited"
    FAILED = "failed"
    LOST = "lost"
    STOPPED = "stopped"

    @property
    def final(self) -> bool:
        return self in (WorkerState.EXITED, WorkerState.FAILED, WorkerState.LOST,
                        WorkerState.STOPPED)

    def check_transition(self, target: "WorkerState") -> None:
        if self.final or target in (WorkerState.STARTING,) or (
            self is WorkerState.LEAVING and target is WorkerState.RUNNING
        ):
            raise IllegalTransition("worker", self.value, target.value)
