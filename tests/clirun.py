"""The CLI in this process (typer's CliRunner): for the tests of one command's module, which
start no process (tests/cli/test_cli.py runs the console script too), and for the polls of
the end-to-end tests (tests/conftest.py, `GpuflexCLI.json`)."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import typer.testing
from typer.testing import CliRunner, Result

from gpuflex.cli import app

# typer's CliRunner builds the click command from the typer app at every invoke (~0.1 s of
# CPU here: each command's signature read back into click parameters), which the console
# script does once per process. Built once here, so an in-process call costs what the
# command costs: the end-to-end tests poll `status` this way every second or half second.
_build_command = typer.testing._get_command
_built: dict[int, object] = {}


def _command_built_once(typer_app):
    if id(typer_app) not in _built:
        _built[id(typer_app)] = _build_command(typer_app)
    return _built[id(typer_app)]


typer.testing._get_command = _command_built_once


def invoke(home: Path, config: Path, *args: str) -> Result:
    """`gpuflex ARGS` as the CLI runs it, with a test's home and config; an exception other
    than an exit is raised (it would be a traceback for a user)."""
    return run(args, {"HOME": str(home), "GPUFLEX_CONFIG": str(config), "COLUMNS": "200"})


def run(args: Sequence[str], env: Mapping[str, str], timeout_s: float | None = None) -> Result:
    """`gpuflex ARGS` with `env` set over this process's environment; an exception other
    than an exit is raised. `timeout_s`: after that long the call raises TimeoutError (as a
    console-script process run with a timeout would fail) instead of hanging the test on a
    lock or a host that never answers; main thread only (SIGALRM)."""
    with _alarm(timeout_s):
        r = CliRunner().invoke(app, list(args), env=dict(env))
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


@contextlib.contextmanager
def _alarm(timeout_s: float | None) -> Iterator[None]:
    if timeout_s is None:
        yield
        return

    def expire(*_: object) -> None:
        raise TimeoutError(f"the command did not end within {timeout_s:g} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
