"""The `gpuflex` command line: thin typer commands over gpuflex.control.service.

Every error a user can cause reads the same: one `error: ...` line on stderr and exit 2.
gpuflex's own errors get there through `common.command`; the parser's (an unknown
option, a missing argument, a value that is not a number) would come as typer's
multi-line boxes, so the root group runs the parser in click's non-standalone mode and
prints them as that one line instead. Help (`--help`, or a group given no command)
prints as it always has.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn, Sequence

import typer
from typer.core import TyperGroup

from gpuflex.errors import INTERRUPTED_EXIT
from gpuflex.cli import (acct_cmd, common, db_cmd, doctor_cmd, fetch_cmd, harvest_cmd, hosts_cmd, jobs_cmd,
                         metrics_cmd, run_cmd, web_cmd)


class OneLineErrors(TyperGroup):
    """The root group: parser errors as one `error:` line (exit 2), the rest as typer does."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as e:   # click's ClickException family
            if not _is_help(e):
                common.print_error(_parser_message(e))
            code = getattr(e, "exit_code", 2)
            if not standalone_mode:
                raise
            sys.exit(code)
        except typer.Abort:   # EOF at a prompt
            common.print_error("aborted.")
            if not standalone_mode:
                raise
            sys.exit(1)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        """The root's options parsed; a Ctrl-C meanwhile is one line and exit 130 as in
        `invoke` (typer imports pydantic here, lazily, the first thing a command loads now
        that importing the CLI does not)."""
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            _interrupted()

    def invoke(self, ctx: Any) -> Any:
        """The command; a Ctrl-C during it is one line and exit 130 (typer would end it with
        130 and no word)."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _interrupted()


def _interrupted() -> NoReturn:
    common.err_console.print()   # closes the terminal's ^C echo
    common.print_error("interrupted.")
    raise typer.Exit(INTERRUPTED_EXIT) from None


def _is_help(e: Exception) -> bool:
    """click's NoArgsIsHelpError: a group run without a command, whose help typer has
    printed already (typer tells it by name too: the class is not public)."""
    return type(e).__name__ == "NoArgsIsHelpError"


def _parser_message(e: typer.TyperException) -> str:
    ctx = getattr(e, "ctx", None)
    message = e.format_message().strip().rstrip(".")
    if ctx is not None and ctx.command.get_help_option(ctx) is not None:
        return f"{message}. See '{ctx.command_path} --help'."
    return f"{message}."


app = typer.Typer(
    name="gpuflex",
    cls=OneLineErrors,
    help="Elastic training jobs on a lab's GPU servers.\n\nExample: gpuflex submit --workers 1:4 -- python train.py",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from gpuflex import __version__
        typer.echo(f"gpuflex {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    config: str = typer.Option(None, "--config", "-c", envvar="GPUFLEX_CONFIG",
                               help="Path to gpuflex.toml (else ./gpuflex.toml, ~/.config/gpuflex/gpuflex.toml, built-in)."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Log what gpuflex does and the errors it carries on from (to stderr)."),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print gpuflex's version and exit."),
) -> None:
    common.setup_logging(verbose)
    ctx.obj = common.Context(config_path=config, command=ctx.invoked_subcommand)


jobs_cmd.register(app)
hosts_cmd.register(app)
doctor_cmd.register(app)
harvest_cmd.register(app)
metrics_cmd.register(app)
run_cmd.register(app)
fetch_cmd.register(app)
acct_cmd.register(app)
web_cmd.register(app)
app.add_typer(db_cmd.app, name="db")


def _one_line_summaries(typer_app: typer.Typer) -> None:
    """Each command's line in `gpuflex --help`: its docstring's first paragraph on one line.
    typer keeps the docstring's own line breaks there, which broke the list mid-sentence."""
    for info in typer_app.registered_commands:
        doc = (info.help or getattr(info.callback, "__doc__", None) or "").strip()
        if info.short_help is None and doc:
            info.short_help = " ".join(doc.split("\n\n")[0].split())


_one_line_summaries(app)


def main() -> None:
    """The CLI (the console script enters through gpuflex.console): every usage error is
    one `error:` line and exit 2, a Ctrl-C one line and exit 130."""
    app(prog_name="gpuflex")
