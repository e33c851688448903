"""The executor: the control side's actions on real processes, and the lifecycle policy's
decisions written down.

Every action gets an `Ops`: the config, the pool's transports and the session of the
transaction it runs in; nothing else of the service. What happened is written through
gpuflex.control.journal.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import posixpath
import signal
import time

from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control import access, intents, journal, prepare
from gpuflex.control import launch as L
from gpuflex.control.coordinator_link import request as coordinator_request
from gpuflex.control.pool import Pool
from gpuflex.db import queries
from gpuflex.db.models import Job, Worker
from gpuflex.elastic.protocol import failpoints
from gpuflex.elastic.protocol.wire import resize_request
from gpuflex.errors import TransportError
from gpuflex.hosts import sync as sync_code
from gpuflex.policy import lifecycle as P
from gpuflex.policy.placement import Assignment
from gpuflex.states import JobState, WorkerState

log = logging.getLogger(__name__)

POKE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Ops:
    """What an action needs: the config, the pool (transports), the current transaction."""

    config: Config
    pool: Pool
    session: Session


# ---- starting -------------------------------------------------------------------------------
def start_job(ops: Ops, job: Job, assignments: list[Assignment]) -> None:
    """Start the coordinator on the first host, then one worker per assignment."""
    launch_run(ops, job, assignments)
    journal.set_state(ops.session, job, JobState.RUNNING,
                      f"{len(assignments)} worker(s) on {', '.join(sorted({a.host for a in assignments}))}",
                      world_size=len(assignments))


def launch_run(ops: Ops, job: Job, assignments: list[Assignment]) -> None:
    """A new run of the job: a fresh coordinator (store port, socket directory) on the
    first host and one worker per assignment, in rank order; the job's state is the
    caller's to set."""
    first = ops.config.host(assignments[0].host)
    t = ops.pool.transport(first)
    job.started_at = time.time()   # the current run: workers started before it are history
    job.progress = None   # what commands saw of the last run's progress is not this run's step
    job.store_host = first.name
    job.store_addr = L.store_address(first)
    job.store_port = L.free_port(t)
    job.socket_dir = L.new_socket_dir()   # fresh each run: a name seen before cannot be squatted
    if job.checkpoint_dir is None:
        job.checkpoint_dir = posixpath.join(L.job_dir(first, job), "checkpoints")
    first_wid = next_wid(ops, job)
    wids = list(range(first_wid, first_wid + len(assignments)))
    # durably, before the first process: a command killed before it commits leaves a run
    # the next command ends (gpuflex.control.intents)
    intents.note(ops.config.database_url, job.id, job.socket_dir, [first.name, *(a.host for a in assignments)])
    spawned = t.spawn(L.coordinator_spec(ops.config, first, job, job.store_port, wids))
    job.store_pgid = spawned.pgid
    # torchrun's contract for the whole run: every rank's place, and rank 0's MASTER_PORT
    layout = L.Layout.of([(a.host, a.devices) for a in assignments], master_port_on(t, job.store_port))
    for rank, (wid, a) in enumerate(zip(wids, assignments)):
        spawn_worker(ops, job, wid, a, rank, len(assignments), layout)
    if failpoints.ARMED: failpoints.hit("start.spawned", job=job.id)
    job.generation = 0
    job.world_size = len(assignments)
    job.target_workers = len(assignments)
    job.queue_reason = None


def next_wid(ops: Ops, job: Job) -> int:
    """The job's next worker id: past every id its rows ever held (a row is written before
    its process starts, so an id once spawned is never given again)."""
    ops.session.flush()
    return queries.max_wid(ops.session, job.id) + 1


def master_port_on(t, store_port: int, tries: int = 5) -> int:
    """A free port on rank 0's host for MASTER_PORT (the script's own store), not the
    job store's port."""
    port = L.free_port(t)
    for _ in range(tries):
        if port != store_port:
            break
        port = L.free_port(t)
    return port


def spawn_worker(ops: Ops, job: Job, wid: int, a: Assignment, rank: int, world: int,
                 layout: "L.Layout | None" = None) -> Worker:
    return launch_worker(ops, job, reserve_worker(ops, job, wid, a, rank), rank, world, layout)


def reserve_worker(ops: Ops, job: Job, wid: int, a: Assignment, rank: int) -> Worker:
    """The worker's row (STARTING, no process yet): written before the spawn, so a command
    killed after it leaves a row that reconcile finds."""
    host = ops.config.host(a.host)
    log_path, exit_path = L.worker_paths(host, job, wid)
    # initial workers get their launch rank; newcomers get one when their generation forms
    w = Worker(job=job, wid=wid, rank=rank if job.state is JobState.QUEUED else None, host=a.host,
               gpus=list(a.devices), state=WorkerState.STARTING, log_path=log_path, exit_path=exit_path,
               control_path=L.worker_socket(job, wid))
    ops.session.add(w)
    return w


def launch_worker(ops: Ops, job: Job, w: Worker, rank: int, world: int, layout: "L.Layout | None" = None) -> Worker:
    """Start the process of a reserved row and record its group. `layout`: the run's, when
    the whole run is launched (else launch.worker_spec reads it from the rows)."""
    host = ops.config.host(w.host)
    if L.syncs(ops.config, host, job):   # issue 33: the code first (sent once per host and tree)
        where, sent = sync_code.send_code(ops.pool.transport(host), job.code_sha256,
                                          sync_code.cached_tar(job.code_sha256))
        if sent:
            journal.record(ops.session, job, "code", f"sent the code ({job.code_sha256[:12]}) to {host.name}: "
                                                     f"{where}", host=host.name, sha256=job.code_sha256)
    if job.image and not host.is_local:   # issue 33: a clear reason rather than the engine's exit 125
        L.check_remote_image(ops.pool.transport(host), job.image)
    prepare.prepare_host(ops, job, host)   # issue 33: --env-setup, the venv checked (once per host per run)
    spawned = ops.pool.transport(host).spawn(L.worker_spec(ops.config, host, job, w, rank, world, layout))
    w.pid, w.pgid = spawned.pid, spawned.pgid
    return w


def stop_workers(ops: Ops, job: Job, workers: list[Worker], why: str) -> None:
    """SIGKILL these workers' groups (all hosts at once) and end their rows: newcomers of a
    resize that was refused or never asked for, leavers that never left. SIGKILL, as a
    reclaim does: the runtime reads SIGTERM as "stop the whole job", and the coordinator
    takes a killed member as any lost one. A row with no group recorded (its command died
    between spawn and record) gets the control socket's stop, which a worker waiting to
    join reads at once."""
    by_host: dict[str, list[Worker]] = collections.defaultdict(list)
    for w in workers:
        by_host[w.host].append(w)
    hosts = [ops.config.host(h) for h in by_host]

    def stop_host(t) -> None:
        ws = by_host[t.host.name]
        if any(w.pgid for w in ws):
            t.signal([w.pgid for w in ws if w.pgid], signal.SIGKILL)
        for w in ws:
            if not w.pgid and w.control_path:
                try:
                    t.control_request(w.control_path, {"op": "stop"}, timeout=POKE_TIMEOUT_S)
                except (TransportError, ValueError) as e:
                    log.debug("job %s: no stop for worker %s (no process group known): %s", job.id, w.wid, e)

    limit = max((h.connect_timeout_s + h.command_timeout_s + POKE_TIMEOUT_S * len(by_host[h.name])
                 for h in hosts), default=0) + 5
    for name, result in ops.pool.fan_out(hosts, stop_host, limit).items():
        for w in by_host[name]:
            if not w.state.final:
                journal.end_worker(ops.session, job, w, WorkerState.STOPPED if result.ok else WorkerState.LOST, None)
    journal.record(ops.session, job, "workers-stopped", f"stopped worker(s) {', '.join(str(w.wid) for w in workers)}: "
                   f"{why}", wids=[w.wid for w in workers])


# ---- resizing -------------------------------------------------------------------------------
def ask_membership(ops: Ops, job: Job, message: str, wait_s: float = 30, by_caller: bool = False) -> None:
    """Send the job's members (live, not leaving) to its coordinator as the desired set,
    poke the workers, and mark the job SCALING. `by_caller`: a person asked (`gpuflex
    scale`), so the event names them ("... requested by carol (admin)") and records `by`,
    as the other verbs' events do; a resize gpuflex decides itself (a reclaim, a harvest
    grow, a straggler) names its reason in `message` instead."""
    by = {"by": access.caller()} if by_caller else {}
    message = f"{message} requested" + (f" by {access.changed_by(job)}" if by_caller else "")
    desired = sorted(w.wid for w in job.members)
    ops.session.flush()
    coordinator_request(ops.config, ops.pool, job, resize_request(desired), wait_s=wait_s)
    poke_workers(ops, job)
    job.target_workers = len(desired)
    if job.state is not JobState.SCALING:
        journal.set_state(ops.session, job, JobState.SCALING, message, target_workers=len(desired), **by)
    else:
        journal.record(ops.session, job, "scale-request", message, target_workers=len(desired), **by)


def poke_workers(ops: Ops, job: Job) -> None:
    """Tell running workers to look at the store now instead of at their next poll.

    All hosts at once, each host's workers in turn; the first failure on a host skips the
    rest there (a poke only hastens what the workers' 0.1 s store poll finds anyway)."""
    by_host: dict[str, list[str]] = collections.defaultdict(list)
    for w in job.members:
        if w.state is WorkerState.RUNNING and w.control_path:
            by_host[w.host].append(w.control_path)
    hosts = [ops.config.host(h) for h in by_host]

    def poke(t) -> None:
        for path in by_host[t.host.name]:
            try:
                t.control_request(path, {"op": "resize"}, timeout=POKE_TIMEOUT_S)
            except (TransportError, ValueError) as e:
                log.debug("job %s: poke of %s on %s failed (the rest there skipped): %s",
                          job.id, path, t.host.name, e)
                return

    limit = max((h.connect_timeout_s + len(by_host[h.name]) * (POKE_TIMEOUT_S + h.connect_timeout_s)
                 for h in hosts), default=0) + 1
    ops.pool.fan_out(hosts, poke, limit)


# ---- stopping -------------------------------------------------------------------------------
def stop_processes(ops: Ops, job: Job, grace_s: float | None = None) -> None:
    """SIGTERM every live worker (grace, then SIGKILL), all hosts at once, then the
    coordinator. `grace_s`: [jobs] cancel_grace_s unless given (a reclaim has a deadline)."""
    by_host: dict[str, list[Worker]] = collections.defaultdict(list)
    for w in job.live_workers:
        if w.pgid:
            by_host[w.host].append(w)
    grace = ops.config.jobs.cancel_grace_s if grace_s is None else max(0.0, grace_s)
    hosts = [ops.config.host(h) for h in by_host]

    def stop_host(t):
        workers = by_host[t.host.name]
        t.stop([w.pgid for w in workers], grace)
        return t.status([(w.pgid, w.exit_path) for w in workers])

    limit = grace + max((h.connect_timeout_s + 2 * h.command_timeout_s for h in hosts), default=0) + 5
    unstopped: list[str] = []
    for name, result in ops.pool.fan_out(hosts, stop_host, limit).items():
        if not result.ok:
            journal.record(ops.session, job, P.UNREACHABLE_KIND, str(result.error), host=name)
            unstopped.append(name)
            continue
        for w, st in zip(by_host[name], result.value):
            rc = st.returncode
            journal.end_worker(ops.session, job, w, WorkerState.EXITED if rc == 0 else WorkerState.STOPPED, rc)
    for w in job.live_workers:  # never spawned, or host unreachable
        journal.end_worker(ops.session, job, w, WorkerState.LOST, None)
    if not stop_coordinator(ops, job) and job.store_host:
        unstopped.append(job.store_host)
    # what ran on a host that did not answer runs on: a later command ends it (intents)
    intents.note_stop(ops.config.database_url, job.id, job.socket_dir, unstopped)
    remove_socket_dirs(ops, job)


def stop_coordinator(ops: Ops, job: Job) -> bool:
    """Stop the job's coordinator; False when its host did not answer (the caller notes
    the run's processes there for a later command: `intents.note_stop`)."""
    if job.store_pgid is None:
        return True
    try:
        ops.pool.transport(job.store_host).stop([job.store_pgid], 5)
    except TransportError as e:
        log.debug("job %s: cannot stop the coordinator (a later command ends it): %s", job.id, e)
        return False
    job.store_pgid = None
    return True


def remove_socket_dirs(ops: Ops, job: Job) -> None:
    """Remove the ended run's control-socket directory on every host it used (the sockets
    of killed processes with it); a host that cannot be reached keeps it."""
    if job.socket_dir is None:
        return
    names = sorted({w.host for w in job.workers} | ({job.store_host} if job.store_host else set()))
    hosts = [ops.config.host(n) for n in names if any(h.name == n for h in ops.config.hosts)]
    limit = max((h.connect_timeout_s + h.command_timeout_s for h in hosts), default=0) + 5
    for name, result in ops.pool.fan_out(hosts, lambda t: t.cleanup([job.socket_dir]), limit).items():
        if not result.ok:
            log.debug("job %s: cannot remove its socket directory on %s: %s", job.id, name, result.error)


def stop_job(ops: Ops, job: Job, target: JobState, why: str, **data) -> None:
    stop_processes(ops, job)
    journal.set_state(ops.session, job, target, why, **data)


def requeue(ops: Ops, job: Job, why: str, cause: str = "requeue", grace_s: float | None = None) -> None:
    """Stop the job gracefully (the workers checkpoint at their step boundary) and queue it;
    it restarts from that checkpoint when it fits again. Every requeue of a job that ran
    is a restart: counted in jobs.restarts; its state event gives the reason, the count
    and the `cause` ("crash" restarts count against the job's --retries). `grace_s`: as
    stop_processes."""
    stop_processes(ops, job, grace_s)
    job.restarts += 1
    job.progress = None   # queued: no step until the next run reports one
    journal.set_state(ops.session, job, JobState.QUEUED, why, restarts=job.restarts, cause=cause)


def finish(ops: Ops, job: Job, state: JobState, exit_code: int, reason: str, restarts: int = 0) -> None:
    """End the job: stop what still runs (a crash or an abort ends it with workers alive;
    otherwise only the coordinator is left), then its final state. A job that was
    restarted says so: "succeeded after 2 restart(s)"."""
    stop_processes(ops, job)
    label = f"{state.value} after {restarts} restart(s)" if restarts else None
    job.exit_code, job.exit_reason = exit_code, f"{label}: {reason}" if label else reason
    journal.set_state(ops.session, job, state, reason, label=label, exit_code=exit_code)


# ---- the lifecycle policy's decisions -------------------------------------------------------
def apply(ops: Ops, job: Job, actions: list[P.Action]) -> None:
    """Write what gpuflex.policy.lifecycle.decide said, in its order."""
    workers = {w.wid: w for w in job.workers}
    for a in actions:
        if isinstance(a, P.EndWorker):
            journal.end_worker(ops.session, job, workers[a.wid], a.state, a.exit_code, ended_at=a.ended_at)
        elif isinstance(a, P.Adopt):
            adopt(job, a.generation, list(a.members))
        elif isinstance(a, P.Record):
            journal.record(ops.session, job, a.kind, a.message, happened_at=a.at, **a.data)
        elif isinstance(a, P.SetState):
            journal.set_state(ops.session, job, a.target, a.message)
        elif isinstance(a, P.Requeue):
            requeue(ops, job, a.reason, a.cause)
        elif isinstance(a, P.Finish):
            finish(ops, job, a.state, a.exit_code, a.reason, a.restarts)
        else:
            raise TypeError(f"not a lifecycle action: {a!r}")


def adopt(job: Job, generation: int, members: list[int]) -> None:
    """The coordinator's generation: members get their ranks (a starting one is running
    now), everyone else has none."""
    job.generation, job.world_size = generation, len(members)
    for w in job.workers:
        if w.wid in members:
            w.rank = members.index(w.wid)
            w.generation = generation
            if w.state is WorkerState.STARTING:
                w.state = WorkerState.RUNNING
        else:
            w.rank = None
