"""The CLI in this process (typer's CliRunner) with a test's home and config: for the
tests of one command's module, which start no process (tests/cli/test_cli.py runs the console
script too)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner, Result

from gpuflex.cli import app


def invoke(home: Path, config: Path, *args: str) -> Result:
    """`gpuflex ARGS` as the CLI runs it; an exception other than an exit is raised (it would
    be a traceback for a user)."""
    env = {"HOME": str(home), "GPUFLEX_CONFIG": str(config), "COLUMNS": "200"}
    r = CliRunner().invoke(app, list(args), env=env)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r
