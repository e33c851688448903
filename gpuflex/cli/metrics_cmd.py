"""`gpuflex metrics`: Prometheus' text format on stdout, for node_exporter's textfile collector."""

from __future__ import annotations

import sys

import typer

from gpuflex.cli.common import command, obj


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
    from gpuflex.control.metrics import exposition   # prometheus_client: only this command needs it

    svc = obj(ctx).service()
    if refresh:
        svc.refresh()
    sys.stdout.write(exposition(svc.sessions, svc.config, svc.progress))
    sys.stdout.flush()
