"""Plain records of what the database holds, for the CLI to render (it imports no models).

Built inside the service's session from the model objects; each field is what the CLI's
JSON (the contract) and tables show.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterable, Iterator, Mapping

from sqlalchemy.orm import Session, object_session

from gpuflex.config import Config
from gpuflex.db import listings, queries
from gpuflex.db.models import Event, Gpu, Job, Worker
from gpuflex.policy import split as split_policy
from gpuflex.policy.lifecycle import CRASH_KIND, WAITING_KIND
from gpuflex.states import JobState, WorkerState

# what a job's --env values read as in every output: they may be keys or passwords, and
# status --json is pasted into issues and chats; the names stay, so a user sees what is set
REDACTED = "<redacted>"


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    wid: int
    rank: int | None
    host: str
    gpus: tuple[int, ...]
    pid: int | None
    state: WorkerState
    generation: int
    exit_code: int | None
    log_path: str
    control_path: str | None


@dataclasses.dataclass(frozen=True)
class EventInfo:
    id: int
    job_id: int
    time: float                  # the first time it happened (a coordinator's or worker's, for theirs)
    kind: str
    message: str                 # the newest wording
    data: dict[str, Any]         # the newest details
    count: int = 1               # how many times it happened in a row (gpuflex.control.journal)
    last_time: float | None = None   # when it last did (None: once)
    recorded_at: float | None = None   # when gpuflex wrote it (at or after `time`)


@dataclasses.dataclass(frozen=True)
class JobInfo:
    id: int
    name: str
    state: JobState
    user: str
    argv: tuple[str, ...]
    workdir: str
    env: dict[str, str]          # names only: every value is REDACTED
    min_workers: int
    max_workers: int
    target_workers: int | None
    world_size: int
    generation: int
    gpus_per_worker: int
    priority: int
    harvest: bool
    restarts: int
    queue_reason: str | None
    exit_code: int | None
    exit_reason: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    workers: tuple[WorkerInfo, ...]
    events: tuple[EventInfo, ...] = ()   # only when asked for
    retries: int = 0             # restarts allowed after a crash (submit --retries)
    last_crash: dict[str, Any] | None = None   # the newest crash event's details, with its time
    # members waiting at a step barrier for busy members (running jobs): [{wid, for, phase, since}]
    waiting: tuple[dict[str, Any], ...] = ()
    recent: tuple[EventInfo, ...] = ()   # the newest few state and generation events (one job's view)
    # issue 11: 'inplace' | 'restart' | None (a fixed gang); the run's time limit and the
    # seconds left of it (running jobs); --after ids; the array and this job's index in it
    elastic: str | None = None
    time_limit_s: float | None = None
    time_left_s: float | None = None
    after: tuple[int, ...] = ()
    array_id: int | None = None
    array_index: int | None = None
    array_limit: int | None = None
    requeue: bool = False
    split: str | None = None     # issue 12: 'speed' | 'even' (in-place jobs), None: a gang's own
    # issue 13: where the job writes its checkpoints (None before its first start; a host's
    # path, `~` its user's home) and the earlier job's it started from (`submit --resume-from`)
    checkpoint_dir: str | None = None
    resume_from: str | None = None
    # issue 33: where each submit setting came from (None: a job submitted before)
    sources: dict[str, str] | None = None
    # issue 33: held (`gpuflex hold`: never started until released); the --after kinds
    # beyond afterok ({"afterany": [ids], "afternotok": [ids], "singleton": true})
    held: bool = False
    dependency: dict[str, Any] | None = None
    # issue 33: --sync given, and the sha256 of the code sent (None: the hosts read workdir)
    sync: bool = False
    code_sha256: str | None = None
    image: str | None = None   # issue 33: --image (each worker in a container of it)
    # issue 33: None for a batch job, "interactive" for a `gpuflex run` session
    kind: str | None = None
    # issue 33: the job's environment (gpuflex.jobenv): --python, --venv, --conda, --env-setup
    python: str | None = None
    venv: str | None = None
    conda: str | None = None
    env_setup: str | None = None
    # issue 28: the coordinator's progress as the owner's last command read it (jobs.progress:
    # {step, epoch, samples_per_s, world_size, at}); what other users' commands show
    progress_seen: dict[str, Any] | None = None


PROGRESS_FIELDS = ("step", "epoch", "samples_per_s", "world_size")


def seen_progress(progress: Any, at: float) -> dict[str, Any] | None:
    """What jobs.progress keeps of a coordinator's progress record: its numbers only (a
    step that is not a whole number: nothing), and `at`, when it was read."""
    if not isinstance(progress, Mapping):
        return None
    kept = {k: progress[k] for k in PROGRESS_FIELDS if isinstance(progress.get(k), (int, float))
            and not isinstance(progress.get(k), bool) and math.isfinite(progress[k])}
    if not isinstance(kept.get("step"), int) or kept["step"] < 0:
        return None
    return {**kept, "at": at}


def worker_info(w: Worker) -> WorkerInfo:
    return WorkerInfo(w.wid, w.rank, w.host, tuple(w.gpus), w.pid, w.state, w.generation, w.exit_code,
                      w.log_path, w.control_path)


RECENT_KINDS = ("state", "formed", "scale", "fault", "rollback", CRASH_KIND)
RECENT = 5


def event_info(e: Event) -> EventInfo:
    return EventInfo(e.id, e.job_id, e.time, e.kind, e.message, e.data, e.count or 1, e.last_time,
                     e.recorded_at if e.recorded_at is not None else e.time)


@dataclasses.dataclass(frozen=True)
class Listing:
    """What `status` lists: the jobs, and how many ended ones it left out (`--all` shows
    them); for each array among the jobs, how many of all its jobs are in each state."""

    jobs: list[JobInfo]
    older: int = 0
    arrays: dict[int, dict[JobState, int]] = dataclasses.field(default_factory=dict)
    # a page of a paged listing (`status --all`): the next page's cursor (None: this was
    # the last) and how many jobs the later pages hold
    next_cursor: int | None = None
    more: int = 0


@dataclasses.dataclass(frozen=True)
class Paged:
    """A page of jobs being read (`status --json`): `jobs` yields them oldest first, a chunk
    of queries.CHUNK read at a time, while its session is open; the next page's cursor
    (None: this is the last) and how many jobs the later pages hold are known first."""

    jobs: Iterator[JobInfo]
    next_cursor: int | None = None
    more: int = 0


def listing(session: Session, owner: str | None, states: list[JobState] | None, ended: int | None) -> Listing:
    """The jobs `status` lists, by id, read in a few queries whatever their number
    (listings.listed_jobs, `job_infos`): every job not ended and the `ended` newest ended
    ones (all when None); only `owner`'s and only those in `states` when given."""
    jobs = listings.listed_jobs(session, owner=owner, states=states, ended=ended)
    older = 0 if ended is None else max(0, listings.ended_count(session, owner=owner, states=states) - ended)
    arrays = queries.array_state_counts(session, [j.array_id for j in jobs if j.array_id is not None])
    return Listing(job_infos(jobs), older, arrays)


def paged(session: Session, owner: str | None, states: list[JobState] | None, limit: int,
          cursor: int | None) -> Paged:
    """The `limit` newest jobs below `cursor` (every one when `limit` is 0), of `owner` and in
    `states` when given, as acct pages (listings.jobs_page: newest first, a cursor is the
    oldest id a page showed); yielded oldest first, as `status` lists. The page's bounds are
    read first (ids alone), then its jobs a chunk at a time, so memory holds one chunk."""
    where = listings.page_where(None if owner is None else [owner], states)
    low, following, more = None, None, 0
    if limit:
        ids = listings.job_ids_page(session, where, below=cursor, limit=limit + 1)
        if not ids:
            return Paged(iter(()))
        low = ids[min(limit, len(ids)) - 1]
        if len(ids) > limit:
            following, more = low, listings.jobs_count(session, where, below=low)
    return Paged(_chunked(session, where, low, cursor), following, more)


def _chunked(session: Session, where: list, low: int | None, below: int | None) -> Iterator[JobInfo]:
    after = None if low is None else low - 1
    while True:
        jobs = listings.jobs_page(session, where, above=after, below=below, limit=queries.CHUNK,
                                 oldest_first=True, workers=True)
        yield from job_infos(jobs)
        if len(jobs) < queries.CHUNK:
            return
        after = jobs[-1].id


def listing_page(session: Session, owner: str | None, states: list[JobState] | None, limit: int,
                 cursor: int | None) -> Listing:
    """`paged`'s page as a whole Listing (the table of `status --all`), with its arrays' counts."""
    page = paged(session, owner, states, limit, cursor)
    jobs = list(page.jobs)
    arrays = queries.array_state_counts(session, [j.array_id for j in jobs if j.array_id is not None])
    return Listing(jobs, 0, arrays, page.next_cursor, page.more)


def job_info(job: Job, *, events: bool = False) -> JobInfo:
    """A job as a record, with its newest few state and generation events (`recent`).
    Only `events` reads the job's whole history; the rest reads a few rows whatever the
    history holds (so `status` stays fast)."""
    info = job_infos([job], recent=True)[0]
    return dataclasses.replace(info, events=tuple(event_info(e) for e in job.events)) if events else info


def without_output(info: JobInfo) -> JobInfo:
    """`info` as another user sees it (gpuflex.control.access.check_reader): its last
    crash without the traceback, which is the job's output."""
    if not info.last_crash or "traceback" not in info.last_crash:
        return info
    return dataclasses.replace(info, last_crash={k: v for k, v in info.last_crash.items() if k != "traceback"})


def job_infos(jobs: list[Job], *, recent: bool = False) -> list[JobInfo]:
    """Jobs of one session as records, in their order, read in a few queries whatever
    their number (the workers come loaded with the jobs, or one query each: see
    listings.listed_jobs): the newest crash of each, the newest wait of each running one,
    and with `recent` each one's newest few state and generation events (a query per
    job: for one job's view)."""
    session = object_session(jobs[0]) if jobs else None
    if session is None:
        return [_job_info(j, None, None, ()) for j in jobs]
    crashes = queries.last_events_of(session, [j.id for j in jobs], [CRASH_KIND])
    waits = queries.last_events_of(session, [j.id for j in jobs if j.state.active], [WAITING_KIND],
                                   since_start=True)
    return [_job_info(j, crashes.get(j.id), waits.get(j.id),
                      queries.recent_events(session, j.id, RECENT_KINDS, RECENT) if recent else ())
            for j in jobs]


def _job_info(job: Job, crash: Event | None, waited: Event | None, recent: Iterable[Event]) -> JobInfo:
    return JobInfo(
        id=job.id, name=job.name, state=job.state, user=job.user, argv=tuple(job.argv),
        workdir=job.workdir, env={k: REDACTED for k in job.env}, min_workers=job.min_workers,
        max_workers=job.max_workers, target_workers=job.target_workers, world_size=job.world_size,
        generation=job.generation, gpus_per_worker=job.gpus_per_worker, priority=job.priority,
        harvest=job.harvest, restarts=job.restarts, queue_reason=job.queue_reason,
        exit_code=job.exit_code, exit_reason=job.exit_reason, created_at=job.created_at,
        started_at=job.started_at, ended_at=job.ended_at,
        workers=tuple(worker_info(w) for w in job.workers),
        retries=job.retries or 0,
        last_crash={**crash.data, "time": crash.time} if crash is not None else None,
        waiting=tuple((waited.data or {}).get("waiting") or ()) if waited is not None else (),
        recent=tuple(event_info(e) for e in recent), kind=job.kind,
        elastic=job.elastic, time_limit_s=job.time_limit_s, time_left_s=time_left(job),
        after=tuple(job.after or ()), array_id=job.array_id, array_index=job.array_index,
        array_limit=job.array_limit, requeue=bool(job.requeue), split=job.split,
        checkpoint_dir=job.checkpoint_dir, resume_from=job.resume_from, held=bool(job.held),
        dependency=dict(job.dependency) if job.dependency else None,
        sources=dict(job.sources) if job.sources is not None else None,
        sync=bool(job.sync), code_sha256=job.code_sha256,
        python=job.python, venv=job.venv, conda=job.conda, env_setup=job.env_setup, image=job.image,
        progress_seen=dict(job.progress) if isinstance(job.progress, dict) else None)


SPLIT_FIELDS = ("share", "samples_per_s", "relative")


def worker_split(progress: Mapping[str, Any] | None, wid: int) -> dict[str, Any]:
    """A worker's share of the global batch, its samples/s and its speed relative to the
    fastest member, from the coordinator's progress record (rank 0's `workers`, keyed by
    the worker id as a string: see docs/architecture.md, the split); None for each field
    not known. Rank 0 writes that record unsigned, so only finite numbers of the right
    kind are taken."""
    workers = (progress or {}).get("workers") if isinstance(progress, Mapping) else None
    entry = workers.get(str(wid)) if isinstance(workers, Mapping) else None
    entry = entry if isinstance(entry, Mapping) else {}
    return {"share": split_policy.count(entry.get("share")),
            "samples_per_s": split_policy.number(entry.get("samples_per_s")),
            "relative": split_policy.number(entry.get("relative"))}


def time_left(job: Job, now: float | None = None) -> float | None:
    """Seconds left of a running job's time limit (from the start of its current run);
    None without a limit or when it is not running."""
    if job.time_limit_s is None or job.started_at is None or not job.state.active:
        return None
    return max(0.0, job.started_at + job.time_limit_s - (time.time() if now is None else now))


def pool_view(config: Config, session: Session) -> list[dict]:
    """Hosts with their devices, the last probe's figures and who holds each device."""
    workers = queries.live_workers_by_device(session)
    samples = queries.latest_samples(session)
    configured = {c.name for c in config.hosts}
    out = []
    for h in queries.hosts(session):
        if h.name not in configured:
            continue
        devices = []
        for g in h.gpus:
            job_worker = workers.get((h.name, g.index))
            sample = samples.get((h.name, g.index))
            foreign = list(sample.foreign_pids) if sample is not None and g.kind == "gpu" else []
            devices.append({
                "index": g.index, "kind": g.kind, "uuid": g.uuid, "model": g.model,
                "utilization_pct": g.utilization_pct, "memory_used_mib": g.memory_used_mib,
                "memory_total_mib": g.memory_total_mib, "verdict": g.verdict,
                "idle_streak": g.idle_streak,
                "job": job_worker[0].id if job_worker else None,
                "rank": job_worker[1].rank if job_worker else None,
                "foreign": foreign,
                "zombie": g.verdict == "zombie",
                "holder": _holder(job_worker, foreign) or _zombie(g),
            })
        out.append({
            "name": h.name, "address": h.address, "owner": h.owner, "reachable": h.reachable,
            "error": h.last_error, "last_probe_at": h.last_probe_at, "devices": devices,
        })
    return out


def _zombie(g: Gpu) -> str | None:
    """Memory in use with no process listed: say so, it is why the GPU is not idle."""
    if g.verdict != "zombie":
        return None
    return f"zombie memory ({g.memory_used_mib:.0f} MiB used, no process listed)"


def _holder(job_worker: tuple[Job, Worker] | None, foreign: list[dict]) -> str | None:
    parts = []
    if job_worker is not None:
        j, w = job_worker
        parts.append(f"job {j.id} rank {w.rank if w.rank is not None else '?'} (w{w.wid})")
    for p in foreign:
        parts.append(f"pid {p['pid']} ({p.get('user') or 'unknown user'})")
    return ", ".join(parts) or None
