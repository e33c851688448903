"""`gpuflex doctor [HOST...]`: is every host ready for a job? One table (or --json)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from gpuflex.cli.common import command, console, obj, print_json
from gpuflex.policy.doctor_facts import Finding, Verdict, exit_code


def run_doctor(config, hosts, pg_port=None):
    """gpuflex.control.doctor.run_doctor, imported when the command runs: it brings the
    transports and the database's modules, which no other command's start needs."""
    from gpuflex.control.doctor import run_doctor as run

    return run(config, hosts, pg_port=pg_port)


STYLES = {Verdict.OK: "green", Verdict.WARN: "yellow", Verdict.FAIL: "red", Verdict.SKIP: "dim"}


def register(root: typer.Typer) -> None:
    root.command()(doctor)


@command
def doctor(
    ctx: typer.Context,
    hosts: Optional[list[str]] = typer.Argument(None, help="Host names from gpuflex.toml (default: every host)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of {host, check, verdict, detail, fix}."),
    pg_port: Optional[int] = typer.Option(None, "--pg-port", min=1, max=65535,
                                          help="The port rank 0 serves the process-group check's store on "
                                               "(default: a free port there, as a job's is picked)."),
) -> None:
    """Check that every configured host (or those named) can run gpuflex's jobs.

    All hosts at once, each check bounded: SSH (reachable, host key pinned, login user),
    the host's python with gpuflex (the same version as here) and torch, nvidia-smi
    (the probe's queries, the configured GPUs, the driver) and CUDA as torch sees it,
    the workdir (writable, modes 0700/0600 kept) and its free disk, the clock against
    this machine's, and between each pair of hosts a 2-process all-reduce over gloo
    (and nccl where both see CUDA) on a port a job would use. A failure comes with its
    one-line fix.

    Exit 0 when no check failed (warnings allowed), 1 when one did, 2 for bad input.

    Example: gpuflex doctor gpu01 gpu02 --json
    """
    findings = run_doctor(obj(ctx).config(), hosts or None, pg_port=pg_port)
    if as_json:
        print_json([f.as_dict() for f in findings])
    else:
        render(findings)
    raise typer.Exit(exit_code(findings))


def render(findings: list[Finding]) -> None:
    t = Table(title="gpuflex doctor", title_justify="left")
    fixes = any(f.fix for f in findings)   # no empty column on a healthy pool
    for col in ("HOST", "CHECK", "VERDICT", "DETAIL") + (("FIX",) if fixes else ()):
        t.add_column(col, no_wrap=col in ("HOST", "CHECK", "VERDICT"))
    for f in findings:
        row = [f.host, f.check, Text(f.verdict.value, style=STYLES[f.verdict]), Text(f.detail)]
        t.add_row(*row, *((Text(f.fix or ""),) if fixes else ()))
    console.print(t)
    counts = {v: sum(f.verdict is v for f in findings) for v in Verdict}
    console.print(", ".join(f"{counts[v]} {v.value}" for v in Verdict))
