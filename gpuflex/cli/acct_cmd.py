"""`gpuflex acct`: the ended jobs' accounting rows (gpuflex.control.acct), a page at a time."""

from __future__ import annotations

import csv
import dataclasses
import sys
import time
from typing import Any, Iterable, Optional

import typer
from rich.table import Table

from gpuflex.cli.common import (check_page, command, console, err_console, obj, parse_states, print_json,
                                stream_json)
from gpuflex.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command()(acct)


def _clock(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts is not None else "-"


def _span(s: float | None) -> str:
    """Seconds as [D-]HH:MM:SS, Slurm's elapsed."""
    if s is None:
        return "-"
    s = int(round(s))
    days, s = divmod(s, 86400)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}-{text}" if days else text


def _device_time(r: dict[str, Any]) -> str:
    parts = [f"{r['gpu_hours']:.2f} GPU-h"] * bool(r["gpu_hours"]) + [f"{r['slot_hours']:.2f} slot-h"] * bool(r["slot_hours"])
    return ", ".join(parts) or "-"


def _table(rows: Iterable[dict[str, Any]]) -> int:
    t = Table(title_justify="left")
    for head in ("ID", "USER", "NAME", "STATE", "EXIT", "STARTED", "ENDED", "WAITED", "ELAPSED", "WORKERS",
                 "DEVICE TIME", "HARVESTED", "REASON"):
        t.add_column(head, no_wrap=head not in ("NAME", "REASON"))
    n = 0
    for r in rows:
        n += 1
        sizes = f"{r['world_size_min']}" if r["world_size_min"] == r["world_size_max"] \
            else f"{r['world_size_min']}-{r['world_size_max']}"
        t.add_row(str(r["id"]), r["user"], r["name"], r["state"], "-" if r["exit_code"] is None else str(r["exit_code"]),
                  _clock(r["started_at"]), _clock(r["ended_at"]), _span(r["wait_s"]), _span(r["elapsed_s"]), sizes,
                  _device_time(r), f"{r['harvested_gpu_hours']:.2f} GPU-h" if r["harvested_gpu_hours"] else "-",
                  r["exit_reason"] or "")
    if n:
        console.print(t)
    return n


def _csv_rows(rows: Iterable[dict[str, Any]]) -> None:
    from gpuflex.control.acct import FIELDS

    w = csv.DictWriter(sys.stdout, fieldnames=FIELDS, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r[k] is None else r[k] for k in FIELDS})


def _show_totals(data: dict[str, Any], as_json: bool, as_csv: bool) -> None:
    if as_json:
        print_json(data)
        return
    if as_csv:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(["by", "key", "jobs", "gpu_hours", "harvested_gpu_hours", "slot_hours", "device_hours"])
        for u in data["by_user"]:
            w.writerow(["user", u["user"], u["jobs"], u["gpu_hours"], u["harvested_gpu_hours"], u["slot_hours"], ""])
        for h in data["by_host"]:
            w.writerow(["host", h["host"], h["jobs"], "", "", "", h["device_hours"]])
        return
    if not data["jobs"]:
        console.print("no ended job matches", markup=False)
        return
    t = Table(title=f"by user ({data['jobs']} job(s))", title_justify="left")
    for head in ("USER", "JOBS", "ELAPSED", "GPU-HOURS", "HARVESTED", "SLOT-HOURS"):
        t.add_column(head, justify="left" if head == "USER" else "right")
    for u in data["by_user"]:
        t.add_row(u["user"], str(u["jobs"]), _span(u["elapsed_s"]), f"{u['gpu_hours']:.2f}",
                  f"{u['harvested_gpu_hours']:.2f}", f"{u['slot_hours']:.2f}")
    console.print(t)
    t = Table(title="by host", title_justify="left")
    for head in ("HOST", "JOBS", "DEVICE-HOURS"):
        t.add_column(head, justify="left" if head == "HOST" else "right")
    for h in data["by_host"]:
        t.add_row(h["host"], str(h["jobs"]), f"{h['device_hours']:.2f} {'GPU' if h['device'] == 'gpu' else 'slot'}-h")
    console.print(t)


@command
def acct(
    ctx: typer.Context,
    user: Optional[list[str]] = typer.Option(None, "--user", help="Only this user's jobs (repeatable, or "
                                             "comma-separated)."),
    mine: bool = typer.Option(False, "--mine", help="Only the jobs I submitted."),
    since: Optional[str] = typer.Option(None, "--since", help="Only jobs that ended at or after this: a "
                                        "duration back from now (24h, 7d) or an ISO date/time (2026-03-01)."),
    until: Optional[str] = typer.Option(None, "--until", help="Only jobs that ended at or before this "
                                        "(as --since)."),
    state: Optional[list[str]] = typer.Option(None, "--state", help="Only jobs that ended so (repeatable, or "
                                              "comma-separated): succeeded, failed, cancelled, timeout."),
    name: Optional[str] = typer.Option(None, "--name", help="Only jobs of this name."),
    limit: int = typer.Option(100, "--limit", help="Jobs per page, newest first (0: every job, streamed)."),
    cursor: Optional[int] = typer.Option(None, "--cursor", help="Start below this job id: the next page, "
                                         "as the previous one printed it."),
    totals: bool = typer.Option(False, "--totals", help="Print totals per user and per host over every "
                                "matching job instead of the rows."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV (one line per job)."),
) -> None:
    """Ended jobs, one row each (Slurm's sacct): owner, name, state, exit code and reason,
    start, end, wait, elapsed time, world size, and the device time its workers held (GPU-
    hours, CPU slot-hours on slot hosts, harvested GPU-hours on owned hosts).

    Example: gpuflex acct --since 7d --user alice --state failed; gpuflex acct --totals --since 2026-11-01 --until 2026-12-01
    """
    from gpuflex.control import access, acct as A
    from gpuflex.control.report import moment_since_1970

    if as_json and as_csv:
        raise UsageError("--json and --csv: choose one.")
    check_page(limit, cursor)
    if totals and (limit != 100 or cursor is not None):
        raise UsageError("--totals sums every matching job: give it without --limit and --cursor.")
    if mine and user:
        raise UsageError("give one of --user NAME and --mine.")
    now = time.time()
    f = A.Filter(since=moment_since_1970(since, "--since", now) if since is not None else None,
                 until=moment_since_1970(until, "--until", now) if until is not None else None,
                 states=tuple(parse_states(state)) if state else None, name=name)
    A.check_filter(f)
    svc = obj(ctx).service()
    if mine:
        f = dataclasses.replace(f, users=(access.caller(),))
    elif user:
        names = [n.strip() for v in user for n in v.split(",") if n.strip()]
        if not names:
            raise UsageError("--user: give a user name.")
        f = dataclasses.replace(f, users=tuple(svc.check_owner_name(n) for n in names))
    svc.refresh()
    if totals:
        _show_totals(A.totals(svc.acct_rows(f, world=False)), as_json, as_csv)
        return
    if limit == 0:
        rows = svc.acct_rows(f, cursor)
        if as_json:
            stream_json(rows, '{"jobs": [', '], "next_cursor": null}')   # written a row at a time
        elif as_csv:
            _csv_rows(rows)
        elif not _table(rows):
            console.print("no ended job matches", markup=False)
        return
    rows, following = svc.acct_page(f, limit, cursor)
    if as_json:
        print_json({"jobs": rows, "next_cursor": following})
        return
    if as_csv:
        _csv_rows(rows)
    elif not _table(rows):
        console.print("no ended job matches", markup=False)
    if following is not None:
        err_console.print(f"more: add --cursor {following} for the next page", markup=False)
