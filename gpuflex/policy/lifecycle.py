"""The job lifecycle policy: pure (job, what was observed) -> actions. No I/O.

Every command first reconciles each running job: gpuflex.control.observe reads what the
hosts and the coordinator say, `decide` (here) says what that means, and
gpuflex.control.executor writes it. In order:

1. EndWorker for each live worker whose process group is gone: EXITED (exit record 0),
   FAILED (another code, or a signal), LOST (no exit record: SIGKILLed, or its host
   rebooted). A host that did not answer is recorded ("host-unreachable").
2. From the coordinator's status (when it answered): Adopt its generation and members
   (ranks; starting workers it has seen become running), Record each newly verified
   generation of its history ("formed", "scale", "fault", "rollback", with the phase
   timings; those up to the newest this run's events hold are skipped), RUNNING once a
   scaling job has settled; Record "forged" (store records that failed authentication),
   "checkpoint-failed" (rank 0's failed checkpoint writes: training goes on) once per new
   count, "waiting" when the members waiting at a step barrier for busy ones changed.
3. A live worker on an unreachable host that the job has gone on without (not in a newer
   generation's members, and not a newcomer still starting) is LOST.
4. A crash is a bug, not a fault: a worker of this run that ended with a non-zero exit
   code the runtime does not use (keys.RUNTIME_EXITS; a Python exception exits 1), or one
   the coordinator lists in "crashed" (before the process is even reaped). Record "crash"
   (worker, host, error, its traceback's last lines: from its crashed record, else the
   tail of its log), then Requeue (cause "crash") while the job's restarts for crashes
   are fewer than its --retries, else Finish FAILED at once (the others are stopped). A
   death by signal, or a worker gone without an exit record, stays an elastic fault.
5. The coordinator's "abort" (the same failure repeated max_same_failures times): Finish
   FAILED with its reason.
6. While workers live: "store-lost" when the coordinator neither answers nor runs (Requeue,
   cause "orphan", if it exited ORPHAN_EXIT); Requeue (cause "below-min") when it holds the
   job (a recovery would go below MIN: survivors wait at a step boundary) or settled below MIN.
7. Once no worker lives: Requeue (cause "store-lost") when the last generation's members
   exited with STORE_LOST_EXIT; FAILED when one exited ABORTED_EXIT; else SUCCEEDED when
   they all exited 0, FAILED with the first bad exit code otherwise. A restarted job's
   Finish carries its restarts: its final event says "succeeded after N restart(s)".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Union

from gpuflex.elastic.keys import ABORTED_EXIT, ORPHAN_EXIT, RUNTIME_EXITS, STORE_LOST_EXIT
from gpuflex.states import JobState, WorkerState

_KINDS = {"initial": "formed", "resize": "scale", "recover": "fault"}
HISTORY_KINDS = ("scale", "fault", "formed", "rollback")   # events that record a generation
FORGED_KIND = "forged"   # the event of store records that failed authentication
CHECKPOINT_FAILED_KIND = "checkpoint-failed"   # the event of a checkpoint write that failed
CRASH_KIND = "crash"     # the event of a worker that crashed (a bug in the training code)
WAITING_KIND = "waiting"   # the event of members waiting at a step barrier for busy ones
CRASH_CAUSE = "crash"    # a requeue's cause, counted against the job's --retries
TRACEBACK_LINES = 10     # the lines of a crash's traceback kept in the job's exit reason
ORPHANED = "its coordinator ended itself, its job gone (no heartbeat or command for its orphan timeout)"


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
    # generations whose formation is an event in this run (every one up to the newest is skipped)
    recorded: frozenset[int] = frozenset()
    forged_recorded: int = 0   # forged store records this run's events already report
    # wid -> the failed checkpoint writes of that worker this run's events already report
    checkpoint_failures_recorded: Mapping[int, int] = dataclasses.field(default_factory=dict)
    retries: int = 0           # restarts allowed after a crash (submit --retries)
    restarts: int = 0          # restarts so far, for any cause
    crash_restarts: int = 0    # of which for a crash
    # who this run's last "waiting" event says waits: (wid, waited-for wids, phase)
    waiting: frozenset[tuple[int, tuple[int, ...], str]] = frozenset()


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
    coordinator_exit: int | None = None           # its exit code, once it ended and left a record
    # wid -> the last lines of the log of a worker that ended with a crash's exit code
    log_tails: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)


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
    a host that stays unreachable is one event, however many commands see it)."""

    kind: str
    message: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)


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


@dataclasses.dataclass(frozen=True)
class Crash:
    """A worker that crashed: what its crashed record (or the tail of its log) says."""

    wid: int
    host: str
    error: str
    traceback: tuple[str, ...] = ()
    phase: str | None = None
    exit_code: int | None = None

    @property
    def summary(self) -> str:
        return f"worker {self.wid} on {self.host} crashed: {self.error}"

    @property
    def reason(self) -> str:
        """The failed job's exit reason: the summary, then the traceback's last lines."""
        how = ", ".join(([f"exit code {self.exit_code}"] if self.exit_code is not None else [])
                        + ([f"in {self.phase}"] if self.phase else []))
        head = f"worker {self.wid} on {self.host} crashed" + (f" ({how})" if how else "") + f": {self.error}"
        return "\n".join([head, *self.traceback[-TRACEBACK_LINES:]])

    def data(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "traceback": list(self.traceback)}


def is_crash_exit(rc: int | None) -> bool:
    """A worker's exit code that means its training code failed: non-zero, not one of the
    runtime's own exits, not a signal (negative)."""
    return rc is not None and rc > 0 and rc not in RUNTIME_EXITS


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
            actions.append(Record("host-unreachable", seen.unreachable[host], {"host": host}))
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
        actions.extend(history(job, coord.get("history")))
        for record in (forgeries(job, coord.get("forged")), checkpoint_failures(job, coord.get("progress")),
                       waiting(job, coord.get("waiting"))):
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
    crash = first_crash(job, workers.values(), (coord or {}).get("crashed"), seen.log_tails)
    if crash is not None:
        actions.append(Record(CRASH_KIND, crash.summary, crash.data()))
        actions.append(after_crash(job, crash))
        return actions
    abort = _reason((coord or {}).get("abort"))
    if abort is not None:
        actions.append(Finish(JobState.FAILED, ABORTED_EXIT, f"aborted: {abort}", job.restarts))
        return actions
    if live():
        held = _reason((coord or {}).get("held"))
        if coord is None and not seen.coordinator_alive:
            actions.append(Requeue(ORPHANED, "orphan") if seen.coordinator_exit == ORPHAN_EXIT
                           else Record("store-lost", "the job's coordinator (store) is gone"))
        elif held is not None:
            actions.append(Requeue(f"{held}; restarting from its checkpoint when it fits", "below-min"))
        elif coord is not None and coord.get("settled") and world_size < job.min_workers:
            actions.append(Requeue(f"fell to {world_size} worker(s), below its minimum of "
                                   f"{job.min_workers}; restarting from its checkpoint when it fits", "below-min"))
        return actions
    actions.append(outcome(job, list(workers.values()), generation))
    return actions


def history(job: JobFacts, entries: Any) -> list[Record]:
    """An event for each verified generation of the coordinator's history newer than the
    newest one this run's events already hold (the coordinator reports its whole history
    at every status: without the mark each would be recorded again at every command)."""
    upto = max(job.recorded, default=0)
    out = []
    for h in entries or ():
        if not isinstance(h, Mapping) or not _is_int(h.get("generation")) or not h.get("verified") \
                or h["generation"] <= upto:
            continue
        kind = _KINDS.get(h.get("kind"), h.get("kind"))
        data = {k: v for k, v in h.items() if k not in ("kind", "message")}
        out.append(Record(kind, f"generation {h['generation']}: {h.get('message', kind)}",
                          {"generation_kind": h.get("kind"), **data}))
    return out


def forgeries(job: JobFacts, report: Any) -> Record | None:
    """An event when the coordinator's `forged` report ({"count": n, "last": key}, records
    that failed authentication and were ignored) counts more than already recorded."""
    if not isinstance(report, Mapping):
        return None
    if not _is_int(count := report.get("count")) or count <= job.forged_recorded:
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
    if not all(_is_int(v) for v in (wid, count)) or count <= job.checkpoint_failures_recorded.get(wid, 0):
        return None
    why = "".join(c for c in str(progress.get("checkpoint_error") or "a checkpoint write failed")
                  if c.isprintable())[:300]
    return Record(CHECKPOINT_FAILED_KIND, f"worker {wid}: {why}; training goes on ({count} failed so far)",
                  {"wid": wid, "count": count})


def waiting(job: JobFacts, entries: Any) -> Record | None:
    """An event when the members the coordinator lists as waiting at a step barrier for
    busy members ([{"wid", "for": [wids], "since", "phase"}]) are not those this run's last
    "waiting" event names (the time they started does not count: the same wait is one
    event, however often it is read)."""
    listed = [e for e in (entries or ()) if isinstance(e, Mapping) and _is_int(e.get("wid"))
              and isinstance(e.get("for"), list) and e["for"] and all(_is_int(x) for x in e["for"])]
    now = frozenset((e["wid"], tuple(sorted(e["for"])), _text(e.get("phase"), 40)) for e in listed)
    if now == job.waiting:
        return None
    if not listed:
        return Record(WAITING_KIND, "no member is waiting any more", {"waiting": []})
    data = [{"wid": e["wid"], "for": sorted(e["for"]), "phase": _text(e.get("phase"), 40),
             "since": e["since"] if isinstance(e.get("since"), (int, float)) else None} for e in listed]
    message = "; ".join(f"worker {d['wid']} waits for {workers_text(d['for'])}"
                        + (f" ({d['phase']})" if d["phase"] else "") for d in data)
    return Record(WAITING_KIND, message, {"waiting": data})


def workers_text(wids: list[int]) -> str:
    return f"worker {wids[0]}" if len(wids) == 1 else "workers " + ", ".join(map(str, wids))


def first_crash(job: JobFacts, workers: Iterable[WorkerFacts], records: Any,
                log_tails: Mapping[int, tuple[str, ...]]) -> Crash | None:
    """The first crash among this run's workers: a crashed record the coordinator reports
    ([{"wid", "error", "traceback", "phase"}]), else a worker that ended with a crash's
    exit code (its error and traceback from the tail of its log)."""
    current = {w.wid: w for w in _current(job, workers)}
    for r in records if isinstance(records, list) else ():
        if isinstance(r, Mapping) and _is_int(r.get("wid")) and r["wid"] in current:
            w = current[r["wid"]]
            tb = _lines(line for line in r.get("traceback") or () if isinstance(line, str))
            return Crash(w.wid, w.host, _text(r.get("error"), 300) or "an exception", tb,
                         _text(r.get("phase"), 40) or None,
                         w.exit_code if w.state is WorkerState.FAILED else None)
    for w in current.values():
        if w.state is WorkerState.FAILED and is_crash_exit(w.exit_code):
            tail = _lines(log_tails.get(w.wid, ()))
            last = next((line.strip() for line in reversed(tail) if line.strip()), "")
            return Crash(w.wid, w.host, last or f"exit code {w.exit_code}", tail, None, w.exit_code)
    return None


def after_crash(job: JobFacts, crash: Crash) -> Requeue | Finish:
    """Restart while the job's --retries allow, else fail it now."""
    if job.crash_restarts < job.retries:
        return Requeue(f"{crash.summary}; restart {job.crash_restarts + 1} of {job.retries}", CRASH_CAUSE)
    return Finish(JobState.FAILED, crash.exit_code or 1, crash.reason, job.restarts)


def outcome(job: JobFacts, workers: list[WorkerFacts], generation: int) -> Requeue | Finish:
    """How a job whose workers have all ended comes out: judged by the members of its last
    generation in the current run (workers of an earlier run are history); a crash of any
    worker of this run fails it (or restarts it, see `after_crash`)."""
    current = _current(job, workers)
    last = [w for w in current if w.generation == generation]
    if any(w.exit_code == STORE_LOST_EXIT for w in last):
        return Requeue("the job store was lost; restarting from the last checkpoint", "store-lost")
    crash = first_crash(job, current, None, {})
    if crash is not None:
        return after_crash(job, crash)
    if any(w.exit_code == ABORTED_EXIT for w in last):
        return Finish(JobState.FAILED, ABORTED_EXIT, "aborted by its coordinator: the same failure repeated",
                      job.restarts)
    failed = [w for w in last or current if w.state is not WorkerState.EXITED]
    if failed:
        rc = failed[0].exit_code if failed[0].exit_code is not None else -9
        return Finish(JobState.FAILED, rc,
                      f"worker {failed[0].wid} {failed[0].state} (exit code {failed[0].exit_code})", job.restarts)
    return Finish(JobState.SUCCEEDED, 0, "all workers exited 0", job.restarts)


def _current(job: JobFacts, workers: Iterable[WorkerFacts]) -> list[WorkerFacts]:
    return [w for w in workers if job.started_at is None or w.started_at >= job.started_at]


def _reason(value: Any) -> str | None:
    """The reason of a coordinator's {"reason": str} ("held", "abort"); None when absent."""
    if not isinstance(value, Mapping):
        return None
    return _text(value.get("reason"), 300) or "no reason given"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _lines(lines: Iterable[str]) -> tuple[str, ...]:
    """A traceback's lines as shown: printable, without Python's "Traceback (most recent
    call last):" header (the frames and the error say it all)."""
    return tuple(_text(line, 300) for line in lines if not line.startswith("Traceback (most recent call"))


def _text(value: Any, limit: int) -> str:
    """What a worker or the coordinator wrote, as one printable line of at most `limit`."""
    return "".join(c for c in str(value or "") if c.isprintable())[:limit]
