"""The job lifecycle policy: pure (job, what was observed) -> actions. No I/O.

Every command first reconciles each running job: gpuflex.control.observe reads what the
hosts and the coordinator say, `decide` (here) says what that means, and
gpuflex.control.executor writes it. In order:

1. EndWorker for each live worker whose process group is gone: EXITED (exit record 0),
   FAILED (another code), LOST (no exit record: SIGKILLed, or its host rebooted). A host
   that did not answer is recorded ("host-unreachable", once while it stays so).
2. From the coordinator's status (when it answered): Adopt its generation and members
   (ranks; starting workers it has seen become running), Record each newly verified
   generation of its history ("formed", "scale", "fault" with the phase timings), and
   RUNNING once a scaling job has settled; Record "forged" when the coordinator has ignored
   more store records that failed authentication than the run's events say (one event
   per new count); Record "checkpoint-failed" when rank 0's progress counts more failed
   checkpoint writes (a full disk: training goes on) than the run's events say for it.
3. A live worker on an unreachable host that the job has gone on without (not in a newer
   generation's members, and not a newcomer still starting) is LOST.
4. While workers live: "store-lost" (once) when the coordinator neither answers nor
   runs; Requeue when the job settled below its MIN.
5. Once no worker lives: Requeue (restart from the last checkpoint) when the last
   generation's members exited with STORE_LOST_EXIT, else Finish: SUCCEEDED when they all
   exited 0, FAILED with the first bad exit code otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Union

from gpuflex.elastic.keys import STORE_LOST_EXIT
from gpuflex.states import JobState, WorkerState

_KINDS = {"initial": "formed", "resize": "scale", "recover": "fault"}
HISTORY_KINDS = ("scale", "fault", "formed")   # events that record a generation
FORGED_KIND = "forged"   # the event of store records that failed authentication
CHECKPOINT_FAILED_KIND = "checkpoint-failed"   # the event of a checkpoint write that failed


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
    recorded: frozenset[int] = frozenset()   # generations whose formation is already an event
    forged_recorded: int = 0   # forged store records this run's events already report
    # wid -> the failed checkpoint writes of that worker this run's events already report
    checkpoint_failures_recorded: Mapping[int, int] = dataclasses.field(default_factory=dict)


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
    coordinator: Mapping[str, Any] | None = None  # its status reply; None: it did not answer
    coordinator_alive: bool = True                # its process group runs (asked when it did not answer)


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
    """An event; with `once`, not when the job's last event already says the same (a
    host that stays unreachable is noted once, not at every command)."""

    kind: str
    message: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    once: bool = False


@dataclasses.dataclass(frozen=True)
class SetState:
    target: JobState
    message: str


@dataclasses.dataclass(frozen=True)
class Requeue:
    """Stop what still runs (gracefully: the workers checkpoint) and queue the job again."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Finish:
    """Every worker has ended: stop the coordinator and end the job in `state`."""

    state: JobState               # SUCCEEDED or FAILED
    exit_code: int
    reason: str


Action = Union[EndWorker, Adopt, Record, SetState, Requeue, Finish]


# ---- the decision -------------------------------------------------------------------------
def decide(job: JobFacts, seen: Observation) -> list[Action]:
    """What one reconcile of `job` should write, in order; see the module docstring."""
    actions: list[Action] = []
    workers = {w.wid: w for w in job.workers}

    def end(w: WorkerFacts, state: WorkerState, rc: int | None, ended_at: float | None = None) -> None:
        actions.append(EndWorker(w.wid, state, rc, ended_at))
        workers[w.wid] = dataclasses.replace(w, state=state, exit_code=rc)

    def live() -> list[WorkerFacts]:
        return [w for w in workers.values() if not w.state.final]

    hosts = list(dict.fromkeys(w.host for w in live()))
    for host in hosts:
        if host in seen.unreachable:
            actions.append(Record("host-unreachable", seen.unreachable[host], {"host": host}, once=True))
            continue
        for w in [w for w in live() if w.host == host]:
            p = seen.procs.get(w.wid)
            if p is None or p.alive:
                continue
            if p.exited:
                end(w, WorkerState.EXITED if p.returncode == 0 else WorkerState.FAILED, p.returncode,
                    p.ended_at)
            else:
                end(w, WorkerState.LOST, None)

    coord = seen.coordinator
    generation, world_size = job.generation, job.world_size
    if coord is not None:
        gen = coord.get("generation") or 0
        members = tuple(coord.get("members") or ())
        if gen and gen >= generation:
            generation, world_size = gen, len(members)
            actions.append(Adopt(gen, members))
            for wid in members:
                if wid in workers:
                    workers[wid] = dataclasses.replace(workers[wid], generation=gen)
        for h in coord.get("history", []):
            if h["generation"] in job.recorded or not h.get("verified"):
                continue
            kind = _KINDS.get(h["kind"], h["kind"])
            data = {k: v for k, v in h.items() if k not in ("kind", "message")}
            actions.append(Record(kind, f"generation {h['generation']}: {h.get('message', kind)}",
                                  {"generation_kind": h["kind"], **data}))
        for record in (forgeries(job, coord.get("forged")), checkpoint_failures(job, coord.get("progress"))):
            if record is not None:
                actions.append(record)
        if job.state is JobState.SCALING and coord.get("settled"):
            actions.append(SetState(JobState.RUNNING, f"world size {world_size} at generation {gen}"))
        if coord.get("generation"):
            # a worker on a host we cannot reach that the job has gone on without is lost
            for w in live():
                if w.host in seen.unreachable and w.wid not in coord["members"] \
                        and w.generation < coord["generation"] and w.state is not WorkerState.STARTING:
                    end(w, WorkerState.LOST, None)
    if live():
        if coord is None and not seen.coordinator_alive:
            actions.append(Record("store-lost", "the job's coordinator (store) is gone", once=True))
        elif coord is not None and coord.get("settled") and world_size < job.min_workers:
            actions.append(Requeue(f"fell to {world_size} worker(s), below its minimum of "
                                   f"{job.min_workers}; restarting from its checkpoint when it fits"))
        return actions
    actions.append(outcome(job, list(workers.values()), generation))
    return actions


def forgeries(job: JobFacts, report: Any) -> Record | None:
    """An event when the coordinator's `forged` report ({"count": n, "last": key}, records
    that failed authentication and were ignored) counts more than already recorded."""
    if not isinstance(report, Mapping):
        return None
    count = report.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count <= job.forged_recorded:
        return None
    last = "".join(c for c in str(report.get("last") or "?") if c.isprintable())[:80]
    return Record(FORGED_KIND, f"ignored {count - job.forged_recorded} forged store record(s) (last: {last})",
                  {"count": count, "last": last})


def checkpoint_failures(job: JobFacts, progress: Any) -> Record | None:
    """An event when rank 0's progress ({"wid", "checkpoint_failures": n,
    "checkpoint_error": why, ...}) counts more failed checkpoint writes than recorded."""
    if not isinstance(progress, Mapping):
        return None
    wid, count = progress.get("wid"), progress.get("checkpoint_failures")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (wid, count)):
        return None
    if count <= job.checkpoint_failures_recorded.get(wid, 0):
        return None
    why = "".join(c for c in str(progress.get("checkpoint_error") or "a checkpoint write failed")
                  if c.isprintable())[:300]
    return Record(CHECKPOINT_FAILED_KIND, f"worker {wid}: {why}; training goes on ({count} failed so far)",
                  {"wid": wid, "count": count})


def outcome(job: JobFacts, workers: list[WorkerFacts], generation: int) -> Requeue | Finish:
    """How a job whose workers have all ended comes out: judged by the members of its last
    generation in the current run (workers of an earlier run are history)."""
    current = [w for w in workers if job.started_at is None or w.started_at >= job.started_at]
    last = [w for w in current if w.generation == generation]
    if any(w.exit_code == STORE_LOST_EXIT for w in last):
        return Requeue("the job store was lost; restarting from the last checkpoint")
    failed = [w for w in last or current if w.state is not WorkerState.EXITED]
    if failed:
        rc = failed[0].exit_code if failed[0].exit_code is not None else -9
        return Finish(JobState.FAILED, rc,
                      f"worker {failed[0].wid} {failed[0].state} (exit code {failed[0].exit_code})")
    return Finish(JobState.SUCCEEDED, 0, "all workers exited 0")
