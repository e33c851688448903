"""The one door to the database: every query the control side and the CLI's service make.

Each function takes the session of the caller's transaction (so it sees, and is part of,
what that transaction wrote) and returns model objects or plain values.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from gpuflex.db.models import Event, Gpu, GpuSample, Host, Job, Worker
from gpuflex.states import JobState, WorkerState

ACTIVE = (JobState.RUNNING, JobState.SCALING)
NOT_FINAL = (JobState.QUEUED, JobState.RUNNING, JobState.SCALING)
FINAL = tuple(s for s in JobState if s.final)
# ids per IN list of a batched read: well under the bound parameters SQLite and the
# PostgreSQL drivers take (SQLAlchemy's selectinload uses the same size)
CHUNK = 500
# when gpuflex wrote an event (rows from before migration 0010: their time). What a run has
# recorded is told by it, not by `time`, which for a coordinator's or worker's record is
# their host's clock (gpuflex.control.journal)
RECORDED_AT = func.coalesce(Event.recorded_at, Event.time)


def _chunks(ids: Iterable[int]) -> Iterator[list[int]]:
    ids = list(ids)
    for start in range(0, len(ids), CHUNK):
        yield ids[start:start + CHUNK]


# ---- jobs ---------------------------------------------------------------------------------
def job(session: Session, job_id: int) -> Job | None:
    return session.get(Job, job_id)


def newest_job_named(session: Session, name: str) -> Job | None:
    return session.scalar(select(Job).where(Job.name == name).order_by(Job.id.desc()).limit(1))


def jobs(session: Session, states: Iterable[JobState] | None = None) -> list[Job]:
    """Jobs by id, all or those in `states`."""
    q = select(Job).order_by(Job.id)
    if states is not None:
        q = q.where(Job.state.in_(list(states)))
    return list(session.scalars(q))


def worker_spans(session: Session, job_ids: Iterable[int]) -> dict[int, list[tuple[float, float | None, int, str]]]:
    """job id -> (started_at, ended_at, devices, host) of each of its workers, by start."""
    out: dict[int, list[tuple[float, float | None, int, str]]] = {}
    for ids in _chunks(job_ids):
        rows = session.execute(select(Worker.job_id, Worker.started_at, Worker.ended_at, Worker.gpus, Worker.host)
                               .where(Worker.job_id.in_(ids)).order_by(Worker.started_at, Worker.id))
        for job_id, start, end, gpus, host in rows:
            out.setdefault(job_id, []).append((start, end, len(gpus or ()), host))
    return out


def events_of_jobs(session: Session, job_ids: Iterable[int], kinds: Iterable[str]) -> dict[int, list[Event]]:
    """job id -> its events of `kinds`, oldest first."""
    out: dict[int, list[Event]] = {}
    for ids in _chunks(job_ids):
        for e in session.scalars(select(Event).where(Event.job_id.in_(ids), Event.kind.in_(list(kinds)))
                                 .order_by(Event.time, Event.id)):
            out.setdefault(e.job_id, []).append(e)
    return out


def owners(session: Session) -> set[str]:
    """Every job owner in the database."""
    return set(session.scalars(select(Job.user).distinct()))


def array_state_counts(session: Session, array_ids: Iterable[int]) -> dict[int, dict[JobState, int]]:
    """array id -> {state: how many of its jobs}, for `array_ids` (one GROUP BY per chunk)."""
    out: dict[int, dict[JobState, int]] = {}
    for chunk in _chunks(dict.fromkeys(array_ids)):
        for array_id, state, n in session.execute(select(Job.array_id, Job.state, func.count(Job.id))
                                                  .where(Job.array_id.in_(chunk))
                                                  .group_by(Job.array_id, Job.state)):
            out.setdefault(array_id, {})[state] = n
    return out


def job_counts(session: Session) -> dict[tuple[JobState, str], int]:
    """(state, owner) -> how many jobs: counted by the database, no row loaded."""
    return {(state, user): n for state, user, n in session.execute(
        select(Job.state, Job.user, func.count(Job.id)).group_by(Job.state, Job.user))}


def job_spans(session: Session) -> list[tuple[str, JobState, float, float, float]]:
    """(owner, state, submitted, first worker start, last worker end) of every job that ever
    had a worker, aggregated by the database (a worker still running ends, as acct counts
    it, at its job's end or else its submission: only an ended job's last end means anything)."""
    end = func.max(func.coalesce(Worker.ended_at, Job.ended_at, Job.created_at))
    return list(session.execute(select(Job.user, Job.state, Job.created_at, func.min(Worker.started_at), end)
                                .join(Worker).group_by(Job.id, Job.user, Job.state, Job.created_at)))


def queued_jobs(session: Session) -> list[Job]:
    """Queued jobs in the order they are placed: higher priority first, then older."""
    return list(session.scalars(select(Job).where(Job.state == JobState.QUEUED)
                                .order_by(Job.priority.desc(), Job.id)))


def array_jobs(session: Session, array_id: int) -> list[Job]:
    """The jobs of the array `array_id` (the id of its first job), by index; [] when no
    array has that id."""
    return list(session.scalars(select(Job).where(Job.array_id == array_id)
                                .order_by(Job.array_index, Job.id)))


def array_job(session: Session, array_id: int, index: int) -> Job | None:
    """The job at `index` of the array `array_id`."""
    return session.scalar(select(Job).where(Job.array_id == array_id, Job.array_index == index).limit(1))


def job_states(session: Session, ids: Iterable[int]) -> dict[int, list[tuple[int, JobState]]]:
    """For each id: (id, state) of every job of the array it names, or of the job itself
    when it names no array; [] for an id that names nothing."""
    ids = list(dict.fromkeys(ids))
    out: dict[int, list[tuple[int, JobState]]] = {i: [] for i in ids}
    for jid, array_id, state in session.execute(select(Job.id, Job.array_id, Job.state).where(
            (Job.array_id.in_(ids)) | (Job.id.in_(ids))).order_by(Job.id)):
        if array_id in out:
            out[array_id].append((jid, state))
    for jid, array_id, state in session.execute(select(Job.id, Job.array_id, Job.state).where(Job.id.in_(ids))):
        if not out[jid]:
            out[jid].append((jid, state))
    return out


def active_in_array(session: Session, array_id: int) -> int:
    """How many of the array's jobs run now."""
    return session.scalar(select(func.count(Job.id)).where(Job.array_id == array_id,
                                                          Job.state.in_(list(ACTIVE)))) or 0


def dependents(session: Session) -> list[Job]:
    """Queued jobs that wait for others (`--after`, any kind), by id."""
    return [j for j in session.scalars(select(Job).where(
        Job.state == JobState.QUEUED, Job.after.is_not(None) | Job.dependency.is_not(None)).order_by(Job.id))
        if j.after or j.dependency]


def singleton_blockers(session: Session, job: Job) -> list[tuple[int, JobState]]:
    """Other jobs of `job`'s name and owner that `--after singleton` waits for: running
    ones, and queued ones submitted before it (id, state), by id."""
    rows = session.execute(select(Job.id, Job.state).where(
        Job.name == job.name, Job.user == job.user, Job.id != job.id,
        Job.state.in_([*ACTIVE, JobState.QUEUED])).order_by(Job.id))
    return [(jid, state) for jid, state in rows if state is not JobState.QUEUED or jid < job.id]


# ---- workers ------------------------------------------------------------------------------
def held_devices(session: Session) -> dict[str, set[int]]:
    """Devices held by live workers of running jobs, per host."""
    held: dict[str, set[int]] = {}
    rows = session.execute(select(Worker.host, Worker.gpus, Worker.state).join(Job)
                           .where(Job.state.in_(ACTIVE)))
    for host, gpus, state in rows:
        if not state.final:
            held.setdefault(host, set()).update(gpus)
    return held


def max_wid(session: Session, job_id: int) -> int:
    """The largest worker id the job's rows ever held; -1 when it has none."""
    top = session.scalar(select(func.max(Worker.wid)).where(Worker.job_id == job_id))
    return -1 if top is None else top


def live_workers_by_device(session: Session) -> dict[tuple[str, int], tuple[Job, Worker]]:
    """(host, device) -> the job and live worker holding it."""
    out: dict[tuple[str, int], tuple[Job, Worker]] = {}
    live = [s for s in WorkerState if not s.final]
    for w, j in session.execute(select(Worker, Job).join(Job).where(Worker.state.in_(live))):
        for d in w.gpus:
            out[(w.host, d)] = (j, w)
    return out


def workers_on(session: Session, hosts: Iterable[str]) -> list[tuple[Worker, Job]]:
    """Every worker ever run on `hosts`, with its job."""
    return list(session.execute(select(Worker, Job).join(Job).where(Worker.host.in_(list(hosts)))))


def held_by_user(session: Session) -> dict[str, int]:
    """Devices held now per job owner: the starting and running workers of running jobs
    (gpuflex.policy.fairshare's quota; a leaver is giving its devices back)."""
    out: dict[str, int] = {}
    rows = session.execute(select(Job.user, Worker.gpus).join(Job).where(
        Job.state.in_(list(ACTIVE)), Worker.state.in_([WorkerState.STARTING, WorkerState.RUNNING])))
    for user, gpus in rows:
        out[user] = out.get(user, 0) + len(gpus or ())
    return out


def holds_since(session: Session, since: float) -> list[tuple[str, float, float | None, int, str]]:
    """(owner, started_at, ended_at, devices, host) of every worker still held at or
    after `since`: the intervals behind fair share's usage and the report's GPU-hours."""
    rows = session.execute(select(Job.user, Worker.started_at, Worker.ended_at, Worker.gpus, Worker.host)
                           .join(Job).where((Worker.ended_at.is_(None)) | (Worker.ended_at >= since)))
    return [(user, start, end, len(gpus or ()), host) for user, start, end, gpus, host in rows]


def usage_since(session: Session, since: float) -> list[tuple[str, float, float | None, int]]:
    """(owner, started_at, ended_at, gpus_per_worker) of every worker still held at or after
    `since`: fair share's intervals (plain columns, so thousands of rows read fast)."""
    return list(session.execute(select(Job.user, Worker.started_at, Worker.ended_at, Job.gpus_per_worker)
                                .join(Job).where((Worker.ended_at.is_(None)) | (Worker.ended_at >= since))))


# ---- hosts and devices --------------------------------------------------------------------
def hosts(session: Session) -> list[Host]:
    """Every host mirrored from the config, by name."""
    return list(session.scalars(select(Host).order_by(Host.name)))


def host(session: Session, name: str) -> Host | None:
    return session.scalar(select(Host).where(Host.name == name))


def hosts_named(session: Session, names: list[str]) -> dict[str, Host]:
    """The hosts among `names` that are in the DB, by name."""
    return {h.name: h for h in session.scalars(select(Host).where(Host.name.in_(names)))}


def worker_pgids(session: Session) -> dict[str, set[int]]:
    """Process groups gpuflex started that are still meant to live, per host: live workers
    and coordinators of running jobs."""
    out: dict[str, set[int]] = {}
    for host, pgid, state in session.execute(
            select(Worker.host, Worker.pgid, Worker.state).join(Job).where(Job.state.in_(ACTIVE))):
        if pgid is not None and not state.final:
            out.setdefault(host, set()).add(pgid)
    for host, pgid in session.execute(select(Job.store_host, Job.store_pgid).where(Job.state.in_(ACTIVE))):
        if host and pgid is not None:
            out.setdefault(host, set()).add(pgid)
    return out


def prune_history(session: Session, host: str, indices: list[int], keep: int) -> None:
    """Keep the newest `keep` probe samples of each of the host's GPUs `indices`."""
    for i in indices:
        cutoff = session.scalar(
            select(GpuSample.id).where(GpuSample.host == host, GpuSample.gpu_index == i)
            .order_by(GpuSample.time.desc(), GpuSample.id.desc()).offset(keep).limit(1))
        if cutoff is not None:
            session.execute(delete(GpuSample).where(
                GpuSample.host == host, GpuSample.gpu_index == i, GpuSample.id <= cutoff))


def slot_host_names(session: Session) -> set[str]:
    """Hosts whose devices are CPU slots."""
    return set(session.scalars(select(Host.name).join(Gpu).where(Gpu.kind == "slot")))


def latest_samples(session: Session) -> dict[tuple[str, int], GpuSample]:
    """The newest probe sample of every GPU, by (host, index)."""
    newest = select(func.max(GpuSample.id)).group_by(GpuSample.host, GpuSample.gpu_index)
    return {(s.host, s.gpu_index): s
            for s in session.scalars(select(GpuSample).where(GpuSample.id.in_(newest)))}


def foreign_history(session: Session, host_name: str, index: int, limit: int) -> list[tuple[float, list]]:
    """(time, foreign processes) of one GPU's newest `limit` samples, newest first."""
    return [(when, pids) for when, pids in session.execute(
        select(GpuSample.time, GpuSample.foreign_pids)
        .where(GpuSample.host == host_name, GpuSample.gpu_index == index)
        .order_by(GpuSample.time.desc(), GpuSample.id.desc()).limit(limit))]


# ---- events -------------------------------------------------------------------------------
def events_of_kind(session: Session, kind: str, since: float, until: float) -> list[tuple[Event, Job]]:
    """Events of `kind` in [since, until], oldest first, with their jobs."""
    return list(session.execute(select(Event, Job).join(Job).where(
        Event.kind == kind, Event.time >= since, Event.time <= until).order_by(Event.time)))


def event_data(session: Session, kinds: Iterable[str], until: float) -> list[tuple[str, dict]]:
    """(kind, data) of every event of `kinds` recorded up to `until`, oldest first: one
    query, no job or event object built."""
    return [(kind, data) for kind, data in session.execute(
        select(Event.kind, Event.data).where(Event.kind.in_(list(kinds)), RECORDED_AT <= until)
        .order_by(Event.time, Event.id))]


def last_event(session: Session, job_id: int) -> Event | None:
    """The job's newest event (one row, whatever its history holds)."""
    return session.scalar(select(Event).where(Event.job_id == job_id).order_by(Event.id.desc()).limit(1))


def last_event_of(session: Session, job_id: int, kinds: Iterable[str], since: float = 0.0) -> Event | None:
    """The job's newest event of one of `kinds` recorded at or after `since` (one row)."""
    return session.scalar(select(Event).where(Event.job_id == job_id, Event.kind.in_(list(kinds)),
                                              RECORDED_AT >= since).order_by(Event.id.desc()).limit(1))


def with_event_since(session: Session, job_ids: Iterable[int], kind: str, since: float) -> set[int]:
    """Which of `job_ids` had a `kind` event (or a repeat of one) at or after `since`."""
    ids = list(job_ids)
    if not ids:
        return set()
    return set(session.scalars(select(Event.job_id).where(
        Event.job_id.in_(ids), Event.kind == kind, func.coalesce(Event.last_time, Event.time) >= since)))


def last_events_of(session: Session, job_ids: Iterable[int], kinds: Iterable[str], *,
                   since_start: bool = False) -> dict[int, Event]:
    """job id -> its newest event of one of `kinds` (with `since_start`: recorded at or
    after the job's current run started), for each of `job_ids` that has one: a query
    per CHUNK ids, whatever the histories hold."""
    out: dict[int, Event] = {}
    for chunk in _chunks(job_ids):
        newest = select(func.max(Event.id)).where(Event.job_id.in_(chunk), Event.kind.in_(list(kinds)))
        if since_start:
            newest = newest.join(Job, Job.id == Event.job_id).where(
                RECORDED_AT >= func.coalesce(Job.started_at, 0.0))
        out.update((e.job_id, e) for e in session.scalars(
            select(Event).where(Event.id.in_(newest.group_by(Event.job_id)))))
    return out


def recent_events(session: Session, job_id: int, kinds: Iterable[str], limit: int) -> list[Event]:
    """The job's newest `limit` events of `kinds`, oldest first."""
    rows = session.scalars(select(Event).where(Event.job_id == job_id, Event.kind.in_(list(kinds)))
                           .order_by(Event.id.desc()).limit(limit))
    return list(rows)[::-1]


def max_count_by_wid(session: Session, job_id: int, kind: str, since: float) -> dict[int, int]:
    """wid -> the largest data["count"] of the job's `kind` events recorded since `since`
    (one row per worker, computed by the database)."""
    wid, count = Event.data["wid"].as_integer(), Event.data["count"].as_integer()
    rows = session.execute(select(wid, func.max(count)).where(
        Event.job_id == job_id, Event.kind == kind, RECORDED_AT >= since, wid.is_not(None)).group_by(wid))
    return {w: c or 0 for w, c in rows}


def events_by_cause(session: Session, job_id: int, kind: str, causes: Iterable[str]) -> dict[str, int]:
    """How many times the job's `kind` events with data["cause"] equal to each of `causes`
    happened (repeats of a coalesced event included), in one query: cause -> count (0 when
    none)."""
    wanted = list(causes)
    cause = Event.data["cause"].as_string()
    rows = session.execute(select(cause, func.sum(Event.count)).where(
        Event.job_id == job_id, Event.kind == kind, cause.in_(wanted)).group_by(cause)).all()
    found = {c: int(n or 0) for c, n in rows}
    return {c: found.get(c, 0) for c in wanted}


def recent_causes(session: Session, job_id: int, kind: str, limit: int) -> list[str]:
    """The causes (data["cause"]) of the job's newest `kind` events that name one, oldest
    first, a coalesced event's repeats included: at most `limit`, in one query."""
    cause = Event.data["cause"].as_string()
    rows = session.execute(select(cause, Event.count).where(
        Event.job_id == job_id, Event.kind == kind, cause.is_not(None)).order_by(Event.id.desc()).limit(limit)).all()
    out = [c for c, n in rows for _ in range(max(1, int(n or 1)))][:limit]
    return out[::-1]
