"""The dashboard's pages as HTML text, from gpuflex.control.dashboard's records: plain
tables and gpuflex.web.svg's plots, one small style sheet inline, no script. Every value
from the database is escaped here (job names, messages and reasons are users' text).
"""

from __future__ import annotations

import time
from html import escape
from typing import Any, Iterable, Sequence

from gpuflex.control import dashboard
from gpuflex.control.views import JobInfo, Listing
from gpuflex.states import JobState
from gpuflex.web import svg

STYLE = """body{font-family:sans-serif;margin:1.2em;color:#222}nav a{margin-right:1em}
table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;
font-size:13px}th{background:#f0f2f5}.note{color:#666}.ranges a{margin-right:.6em}h2{margin-top:1.2em}"""


PHASES = ("detect", "agree", "rebuild", "copy", "verify", "first_step", "total")   # a resize's, as `events` prints them


def _clock(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _cell(v: Any) -> str:
    return "-" if v is None or v == "" else escape(str(v))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "") -> str:
    """An HTML table; a cell given as ("html", text) goes in unescaped (a link built here)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for r in rows:
        cells = "".join(f"<td>{c[1] if isinstance(c, tuple) else _cell(c)}</td>" for c in r)
        body.append(f"<tr>{cells}</tr>")
    return f'<table class="{cls}"><tr>{head}</tr>{"".join(body)}</table>'


def page(title: str, viewer: str, body: str) -> str:
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)} - gpuflex</title>'
            f'<style>{STYLE}</style></head><body><nav><a href="/">pool</a><a href="/queue">queue</a>'
            f'<a href="/acct">accounting</a><span class="note">viewing as {escape(viewer)}</span></nav>'
            f'<h1>{escape(title)}</h1>{body}</body></html>')


def _ranges(path: str, w: dashboard.Window) -> str:
    links = " ".join(f'<a href="{path}?range={r}">{r}</a>' for r in dashboard.RANGES)
    return (f'<p class="ranges">range: {links} <span class="note">shown: {escape(w.label)}; or '
            f'?since=2026-03-01&amp;until=2026-03-08 (as acct --since/--until)</span></p>')


def pool_page(data: dict[str, Any], viewer: str) -> str:
    w = data["window"]
    rows = []
    for h in data["hosts"]:
        for d in h["devices"]:
            util = "-" if d["utilization_pct"] is None else f'{d["utilization_pct"]:.0f}%'
            mem = "-" if d["memory_total_mib"] is None else f'{d["memory_used_mib"] or 0:.0f}/{d["memory_total_mib"]:.0f} MiB'
            state = "held" if d["job"] is not None else "free" if d["kind"] == "slot" else (d["verdict"] or "-")
            job = ("html", f'<a href="/jobs/{d["job"]}">{d["job"]}</a>') if d["job"] is not None else "-"
            rows.append((h["name"], h["owner"], "yes" if h["reachable"] else "no" if h["reachable"] is False else "?",
                         f'{d["kind"]} {d["index"]}', d["model"], util, mem, state, job, d["holder"]))
    hosts = table(("HOST", "OWNER", "REACHABLE", "DEVICE", "MODEL", "UTIL", "MEMORY", "STATE", "JOB", "HELD BY"),
                  rows, "hosts")
    errors = "".join(f'<p class="note">{escape(h["name"])}: {escape(h["error"])}</p>'
                     for h in data["hosts"] if h["error"])
    chart = svg.stacked_columns(data["timeline"], ("busy", "harvested", "idle"), marker="reclaimed",
                                label=f"pool utilization over {w.label}")
    return page("pool", viewer, f"<h2>hosts and devices now</h2>{hosts}{errors}"
                f"<h2>utilization of the {data['capacity']} devices</h2>{_ranges('/', w)}{chart}"
                '<p class="note">busy: held by gpuflex jobs on hosts without an owner; harvested: held on an '
                "owner's idle GPUs; reclaimed: the owner took GPUs back (count per column).</p>")


def reason(j: JobInfo) -> str:
    """The reason `status` gives in its NOTE column: why it waits, what it waits for, why
    it ended."""
    if j.held:
        return "held (gpuflex release)"
    if j.state is JobState.QUEUED:
        return j.queue_reason or ""
    if j.state.active and j.waiting:
        return "; ".join(f"waiting for {', '.join(map(str, w.get('for') or ()))}" +
                         (f" ({w['phase']})" if w.get("phase") else "") for w in j.waiting)
    return j.exit_reason or ""


def queue_page(shown: Listing, viewer: str) -> str:
    rows = [(("html", f'<a href="/jobs/{j.id}">{j.id}</a>'), j.name, j.user, j.state.value,
             f"{j.world_size} ({j.min_workers}:{j.max_workers})", j.priority, _clock(j.created_at), reason(j))
            for j in shown.jobs]
    older = f'<p class="note">{shown.older} older ended jobs not shown (gpuflex acct lists them).</p>' \
        if shown.older else ""
    return page("queue", viewer, table(("ID", "NAME", "USER", "STATE", "WORLD", "PRIORITY", "SUBMITTED", "REASON"),
                                       rows, "queue") + older)


def job_page(data: dict[str, Any], viewer: str) -> str:
    j: JobInfo = data["info"]
    facts = table(("STATE", "USER", "WORLD", "GENERATION", "SUBMITTED", "STARTED", "ENDED", "EXIT", "REASON"),
                  [(j.state.value, j.user, f"{j.world_size} ({j.min_workers}:{j.max_workers})", j.generation,
                    _clock(j.created_at), _clock(j.started_at), _clock(j.ended_at), j.exit_code, reason(j))], "facts")
    split = data["split"]
    workers = table(("RANK", "WID", "HOST", "DEVICES", "STATE", "GEN", "EXIT", "SHARE", "SAMPLES/S", "SPEED"),
                    [(w.rank, w.wid, w.host, ",".join(map(str, w.gpus)), w.state.value, w.generation, w.exit_code,
                      *_split_cells(split.get(w.wid) or {})) for w in j.workers], "workers")
    title = f"job {j.id} {j.name}"
    if not data["readable"]:
        return page(title, viewer, facts + "<h2>workers</h2>" + workers +
                    f'<p class="note">This is {escape(j.user)}\'s job: its history, output and environment are '
                    "its owner's and the admins' (as gpuflex events and gpuflex logs).</p>")
    marks = [(e.time, e.kind, e.message) for e in data["marks"]]
    chart = svg.step_line(data["world"], marks, label=f"world size of job {j.id}")
    events = table(("TIME", "KIND", "WHAT"), [(_clock(e.time), e.kind, e.message) for e in data["marks"]], "events")
    timings = table(("TIME", "KIND", *PHASES),
                    [(_clock(t["time"]), t["kind"], *(_ms(t["timings"].get(p)) for p in PHASES))
                     for t in data["timings"]], "timings")
    return page(title, viewer, facts + f"<h2>world size over time</h2>{chart}<h2>resizes and faults</h2>{events}"
                f"<h2>per-phase scale timings (ms)</h2>{timings}<h2>workers</h2>{workers}")


def _ms(v: Any) -> str:
    return f"{v * 1000:.0f}" if isinstance(v, (int, float)) else "-"


def _split_cells(s: dict[str, Any]) -> tuple[str, str, str]:
    share, rate, rel = s.get("share"), s.get("samples_per_s"), s.get("relative")
    return ("-" if share is None else str(share), "-" if rate is None else f"{rate:.1f}",
            "-" if rel is None else f"{rel:.2f}x")


def acct_page(data: dict[str, Any], viewer: str) -> str:
    w = data["window"]
    users, hosts = data["by_user"], data["by_host"]
    by_user = svg.hbars([(u["user"], u["gpu_hours"] + u["slot_hours"]) for u in users], unit="device-h",
                        label=f"device-hours per user, {w.label}")
    by_host = svg.hbars([(h["host"], h["device_hours"]) for h in hosts], unit="device-h",
                        label=f"device-hours per host, {w.label}")
    user_rows = [(u["user"], u["jobs"], f'{u["elapsed_s"] / 3600:.2f}', f'{u["gpu_hours"]:.3f}',
                  f'{u["harvested_gpu_hours"]:.3f}', f'{u["slot_hours"]:.3f}') for u in users]
    host_rows = [(h["host"], h["device"], h["jobs"], f'{h["device_hours"]:.3f}') for h in hosts]
    return page("accounting", viewer, _ranges("/acct", w) +
                f'<p class="note">{data["jobs"]} job{"" if data["jobs"] == 1 else "s"} ended in this range (as gpuflex acct --totals counts them: '
                "each job's whole device time, by its end).</p>"
                f"<h2>per user</h2>{by_user}" +
                table(("USER", "JOBS", "ELAPSED H", "GPU-H", "HARVESTED GPU-H", "SLOT-H"), user_rows, "by-user") +
                f"<h2>per host</h2>{by_host}" + table(("HOST", "DEVICE", "JOBS", "DEVICE-H"), host_rows, "by-host"))
