"""Slurm's everyday verbs (issue 33): cancel (several ids, --user/--state/--name), hold,
release, update, requeue. Thin: gpuflex.control.service checks every job named before it
changes any (gpuflex.control.verbs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import typer

import gpuflex.cli.render as render
from gpuflex.cli.common import command, console, obj, parse_states
from gpuflex.control.requests import INT_MAX, parse_count, parse_ref
from gpuflex.errors import UsageError
from gpuflex.jobspec import parse_time

if TYPE_CHECKING:
    from gpuflex.control.service import JobService

_JOBS = "Job ids or names (several: 3 4 train); an array's id stands for its jobs not ended."


def register(app: typer.Typer) -> None:
    for fn in (cancel, hold, release, update, requeue):
        app.command()(fn)


def _refs(jobs: list[str]) -> list[str]:
    """Each reference checked (UnknownJobError for one that can be no job) before any
    database is opened."""
    for ref in jobs:
        parse_ref(ref)
    return list(dict.fromkeys(jobs))


def _print(lines: list[str]) -> None:
    for line in lines:
        console.print(line)


@command
def cancel(
    ctx: typer.Context,
    jobs: Optional[list[str]] = typer.Argument(None, metavar="JOB", help="Job ids or names (several: "
                                               "3 4 train). An array's id, or its name, cancels every job of "
                                               "the array not ended yet; ID_INDEX (5_3) that one job."),
    user: Optional[str] = typer.Option(None, "--user", help="Only this user's jobs (an admin's, for "
                                       "another user's; without it, filters select the caller's own jobs)."),
    state: Optional[list[str]] = typer.Option(None, "--state", help="Only jobs in this state (repeatable, or "
                                              "comma-separated): queued, running, scaling. E.g. --state queued."),
    name: Optional[str] = typer.Option(None, "--name", help="Only jobs of this name, e.g. --name train."),
) -> None:
    """Stop jobs (SIGTERM, then SIGKILL after the grace period) and free their GPUs.

    With filters and no JOB, every job of the caller (or --user) not ended that they keep; with
    JOB and filters, those of the named jobs they keep. Prints how many it cancels; a
    filter that matches nothing says so and exits 0, as scancel does. An unknown or ended
    job named, or one the caller may not change, cancels nothing (exit 2).

    Example: gpuflex cancel 3 4 train    gpuflex cancel --state queued --name sweep
    """
    refs = _refs(jobs or [])
    if not refs and user is None and not state and name is None:
        raise UsageError("give a JOB (id or name) or a filter: --user, --state or --name.",
                         hint="Example: gpuflex cancel 3, or gpuflex cancel --state queued.")
    states = parse_states(state) if state else None
    svc = obj(ctx).service()
    if user is not None:
        svc.check_owner_name(user)
    if len(refs) == 1 and user is None and states is None and name is None:
        _cancelled_one(svc, refs[0])
        return
    filters = " ".join(f"{o} {v}" for o, v in (("--user", user), ("--name", name)) if v is not None) + \
        "".join(f" --state {s.value}" for s in states or ())
    done = svc.cancel_many(refs, user, states, name)
    if not done:
        console.print(f"no job matches {filters.strip()}; nothing cancelled.")
        return
    console.print(f"cancelled {len(done)} job(s): {render.id_ranges([j.id for j in done])}")


def _cancelled_one(svc: JobService, ref: str) -> None:
    """One job (or one array) named: today's lines."""
    done = svc.cancel(ref)
    if len(done) == 1:
        console.print(f"job {done[0].id} cancelled")
    else:
        console.print(f"array {done[0].array_id}: cancelled {len(done)} job(s) "
                      f"({render.id_ranges([j.id for j in done])})")


@command
def hold(ctx: typer.Context, jobs: list[str] = typer.Argument(..., metavar="JOB", help=_JOBS)) -> None:
    """Keep queued jobs queued until 'gpuflex release'.

    The scheduler never starts a held job (`status` shows it "queued (held)", its JSON "held": true). A running job cannot be
    held ('gpuflex requeue --hold' stops it and holds it).

    Example: gpuflex hold 7 8
    """
    refs = _refs(jobs)
    _print(obj(ctx).service().hold(refs))


@command
def release(ctx: typer.Context, jobs: list[str] = typer.Argument(..., metavar="JOB", help=_JOBS)) -> None:
    """Let held jobs start again: they are placed as soon as they fit, in their turn.

    Example: gpuflex release 7 8
    """
    refs = _refs(jobs)
    _print(obj(ctx).service().release(refs))


@command
def update(
    ctx: typer.Context,
    jobs: list[str] = typer.Argument(..., metavar="JOB", help=_JOBS),
    time: Optional[str] = typer.Option(None, "--time", help="New time limit, spelt as submit's (90s, 30m, "
                                       "4h, 1-12:00:00). A queued job's, for each run; a running job's may only "
                                       "be lowered (its deadline moves earlier): each host keeps the deadline "
                                       "it started with. E.g. --time 2h."),
    priority: Optional[int] = typer.Option(None, "--priority", help="New priority (higher runs first): a "
                                           "queued job's place in the queue; a running one's matters when a "
                                           "higher-priority job looks for jobs to preempt. E.g. --priority 10."),
) -> None:
    """Change the time limit or priority of queued or running jobs.

    Example: gpuflex update 7 --time 2h --priority 10
    """
    refs = _refs(jobs)
    if time is None and priority is None:
        raise UsageError("give --time and/or --priority to change.", hint="Example: gpuflex update 7 --time 2h.")
    limit = parse_time(time) if time is not None else None
    if priority is not None:
        parse_count("--priority", priority, -INT_MAX, INT_MAX)
    _print(obj(ctx).service().update(refs, limit, priority))


@command
def requeue(
    ctx: typer.Context,
    jobs: list[str] = typer.Argument(..., metavar="JOB", help=_JOBS),
    hold_it: bool = typer.Option(False, "--hold", help="Hold it once requeued (Slurm's requeuehold): it "
                                 "starts after 'gpuflex release'."),
) -> None:
    """Stop running jobs as preemption does and queue them again.

    SIGTERM, the grace, a checkpoint at the step boundary; each starts again when it fits (from its checkpoint,
    for a gpuflex.elastic job). Only running jobs: an ended job is submitted again.

    Example: gpuflex requeue 7 --hold
    """
    refs = _refs(jobs)
    _print(obj(ctx).service().requeue(refs, hold_it))

