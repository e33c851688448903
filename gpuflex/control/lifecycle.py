"""Launch, reconcile, scale and stop jobs: the control side's actions on real processes."""

from __future__ import annotations

import collections
import posixpath
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.control import launch as L
from gpuflex.elastic.keys import STORE_LOST_EXIT
from gpuflex.db.models import Job, Worker
from gpuflex.errors import JobError, TransportError
from gpuflex.policy.placement import Assignment, place
from gpuflex.states import JobState, WorkerState

if TYPE_CHECKING:
    from gpuflex.control.service import JobService

LAUNCH_RETRY_S = 30   # wait this long before launching a job again after a host failed it


def _record(session, job, kind, message, **data):
    from gpuflex.control.service import record

    return record(session, job, kind, message, **data)


def _set_state(session, job, target, message, **data):
    from gpuflex.control.service import set_state

    set_state(session, job, target, message, **data)


def live_workers(job: Job) -> list[Worker]:
    return [w for w in job.workers if not WorkerState(w.state).final]


def members(job: Job) -> list[Worker]:
    """Workers meant to be in the job now: alive and not retiring."""
    return [w for w in live_workers(job) if w.state != WorkerState.LEAVING.value]


# ---- placement -------------------------------------------------------------------
def place_queued(svc: "JobService", session: Session) -> None:
    """Start queued jobs that fit, by priority then age; record why the others wait."""
    queued = session.scalars(select(Job).where(Job.state == JobState.QUEUED.value)
                             .order_by(Job.priority.desc(), Job.id))
    for job in queued:
        failed = [e.time for e in job.events if e.kind == "launch-failed"]
        if failed and time.time() - failed[-1] < LAUNCH_RETRY_S:
            continue   # a host failed us a moment ago: do not hammer it on every command
        want_max = job.target_workers or job.max_workers
        p = place(svc.pool.free(session), job.min_workers, max(want_max, job.min_workers),
                  job.gpus_per_worker)
        if not p.ok:
            if job.queue_reason != p.reason:
                job.queue_reason = p.reason
                _record(session, job, "queued", p.reason)
            continue
        try:
            start_job(svc, session, job, list(p.assignments))
        except TransportError as e:
            stop_processes(svc, session, job)
            if "cannot start" in str(e):   # the job's own command cannot run: retrying won't help
                job.exit_reason = str(e)
                _set_state(session, job, JobState.FAILED, f"launch failed: {e}")
            else:
                job.queue_reason = f"launch failed (retrying in {LAUNCH_RETRY_S:.0f} s): {e}"
                _record(session, job, "launch-failed", str(e))
        session.flush()


def start_job(svc: "JobService", session: Session, job: Job, assignments: list[Assignment]) -> None:
    """Start the coordinator on the first host, then one worker per assignment."""
    first = svc.config.host(assignments[0].host)
    t = svc.pool.transport(first)
    job.started_at = time.time()   # the current run: workers started before it are history
    job.store_host = first.name
    job.store_addr = L.store_address(first)
    job.store_port = L.free_port(t)
    if job.checkpoint_dir is None:
        job.checkpoint_dir = posixpath.join(L.job_dir(first, job), "checkpoints")
    next_wid = max((w.wid for w in job.workers), default=-1) + 1
    wids = list(range(next_wid, next_wid + len(assignments)))
    spawned = t.spawn(L.coordinator_spec(svc.config, first, job, job.store_port, wids))
    job.store_pgid = spawned.pgid
    for rank, (wid, a) in enumerate(zip(wids, assignments)):
        spawn_worker(svc, session, job, wid, a, rank, len(assignments))
    job.generation = 0
    job.world_size = len(assignments)
    job.target_workers = len(assignments)
    job.queue_reason = None
    _set_state(session, job, JobState.RUNNING,
               f"{len(assignments)} worker(s) on {', '.join(sorted({a.host for a in assignments}))}",
               world_size=len(assignments))


def spawn_worker(svc: "JobService", session: Session, job: Job, wid: int, a: Assignment,
                 rank: int, world: int) -> Worker:
    host = svc.config.host(a.host)
    log, exit_path = L.worker_paths(host, job, wid)
    # initial workers get their launch rank; newcomers get one when their generation forms
    w = Worker(job=job, wid=wid, rank=rank if job.state == JobState.QUEUED.value else None, host=a.host, gpus=list(a.devices),
               state=WorkerState.STARTING.value, log_path=log, exit_path=exit_path,
               control_path=L.worker_socket(job, wid))
    session.add(w)
    spawned = svc.pool.transport(host).spawn(L.worker_spec(svc.config, host, job, w, rank, world))
    w.pid, w.pgid = spawned.pid, spawned.pgid
    return w


# ---- reading reality ---------------------------------------------------------------
def coordinator_request(svc: "JobService", job: Job, message: dict[str, Any],
                        wait_s: float = 0.0) -> dict[str, Any]:
    """One request to the job's coordinator; retried for up to `wait_s` while it starts."""
    t = svc.pool.transport(job.store_host)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = t.control_request(L.coordinator_socket(job), message)
            break
        except TransportError:
            if time.monotonic() >= deadline or not coordinator_alive(svc, job):
                raise
            time.sleep(0.2)
    if not reply.get("ok"):
        raise JobError(f"job {job.id}: coordinator refused {message.get('op')}: {reply.get('error')}")
    return reply


def reconcile(svc: "JobService", session: Session, job: Job) -> None:
    """Bring one running job's record in line with its processes and coordinator."""
    by_host: dict[str, list[Worker]] = collections.defaultdict(list)
    for w in live_workers(job):
        by_host[w.host].append(w)
    hosts = [svc.config.host(h) for h in by_host]
    limit = max((h.connect_timeout_s + h.command_timeout_s for h in hosts), default=0) + 5
    results = svc.pool.fan_out(hosts, lambda t: t.status(
        [(w.pgid, w.exit_path) for w in by_host[t.host.name]]), limit)
    unreachable = []
    for host, res in results.items():
        if not res.ok:
            unreachable.append(host)
            note_once(session, job, "host-unreachable", str(res.error), host=host)
            continue
        for w, st in zip(by_host[host], res.value):
            if st.exit is not None and not st.alive:
                rc = st.returncode
                end_worker(session, job, w, WorkerState.EXITED if rc == 0 else WorkerState.FAILED, rc,
                           ended_at=st.exit.get("ended_at"))
            elif not st.alive:
                end_worker(session, job, w, WorkerState.LOST, None)
    coord = read_coordinator(svc, session, job)
    if coord is not None and coord.get("generation"):
        # a worker on a host we cannot reach that the job has gone on without is lost
        for w in live_workers(job):
            if w.host in unreachable and w.wid not in coord["members"] and w.generation < coord["generation"] \
                    and w.state != WorkerState.STARTING.value:
                end_worker(session, job, w, WorkerState.LOST, None)
    if live_workers(job):
        if coord is None and not coordinator_alive(svc, job):
            note_once(session, job, "store-lost", "the job's coordinator (store) is gone")
        elif coord is not None and coord.get("settled") and job.world_size < job.min_workers:
            from gpuflex.control.scaling import requeue

            requeue(svc, session, job, f"fell to {job.world_size} worker(s), below its minimum of "
                    f"{job.min_workers}; restarting from its checkpoint when it fits")
        return
    finish(svc, session, job, coord)


def note_once(session: Session, job: Job, kind: str, message: str, **data) -> None:
    """Record an event unless the job's last event already says the same."""
    last = job.events[-1] if job.events else None
    if last is None or last.kind != kind or last.message != message:
        _record(session, job, kind, message, **data)


def coordinator_alive(svc: "JobService", job: Job) -> bool:
    if job.store_pgid is None:
        return False
    try:
        host = svc.config.host(job.store_host)
        d = L.job_dir(host, job)
        st = svc.pool.transport(host).status([(job.store_pgid, posixpath.join(d, "coordinator.exit"))])
        return st[0].alive
    except TransportError:
        return False


def read_coordinator(svc: "JobService", session: Session, job: Job) -> dict[str, Any] | None:
    """Pull generation, membership and new scale/fault records from the coordinator."""
    try:
        st = coordinator_request(svc, job, {"op": "status"})
    except (TransportError, JobError, ValueError):
        return None
    if st.get("progress"):
        svc.progress[job.id] = st["progress"]
    gen = st.get("generation") or 0
    mem = st.get("members") or []
    if gen and gen >= job.generation:
        job.generation, job.world_size = gen, len(mem)
        for w in job.workers:
            if w.wid in mem:
                w.rank = mem.index(w.wid)
                w.generation = gen
                if w.state == WorkerState.STARTING.value:
                    w.state = WorkerState.RUNNING.value
            else:
                w.rank = None
    seen = {e.data.get("generation") for e in job.events if e.kind in ("scale", "fault", "formed")}
    for h in st.get("history", []):
        if h["generation"] in seen or not h.get("verified"):
            continue
        kind = {"initial": "formed", "resize": "scale", "recover": "fault"}.get(h["kind"], h["kind"])
        data = {k: v for k, v in h.items() if k not in ("kind", "message")}
        _record(session, job, kind, f"generation {h['generation']}: {h.get('message', kind)}",
                generation_kind=h["kind"], **data)
    if job.state == JobState.SCALING.value and st.get("settled"):
        _set_state(session, job, JobState.RUNNING, f"world size {job.world_size} at generation {gen}")
    return st


def end_worker(session: Session, job: Job, w: Worker, state: WorkerState, rc: int | None,
               ended_at: float | None = None) -> None:
    WorkerState(w.state).check_transition(state)
    w.state, w.exit_code, w.ended_at = state.value, rc, ended_at or time.time()
    how = {WorkerState.EXITED: "exited 0", WorkerState.FAILED: f"failed with exit code {rc}",
           WorkerState.LOST: "was lost (killed, or its host is gone)",
           WorkerState.STOPPED: "was stopped"}[state]
    _record(session, job, "worker", f"worker {w.wid} on {w.host} {how}",
            wid=w.wid, host=w.host, exit_code=rc, state=state.value)


def finish(svc: "JobService", session: Session, job: Job, coord: dict[str, Any] | None) -> None:
    """All workers have ended: decide the job's outcome, or requeue it after a lost store."""
    stop_coordinator(svc, job)
    current = [w for w in job.workers if job.started_at is None or w.started_at >= job.started_at]
    if any(w.exit_code == STORE_LOST_EXIT for w in current if w.generation == job.generation):
        job.restarts += 1
        _set_state(session, job, JobState.QUEUED,
                   "the job store was lost; restarting from the last checkpoint", restarts=job.restarts)
        return
    last = [w for w in current if w.generation == job.generation] or current
    failed = [w for w in last if w.state != WorkerState.EXITED.value]
    if failed:
        job.exit_code = failed[0].exit_code if failed[0].exit_code is not None else -9
        job.exit_reason = f"worker {failed[0].wid} {failed[0].state} (exit code {failed[0].exit_code})"
        _set_state(session, job, JobState.FAILED, job.exit_reason, exit_code=job.exit_code)
    else:
        job.exit_code, job.exit_reason = 0, "all workers exited 0"
        _set_state(session, job, JobState.SUCCEEDED, job.exit_reason, exit_code=0)


# ---- stopping ------------------------------------------------------------------------
def stop_processes(svc: "JobService", session: Session, job: Job) -> None:
    """SIGTERM every live worker (grace, then SIGKILL), all hosts at once, then the coordinator."""
    by_host: dict[str, list[Worker]] = collections.defaultdict(list)
    for w in live_workers(job):
        if w.pgid:
            by_host[w.host].append(w)
    grace = svc.config.jobs.cancel_grace_s
    hosts = [svc.config.host(h) for h in by_host]

    def stop_host(t):
        workers = by_host[t.host.name]
        t.stop([w.pgid for w in workers], grace)
        return t.status([(w.pgid, w.exit_path) for w in workers])

    limit = grace + max((h.connect_timeout_s + 2 * h.command_timeout_s for h in hosts), default=0) + 5
    for name, result in svc.pool.fan_out(hosts, stop_host, limit).items():
        if not result.ok:
            _record(session, job, "host-unreachable", str(result.error), host=name)
            continue
        for w, st in zip(by_host[name], result.value):
            rc = st.returncode
            end_worker(session, job, w, WorkerState.EXITED if rc == 0 else WorkerState.STOPPED, rc)
    for w in live_workers(job):  # never spawned, or host unreachable
        end_worker(session, job, w, WorkerState.LOST, None)
    stop_coordinator(svc, job)


def stop_coordinator(svc: "JobService", job: Job) -> None:
    if job.store_pgid is None:
        return
    try:
        svc.pool.transport(job.store_host).stop([job.store_pgid], 5)
    except TransportError:
        return
    job.store_pgid = None


def stop_job(svc: "JobService", session: Session, job: Job, target: JobState, why: str) -> None:
    stop_processes(svc, session, job)
    _set_state(session, job, target, why)
