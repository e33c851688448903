"""The harvest plan's inputs, read from the DB: jobs with their live workers, and every
device with its last verdict and since when a foreign process holds it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control import lifecycle
from gpuflex.db.models import GpuSample as SampleRow
from gpuflex.db.models import Host, Job
from gpuflex.hosts.probe import HISTORY_PER_GPU, latest_samples
from gpuflex.policy.harvest import GpuView, JobView, Plan, WorkerView, plan
from gpuflex.states import JobState

if TYPE_CHECKING:
    from gpuflex.control.service import JobService


def current_plan(svc: "JobService", session: Session, errors: dict[str, str]) -> Plan:
    jobs, gpus = snapshot(session, svc.config)
    return plan(jobs, gpus, svc.config.harvest, time.time(), host_errors=errors,
                max_probe_age_s=svc.pool.probe_max_age_s)


def snapshot(session: Session, config: Config) -> tuple[list[JobView], list[GpuView]]:
    """The plan's inputs from the DB: jobs that are not final with their live workers, and
    every device of the configured hosts with its last verdict."""
    jobs = []
    live = [JobState.QUEUED.value, JobState.RUNNING.value, JobState.SCALING.value]
    for j in session.scalars(select(Job).where(Job.state.in_(live)).order_by(Job.id)):
        workers = tuple(WorkerView(w.wid, w.host, tuple(w.gpus), w.state) for w in lifecycle.live_workers(j))
        jobs.append(JobView(id=j.id, state=j.state, min_workers=j.min_workers, max_workers=j.max_workers,
                            gpus_per_worker=j.gpus_per_worker, priority=j.priority, harvest=j.harvest,
                            workers=workers, target_workers=j.target_workers, name=j.name))
    since = foreign_since(session)
    names = {h.name for h in config.hosts}
    gpus = [GpuView(host=h.name, index=g.index, verdict=g.verdict, owner=h.owner, kind=g.kind,
                    idle_streak=g.idle_streak or 0, probed_at=g.updated_at,
                    foreign_since=since.get((h.name, g.index)))
            for h in session.scalars(select(Host).order_by(Host.name)) if h.name in names
            for g in h.gpus]
    return jobs, gpus


def foreign_since(session: Session) -> dict[tuple[str, int], float]:
    """For each GPU whose newest sample shows a foreign process: the time of the first of
    the consecutive samples that do (when its owner came back)."""
    out = {}
    for key, newest in latest_samples(session).items():
        if not newest.foreign_pids:
            continue
        since = newest.time
        rows = session.execute(select(SampleRow.time, SampleRow.foreign_pids)
                               .where(SampleRow.host == key[0], SampleRow.gpu_index == key[1])
                               .order_by(SampleRow.time.desc(), SampleRow.id.desc()).limit(HISTORY_PER_GPU))
        for when, pids in rows:
            if not pids:
                break
            since = when
        out[key] = since
    return out
