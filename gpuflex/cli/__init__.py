"""The `gpuflex` command line: thin typer commands over gpuflex.control.service."""

from __future__ import annotations

import typer

from gpuflex.cli import common, db_cmd, harvest_cmd, hosts_cmd, jobs_cmd

app = typer.Typer(
    name="gpuflex",
    help="Elastic training jobs on a lab's GPU servers.\n\nExample: gpuflex submit --workers 1:4 -- python train.py",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    ctx: typer.Context,
    config: str = typer.Option(None, "--config", "-c", envvar="GPUFLEX_CONFIG",
                               help="Path to gpuflex.toml (else ./gpuflex.toml, ~/.config/gpuflex/gpuflex.toml, built-in)."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Log what gpuflex does and the errors it carries on from (to stderr)."),
) -> None:
    common.setup_logging(verbose)
    ctx.obj = common.Context(config_path=config)


jobs_cmd.register(app)
hosts_cmd.register(app)
harvest_cmd.register(app)
app.add_typer(db_cmd.app, name="db")


def main() -> None:
    """The console script: typer reports usage errors itself (exit 2)."""
    app(prog_name="gpuflex")
