"""The console script's entry (`gpuflex`, `python -m gpuflex`): the CLI is imported here,
inside the handler, so a Ctrl-C while it still imports (~0.65 s of typer, rich, SQLAlchemy
and the commands) is the same one line and exit 130 as a Ctrl-C during a command
(gpuflex.cli.OneLineErrors), never a `KeyboardInterrupt` traceback. Nothing but the
standard library (and gpuflex.errors, which imports none) is imported before the
handler is in place."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable, NoReturn

from gpuflex.errors import INTERRUPTED_EXIT   # no import beyond the standard library

RESEND_S = 0.01   # a Ctrl-C Python could not raise is sent again this long after (interrupt_again)


def main() -> None:
    sys.unraisablehook = interrupt_again(sys.unraisablehook)
    try:
        from gpuflex.cli import main as run_cli
        run_cli()
    except KeyboardInterrupt:
        interrupted()
    except SystemExit:   # the command is over (click exits with its code): see `finished`
        finished()
        raise
    except Exception as e:
        if interrupt_inside(e):
            interrupted()
        raise
    finished()


def interrupt_again(default: Callable[[Any], object]) -> Callable[[Any], object]:
    """An unraisable-exception hook that sends a Ctrl-C again. One that lands in a callback
    Python cannot raise from (a weakref's, run by the garbage collector in the middle of an
    import) was printed as "Exception ignored ... KeyboardInterrupt" with its traceback, and
    lost: the command went on. Sent again, it lands in ordinary code: one line, exit 130.
    It is sent from a timer thread to the main thread, after the hook has returned: sent
    from the hook itself (`signal.raise_signal`), Python ran the handler at once, inside the
    hook, and printed "Exception ignored in sys.unraisablehook" with a traceback instead. One
    that lands in such a callback again is sent again."""
    def hook(unraisable: Any) -> object:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            send_sigint_later(RESEND_S)
            return None
        return default(unraisable)
    return hook


def send_sigint_later(delay: float) -> None:
    """SIGINT to the main thread in `delay` seconds (a blocking call there is woken as by a
    real Ctrl-C); ignored once the command is `finished`. The timer is a daemon thread: it
    never holds the process open."""
    main_thread = threading.main_thread().ident
    assert main_thread is not None

    def send() -> None:
        try:
            signal.pthread_kill(main_thread, signal.SIGINT)
        except OSError:   # the process is ending: nothing left to interrupt, and no traceback
            pass

    timer = threading.Timer(delay, send)
    timer.daemon = True
    timer.start()


def finished() -> None:
    """The command is done and its exit code decided: a Ctrl-C from now on is ignored. A
    SIGINT in the process's last moments (the exit unwinding, the interpreter's shutdown)
    otherwise raised KeyboardInterrupt where nothing catches it, and Python then ends itself
    by SIGINT: no line, and exit status -2 instead of the command's (3 in 60 runs of
    `status` with a Ctrl-C near their end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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
