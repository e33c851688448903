"""`gpuflex fetch`: copy back what a job wrote on its hosts (issue 33; the work is
gpuflex.control.fetch's)."""

from __future__ import annotations

from typing import Optional

import typer

from gpuflex.cli.common import command, console, err_console, obj
from gpuflex.control.requests import parse_ref


def register(app: typer.Typer) -> None:
    app.command()(fetch)


@command
def fetch(
    ctx: typer.Context,
    job: str = typer.Argument(..., help="A job id or name."),
    path: str = typer.Argument(..., help="A file or directory, relative to the directory the job's workers ran "
                               "in on its host (with --sync, the sent copy of the working directory)."),
    host: Optional[str] = typer.Option(None, "--host", help="Only this host's copy (default: every host the job "
                                       "ran on), e.g. --host gpu2."),
    to: str = typer.Option(".", "--to", help="The local directory the copy goes into, e.g. --to results."),
) -> None:
    """Copy a file or directory a job wrote on its host back here: into DIR/NAME (NAME: the
    last part of PATH), or DIR/HOST/NAME for each host when the job ran on several and
    --host does not choose one. Links leaving the job's directory are never followed.

    Example: gpuflex fetch 3 out/model.pt --to results
    """
    parse_ref(job)
    from gpuflex.control import fetch as fetching   # transports and the ORM: loaded to run it

    fetching.check_path(path)   # bad input: refused before the database is read
    svc = obj(ctx).service()
    j = svc.job(job, events=False)
    for f in fetching.fetch(svc.config, svc.pool, j, path, host, to):
        if f.dest is None:
            err_console.print(f"note: {f.host}: {f.missing}", highlight=False)
            continue
        console.print(f"{f.host}: {f.files} file(s) to {f.dest}", highlight=False)
        for rel, why in f.skipped:
            err_console.print(f"note: {f.host}: left out {rel}: {why}", highlight=False)
