"""The harvest plan's inputs, read from the DB: jobs with their live workers, and every
device with its last verdict and since when a foreign process holds it; each user's
quota and decayed usage (gpuflex.control.quotas); and, for each job harvest could grow,
whether its training has finished (its coordinator's word and its workers' exits: a
finished job's newcomers exit 0 at once, and growing it again and again kept it
`scaling` after its end)."""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control import access, quotas, throughput
from gpuflex.control.executor import Ops
from gpuflex.control.observe import coordinator_status
from gpuflex.db import queries
from gpuflex.db.models import Job
from gpuflex.hosts.probe import HISTORY_PER_GPU
from gpuflex.jobspec import INPLACE
from gpuflex.policy.harvest import GpuView, JobView, Plan, Share, WorkerView, plan, training_finished
from gpuflex.policy.split import REGROW_AFTER_S, STRAGGLER_KIND
from gpuflex.states import WorkerState


def current_plan(ops: Ops, errors: dict[str, str]) -> Plan:
    finished = {j.id for j in queries.jobs(ops.session, queries.ACTIVE) if could_grow(j) and has_finished(ops, j)}
    jobs, gpus = snapshot(ops.session, ops.config, finished)
    return plan(jobs, gpus, ops.config.harvest, time.time(), host_errors=errors,
                max_probe_age_s=ops.pool.probe_max_age_s, share=share(ops, {j.user for j in jobs}))


def share(ops: Ops, users: set[str]) -> Share:
    """Decayed usage by user, and the quotas of `users` (none when [quota] sets no limit)."""
    limited = ops.config.quota.default_gpus is not None or bool(ops.config.quota.users)
    return Share(usage=quotas.usage(ops), quotas={u: quotas.quota_of(ops, u) for u in users} if limited else {})


def could_grow(job: Job) -> bool:
    """A --harvest job below its MAX: the only ones whose coordinator the plan asks."""
    return job.harvest and job.gpus_per_worker >= 1 and len(job.members) < job.max_workers


def has_finished(ops: Ops, job: Job) -> bool:
    """Whether the running job's training has ended (gpuflex.policy.harvest.training_finished):
    asks its coordinator; a worker of this run that exited 0 is a done record."""
    since = job.started_at or 0.0
    exited_ok = [w.wid for w in job.workers if w.state is WorkerState.EXITED and w.exit_code == 0
                 and (w.ended_at or 0.0) >= since]
    return training_finished(coordinator_status(ops.config, ops.pool, job), exited_ok)


def snapshot(session: Session, config: Config,
             finished: set[int] | frozenset[int] = frozenset()) -> tuple[list[JobView], list[GpuView]]:
    """The plan's inputs from the DB: jobs that are not final with their live workers
    (`finished`: the ids of those whose training ended), and every device of the
    configured hosts with its last verdict. A job is not grown onto the GPUs it released
    stragglers from (`shunned`) nor onto a host where this command cannot start its
    processes (another user's job on a host reached as each user: access.may_start)."""
    since = foreign_since(session)
    names = {h.name for h in config.hosts}
    gpus = [GpuView(host=h.name, index=g.index, verdict=g.verdict, owner=h.owner, kind=g.kind,
                    idle_streak=g.idle_streak or 0, probed_at=g.updated_at,
                    foreign_since=since.get((h.name, g.index)))
            for h in queries.hosts(session) if h.name in names
            for g in h.gpus]
    jobs = []
    shun = shunned(session, time.time())
    listed = queries.jobs(session, queries.NOT_FINAL)
    history = queries.events_of_jobs(session, [j.id for j in listed if j.harvest],
                                     [throughput.KIND, throughput.DECIDED])
    for j in listed:
        if j.held:   # queued and left alone until released: it claims no device in the plan
            continue
        workers = tuple(WorkerView(w.wid, w.host, tuple(w.gpus), w.state) for w in j.live_workers)
        shut = {h for h in names if not access.may_start(config, j, [h])}
        closed = {g.ref for g in gpus if g.host in shut}
        jobs.append(JobView(id=j.id, state=j.state, min_workers=j.min_workers, max_workers=j.max_workers,
                            gpus_per_worker=j.gpus_per_worker, priority=j.priority, harvest=j.harvest,
                            workers=workers, target_workers=j.target_workers, name=j.name, user=j.user,
                            finished=j.id in finished, pinned=j.kind is not None, shunned=shun.get(j.id, frozenset()) | closed,
                            points=tuple(throughput.points_of(history.get(j.id, []))), inplace=j.elastic == INPLACE,
                            resized_at=throughput.resized_at(history.get(j.id, []))))
    return jobs, gpus


def shunned(session: Session, now: float) -> dict[int, frozenset[tuple[str, int]]]:
    """By job: the GPUs of the workers it released as stragglers in the last REGROW_AFTER_S
    (their "straggler" events), which harvest does not grow it back onto."""
    out: dict[int, set[tuple[str, int]]] = {}
    for e, job in queries.events_of_kind(session, STRAGGLER_KIND, now - REGROW_AFTER_S, now):
        wid = e.data.get("worker")
        for w in job.workers:
            if w.wid == wid:
                out.setdefault(job.id, set()).update((w.host, d) for d in w.gpus)
    return {k: frozenset(v) for k, v in out.items()}


def foreign_since(session: Session) -> dict[tuple[str, int], float]:
    """For each GPU whose newest sample shows a foreign process: the time of the first of
    the consecutive samples that do (when its owner came back)."""
    out = {}
    for key, newest in queries.latest_samples(session).items():
        if not newest.foreign_pids:
            continue
        since = newest.time
        for when, pids in queries.foreign_history(session, key[0], key[1], HISTORY_PER_GPU):
            if not pids:
                break
            since = when
        out[key] = since
    return out
