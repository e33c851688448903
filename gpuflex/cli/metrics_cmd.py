"""`gpuflex metrics`: Prometheus' text format on stdout, for node_exporter's textfile
collector, or (`--serve`) an HTTP endpoint for Prometheus to scrape."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any, Optional

import typer

from gpuflex.cli.common import command, err_console, obj
from gpuflex.errors import INTERRUPTED_EXIT, UsageError


def register(app: typer.Typer) -> None:
    app.command()(metrics)


class _Terminated(BaseException):
    """Raised by the SIGTERM handler in the main thread, which only sleeps while serving."""


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated


@command
def metrics(
    ctx: typer.Context,
    refresh: Optional[bool] = typer.Option(None, "--refresh/--no-refresh", help="Read reality first, as status "
                                           "does (the default of the printed form); --no-refresh only reads "
                                           "the database (a user who may read it but not change it). --serve "
                                           "never refreshes."),
    serve: bool = typer.Option(False, "--serve", help="Serve the metrics over HTTP until stopped (Ctrl-C or "
                               "SIGTERM), read from the database at each scrape, for a Prometheus to scrape "
                               "(examples/systemd/gpuflex-metrics.service). Example: gpuflex metrics --serve"),
    bind: Optional[str] = typer.Option(None, "--bind", metavar="ADDR:PORT", help="Where --serve listens "
                                       "(default 127.0.0.1:9464: loopback, since the series name users, jobs "
                                       "and hosts; bind another address only where your firewall or a proxy "
                                       "limits who reaches it). Example: --bind 0.0.0.0:9464"),
) -> None:
    """Print the pool's and the jobs' metrics in the Prometheus text exposition format, or
    serve them over HTTP (--serve).

    For node_exporter's textfile collector, from cron: examples/cron/gpuflex-metrics.crontab.

    Example: gpuflex metrics > gpuflex.prom.tmp && mv gpuflex.prom.tmp gpuflex.prom

    Example: gpuflex metrics --serve --bind 127.0.0.1:9464
    """
    if bind is not None and not serve:
        raise UsageError("--bind is where --serve listens: add --serve, or leave --bind out.")
    if serve and refresh:
        raise UsageError("--serve never refreshes (a scrape only reads the database); leave --refresh out "
                         "and run `gpuflex watch` beside it to keep the database fresh.")
    try:   # prometheus_client: only this command needs it (a GPU host's --no-deps install lacks it)
        from gpuflex.control.metrics import exposition
        if serve:
            from gpuflex.control import exporter
    except ImportError as e:
        raise UsageError(f"gpuflex metrics needs the {e.name} package, which is not installed; "
                         "pip install prometheus_client (a dependency of gpuflex on the control host).") from None
    if serve:
        exporter.parse_bind(bind or exporter.DEFAULT_BIND)   # bad text fails before the database is opened
        _serve(ctx, exporter, bind or exporter.DEFAULT_BIND)
        return
    svc = obj(ctx).service()
    if refresh is None or refresh:
        svc.refresh()
    sys.stdout.write(exposition(svc.sessions, svc.config, svc.progress))
    sys.stdout.flush()


def _serve(ctx: typer.Context, exporter: Any, bind: str) -> None:
    """Serve until SIGTERM (exit 0) or Ctrl-C (exit 130), one line each on stderr."""
    svc = obj(ctx).service()
    server, url = exporter.start(svc.sessions, svc.config, bind)
    old = signal.signal(signal.SIGTERM, _terminated)
    try:
        err_console.print(f"serving metrics on {url} (Ctrl-C or SIGTERM stops)")
        while True:   # the server runs on its own threads; this one only waits for a signal
            time.sleep(3600)
    except _Terminated:
        err_console.print("stopped (SIGTERM)")
    except KeyboardInterrupt:
        err_console.print("stopped (Ctrl-C)")
        raise typer.Exit(INTERRUPTED_EXIT) from None
    finally:
        signal.signal(signal.SIGTERM, old)
        server.shutdown()
        server.server_close()
