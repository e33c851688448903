"""Harvest commands: `gpuflex harvest` (one tick), `gpuflex watch` (ticks in the
foreground) and `gpuflex report` (what harvesting gained)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

import typer
from rich.table import Table
from rich.text import Text

from gpuflex.cli.common import StopSignals, command, console, err_console, obj, print_json, seconds
from gpuflex.errors import INTERRUPTED_EXIT, GpuflexError, UsageError


MAX_TICKS = 1_000_000   # a typo of many digits is not a service that runs for ever


def register(app: typer.Typer) -> None:
    app.command()(harvest)
    app.command()(watch)
    app.command()(report)


# ---- rendering a tick ----------------------------------------------------------------
def _gpus(pairs) -> str:
    return ", ".join(f"{h}:{d}" for h, d in pairs)


def _plan_line(a: dict) -> str:
    kind = a["action"]
    if kind == "host-down":
        return f"host-down {a['host']}: {a['error']}"
    if kind == "yield":
        return f"yield     job {a['job']}: retire worker(s) {a['wids']} ({a['reason']})"
    if kind == "requeue":
        return f"requeue   job {a['job']}: checkpoint and queue ({a['reason']})"
    if kind == "place":
        return f"place     job {a['job']} on {_gpus((x['host'], ','.join(map(str, x['devices']))) for x in a['assignments'])}"
    return f"grow      job {a['job']}: +1 worker on {a['host']}:{','.join(map(str, a['devices']))}"


def _action_line(a: dict) -> str:
    kind, ok = a["action"], a.get("ok")
    if a.get("skipped"):
        return f"{kind}: skipped, {a['skipped']}"
    if kind == "reclaim":
        took = f"in {a['latency_s']:.2f} s" if a.get("latency_s") is not None else "FAILED"
        return (f"reclaim   {a['host']}:{a['gpu']} from job {a['job']} {took} "
                f"({a['method']}; deadline {a['deadline_s']:g} s)")
    if kind == "requeue":
        return f"requeue   job {a['job']}: {'queued' if ok else 'FAILED'} ({a['reason']})"
    if kind == "place":
        return f"place     job {a['job']} started on {_gpus(a['gpus']) or 'CPU slots'}"
    if kind == "grow":
        return (f"grow      job {a['job']} onto {_gpus(a['gpus'])}"
                + (f": workers {a['wids']}" if ok else f": FAILED: {a.get('error')}"))
    return f"{kind}     job {a.get('job')}: {'ok' if ok else 'FAILED: ' + str(a.get('error'))}"


def show_tick(result, as_json: bool, *, lines: bool = False) -> None:
    if as_json:
        data = result.to_json()
        if lines:
            sys.stdout.write(json.dumps(data, default=str) + "\n")
            sys.stdout.flush()
        else:
            print_json(data)
        return
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(result.started_at))
    if result.skipped:
        console.print(f"{stamp} harvest tick skipped: {result.skipped}", markup=False)
        return
    bad = [h for h, e in result.hosts.items() if e]
    console.print(f"{stamp} harvest tick{' (dry run: nothing done)' if result.dry_run else ''}: "
                  f"{len(result.hosts)} host(s) probed, {len(bad)} failed, {result.duration_s:.1f} s",
                  markup=False)
    for h in bad:
        err_console.print(Text(f"  {result.hosts[h]}", style="red"))
    entries = [_plan_line(a) for a in result.plan.to_json() if a["action"] != "host-down"] \
        if result.dry_run else [_action_line(a) for a in result.actions]
    for line in entries:
        console.print("  " + line, markup=False)
    if not entries:
        console.print("  nothing to do", markup=False)


def _user_table(data: dict, when: str) -> None:
    """GPU-hours (used, harvested) and slot-hours per user: the columns of the devices used."""
    rows = data["by_user"]
    if not rows:
        console.print(f"no GPU or CPU slot time used since {when}", markup=False)
        return
    gpus = any(r["gpu_hours"] for r in rows) or not any(r["slot_hours"] for r in rows)
    slots = any(r["slot_hours"] for r in rows)
    what = " and ".join(["GPU-hours"] * gpus + ["slot-hours"] * slots)
    t = Table(title=f"{what} by user since {when}", title_justify="left")
    cols = [("USER", "user")] + [("GPU-HOURS", "gpu_hours"), ("HARVESTED", "harvested_gpu_hours")] * gpus \
        + [("SLOT-HOURS", "slot_hours")] * slots
    for head, _ in cols:
        t.add_column(head, justify="left" if head == "USER" else "right")
    for r in rows:
        t.add_row(r["user"], *(f"{r[key]:.2f}" for _, key in cols[1:]))
    console.print(t)


# ---- commands ------------------------------------------------------------------------
@command
def harvest(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Probe and print the plan; change nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan and the actions taken as JSON."),
) -> None:
    """One harvest tick: probe all GPU hosts, yield GPUs whose owner is back, start queued
    jobs, grow --harvest jobs onto idle GPUs. Safe under cron: overlapping ticks skip.

    Exit 0 when the tick ran or was skipped (unreachable hosts are reported, not fatal), 1 when
    an action failed (a grow, or a reclaim that missed the deadline).

    Example: gpuflex harvest --dry-run
    """
    from gpuflex.control.harvest import run_tick

    result = run_tick(obj(ctx).service(), dry_run=dry_run)
    show_tick(result, as_json)
    if result.failed:
        raise typer.Exit(1)


@command
def watch(
    ctx: typer.Context,
    interval: Optional[str] = typer.Option(None, "--interval", help="Seconds between tick starts "
                                           "(30, 30s, 2m; default: interval_s of the harvest settings)."),
    ticks: Optional[int] = typer.Option(None, "--ticks", help="Stop after this many ticks (default: run until stopped)."),
    refresh: Optional[str] = typer.Option(None, "--refresh", help="Seconds between refreshes of the jobs "
                                          "between ticks (5, 5s, 1m; 0: only at ticks; default: refresh_s "
                                          "of the jobs settings)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per tick (JSON lines)."),
) -> None:
    """Run harvest ticks in the foreground, for a systemd service or a terminal.

    Between ticks the jobs are refreshed (as every command does first): ended runs noticed,
    restarts and requeues made, queued jobs that now fit started.

    Ctrl-C (or SIGTERM) lets the running tick finish, then stops; a second Ctrl-C aborts it.

    Example: gpuflex watch --interval 60 --refresh 5
    """
    from gpuflex.control.harvest import run_tick
    from gpuflex.control.report import parse_duration

    cfg = obj(ctx).config()
    every = seconds("--interval", parse_duration(interval, "--interval"), 0.0) if interval is not None \
        else cfg.harvest.interval_s
    if refresh is None:
        refresh_s = cfg.jobs.refresh_s
    else:
        refresh_s = 0.0 if refresh.strip() in ("0", "0s") else parse_duration(refresh, "--refresh")
        seconds("--refresh", refresh_s, 0.0)
    if ticks is not None and not 1 <= ticks <= MAX_TICKS:
        raise UsageError(f"--ticks {ticks}: must be 1 or more (at most {MAX_TICKS}).")
    svc = obj(ctx).service()
    done = 0
    with StopSignals(notice="stopping after this tick (Ctrl-C again to abort it)") as stop:
        try:
            while True:
                began = time.monotonic()
                try:
                    show_tick(run_tick(svc), as_json, lines=True)
                except GpuflexError as e:  # one bad tick (DB busy, ...) does not end the service
                    err_console.print(Text(f"error: {e}", style="red"))
                done += 1
                if ticks is not None and done >= ticks:
                    break
                if _refresh_until(svc, stop, began + every, refresh_s):
                    break
        except KeyboardInterrupt:
            err_console.print("aborted")
            raise typer.Exit(INTERRUPTED_EXIT)
    err_console.print(f"stopped after {done} tick(s)")


def _refresh_until(svc: Any, stop: StopSignals, deadline: float, every: float) -> bool:
    """Until `deadline` (time.monotonic()): the jobs refreshed every `every` seconds (0: not
    at all). True: told to stop. A refresh that fails is shown and the next one tried."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if every <= 0 or every >= left:
            return stop.sleep(left)
        if stop.sleep(every):
            return True
        try:
            svc.refresh()
        except GpuflexError as e:
            err_console.print(Text(f"error: {e}", style="red"))


@command
def report(
    ctx: typer.Context,
    since: str = typer.Option("7d", "--since", help="A duration back from now (24h, 7d) or an ISO "
                              "date/time (2026-03-01, 2026-03-01T08:00)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV: one line per host and job (per user "
                                "with --by user)."),
    by: str = typer.Option("host", "--by", help="host: harvested GPU-hours by host, owner and job; "
                           "user: GPU-hours used and harvested, and CPU slot-hours, per user (job owner)."),
) -> None:
    """GPU-hours harvested per host, owner and job; reclaims and their latencies (median, max).
    With --by user: GPU-hours used and harvested, and CPU slot-hours used, per user.

    Example: gpuflex report --since 24h --csv; gpuflex report --by user --since 30d
    """
    from gpuflex.control import report as R

    if as_json and as_csv:
        raise UsageError("--json and --csv: choose one.")
    if by not in ("host", "user"):
        raise UsageError(f"--by {by!r}: expected host or user.")
    start = R.parse_since(since)
    svc = obj(ctx).service()
    svc.refresh()
    data = svc.report(start)
    if as_json:
        print_json(data)
        return
    if as_csv:
        sys.stdout.write(R.to_csv(data, by))
        return
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(data["since"]))
    if by == "user":
        _user_table(data, when)
        return
    console.print(f"harvested since {when}: {data['gpu_hours']:.2f} GPU-hours on owners' idle GPUs",
                  markup=False)
    for title, rows, keys in () if not data["rows"] else (("by host", data["by_host"], ("host", "owner")),
                              ("by owner", data["by_owner"], ("owner",)),
                              ("by job", data["by_job"], ("job", "job_name"))):
        t = Table(title=title, title_justify="left")
        for k in (*keys, "GPU-hours"):
            t.add_column(k.upper())
        for r in rows:
            t.add_row(*(str(r[k]) for k in keys), f"{r['gpu_hours']:.2f}")
        console.print(t)
    rc = data["reclaims"]
    if rc["count"]:
        console.print(f"reclaims: {rc['count']} ({rc['within_deadline']} within the deadline, "
                      f"{rc['failed']} failed); latency median {rc['median_s']} s, max {rc['max_s']} s; "
                      + ", ".join(f"{k} {v}" for k, v in sorted(rc["by_method"].items())), markup=False)
    else:
        console.print("reclaims: none", markup=False)
