"""Job, worker and event rendering: JSON objects (the contract) and rich tables."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpuflex.jobspec import format_time
from gpuflex.states import JobState

if TYPE_CHECKING:   # views reads the database (SQLAlchemy): imported by the commands that do
    from gpuflex.control.views import EventInfo, JobInfo, Listing, WorkerInfo


def worker_json(w: WorkerInfo, progress: dict[str, Any] | None = None) -> dict[str, Any]:
    """A worker, with its share of the global batch, samples/s and speed relative to the
    fastest member from the coordinator's `progress` (null when unknown: issue 12)."""
    from gpuflex.control.views import worker_split

    return {"rank": w.rank, "wid": w.wid, "host": w.host, "gpus": list(w.gpus), "pid": w.pid,
            "state": w.state, "generation": w.generation, "exit_code": w.exit_code, "log": w.log_path,
            "control": w.control_path, **worker_split(progress, w.wid)}


def job_json(job: JobInfo, *, progress: dict[str, Any] | None = None,
             forming: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": job.id, "name": job.name, "state": job.state, "user": job.user,
        "owner": job.user,   # issue 14: who may cancel or scale it (with the admins); "user" kept
        "argv": list(job.argv), "workdir": job.workdir, "env": dict(job.env),
        "min_workers": job.min_workers, "max_workers": job.max_workers,
        "target_workers": job.target_workers, "world_size": job.world_size,
        "generation": job.generation, "gpus_per_worker": job.gpus_per_worker,
        "priority": job.priority, "harvest": job.harvest, "restarts": job.restarts,
        "queue_reason": job.queue_reason, "exit_code": job.exit_code, "exit_reason": job.exit_reason,
        "created_at": job.created_at, "started_at": job.started_at, "ended_at": job.ended_at,
        "step": (progress or job.progress_seen or {}).get("step"), "progress": progress,
        # issue 28: the step as the owner's last command read it (another user's job: the only one)
        "progress_seen": job.progress_seen,
        "workers": [worker_json(w, progress) for w in job.workers], "split": job.split,
        "retries": job.retries, "last_crash": job.last_crash, "waiting": [dict(w) for w in job.waiting],
        "forming": forming,   # the coordinator's {generation, since, waiting_for, phase}, or null
        "elastic": job.elastic, "time_limit_s": job.time_limit_s, "time_left_s": job.time_left_s,
        "after": list(job.after), "array_id": job.array_id, "array_index": job.array_index,
        "requeue": job.requeue, "checkpoint_dir": job.checkpoint_dir, "resume_from": job.resume_from,
        "sync": job.sync, "code_sha256": job.code_sha256,   # issue 33: --sync, the code's address
        "image": job.image,   # issue 33: --image, the container each worker runs in (null: none)
        "sources": job.sources,   # issue 33: setting -> command line, #GPUFLEX, #SBATCH, task file, default
        "held": job.held, "dependency": job.dependency,   # issue 33: hold/release; afterany/afternotok/singleton
        "kind": job.kind,   # issue 33: None (a batch job) or "interactive" (gpuflex run)
        # issue 33: the job's environment (each None when not given)
        "python": job.python, "venv": job.venv, "conda": job.conda, "env_setup": job.env_setup,
    }


def event_json(e: EventInfo) -> dict[str, Any]:
    return {"id": e.id, "job": e.job_id, "time": e.time, "kind": e.kind, "message": e.message,
            "data": e.data, "count": e.count, "last_time": e.last_time, "recorded_at": e.recorded_at}


def waiting_text(waiting: tuple[dict[str, Any], ...], now: float | None = None) -> str:
    """"waiting for worker 0 (boundary) 42 s": who the job's members wait for, per
    waited-for set, with the longest wait."""
    now = time.time() if now is None else now
    groups: dict[tuple, float | None] = {}
    for w in waiting:
        key = (tuple(w.get("for") or ()), w.get("phase") or "")
        since = w.get("since") if isinstance(w.get("since"), (int, float)) else None
        prev = groups.get(key)
        groups[key] = since if prev is None else min(prev, since if since is not None else prev)
    parts = []
    for (wids, phase), since in groups.items():
        who = f"worker {wids[0]}" if len(wids) == 1 else "workers " + ", ".join(map(str, wids))
        parts.append(f"waiting for {who}" + (f" ({phase})" if phase else "")
                     + (f" {max(0.0, now - since):.0f} s" if since is not None else ""))
    return "; ".join(parts)


def forming_text(forming: dict[str, Any] | None, now: float | None = None) -> str:
    """"forming generation 2 since 10:42:07 (12 s), waiting for worker 0 (joining)": the
    generation the coordinator is forming and who it still waits for; "" when none."""
    if not isinstance(forming, dict) or not isinstance(forming.get("generation"), int):
        return ""
    now = time.time() if now is None else now
    since = forming.get("since")
    text = f"forming generation {forming['generation']}"
    if isinstance(since, (int, float)):
        text += f" since {clock(since)} ({max(0.0, now - since):.0f} s)"
    wids = [w for w in forming.get("waiting_for") or () if isinstance(w, int)]
    if wids:
        text += ", waiting for " + (f"worker {wids[0]}" if len(wids) == 1 else "workers " + ", ".join(map(str, wids)))
    phase = forming.get("phase")
    text += f" ({phase})" if isinstance(phase, str) and phase else ""
    hint = forming.get("hint")   # an in-place job of a plain script (gpuflex.elastic.coordinator.forming)
    return text + (f"; {hint}" if isinstance(hint, str) and hint else "")


def restarts_text(job: JobInfo) -> str:
    """"restarts 1, --retries 2": empty for a job never restarted that allows no retries."""
    if not job.restarts and not job.retries:
        return ""
    return f"restarts {job.restarts}" + (f", --retries {job.retries}" if job.retries else "")


def ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0, time.time() - ts)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


_STATE_STYLE = {JobState.QUEUED: "yellow", JobState.RUNNING: "green", JobState.SCALING: "cyan",
                JobState.SUCCEEDED: "bold green", JobState.FAILED: "red", JobState.CANCELLED: "magenta",
                JobState.TIMEOUT: "red"}


def id_ranges(ids: list[int]) -> str:
    """[5, 6, 7, 9] -> "5-7,9"."""
    out: list[str] = []
    for i in sorted(ids):
        if out and out[-1].rsplit("-", 1)[-1] == str(i - 1):
            out[-1] = out[-1].split("-")[0] + f"-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def array_submitted(first: int, count: int, limit: int | None) -> str:
    """"array 5: jobs 5-20 (16 jobs, at most 4 running)": an array's jobs are numbered on
    from its first, which is the array's id."""
    return (f"array {first}: jobs {id_ranges(list(range(first, first + count)))} ({count} jobs"
            + (f", at most {limit} running)" if limit is not None else ")"))


def time_left_text(job: JobInfo) -> str:
    """"time left 00:12:03 of 01:00:00" for a running job with a limit; "" otherwise."""
    if job.time_left_s is None or job.time_limit_s is None:
        return ""
    return f"time left {format_time(job.time_left_s)} of {format_time(job.time_limit_s)}"


def array_summary(jobs: list[JobInfo], counts: dict[JobState, int] | None = None) -> str:
    """"16 jobs: 4 running, 10 queued, 2 succeeded" (states in their life's order): of
    `jobs`, or of the whole array's `counts` per state when given (a listing may show
    only some of its jobs)."""
    if counts is None:
        counts = {s: sum(1 for j in jobs if j.state is s) for s in JobState}
    return f"{sum(counts.values())} jobs: " + ", ".join(f"{counts[s]} {s}" for s in JobState if counts.get(s))


def listing(shown: Listing, progress: dict[int, dict[str, Any]]) -> Table | Group:
    """`status`'s table, then a line for the jobs it left out, if any: ended ones, or for a
    page of `status --all` the later pages'."""
    table = jobs_table(shown.jobs, progress, shown.arrays)
    if shown.next_cursor is not None:   # a page of `status --all`
        return Group(table, f"{shown.more} older job(s) not shown: add --cursor {shown.next_cursor} "
                     "for the next page")
    if not shown.older:
        return table
    return Group(table, f"{shown.older} older ended job(s) not shown: gpuflex status --all")


def jobs_table(jobs: list[JobInfo], progress: dict[int, dict[str, Any]],
               array_counts: dict[int, dict[JobState, int]] | None = None) -> Table:
    """One row per job; an array is one row (its id, counts per state: of `array_counts` when
    given, else of its jobs here) with its jobs under it, indented, each named NAME[INDEX]."""
    t = Table(title="gpuflex jobs", title_justify="left")
    for col in ("ID", "NAME", "STATE", "WORKERS", "GEN", "STEP", "LEFT", "OWNER", "AGE", "NOTE"):
        t.add_column(col, no_wrap=col != "NOTE")
    arrays: dict[int, list[JobInfo]] = {}
    for j in jobs:
        if j.array_id is not None:
            arrays.setdefault(j.array_id, []).append(j)
    for j in jobs:
        if j.array_id is None:
            _job_row(t, j, progress)
        elif j.array_id in arrays:
            members = arrays.pop(j.array_id)
            cap = f" (at most {members[0].array_limit} running)" if members[0].array_limit else ""
            summary = array_summary(members, (array_counts or {}).get(j.array_id))
            t.add_row(f"array {j.array_id}", j.name, summary + cap, "", "", "", "", j.user,
                      ago(min(m.created_at for m in members)), "")
            for m in members:
                _job_row(t, m, progress, indent=True)
    return t


def _job_row(t: Table, j: JobInfo, progress: dict[int, dict[str, Any]], indent: bool = False) -> None:
    note = j.queue_reason if j.state is JobState.QUEUED else (j.exit_reason or "").split("\n")[0]
    if j.waiting and j.state.active:
        note = waiting_text(j.waiting)
    if j.restarts and not j.state.final:
        note = f"restarts {j.restarts}" + (f"; {note}" if note else "")
    if j.kind is not None:   # a `gpuflex run` session: its owner is at a terminal
        note = j.kind + (f"; {note}" if note else "")
    step = (progress.get(j.id) or j.progress_seen or {}).get("step")
    left = format_time(j.time_left_s) if j.time_left_s is not None else "-"
    t.add_row(f"  {j.id}" if indent else str(j.id), f"{j.name}[{j.array_index}]" if indent else j.name,
              Text(f"{j.state} (held)" if j.held and j.state is JobState.QUEUED else str(j.state),
                   style=_STATE_STYLE.get(j.state, "")),
              f"{j.world_size}/{j.min_workers}:{j.max_workers}", str(j.generation),
              "-" if step is None else str(step), left, j.user, ago(j.created_at), note or "")


def workers_table(job: JobInfo, progress: dict[str, Any] | None = None) -> Table:
    """The job's workers; with SHARE, SAMPLES/S and SPEED (relative to the fastest member)
    once the coordinator's `progress` reports a split of the global batch (issue 12)."""
    from gpuflex.control.views import worker_split

    t = Table(title=f"workers of job {job.id}", title_justify="left")
    split = {w.wid: worker_split(progress, w.wid) for w in job.workers}
    shown = any(v is not None for row in split.values() for v in row.values())
    for col in ("RANK", "WID", "HOST", "DEVICES", "PID", "STATE", "GEN", "EXIT") + \
            (("SHARE", "SAMPLES/S", "SPEED") if shown else ()):
        t.add_column(col)
    for w in job.workers:
        t.add_row("-" if w.rank is None else str(w.rank), str(w.wid), w.host,
                  ",".join(map(str, w.gpus)), str(w.pid or "-"), str(w.state), str(w.generation),
                  "-" if w.exit_code is None else str(w.exit_code),
                  *(split_cells(split[w.wid]) if shown else ()))
    return t


def split_cells(split: dict[str, Any]) -> tuple[str, str, str]:
    """("43", "812.4", "0.33x"): a worker's share, samples/s and relative speed; "-" unknown."""
    from gpuflex.control.views import SPLIT_FIELDS

    share, rate, rel = (split.get(k) for k in SPLIT_FIELDS)
    return ("-" if share is None else str(share), "-" if rate is None else f"{rate:.1f}",
            "-" if rel is None else f"{rel:.2f}x")


def phases(data: dict[str, Any]) -> str:
    t = data.get("timings") or {}
    order = ("detect", "agree", "rebuild", "copy", "verify", "first_step", "total")
    return " ".join(f"{k}={t[k] * 1000:.0f}ms" for k in order if isinstance(t.get(k), (int, float)))


def events_table(job: JobInfo, events: list[EventInfo]) -> Table:
    t = Table(title=f"events of job {job.id}", title_justify="left")
    for col in ("TIME", "KIND", "WHAT", "PHASES"):
        t.add_column(col)
    for e in events:
        what = e.message
        if e.count > 1:
            what += f" (x{e.count}" + (f", last {clock(e.last_time)}" if e.last_time else "") + ")"
        t.add_row(clock(e.time) + f".{int(e.time % 1 * 1000):03d}", e.kind, what, phases(e.data))
    return t


def clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))
