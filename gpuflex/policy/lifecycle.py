"""The job lifecycle policy: pure (job, what was observed) -> actions. No I/O.

Every command first reconciles each running job: gpuflex.control.observe reads what the
hosts and the coordinator say, `decide` (here) says what that means, and
gpuflex.control.executor writes it. In order:

1. EndWorker for each live worker whose process group is gone: EXITED (exit record 0),
   FAILED (another code, or a signal), LOST (no exit record: SIGKILLed, or its host
   rebooted). A host that did not answer is recorded ("host-unreachable").
2. From the coordinator's status (when it answered; its generations, history and stop
   record also from the last status it left as it ended itself): Adopt its generation and members
   (ranks; starting workers it has seen become running), Record each newly verified
   generation of its history ("formed", "scale", "fault", "rollback", with the phase
   timings, at the time the coordinator published it; those up to the newest this run's
   events hold are skipped), RUNNING once a
   scaling job has settled; Record "forged" (store records that failed authentication),
   "checkpoint-failed" (rank 0's failed checkpoint writes: training goes on) once per new
   count, "waiting" when the members waiting at a step barrier for busy ones changed,
   "left-out" for each newcomer the coordinator left out of a resize (it died warming up,
   or never started: worker, host, phase; a settle in the same reconcile names them too).
3. A live worker on an unreachable host that the job has gone on without (not in a newer
   generation's members, and not a newcomer still starting unless the coordinator left it
   out) is LOST.
4. A gang (all but an in-place job) whose worker ended badly is stopped: failed with
   that worker's exit code, or relaunched (gpuflex.policy.outcomes.gang_failure).
   A crash (outcomes: a worker's non-zero exit code the runtime does not use, or one the
   coordinator lists in "crashed", before the process is even reaped): Record "crash"
   (worker, host, error, its traceback's last lines), then Requeue (cause "crash") while
   --retries allow, else Finish FAILED at once (the others are stopped). In an in-place
   job a death by signal, or a worker gone without an exit record, stays an elastic fault.
   A gang's crash beside a peer lost with its host is that loss (a "crash-deferred" event
   while the peer's host does not answer, at most CRASH_PEER_WAIT_S: outcomes.lost_peer).
5. The coordinator's "abort" (the same failure repeated max_same_failures times, or an
   in-place job none of whose workers joined the runtime within the formation deadline: a
   plain script), from its status or, once it has ended itself, from the record it left
   in the run's directory: Finish FAILED with its whole reason. The first to happen
   decides: a worker's end before the abort's time is judged by itself (a crash, or every
   worker ended: `outcome`), one after it is the abort's doing (a peer stopped under it)
   and no crash (the hosts' clocks are taken to agree, as for time limits).
6. While workers live: "store-lost" when the coordinator neither answers nor runs (Requeue,
   cause "orphan", if it exited ORPHAN_EXIT, but for a gang); Requeue (cause "below-min") when it holds the
   job (a recovery would go below MIN: survivors wait at a step boundary; the reason names the
   workers the hold lists, each with its host, and the phase) or settled below MIN.
7. Once no worker lives: `outcome` (gpuflex.policy.outcomes); a fault that would restart an
   in-place job a STUCK_RUNS-th time from the same checkpoint step fails it (`stuck`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from gpuflex.elastic.protocol.keys import ABORT_REASON_CHARS, ABORTED_EXIT, ORPHAN_EXIT
from gpuflex.elastic.protocol.wire import CoordinatorStatus, LeftOut
from gpuflex.policy.outcomes import (  # noqa: F401 (the policy's inputs and actions, re-exported)
    CRASH_CAUSE, CRASH_DEFERRED_KIND, CRASH_KIND, FAULT_RELAUNCHES, GANG_CAUSE, GANG_FAILED_KIND, INPLACE, RETRY_CAUSES,
    STOP_CAUSE, STUCK_RUNS, TRACEBACK_LINES, Action,
    Adopt, Crash, EndWorker, Finish, JobFacts, Observation, ProcSeen, Record, Requeue, SetState, WorkerFacts,
    after_crash, first_crash, gang_failure, instant, is_crash_exit, is_int, one_line, outcome)
from gpuflex.states import JobState, WorkerState

UNREACHABLE_KIND = "host-unreachable"   # the event of a host that did not answer
FORMED_KIND = "formed"   # the event of a run's first generation (its timings name the step it started at)
_KINDS = {"initial": FORMED_KIND, "resize": "scale", "recover": "fault"}
HISTORY_KINDS = ("scale", "fault", FORMED_KIND, "rollback")   # events that record a generation
FORGED_KIND = "forged"   # the event of store records that failed authentication
CHECKPOINT_FAILED_KIND = "checkpoint-failed"   # the event of a checkpoint write that failed
WAITING_KIND = "waiting"   # the event of members waiting at a step barrier for busy ones
LEFT_OUT_KIND = "left-out"   # the event of a newcomer the coordinator left out of a resize
ORPHANED = "its coordinator ended itself, its job gone (no heartbeat or command for its orphan timeout)"


# ---- the decision -------------------------------------------------------------------------
def decide(job: JobFacts, seen: Observation, now: float | None = None) -> list[Action]:
    """What one reconcile of `job` should write, in order; see the module docstring.
    `now`: the command's clock, for a gang's crash that waits for a peer's host (None: it
    does not wait)."""
    actions: list[Action] = []
    workers = {w.wid: w for w in job.workers}

    def end(w: WorkerFacts, state: WorkerState, rc: int | None, ended_at: float | None = None) -> None:
        actions.append(EndWorker(w.wid, state, rc, ended_at))
        workers[w.wid] = dataclasses.replace(w, state=state, exit_code=rc, ended_at=ended_at)

    def live() -> list[WorkerFacts]:
        return [w for w in workers.values() if not w.state.final]

    hosts = list(dict.fromkeys(w.host for w in live()))
    for host in hosts:
        if host in seen.unreachable:
            actions.append(Record(UNREACHABLE_KIND, seen.unreachable[host], {"host": host}))
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
    # what the coordinator said last: its reply, or the one it left as it ended itself
    said = coord if coord is not None else seen.recorded_status
    if said is not None:
        gen, members = said.generation, said.members
        if gen and gen >= generation:
            generation, world_size = gen, len(members)
            actions.append(Adopt(gen, members))
            for wid in members:
                if wid in workers:
                    workers[wid] = dataclasses.replace(workers[wid], generation=gen)
        actions.extend(history(job, said.history))
    if coord is not None:
        for record in (forgeries(job, coord.forged), checkpoint_failures(job, coord.progress),
                       waiting(job, coord.waiting)):
            if record is not None:
                actions.append(record)
        dropped = left_out(job, coord.left_out)
        actions.extend(dropped)
        if job.state is JobState.SCALING and coord.settled:
            actions.append(SetState(JobState.RUNNING, "; ".join(
                [f"world size {world_size} at generation {gen}", *(r.message for r in dropped)])))
        if coord.generation:
            # a worker on a host we cannot reach that the job has gone on without is lost; a
            # newcomer still starting only once the coordinator left it out of a resize or
            # rejected it (a first formation's deadline): it would stay "starting" while its
            # host is gone, and hold its slot
            dropped_wids = {e.wid for e in coord.left_out} | set(coord.rejected)
            for w in live():
                if w.host in seen.unreachable and w.wid not in coord.members \
                        and w.generation < coord.generation \
                        and (w.state is not WorkerState.STARTING or w.wid in dropped_wids):
                    end(w, WorkerState.LOST, None)
    crashed = coord.crashed if coord is not None else ()
    if job.gang and (ended := gang_failure(job, workers.values(), crashed, seen.log_tails, seen.unreachable, now)):
        if isinstance(ended[0], Record) and ended[0].kind == CRASH_DEFERRED_KIND:
            # it names the silent host: one event that counts its repeats, not two that alternate
            actions = [a for a in actions if not (isinstance(a, Record) and a.kind == UNREACHABLE_KIND)]
        actions.extend(ended)
        return actions
    abort = coordinator_abort(coord, seen.recorded_abort)
    at = abort.at if abort is not None else None
    # a worker that ended after the abort is the abort's doing: no crash
    judged = [w for w in workers.values() if at is None or not w.state.final or ended_before(w, at)]
    crash = first_crash(job, judged, crashed, seen.log_tails)
    if crash is not None:
        actions.append(Record(CRASH_KIND, crash.summary, crash.data()))
        actions.append(after_crash(job, crash))
        return actions
    current = [w for w in workers.values() if job.started_at is None or w.started_at >= job.started_at]
    if abort is not None and not (at is not None and current and all(ended_before(w, at) for w in current)):
        actions.append(Finish(JobState.FAILED, ABORTED_EXIT, f"aborted: {abort.reason}", job.restarts))
        return actions
    if live():
        held = _reason(coord.held if coord is not None else None)
        if coord is None and not seen.coordinator_alive:
            # a gang's plain processes go on without it; its gpuflex.elastic ones exit STORE_LOST_EXIT
            actions.append(Requeue(f"{ORPHANED} (on {job.store_host or 'its host'}, in {job.phase})", "orphan")
                           if seen.coordinator_exit == ORPHAN_EXIT and not job.gang
                           else Record("store-lost", "the job's coordinator (store) is gone"))
        elif held is not None:
            actions.append(Requeue(f"{held}{where(job, coord.held)}; restarting from its checkpoint when it "
                                   "fits", "below-min"))
        elif coord is not None and coord.settled and world_size < job.min_workers:
            actions.append(Requeue(f"fell to {world_size} worker(s), below its minimum of "
                                   f"{job.min_workers}; restarting from its checkpoint when it fits", "below-min"))
        return actions
    stopped = said.stopped if said is not None and not said.finished else None
    actions.append(outcome(job, list(workers.values()), generation, stopped))
    return actions


def history(job: JobFacts, entries: Iterable[Mapping[str, Any]]) -> list[Record]:
    """An event for each verified generation of the coordinator's history newer than the
    newest one this run's events already hold (the coordinator reports its whole history
    at every status: without the mark each would be recorded again at every command),
    dated when the coordinator published the generation (its "created")."""
    upto = max(job.recorded, default=0)
    out = []
    for h in entries:
        if not is_int(h.get("generation")) or not h.get("verified") \
                or h["generation"] <= upto:
            continue
        kind = _KINDS.get(h.get("kind"), h.get("kind"))
        data = {k: v for k, v in h.items() if k not in ("kind", "message")}
        out.append(Record(kind, f"generation {h['generation']}: {h.get('message', kind)}",
                          {"generation_kind": h.get("kind"), **data}, at=instant(h.get("created"))))
    return out


def forgeries(job: JobFacts, report: Mapping[str, Any] | None) -> Record | None:
    """An event when the coordinator's `forged` report ({"count": n, "last": key}, records
    that failed authentication and were ignored) counts more than already recorded."""
    if report is None:
        return None
    if not is_int(count := report.get("count")) or count <= job.forged_recorded:
        return None
    last = "".join(c for c in str(report.get("last") or "?") if c.isprintable())[:80]
    return Record(FORGED_KIND, f"ignored {count - job.forged_recorded} forged store record(s) (last: {last})",
                  {"count": count, "last": last})


def checkpoint_failures(job: JobFacts, progress: Mapping[str, Any] | None) -> Record | None:
    """An event when rank 0's progress ({"wid", "checkpoint_failures": {"count",
    "last_error", "last_time"}, ...}: the coordinator keeps the last failure's reason after
    the next write clears the worker's; an older one gives a bare count and
    "checkpoint_error") counts more failed checkpoint writes than recorded."""
    if progress is None:
        return None
    wid, failures = progress.get("wid"), progress.get("checkpoint_failures")
    count, error, at = (failures.get("count"), failures.get("last_error"), failures.get("last_time")) \
        if isinstance(failures, Mapping) else (failures, progress.get("checkpoint_error"), None)
    if not all(is_int(v) for v in (wid, count)) or count <= job.checkpoint_failures_recorded.get(wid, 0):
        return None
    why = one_line(error or "a checkpoint write failed", 300)
    return Record(CHECKPOINT_FAILED_KIND, f"worker {wid}: {why}; training goes on ({count} failed so far)",
                  {"wid": wid, "count": count}, at=instant(at))


def left_out(job: JobFacts, entries: Iterable[LeftOut]) -> list[Record]:
    """An event for each newcomer the coordinator left out of a resize (n counting them)
    newer than this run's events report, naming the worker, its host and the phase, dated
    when the coordinator left it out."""
    hosts = {w.wid: w.host for w in job.workers}
    out = []
    for e in entries:
        if e.n <= job.left_out_recorded:
            continue
        wid, phase = e.wid, one_line(e.phase, 40) or "warm-up"
        host = hosts.get(wid, "an unknown host")
        why = one_line(e.reason, 300) or "was not ready"
        out.append(Record(LEFT_OUT_KIND, f"worker {wid} on {host} left out of the resize ({phase}): {why}",
                          {"n": e.n, "wid": wid, "host": host, "phase": phase}, at=instant(e.at)))
    return out


def waiting(job: JobFacts, entries: Iterable[Mapping[str, Any]]) -> Record | None:
    """An event when the members the coordinator lists as waiting at a step barrier for
    busy members ([{"wid", "for": [wids], "since", "phase"}]) are not those this run's last
    "waiting" event names (the time they started does not count: the same wait is one
    event, however often it is read); dated when the first of them started waiting."""
    listed = [e for e in entries if is_int(e.get("wid"))
              and isinstance(e.get("for"), list) and e["for"] and all(is_int(x) for x in e["for"])]
    now = frozenset((e["wid"], tuple(sorted(e["for"])), one_line(e.get("phase"), 40)) for e in listed)
    if now == job.waiting:
        return None
    if not listed:
        return Record(WAITING_KIND, "no member is waiting any more", {"waiting": []})
    data = [{"wid": e["wid"], "for": sorted(e["for"]), "phase": one_line(e.get("phase"), 40),
             "since": e["since"] if isinstance(e.get("since"), (int, float)) else None} for e in listed]
    message = "; ".join(f"worker {d['wid']} waits for {workersone_line(d['for'])}"
                        + (f" ({d['phase']})" if d["phase"] else "") for d in data)
    started = [t for t in (instant(d["since"]) for d in data) if t is not None]
    return Record(WAITING_KIND, message, {"waiting": data}, at=min(started, default=None))


def workersone_line(wids: list[int]) -> str:
    return f"worker {wids[0]}" if len(wids) == 1 else "workers " + ", ".join(map(str, wids))


def where(job: JobFacts, held: Mapping[str, Any]) -> str:
    """"; worker 0 on a, worker 2 on b, in generation 3, steady": the workers a hold names
    ({"workers": [ids], "phase": ...}), each with its host, and the phase; "" when it
    names neither."""
    hosts = {w.wid: w.host for w in job.workers}
    wids = [w for w in held.get("workers") or () if is_int(w)] if isinstance(held.get("workers"), list) else []
    named = [f"worker {w} on {hosts.get(w, 'an unknown host')}" for w in wids[:16]]
    phase = one_line(held.get("phase"), 60)
    return "; " + ", ".join(named + ([f"in {phase}"] if phase else [])) if named or phase else ""


@dataclasses.dataclass(frozen=True)
class Abort:
    """The coordinator's end of the job: its whole reason, and when (None: not said)."""

    reason: str
    at: float | None = None


def coordinator_abort(coord: CoordinatorStatus | None, recorded: Mapping[str, Any] | None) -> Abort | None:
    """The coordinator's abort ({"reason", "at", ...}): from its status when it answered,
    else the record it left in the run's directory; None when it did not end the job."""
    value = coord.abort if coord is not None else recorded
    reason = _reason(value, ABORT_REASON_CHARS)
    if reason is None:
        return None
    at = value.get("at")
    return Abort(reason, float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None)


def ended_before(w: WorkerFacts, at: float) -> bool:
    """Whether the worker ended, and is known to have ended before `at`."""
    return w.state.final and w.ended_at is not None and w.ended_at < at


def _reason(value: Any, limit: int = 300) -> str | None:
    """The reason of a coordinator's {"reason": str} ("held", "abort"); None when absent."""
    if not isinstance(value, Mapping):
        return None
    return one_line(value.get("reason"), limit) or "no reason given"
