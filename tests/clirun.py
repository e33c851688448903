"""The CLI in this process (typer's CliRunner): for the tests of one command's module, which
start no process (tests/cli/test_cli.py runs the console script too), and for the polls of
the end-to-end tests (tests/conftest.py, `GpuflexCLI.json`)."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import typer.main
import typer.testing
from typer.testing import CliRunner, Result

from gpuflex.cli import app


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


def _shape(typer_app: typer.Typer) -> tuple:
    """What typer builds a click command from: the app's callback, its commands' names and
    functions, and its groups', recursively."""
    callback = typer_app.registered_callback.callback if typer_app.registered_callback else None
    return (callback, tuple((c.name, c.callback) for c in typer_app.registered_commands),
            tuple((g.name, _shape(g.typer_instance)) for g in typer_app.registered_groups if g.typer_instance))


_built: dict[int, tuple[tuple, object]] = {}


def built_command(typer_app: typer.Typer):
    """typer.main.get_command, once per app: CliRunner.invoke built the whole click tree from
    the functions' signatures at every call (~0.1 s of CPU here, a third of an in-process
    `gpuflex status`), where the console script builds it once per process. A click command
    holds no state between calls; an app whose commands changed is built again."""
    shape = _shape(typer_app)
    cached = _built.get(id(typer_app))
    if cached is None or cached[0] != shape:
        cached = _built[id(typer_app)] = (shape, typer.main.get_command(typer_app))
    return cached[1]
