"""`gpuflex metrics`: Prometheus' text format on stdout, for node_exporter's textfile collector."""

from __future__ import annotations

import sys

import typer

from gpuflex.cli.common import command, obj
from gpuflex.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command()(metrics)


@command
def metrics(
    ctx: typer.Context,
    refresh: bool = typer.Option(True, "--refresh/--no-refresh", help="Read reality first, as status does "
                                 "(the default); --no-refresh only reads the database (a user who may "
                                 "read it but not change it)."),
) -> None:
    """Print the pool's and the jobs' metrics in the Prometheus text exposition format.

    For node_exporter's textfile collector, from cron: examples/cron/gpuflex-metrics.crontab.

    Example: gpuflex metrics > gpuflex.prom.tmp && mv gpuflex.prom.tmp gpuflex.prom
    """
    try:   # prometheus_client: only this command needs it (a GPU host's --no-deps install lacks it)
        from gpuflex.control.metrics import exposition
    except ImportError as e:
        raise UsageError(f"gpuflex metrics needs the {e.name} package, which is not installed; "
                         "pip install prometheus_client (a dependency of gpuflex on the control host).") from None
    svc = obj(ctx).service()
    if refresh:
        svc.refresh()
    sys.stdout.write(exposition(svc.sessions, svc.config, svc.progress))
    sys.stdout.flush()
