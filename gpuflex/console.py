"""The console script's entry (`gpuflex`, `python -m gpuflex`): the CLI is imported here,
inside the handler, so a Ctrl-C while it still imports (~0.65 s of typer, rich, SQLAlchemy
and the commands) is the same one line and exit 130 as a Ctrl-C during a command
(gpuflex.cli.OneLineErrors), never a `KeyboardInterrupt` traceback. Nothing but the
standard library (and gpuflex.errors, which imports none) is imported before the
handler is in place."""

from __future__ import annotations

import signal
import sys
from typing import NoReturn

from gpuflex.errors import INTERRUPTED_EXIT   # no import beyond the standard library


def main() -> None:
    try:
        from gpuflex.cli import main as run_cli
        run_cli()
    except KeyboardInterrupt:
        interrupted()
    except Exception as e:
        if interrupt_inside(e):
            interrupted()
        raise


def interrupt_inside(e: BaseException | None) -> bool:
    """Whether `e` is a Ctrl-C in disguise: pydantic-core turns a KeyboardInterrupt raised
    while it builds a model's schema (the config's models, built as a command loads them)
    into a SchemaError that names it, chained or only in its text."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt) or (type(e).__name__ == "SchemaError" and "KeyboardInterrupt" in str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def interrupted() -> NoReturn:
    """One line and exit 130. A second Ctrl-C while it exits is ignored: the first one
    already said what happened. A transaction the interrupt cut short was rolled back by
    the `with` blocks it unwound."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stderr.write("\nerror: interrupted.\n")
        sys.stderr.flush()
    except (OSError, ValueError):   # stderr closed or gone: the exit code still says it
        pass
    sys.exit(INTERRUPTED_EXIT)
