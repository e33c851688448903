"""What every command shares: the context object, error handling, output helpers."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape

from gpuflex.errors import GpuflexError, UsageError
from gpuflex.states import JobState

if TYPE_CHECKING:   # imported when a command reads its config (pydantic) or opens the database
    from gpuflex.config import Config
    from gpuflex.control.service import JobService

PIPE_WIDTH = 10_000   # columns for output that goes to no terminal: wider than any row


class PipeConsole(Console):
    """A console whose output to a pipe or a file is as wide as its rows need.

    Rich sizes output to a terminal it finds on stdin, stdout or stderr, else 80 columns,
    even when its own output is piped: `gpuflex status | grep` or a script's capture got
    the table cut to that width, its columns shortened to "…". When the output is no
    terminal and COLUMNS is not set, it is PIPE_WIDTH wide: a table (never expanded) is as
    wide as its contents, every column whole. COLUMNS, when set, is still obeyed.
    """

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is None and not self.is_terminal and not self._environ.get("COLUMNS", "").isdigit():
            return ConsoleDimensions(PIPE_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


# markup off: job names, commands, messages and paths are the users' text, and "[/x]" in
# one of them must print as itself, not break every later `status` (our own styles are
# rich Text or an explicit markup=True over escaped text)
console = PipeConsole(highlight=False, soft_wrap=True, markup=False)
err_console = PipeConsole(stderr=True, highlight=False, soft_wrap=True, markup=False)


class _Stderr(logging.StreamHandler):
    """A handler that writes to sys.stderr as it is at each message (tests swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


_HANDLER = _Stderr()
_HANDLER.setFormatter(logging.Formatter("gpuflex: %(message)s"))


_QUIET = logging.NullHandler()


def setup_logging(verbose: bool) -> None:
    """The library logs to the "gpuflex" logger and chooses no handler; the CLI does: one
    line per message on stderr, warnings and worse unless --verbose (then debug too:
    transport errors that were skipped, failed pokes, ...). paramiko's own log (its
    transport thread logs a failed connection at ERROR with a traceback, one line each)
    is silent unless --verbose: gpuflex says what failed in its own line. Without a
    handler of its own, Python's last-resort handler printed that traceback on the
    terminal (seen in the multi-host soak, as an sshd went down mid-connect)."""
    logger = logging.getLogger("gpuflex")
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if _HANDLER not in logger.handlers:
        logger.addHandler(_HANDLER)
    ssh = logging.getLogger("paramiko")
    ssh.propagate = False
    for h in (_HANDLER, _QUIET):
        if h in ssh.handlers:
            ssh.removeHandler(h)
    ssh.addHandler(_HANDLER if verbose else _QUIET)


@dataclasses.dataclass
class Context:
    config_path: str | None = None
    command: str | None = None   # the subcommand: a database lock it holds is named by it
    _config: Config | None = None
    _service: JobService | None = None

    def config(self) -> Config:
        if self._config is None:
            from gpuflex.config import load_config   # not at import: `--help` needs no pydantic

            self._config = load_config(self.config_path)
        return self._config

    def service(self) -> JobService:
        if self._service is None:
            from gpuflex.control.service import JobService   # the ORM, only for commands that use it
            from gpuflex.db import locks

            if self.command:
                locks.ACTOR[:] = [self.command]   # locks.actor: "scale pid 12"
            self._service = JobService(self.config())
        return self._service

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
            from gpuflex.db import locks

            locks.ACTOR.clear()   # the command is over (one process may run several: tests)


def known_job(svc: JobService, job: str) -> None:
    """Fail on an unknown job before the refresh, so bad input changes nothing."""
    svc.job(job, events=False)


def one_line(text: str) -> str:
    """`text` as one printable line: newlines folded, bytes that are not UTF-8 (argv
    comes surrogate-escaped) shown as backslash escapes instead of failing the write."""
    flat = " ".join(text.split()) if "\n" in text or "\r" in text else text
    return flat.encode("utf-8", "backslashreplace").decode("utf-8")


def print_error(message: str) -> None:
    # escape: messages quote user values and name TOML tables ("[database] url")
    err_console.print(f"[red]error:[/red] {escape(one_line(message))}", markup=True)


def parse_states(values: list[str]) -> list[JobState]:
    """`--state` values (each may be a comma-separated list) as job states; UsageError
    naming the first that is none."""
    out = []
    for name in (n.strip() for v in values for n in v.split(",")):
        try:
            out.append(JobState(name))
        except ValueError:
            raise UsageError(f"--state {name!r}: give one of " + ", ".join(s.value for s in JobState) + ".") from None
    return out


def seconds(option: str, value: float, low: float, high: float | None = None) -> float:
    """`value` if it is a finite number of seconds in [low, high]; UsageError otherwise
    (typer's own `min=` lets nan through, and inf or 1e300 overflow time.sleep). A day is
    the longest wait a user may ask for, as for the config's settings (the default `high`)."""
    if high is None:
        from gpuflex.config import DAY_S   # here, not at import: `--help` needs no pydantic

        high = DAY_S
    if not math.isfinite(value) or not low <= value <= high:
        raise UsageError(f"{option} {value!r}: give seconds from {low:g} to {high:g}.")
    return value


def command(fn: Callable) -> Callable:
    """Turn gpuflex errors into one clean line and an exit code (2 bad input, 1 failed)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = kwargs.get("ctx")
        try:
            return fn(*args, **kwargs)
        except GpuflexError as e:
            print_error(str(e))
            raise typer.Exit(e.exit_code) from None
        finally:
            if ctx is not None and isinstance(ctx.obj, Context):
                ctx.obj.close()

    return wrapper


def obj(ctx: typer.Context) -> Context:
    return ctx.obj if isinstance(ctx.obj, Context) else Context()


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def stream_json(items: Iterable[Any], head: str = "[", tail: str = "]") -> None:
    """A JSON array written an item at a time, one per line, between `head` and `tail` (a
    listing of any length is never built whole; the document is whole once it ends)."""
    out = sys.stdout
    out.write(head)
    for i, item in enumerate(items):
        out.write(("," if i else "") + "\n  " + json.dumps(item, default=str))
    out.write("\n" + tail + "\n")


def check_page(limit: int, cursor: int | None) -> None:
    """UsageError for a page (`acct`, `status --all/--json`) of a size out of range or a
    cursor that no page printed."""
    from gpuflex.control.acct import MAX_LIMIT

    if not 0 <= limit <= MAX_LIMIT:
        raise UsageError(f"--limit {limit}: give 1 to {MAX_LIMIT} jobs per page, or 0 for every job (streamed).")
    if cursor is not None and cursor < 1:
        raise UsageError(f"--cursor {cursor}: give the job id a previous page ended at (1 or more).")


class _Woken(BaseException):
    """Raised by StopSignals' handler, only while the loop sleeps."""


class StopSignals:
    """Ctrl-C (and SIGTERM) for a command that loops: work, then sleep, then work again.

    A signal while the loop sleeps ends the sleep at once. One that comes during the work
    only marks the stop: the work (a DB transaction, a lock held inside SQLAlchemy or
    rich) finishes first. An exception raised at an arbitrary point in that work could
    leave a lock taken and hang the exit. A second signal during the work aborts it
    (KeyboardInterrupt), for work that does not finish.

        with StopSignals() as stop:
            while True:
                work()
                if stop.sleep(interval):
                    break
    """

    def __init__(self, notice: str | None = None,
                 signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.notice, self.signums = notice, signums
        self.requested = False
        self._sleeping = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        self._old = {s: signal.signal(s, self._handle) for s in self.signums}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._sleeping:
            raise _Woken
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.notice:
            err_console.print(self.notice)

    def sleep(self, seconds: float) -> bool:
        """Sleep unless a stop was asked for; True when one was (before or during the sleep)."""
        try:
            try:
                self._sleeping = True   # from here a signal raises _Woken
                if not self.requested:  # one that came just before is seen here
                    time.sleep(seconds)
            finally:
                self._sleeping = False
        except _Woken:
            self.requested = True
        return self.requested
