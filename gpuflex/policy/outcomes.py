"""How a job's run comes out: the rules for crashes, gangs and runs whose workers all
ended, over the facts and actions of gpuflex.policy.facts (re-exported here). Pure, no I/O.

gpuflex.policy.lifecycle's `decide` reads the coordinator and the processes; the rules
here judge the workers' ends:

- A crash is a bug, not a fault: a worker of this run that ended with a non-zero exit
  code the runtime does not use (keys.RUNTIME_EXITS; a Python exception exits 1), or one
  the coordinator lists in "crashed". Record "crash" (worker, host, error, traceback),
  then Requeue (cause "crash") while the job's restarts that count against --retries are
  fewer than them, else Finish FAILED at once (the others are stopped).
- A gang (any job but an in-place elastic one: `JobFacts.elastic` is not "inplace") runs
  as a whole, torchrun-style: the first of this run's workers to end badly (a non-zero
  exit code, a signal, or gone without an exit record) stops the others at once (no one
  is left in a collective) and, in a "worker-failed" event naming the worker, its host
  and its exit code (a signal N as 128+N, a worker gone without a record as 137), fails
  the job with that code, unless --retries is left: then the whole gang is relaunched
  (Requeue, cause "gang"). A restart-elastic job relaunches for a fault (a signal, a
  lost worker) without counting it: it resumes from its own checkpoint; its crashes
  (exit codes) are a gang's. A crash beside a peer lost with its host (no exit record,
  or a host that does not answer) is that loss, not a crash: its collective failed
  because the peer was gone; while the peer's host is silent the verdict waits, at most
  CRASH_PEER_WAIT_S ("crash-deferred"), then the peer is taken as lost.
- Once no worker lives: Requeue (cause "store-lost", naming the store's host and the
  phase the job was in) when the last generation's members exited with STORE_LOST_EXIT;
  Requeue (cause "shards-lost", naming the member that died) when a sharded run's exited
  with SHARDS_LOST_EXIT: it resumes from its last distributed checkpoint, not counted;
  FAILED when one exited ABORTED_EXIT. In an in-place job where one of the last members
  ended by a fault (a signal, no exit record: kill -9 of its only worker, a lost host):
  Requeue (cause "fault", not counted against --retries: it resumes from its checkpoint,
  as a restart job's gang does), also beside members that exited 0: those finished the
  training (a member only leaves mid-run when a shrink retires it, `left`, or a stop is
  agreed), but the faulted one did not finish the script's work after it (rank 0's report,
  say); the restart resumes from the last step's checkpoint and runs only that. Members
  that all exited 0 because a stop was agreed before the end of training (the
  coordinator's `stopped`: a worker got a SIGTERM that no cancel, time limit or requeue of
  gpuflex's sent, e.g. a host shutting down or someone's `kill`) did not finish it:
  Requeue (cause "stopped", not counted against --retries) up to STOP_RESTARTS times, then
  FAILED with 128 + SIGTERM. Else SUCCEEDED when they all exited 0, FAILED with the first
  bad exit code otherwise. A restarted job's Finish carries its restarts: its final event
  says "succeeded after N restart(s)".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

from gpuflex.elastic.protocol.keys import ABORTED_EXIT, RUNTIME_EXITS, SHARDS_LOST_EXIT, STORE_LOST_EXIT
from gpuflex.policy.facts import (  # noqa: F401 (the policy's inputs and actions, re-exported)
    INPLACE, RESTART, Action, Adopt, EndWorker, Finish, JobFacts, Observation, ProcSeen, Record, Requeue, SetState,
    WorkerFacts)
from gpuflex.states import JobState, WorkerState

CRASH_KIND = "crash"     # the event of a worker that crashed (a bug in the training code)
CRASH_CAUSE = "crash"    # a requeue's cause, counted against the job's --retries
GANG_FAILED_KIND = "worker-failed"   # the event of a gang's worker that ended badly
GANG_CAUSE = "gang"      # a gang relaunched after a worker failed: counted against --retries
FAULT_CAUSE = "fault"    # a restart job relaunched after a fault: not counted
SHARDS_LOST_CAUSE = "shards-lost"   # a sharded job restarted from its distributed checkpoint: not counted
STOP_CAUSE = "stopped"   # a job stopped from outside gpuflex before the end of training, restarted
STOP_RESTARTS = 3        # ... at most this many times; then it fails
STUCK_RUNS = 3         # fault-ended runs in a row from one checkpoint step: not restarted again (`stuck`)
FAULT_RELAUNCHES = 5   # a restart job's fault relaunches in a row: the next fault fails it (no step known)
STOP_EXIT = 128 + 15     # its exit code then: as a process ended by SIGTERM
RETRY_CAUSES = (CRASH_CAUSE, GANG_CAUSE)
LOST_EXIT = 128 + 9      # a gang worker gone without an exit record: as if SIGKILLed
CRASH_DEFERRED_KIND = "crash-deferred"   # the event of a gang's crash judged once a peer's host answers
CRASH_PEER_WAIT_S = 60.0   # ... or this long after, that peer then taken as lost with its host
TRACEBACK_LINES = 10     # the lines of a crash's traceback kept in the job's exit reason


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


# ---- the rules ---------------------------------------------------------------------------
def first_crash(job: JobFacts, workers: Iterable[WorkerFacts], records: Iterable[Mapping[str, Any]] | None,
                log_tails: Mapping[int, tuple[str, ...]]) -> Crash | None:
    """The first crash among this run's workers: a crashed record the coordinator reports
    ([{"wid", "error", "traceback", "phase"}]), else a worker that ended with a crash's
    exit code (its error and traceback from the tail of its log)."""
    current = {w.wid: w for w in _current(job, workers)}
    for r in records or ():
        if is_int(r.get("wid")) and r["wid"] in current:
            w = current[r["wid"]]
            tb = printable_lines(line for line in r.get("traceback") or () if isinstance(line, str))
            return Crash(w.wid, w.host, one_line(r.get("error"), 300) or "an exception", tb,
                         one_line(r.get("phase"), 40) or None,
                         w.exit_code if w.state is WorkerState.FAILED else None)
    for w in current.values():
        if w.state is WorkerState.FAILED and is_crash_exit(w.exit_code):
            tail = printable_lines(log_tails.get(w.wid, ()))
            last = next((line.strip() for line in reversed(tail) if line.strip()), "")
            return Crash(w.wid, w.host, last or f"exit code {w.exit_code}", tail, None, w.exit_code)
    return None


def after_crash(job: JobFacts, crash: Crash) -> Requeue | Finish:
    """Restart while the job's --retries allow, else fail it now."""
    if job.crash_restarts < job.retries:
        return Requeue(f"{crash.summary}; restart {job.crash_restarts + 1} of {job.retries}", CRASH_CAUSE)
    return Finish(JobState.FAILED, crash.exit_code or 1, crash.reason, job.restarts)


def outcome(job: JobFacts, workers: list[WorkerFacts], generation: int,
            stopped: Mapping[str, Any] | None = None) -> Requeue | Finish:
    """How a job whose workers have all ended comes out: judged by the members of its last
    generation in the current run (workers of an earlier run are history); a crash of any
    worker of this run fails it (or restarts it, see `after_crash`). `stopped`: the
    coordinator's record of a stop agreed before the end of training (None: none, or the
    training finished). A member a shrink retired that exited 0 had left, not finished:
    it is not judged with the generation, which may still name it when the coordinator
    was lost before the shrunk one was heard of."""
    current = _current(job, workers)
    last = [w for w in current if w.generation == generation and not left(w)]
    if any(w.exit_code == STORE_LOST_EXIT for w in last):
        return Requeue(f"the job store on {job.store_host or 'its host'} was lost in {job.phase}; "
                       "restarting from the last checkpoint", "store-lost")
    if any(w.exit_code == SHARDS_LOST_EXIT for w in last):
        gone = next((w for w in last if is_fault(w)), None)
        who = f"worker {gone.wid} on {gone.host} {gang_exit(gone)[1]}" if gone else "a collective failed"
        return stuck(job, gone, f"{who} in {job.phase}, with the only copy of its shards") or Requeue(
            f"{who} in {job.phase}, with the only copy of its shards; restarting from the last distributed "
            "checkpoint", SHARDS_LOST_CAUSE)
    crash = first_crash(job, current, None, {})
    if crash is not None:
        return after_crash(job, crash)
    if any(w.exit_code == ABORTED_EXIT for w in last):
        return Finish(JobState.FAILED, ABORTED_EXIT, "aborted by its coordinator: the same failure repeated",
                      job.restarts)
    faults = [w for w in last if is_fault(w)]
    if not job.gang and faults:
        w = faults[0]
        beside = ("beside members that exited 0" if any(x.state is WorkerState.EXITED for x in last)
                  else "and no member is left")
        what = f"worker {w.wid} on {w.host} {gang_exit(w)[1]} in {job.phase}, {beside}"
        return stuck(job, w, what) or Requeue(f"{what}; restarting from its checkpoint", FAULT_CAUSE)
    failed = [w for w in last or current if w.state is not WorkerState.EXITED]
    if failed:
        rc = failed[0].exit_code if failed[0].exit_code is not None else -9
        return Finish(JobState.FAILED, rc,
                      f"worker {failed[0].wid} {failed[0].state} (exit code {failed[0].exit_code})", job.restarts)
    if stopped is not None:
        return after_stop(job, stopped)
    return Finish(JobState.SUCCEEDED, 0, "all workers exited 0", job.restarts)


def left(w: WorkerFacts) -> bool:
    """A worker that a shrink asked to leave and that exited 0: it left."""
    return w.retired and w.state is WorkerState.EXITED


def stuck(job: JobFacts, w: WorkerFacts | None, what: str) -> Finish | None:
    """The end of an in-place job that a fault would restart once more from where its last
    STUCK_RUNS runs all started, the earlier ones ended by faults too (requeued "fault" or
    "shards-lost"): a fault that comes back at the same place (a crash in the script's last
    step, say) would otherwise be restarted without end. None: restart it."""
    steps, causes = job.run_start_steps, job.restart_causes[-(STUCK_RUNS - 1):]
    if len(steps) < STUCK_RUNS or steps[-1] is None or any(s != steps[-1] for s in steps[-STUCK_RUNS:]):
        return None
    if len(causes) < STUCK_RUNS - 1 or any(c not in (FAULT_CAUSE, SHARDS_LOST_CAUSE) for c in causes):
        return None   # a run that ended otherwise (a preemption, a requeue below MIN) is no repeat
    rc = gang_exit(w)[0] if w is not None else LOST_EXIT
    return Finish(JobState.FAILED, rc, f"{what}; its last {STUCK_RUNS} runs each restarted from the checkpoint at "
                  f"step {steps[-1]} and each ended so, with no checkpoint after it: not restarted again (its "
                  "worker logs say where it died)", job.restarts)


def after_stop(job: JobFacts, stopped: Mapping[str, Any]) -> Requeue | Finish:
    """Members that exited 0 after a stop nobody in gpuflex asked for (a cancel, a time limit
    and a requeue end the run themselves, before this is judged): not a success."""
    nums = {k: stopped.get(k) if is_int(stopped.get(k)) else "?" for k in ("wid", "step", "of")}
    by = one_line(stopped.get("by"), 40) or "a stop request"
    what = (f"worker {nums['wid']} got {by} at step {nums['step']} of {nums['of']} that no cancel, time limit "
            "or requeue sent (a host shutting down, or someone's kill), and the job stopped before the end of "
            "its training")
    if job.stop_restarts < STOP_RESTARTS:
        return Requeue(f"{what}; restarting from its checkpoint ({job.stop_restarts + 1} of {STOP_RESTARTS}; "
                       f"'gpuflex cancel {job.id}' ends a job)", STOP_CAUSE)
    return Finish(JobState.FAILED, STOP_EXIT, f"{what}, {STOP_RESTARTS + 1} times: not restarted again",
                  job.restarts)


def gang_failure(job: JobFacts, workers: Iterable[WorkerFacts], records: Iterable[Mapping[str, Any]] | None,
                 log_tails: Mapping[int, tuple[str, ...]], unreachable: Mapping[str, str] | None = None,
                 now: float | None = None) -> list[Record | Requeue | Finish]:
    """A gang's end when one of this run's workers ended badly (see the module's doc):
    [] while none has. The first to end decides: the others often fail because of it (a
    reset connection in their collective). A crash is told as `first_crash` tells it
    (`records`: the coordinator's crashed list, for a gpuflex.elastic script), unless a
    peer was lost with its host (`lost_peer`): then the loss decides, and while that
    peer's host does not answer the verdict waits (a "crash-deferred" event), at most
    CRASH_PEER_WAIT_S from `now` on (None: no waiting, the crash is judged now)."""
    current = _current(job, workers)
    bad = [w for w in current if w.state in (WorkerState.FAILED, WorkerState.LOST)]
    if not bad:
        return []
    w = min(bad, key=lambda w: (w.ended_at if w.ended_at is not None else float("inf"), w.wid))
    crashed = None
    if is_crash_exit(w.exit_code):
        peer = lost_peer(job, w, current, unreachable or {}, now)
        if isinstance(peer, Record):
            return [peer]
        if peer is None:
            crash = first_crash(job, [w], records, log_tails)
            if crash is not None:
                return [Record(CRASH_KIND, crash.summary, crash.data()), after_crash(job, crash)]
        else:
            crashed, w = w, peer
    code, how = gang_exit(w)
    summary = f"worker {w.wid} on {w.host} {how}"
    if crashed is not None:
        summary += (f"; worker {crashed.wid} on {crashed.host} ended with exit code {crashed.exit_code} beside it "
                    "(a collective fails when a peer is lost): judged the loss, not a crash")
    data = {"wid": w.wid, "host": w.host, "exit_code": code, "returncode": w.exit_code}
    first = Record(GANG_FAILED_KIND, f"{summary}; the gang is stopped", data)
    if job.elastic == RESTART and (w.exit_code is None or w.exit_code < 0):
        recent = job.restart_causes[-FAULT_RELAUNCHES:]
        if len(recent) == FAULT_RELAUNCHES and all(c == FAULT_CAUSE for c in recent):
            return [first, Finish(JobState.FAILED, code, f"{summary}; relaunched {FAULT_RELAUNCHES} times in a row "
                                  "for such faults, no run ending otherwise: not relaunched again (its worker logs "
                                  "say where it died)", job.restarts)]
        return [first, Requeue(f"{summary}; relaunching the gang from its checkpoint", FAULT_CAUSE)]
    if job.crash_restarts < job.retries:
        return [first, Requeue(f"{summary}; relaunch {job.crash_restarts + 1} of {job.retries}", GANG_CAUSE)]
    return [first, Finish(JobState.FAILED, code, summary, job.restarts)]


def lost_peer(job: JobFacts, crashed: WorkerFacts, current: list[WorkerFacts], unreachable: Mapping[str, str],
              now: float | None) -> WorkerFacts | Record | None:
    """Why a gang's crash may not be one: a peer of this run lost with no exit record (its
    host went down: when it ended is unknown, so it may have been first, and a collective
    with a lost peer fails with a reset connection), or still live on a host that does not
    answer. That peer (as lost), once its host answers or CRASH_PEER_WAIT_S after the wait
    began (`job.crash_deferred_at`); meanwhile a "crash-deferred" Record; None: no such
    peer, the crash is judged as one."""
    lost = [p for p in current if p.wid != crashed.wid and p.state is WorkerState.LOST]
    if lost:
        return lost[0]
    silent = [p for p in current if p.wid != crashed.wid and not p.state.final and p.host in unreachable]
    if not silent or now is None:
        return None
    p = silent[0]
    if job.crash_deferred_at is not None and now - job.crash_deferred_at >= CRASH_PEER_WAIT_S:
        return dataclasses.replace(p, state=WorkerState.LOST, exit_code=None)
    return Record(CRASH_DEFERRED_KIND,
                  f"worker {crashed.wid} on {crashed.host} ended with exit code {crashed.exit_code} while the host "
                  f"{p.host} of worker {p.wid} does not answer: judged a crash or that host's loss once it answers "
                  f"(at most {CRASH_PEER_WAIT_S:.0f} s)",
                  {"wid": crashed.wid, "host": crashed.host, "exit_code": crashed.exit_code, "peer": p.wid,
                   "peer_host": p.host})


def is_fault(w: WorkerFacts) -> bool:
    """A worker ended by a fault, not by its code: killed by a signal, or gone without an
    exit record (SIGKILLed with its supervisor, its host lost)."""
    return w.state is WorkerState.LOST or (w.state is WorkerState.FAILED and (w.exit_code is None or w.exit_code < 0))


def gang_exit(w: WorkerFacts) -> tuple[int, str]:
    """The job's exit code for a gang worker that ended badly, torchrun-style, and how it
    ended in words: its code; 128+N for signal N; LOST_EXIT when it left no record."""
    rc = w.exit_code
    if rc is None:
        return LOST_EXIT, f"was lost (no exit record: killed with its supervisor, or its host went down; exit code {LOST_EXIT})"
    if rc < 0:
        return 128 - rc, f"was killed by signal {-rc} (exit code {128 - rc})"
    return rc, f"ended with exit code {rc}"


def _current(job: JobFacts, workers: Iterable[WorkerFacts]) -> list[WorkerFacts]:
    return [w for w in workers if job.started_at is None or w.started_at >= job.started_at]


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def instant(v: Any) -> float | None:
    """A time a coordinator's or worker's record gives (unix seconds): a finite number
    above 0, not a bool; None otherwise (the event then takes the time it was noticed)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return None
    return float(v)


def printable_lines(lines: Iterable[str]) -> tuple[str, ...]:
    """A traceback's lines as shown: printable, without Python's "Traceback (most recent
    call last):" header (the frames and the error say it all)."""
    return tuple(one_line(line, 300) for line in lines if not line.startswith("Traceback (most recent call"))


def one_line(value: Any, limit: int) -> str:
    """What a worker or the coordinator wrote, as one printable line of at most `limit`."""
    return "".join(c for c in str(value or "") if c.isprintable())[:limit]
