"""`gpuflex status`: the jobs not ended and the newest ended ones, every job a page at a time
(`--all`; acct's keyset pages, gpuflex.control.views.paged), every job as a JSON array
written as it is read (`--json`), or one job with its workers and last events."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.text import Text

import gpuflex.cli.job_settings as job_settings
import gpuflex.cli.render as render
from gpuflex.cli.common import (StopSignals, check_page, command, console, err_console, known_job, obj, parse_states,
                                print_json, seconds, stream_json)
from gpuflex.control.requests import parse_ref
from gpuflex.errors import UsageError
from gpuflex.jobenv import JobEnv, describe
from gpuflex.states import JobState, WorkerState

ENDED_SHOWN = 20   # ended jobs `status` lists without --all: the newest
ALL_PAGE = 100   # jobs a page of `status --all` lists unless --limit says (acct's page too)


@command
def status(
    ctx: typer.Context,
    job: Optional[str] = typer.Argument(None, help="A job id or name; when left out, the jobs not ended "
                                        f"and the {ENDED_SHOWN} that ended last."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object, or an array of all jobs, "
                                 "filtered by --user, --mine and --state, written a job per line as it is "
                                 "read; --limit makes it a page)."),
    show_all: bool = typer.Option(False, "--all", help="List every job, ended ones too, a page at a time: "
                                  f"the newest {ALL_PAGE} (--limit), then a line that says how many are older "
                                  "and the --cursor of the next page."),
    limit: Optional[int] = typer.Option(None, "--limit", help=f"Jobs per page with --all (default {ALL_PAGE}) "
                                        "or --json (default: every job), the newest first; 0: every job. "
                                        "E.g. gpuflex status --json --limit 500."),
    cursor: Optional[int] = typer.Option(None, "--cursor", help="List the jobs below this id: the next page, "
                                         "as the previous one's last line gave it. E.g. gpuflex status --all "
                                         "--cursor 9901."),
    state: Optional[list[str]] = typer.Option(None, "--state", help="Only jobs in this state (repeatable, "
                                              "or comma-separated): " + ", ".join(s.value for s in JobState) + "."),
    watch: bool = typer.Option(False, "--watch", help="Refresh every --interval seconds until Ctrl-C "
                               "(with --json: one JSON document per line per refresh)."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between refreshes with --watch (0.2 to 86400)."),
    user: Optional[str] = typer.Option(None, "--user", help="Only the jobs this user submitted (their owner)."),
    mine: bool = typer.Option(False, "--mine", help="Only the jobs I submitted."),
) -> None:
    """Show the jobs not ended and the newest ended ones (--all: every job, a page at a time),
    or one job with its workers and last scale events.

    Example: gpuflex status 3 --json; gpuflex status --all --user alice --limit 50
    """
    seconds("--interval", interval, 0.2)
    if job is not None:
        parse_ref(job)
    if (job is not None) + (user is not None) + mine > 1:
        raise UsageError("give one of JOB, --user NAME and --mine.")
    if job is not None and (show_all or state or limit is not None or cursor is not None):
        raise UsageError("--all, --state, --limit and --cursor choose the jobs listed; give them without JOB.")
    if (limit is not None or cursor is not None) and not (show_all or as_json):
        raise UsageError("--limit and --cursor page 'status --all' and 'status --json': add one of them.")
    # JSON is for scripts: every job (the contract) unless --limit; a table is for people:
    # the jobs not ended and the newest ended ones, or with --all a page of every job
    page = (ALL_PAGE if show_all and not as_json else 0) if limit is None else limit
    check_page(page, cursor)
    states = parse_states(state) if state else None
    svc = obj(ctx).service()
    from gpuflex.control import access, throughput   # the models: loaded by the commands that read them

    owner = access.caller() if mine else svc.check_owner_name(user) if user is not None else None

    def as_json_row(j):
        return render.job_json(j, progress=svc.progress.get(j.id), forming=svc.forming.get(j.id))

    def snapshot():
        svc.refresh()
        if job is None:
            if as_json:
                with svc.paged(owner, states, page, cursor) as shown:
                    return [as_json_row(j) for j in shown.jobs]
            if show_all:
                return render.listing(svc.listing_page(owner, states, page, cursor), svc.progress)
            return render.listing(svc.listing(owner, states, ENDED_SHOWN), svc.progress)
        j = svc.job(job, events=False)   # the whole history is `gpuflex events`; status reads a few rows
        hosts = len({w.host for w in j.workers if w.state is WorkerState.RUNNING}) or 1
        scaling = throughput.scaling(svc.sessions, j.id, j.min_workers, j.max_workers, j.world_size or 0, hosts)
        if as_json:   # issue 32: "scaling" is added to the one job's object only
            return {**render.job_json(j, progress=svc.progress.get(j.id), forming=svc.forming.get(j.id)),
                    "scaling": scaling}
        head = Text.assemble(f"job {j.id} ", (j.name, "bold"), f" {j.state} world {j.world_size} "
                             f"({j.min_workers}:{j.max_workers}) generation {j.generation}")
        if j.array_id is not None:
            head += f" array {j.array_id}_{j.array_index}"
        if render.time_left_text(j):
            head += f" {render.time_left_text(j)}"
        prog = svc.progress.get(j.id)
        if prog:
            head += f" step {prog.get('step')} epoch {prog.get('epoch')}"
            if prog.get("samples_per_s"):
                head += f" {prog['samples_per_s']:.0f} samples/s"
        elif j.progress_seen and j.state.active:   # another user's job: its coordinator is theirs to ask
            seen = j.progress_seen
            head += f" step {seen.get('step')}" + (f" epoch {seen['epoch']}" if "epoch" in seen else "")
            head += f" ({render.ago(seen.get('at'))} ago, as {j.user}'s last command read it)"
        if render.restarts_text(j):
            head += f" {render.restarts_text(j)}"
        if j.waiting and j.state.active:
            head += f"\n{render.waiting_text(j.waiting)}"
        forming = render.forming_text(svc.forming.get(j.id))
        if forming and j.state.active:
            head += f"\n{forming}"
        if throughput.scaling_text(scaling):
            head += f"\n{throughput.scaling_text(scaling)}"
        if j.queue_reason and j.state is JobState.QUEUED:
            head += f"\n{j.queue_reason}"
        if job_settings.sources_text(j.sources):
            head += f"\nsettings: {job_settings.sources_text(j.sources)}; the rest default"
        if j.code_sha256:
            head += f"\ncode: {j.code_sha256[:12]} ({'--sync' if j.sync else 'hosts with sync = true'}, " \
                    f"in <workdir>/.gpuflex/code/{j.code_sha256[:12]}...)"
        if describe(JobEnv.of(j)):
            head += f"\nenvironment: {describe(JobEnv.of(j))}"
        if j.image:
            head += f"\nimage: {j.image} (each worker in a container)"
        if j.exit_reason:
            head += f"\n{j.exit_reason}"
        elif j.last_crash and not j.state.final:
            head += f"\nlast crash: worker {j.last_crash.get('wid')} on {j.last_crash.get('host')}: " \
                    f"{j.last_crash.get('error')}"
        return Group(head, render.workers_table(j, prog), render.events_table(j, list(j.recent)))

    if job is not None:
        known_job(svc, job)
    if not watch and as_json and job is None:
        svc.refresh()
        with svc.paged(owner, states, page, cursor) as shown:   # written as read, a chunk at a time
            stream_json(as_json_row(j) for j in shown.jobs)
        if shown.next_cursor is not None:   # stdout is the JSON document: the hint goes beside it
            err_console.print(f"{shown.more} older job(s) not shown: add --cursor {shown.next_cursor} "
                              "for the next page", markup=False)
        return
    if not watch:
        out = snapshot()
        print_json(out) if as_json else console.print(out)
        return
    with StopSignals() as stop:  # Ctrl-C ends the watch after the refresh under way
        if as_json:  # a live table cannot show JSON: one document per line, per refresh
            while True:
                sys.stdout.write(json.dumps(snapshot(), default=str) + "\n")
                sys.stdout.flush()
                if stop.sleep(interval):
                    return
        with Live(snapshot(), console=console, auto_refresh=False) as live:
            while not stop.sleep(interval):
                live.update(snapshot(), refresh=True)
