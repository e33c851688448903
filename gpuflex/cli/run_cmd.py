"""`gpuflex run`, an interactive session (issue 33, Slurm's `srun --pty`), and `gpuflex
alloc`, devices held (Slurm's `salloc`). Thin: the job is recorded by
gpuflex.control.interactive, the terminal kept by gpuflex.hosts.terminal."""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from typing import Optional

import typer

from gpuflex.cli.common import command, console, obj
from gpuflex.control.requests import MAX_GPUS_PER_WORKER, check_text, parse_count
from gpuflex.hosts import terminal
from gpuflex.jobspec import parse_time


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})(run)
    app.command()(alloc)


_GPUS_HELP = "GPUs (or CPU slots) to hold, e.g. --gpus 2."
_TIME_HELP = ("Time limit: 90s, 30m, 4h, 2d or 1-12:00:00 (a bare number is minutes); then SIGTERM, grace, "
              "SIGKILL, state timeout. E.g. --time 2h.")


@command
def run(
    ctx: typer.Context,
    cmd: Optional[list[str]] = typer.Argument(None, metavar="-- CMD ARGS...", help="The command to run on this "
                                              "terminal (default: $SHELL)."),
    gpus: int = typer.Option(1, "--gpus", help=_GPUS_HELP),
    time: Optional[str] = typer.Option(None, "--time", help=_TIME_HELP),
) -> None:
    """Run a command (default: your shell) in the foreground on devices of a host of the
    pool (local, or SSH: it runs there, in this directory's path, over the host's SSH
    connection), recorded as an interactive job of yours while it runs.

    It gets CUDA_VISIBLE_DEVICES (GPUFLEX_SLOTS on a CPU-slot host) and GPUFLEX_JOB_ID,
    and a terminal of its own when stdin is one. It counts toward your quota and fair
    share, is never preempted or harvested, and `gpuflex cancel` ends it. When it ends the
    devices are free and `run` exits with its exit code. A pool without the devices free
    now refuses it (exit 2, nothing recorded): it does not wait; submit a job to queue.

    Example: gpuflex run --gpus 1 --time 2h -- python    gpuflex run -- nvidia-smi
    """
    argv = list(cmd or []) or [os.environ.get("SHELL") or "/bin/sh"]
    for i, arg in enumerate(argv):
        check_text(f"the command's argument {i}", arg)
    parse_count("--gpus", gpus, 1, MAX_GPUS_PER_WORKER)
    limit = parse_time(time) if time is not None else None
    service = obj(ctx).service()
    host = service.session_host(gpus)
    use_pty = os.isatty(sys.stdin.fileno())
    if not host.is_local:
        raise typer.Exit(_run_remote(service, host, argv, gpus, limit, use_pty))
    held = terminal.fork_blocked(argv, use_pty=use_pty)
    try:
        session = service.open_session(argv, gpus, limit, held.pid, host.name)
    except BaseException:
        terminal.abort(held)
        raise
    terminal.go(held, session.env)
    rc, timed_out = terminal.attend(held, session.deadline, session.grace_s)
    terminal.write_exit(session.exit_path, rc, timed_out)
    service.refresh()
    raise typer.Exit(rc)


def _run_remote(service, host, argv: list[str], gpus: int, limit: float | None, use_pty: bool) -> int:
    """The session on an SSH host: its command started there under a supervisor
    (gpuflex.hosts.attach), which keeps the time limit and writes the exit record."""
    from gpuflex.hosts import remote_session   # paramiko, loaded only where SSH is used
    transport = service.pool.transport(host)
    held = remote_session.start(transport, os.getcwd(), argv, use_pty)
    try:
        session = service.open_session(argv, gpus, limit, held.pid, host.name)
    except BaseException:
        remote_session.abort(held)
        raise
    remote_session.go(held, session.env, session.exit_path, session.deadline, session.grace_s)
    rc = remote_session.attend(held, lambda signum: transport.signal([held.pid], signum))
    service.refresh()
    return rc


@command
def alloc(
    ctx: typer.Context,
    gpus: int = typer.Option(1, "--gpus", help=_GPUS_HELP),
    time: Optional[str] = typer.Option(None, "--time", help=_TIME_HELP),
) -> None:
    """Hold devices of a host of the pool (local or SSH) for your own use until --time or
    `gpuflex cancel JOB` (Slurm's salloc), recorded as a job of yours (kind alloc), and
    print how to use them (on an SSH host, the ssh command that reaches it too).

    Processes you start with the printed environment use the held devices (gpuflex does
    not track them). It counts toward your quota and fair share, is never preempted or
    harvested, and is refused (exit 2, nothing recorded) when the devices are not free now.

    Example: gpuflex alloc --gpus 2 --time 4h
    """
    parse_count("--gpus", gpus, 1, MAX_GPUS_PER_WORKER)
    limit = parse_time(time) if time is not None else None
    session = obj(ctx).service().open_alloc(gpus, limit)
    what = "slot(s)" if session.slots else "GPU(s)"
    until = f"until {datetime.datetime.fromtimestamp(session.deadline):%Y-%m-%d %H:%M:%S} or" \
        if session.deadline is not None else "until"
    console.print(f"job {session.job_id} holds {what} {','.join(map(str, session.devices))} on "
                  f"{session.host} {until} 'gpuflex cancel {session.job_id}'. To use them:", highlight=False,
                  soft_wrap=True)
    if session.login is not None:
        console.print(f"on {session.host}: {session.login}", highlight=False, soft_wrap=True)
    console.print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in session.env.items()),
                  highlight=False, soft_wrap=True)
