"""`gpuflex metrics`: the pool and its jobs in Prometheus' text exposition format.

There is no daemon to scrape, so the figures are meant for node_exporter's textfile
collector: cron runs `gpuflex metrics` into a temporary file and renames it into the
collector's directory (examples/cron/gpuflex-metrics.crontab), and node_exporter serves
it with its own. `gpuflex metrics --serve` (gpuflex.control.exporter) serves the same
families over HTTP, read anew at each scrape. Either way nothing is counted in memory: every value
is read from the database (after the command's refresh) or from the coordinators' last
progress reports (`JobService.progress`), and the histograms are rebuilt from the events,
which only grow (a `_total`, `_count` or `_sum` here never goes down while no job is
deleted). Every job state has a `gpuflex_jobs_in_state` series, 0 when no job is in it,
and every generation kind a `gpuflex_scale_events_total` one, so that a rate or a sum
over them never misses a series that has not happened yet.

prometheus_client writes the format: one collector yields this run's metric families into
a private CollectorRegistry (no process or platform collectors, no global registry), and
`generate_latest` renders it. No HTTP server is started.

Device time is `report --by user`'s (gpuflex.control.report.by_user over all time):
GPU-hours and CPU slot-hours named apart by a `device` label ("gpu", "cpu-slot"), and the
GPU-hours on hosts with an owner again as harvested. Queue wait (submission to the first
worker's start) and run time (first start to the last worker's end, of ended jobs) are
acct's, read per job by the database (queries.job_spans).

Labels: `job_id` rather than `job`, which Prometheus gives the scrape target (a `job`
label of ours would come out as `exported_job`); per-job series only for running jobs,
so a database of 10,000 ended jobs does not become 10,000 series.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from typing import Any, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from gpuflex.config import Config
from gpuflex.control import report, views
from gpuflex.db import queries
from gpuflex.policy.lifecycle import HISTORY_KINDS
from gpuflex.states import JobState

# seconds: a resize phase takes milliseconds to seconds, a restart or a reclaim seconds to minutes
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OWNER_VERDICTS = frozenset({"owner", "busy", "zombie"})   # someone outside gpuflex uses the GPU
FREE_VERDICTS = frozenset({"free", "idle"})
_PHASE_NAME_MAX = 32
# seconds a job waits in the queue or runs: from seconds to a week
JOB_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0,
               86400.0, 259200.0, 604800.0)
SCALE_KINDS = (*HISTORY_KINDS, "restart")   # the events that change a running job's generation
RECLAIM_OUTCOMES = ("within_deadline", "late", "failed")


def holder(device: Mapping[str, Any]) -> str:
    """Who holds a device of views.pool_view: "job" (a live gpuflex worker), "owner"
    (someone else: the host's owner, a foreign process, memory nobody lists), "free", or
    "unknown" (its host could not be probed, or never was)."""
    if device.get("job") is not None:
        return "job"
    verdict = device.get("verdict")
    if device.get("kind") != "gpu" or verdict in FREE_VERDICTS:
        return "free"
    return "owner" if verdict in OWNER_VERDICTS else "unknown"


def histogram(name: str, doc: str, labels: list[str], series: Mapping[tuple[str, ...], list[float]],
              bounds: tuple[float, ...] = BUCKETS) -> HistogramMetricFamily:
    """A histogram family from observed values per label tuple (cumulative buckets)."""
    family = HistogramMetricFamily(name, doc, labels=labels)
    for key, values in sorted(series.items()):
        ordered = sorted(values)
        buckets = [(repr(le), bisect.bisect_right(ordered, le)) for le in bounds]
        family.add_metric(list(key), buckets + [("+Inf", len(ordered))], sum_value=sum(ordered))
    return family


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        return None
    return float(value)


def phase_series(session: Session, now: float) -> tuple[dict[tuple[str, str], list[float]],
                                                         dict[tuple[str], list[float]], Counter]:
    """(event kind, phase) -> every duration the events hold: each generation event's
    `timings` (formed, scale, fault, rollback: detect, agree, rebuild, copy, verify,
    first_step, total ...) and each restart's `down_s` (phase "down"); the stall of each
    by kind (the time training stood still: a generation's `total`, a restart's
    `down_s`); and how many events of each of SCALE_KINDS there are (with or without
    timings: a failed resize counts too)."""
    out: dict[tuple[str, str], list[float]] = {}
    stalls: dict[tuple[str], list[float]] = {(kind,): [] for kind in SCALE_KINDS}
    counts: Counter = Counter({kind: 0 for kind in SCALE_KINDS})
    for kind, data in queries.event_data(session, SCALE_KINDS, now):
        counts[kind] += 1
        if kind == "restart":
            s = _seconds((data or {}).get("down_s"))
            if s is not None:
                out.setdefault(("restart", "down"), []).append(s)
                stalls[(kind,)].append(s)
            continue
        timings = (data or {}).get("timings")
        if not isinstance(timings, Mapping):
            continue
        for phase, value in timings.items():
            s = _seconds(value)
            if s is not None and isinstance(phase, str) and phase.isidentifier() \
                    and len(phase) <= _PHASE_NAME_MAX:
                out.setdefault((kind, phase), []).append(s)
                if phase == "total":
                    stalls[(kind,)].append(s)
    return out, stalls, counts


def reclaim_series(session: Session, now: float) -> tuple[dict[tuple[str], list[float]], Counter]:
    """Reclaim latencies by method (shrink, requeue, restart), and the reclaims by method
    and outcome (within the deadline, late, failed: no latency)."""
    latencies: dict[tuple[str], list[float]] = {}
    outcomes: Counter = Counter()
    for _kind, data in queries.event_data(session, ["reclaim"], now):
        d = data or {}
        method = str(d.get("method") or "unknown")
        s = _seconds(d.get("latency_s"))
        if s is None:
            outcomes[(method, "failed")] += 1
            continue
        latencies.setdefault((method,), []).append(s)
        outcomes[(method, "within_deadline" if d.get("within_deadline") else "late")] += 1
    return latencies, outcomes


def job_time_series(session: Session) -> tuple[dict[tuple[str], list[float]], dict[tuple[str, str], list[float]]]:
    """Queue waits by owner (every job that started: its first worker's start less its
    submission) and run times by owner and final state (every ended job that started: its
    first start to its last worker's end), as acct counts them."""
    waits: dict[tuple[str], list[float]] = {}
    runs: dict[tuple[str, str], list[float]] = {}
    for user, state, submitted, first, last in queries.job_spans(session):
        if first is None:
            continue
        waits.setdefault((user,), []).append(max(0.0, first - submitted))
        if state.final:
            runs.setdefault((user, state.value), []).append(max(0.0, last - first))
    return waits, runs


def usage_families(session: Session, now: float) -> list[Any]:
    """Device time by owner since the first job: report --by user's figures, GPU time and
    CPU slot time apart, and the harvested GPU time, in seconds (Prometheus' base unit:
    promtool refuses `_hours`; divide by 3600 for report's device-hours). They only grow
    while no job is deleted and no host's owner or devices change (report counts by the
    pool as it is now)."""
    owned = {h.name for h in queries.hosts(session) if h.owner}
    rows = report.by_user(session, 0.0, now, owned, queries.slot_host_names(session))
    f_used = CounterMetricFamily("gpuflex_device_seconds", "Device time the workers of each user's jobs held, "
                                 "in device-seconds: GPUs (device=gpu) and CPU slots (device=cpu-slot), as "
                                 "report --by user counts them (/3600: its device-hours).", labels=["user", "device"])
    f_harvested = CounterMetricFamily("gpuflex_harvested_gpu_seconds", "GPU-seconds each user's jobs held on "
                                      "hosts with an owner (harvested idle GPUs).", labels=["user"])
    for r in rows:
        f_used.add_metric([r["user"], "gpu"], round(r["gpu_hours"] * 3600, 3))
        f_used.add_metric([r["user"], "cpu-slot"], round(r["slot_hours"] * 3600, 3))
        f_harvested.add_metric([r["user"]], round(r["harvested_gpu_hours"] * 3600, 3))
    return [f_used, f_harvested]


def families(session: Session, config: Config, progress: Mapping[int, Mapping[str, Any]],
             now: float | None = None) -> list[Any]:
    """Every metric family of one run (see the module docstring)."""
    now = time.time() if now is None else now
    by_state = {(state.value, user): n for (state, user), n in queries.job_counts(session).items()}
    f_jobs = GaugeMetricFamily("gpuflex_jobs", "Jobs in the database by state and user.", labels=["state", "user"])
    for (state, user), n in sorted(by_state.items()):
        f_jobs.add_metric([state, user], n)
    f_states = GaugeMetricFamily("gpuflex_jobs_in_state", "Jobs in the database by state, every state "
                                 "(0 when none).", labels=["state"])
    for state in JobState:
        f_states.add_metric([state.value], sum(n for (s, _u), n in by_state.items() if s == state.value))
    waits, runs = job_time_series(session)
    f_wait = histogram("gpuflex_job_queue_wait_seconds", "Time from a job's submission to its first worker's "
                       "start, per started job, by owner.", ["user"], waits, JOB_BUCKETS)
    f_run = histogram("gpuflex_job_run_seconds", "Time from an ended job's first worker start to its last "
                      "worker's end, by owner and final state.", ["user", "state"], runs, JOB_BUCKETS)
    jobs = queries.jobs(session, queries.ACTIVE)   # per-job series: running jobs only

    job_labels = ["job_id", "name", "user"]
    f_world = GaugeMetricFamily("gpuflex_job_world_size", "Workers in a running job's current generation.",
                                labels=job_labels)
    f_rate = GaugeMetricFamily("gpuflex_job_samples_per_second",
                               "Training samples per second of a running job (its coordinator's last "
                               "progress report).", labels=job_labels)
    f_step = GaugeMetricFamily("gpuflex_job_step", "A running job's last reported training step.", labels=job_labels)
    f_restarts = CounterMetricFamily("gpuflex_job_restarts", "Times a running job was requeued and restarted.",
                                     labels=job_labels)
    for j in jobs:
        if j.state not in (JobState.RUNNING, JobState.SCALING):
            continue
        labels = [str(j.id), j.name, j.user]
        f_world.add_metric(labels, j.world_size or 0)
        f_restarts.add_metric(labels, j.restarts or 0)
        # another user's job: its progress as its owner's last command read it (jobs.progress)
        report = progress.get(j.id) or (j.progress if isinstance(j.progress, dict) else {})
        for family, key in ((f_rate, "samples_per_s"), (f_step, "step")):
            value = report.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family.add_metric(labels, value)

    f_gpus = GaugeMetricFamily("gpuflex_gpus", "GPUs by their last probe's verdict and who holds them "
                               "(job, owner, free, unknown).", labels=["host", "verdict", "holder"])
    f_slots = GaugeMetricFamily("gpuflex_cpu_slots", "CPU slots of slot hosts by holder (job, free).",
                                labels=["host", "holder"])
    f_probe_err = GaugeMetricFamily("gpuflex_host_probe_error",
                                    "1 when the host's last probe failed (unreachable, or nvidia-smi failed).",
                                    labels=["host"])
    f_probe_at = GaugeMetricFamily("gpuflex_host_last_probe_timestamp_seconds",
                                   "Unix time of the host's last probe.", labels=["host"])
    for host in views.pool_view(config, session):
        gpus = Counter((d.get("verdict") or "unknown", holder(d)) for d in host["devices"] if d["kind"] == "gpu")
        for (verdict, who), n in sorted(gpus.items()):
            f_gpus.add_metric([host["name"], verdict, who], n)
        slots = Counter(holder(d) for d in host["devices"] if d["kind"] != "gpu")
        for who, n in sorted(slots.items()):
            f_slots.add_metric([host["name"], who], n)
        if host["last_probe_at"] is not None:
            f_probe_err.add_metric([host["name"]], 1 if host["error"] else 0)
            f_probe_at.add_metric([host["name"]], host["last_probe_at"])

    phases, stalls, events = phase_series(session, now)
    f_phases = histogram("gpuflex_scale_phase_seconds", "Durations of the phases of each formed, scaled, "
                         "recovered or rolled-back generation, and of each restart's downtime.",
                         ["kind", "phase"], phases)
    f_stall = histogram("gpuflex_scale_stall_seconds", "Time training stood still per generation change: "
                        "a generation's total (detect to first step), a restart's downtime.", ["kind"], stalls)
    f_events = CounterMetricFamily("gpuflex_scale_events", "Generation changes by kind (formed, scale, fault, "
                                   "rollback, restart), with or without timings.", labels=["kind"])
    for kind, n in sorted(events.items()):
        f_events.add_metric([kind], n)
    latencies, outcomes = reclaim_series(session, now)
    for method in {m for m, _o in outcomes}:   # every outcome of a method seen, 0 when none
        for outcome in RECLAIM_OUTCOMES:
            outcomes[(method, outcome)] += 0
    f_reclaim = histogram("gpuflex_reclaim_latency_seconds", "Time from the probe that saw a GPU's owner "
                          "return to the GPU given back, per reclaim.", ["method"], latencies)
    f_reclaims = CounterMetricFamily("gpuflex_reclaims", "Reclaims by method and outcome "
                                     "(within_deadline, late, failed).", labels=["method", "outcome"])
    for (method, outcome), n in sorted(outcomes.items()):
        f_reclaims.add_metric([method, outcome], n)
    return [f_jobs, f_states, f_wait, f_run, f_world, f_rate, f_step, f_restarts, f_gpus, f_slots,
            f_probe_err, f_probe_at, *usage_families(session, now), f_phases, f_stall, f_events,
            f_reclaim, f_reclaims]


class _Snapshot(Collector):
    """The families of one run, for a private registry."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = list(items)

    def collect(self) -> Iterator[Any]:
        yield from self.items


def exposition(sessions: sessionmaker[Session], config: Config, progress: Mapping[int, Mapping[str, Any]],
               now: float | None = None) -> str:
    """The text exposition format (version 0.0.4) of every metric, via prometheus_client,
    read in one session of `sessions` (nothing is written)."""
    with sessions() as session:
        items = families(session, config, progress, now)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(items))
    return generate_latest(registry).decode("utf-8")
