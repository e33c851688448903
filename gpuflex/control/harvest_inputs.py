"""The harvest plan's inputs, read from the DB: jobs with their live workers, and every
device with its last verdict and since when a foreign process holds it."""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control.executor import Ops
from gpuflex.db import queries
from gpuflex.hosts.probe import HISTORY_PER_GPU
from gpuflex.policy.harvest import GpuView, JobView, Plan, WorkerView, plan


def current_plan(ops: Ops, errors: dict[str, str]) -> Plan:
    jobs, gpus = snapshot(ops.session, ops.config)
    return plan(jobs, gpus, ops.config.harvest, time.time(), host_errors=errors,
                max_probe_age_s=ops.pool.probe_max_age_s)


def snapshot(session: Session, config: Config) -> tuple[list[JobView], list[GpuView]]:
    """The plan's inputs from the DB: jobs that are not final with their live workers, and
    every device of the configured hosts with its last verdict."""
    jobs = []
    for j in queries.jobs(session, queries.NOT_FINAL):
        workers = tuple(WorkerView(w.wid, w.host, tuple(w.gpus), w.state) for w in j.live_workers)
        jobs.append(JobView(id=j.id, state=j.state, min_workers=j.min_workers, max_workers=j.max_workers,
                            gpus_per_worker=j.gpus_per_worker, priority=j.priority, harvest=j.harvest,
                            workers=workers, target_workers=j.target_workers, name=j.name))
    since = foreign_since(session)
    names = {h.name for h in config.hosts}
    gpus = [GpuView(host=h.name, index=g.index, verdict=g.verdict, owner=h.owner, kind=g.kind,
                    idle_streak=g.idle_streak or 0, probed_at=g.updated_at,
                    foreign_since=since.get((h.name, g.index)))
            for h in queries.hosts(session) if h.name in names
            for g in h.gpus]
    return jobs, gpus


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
