"""The exception family of the control side.

Only the CLI turns these into exit codes and messages: a `UsageError` (bad input,
bad config, unknown job) exits 2, any other `GpuflexError` exits 1.
"""

from __future__ import annotations

INTERRUPTED_EXIT = 130   # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


class GpuflexError(Exception):
    """An expected failure with a message fit for a user."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} {self.hint}" if self.hint else self.message


class UsageError(GpuflexError):
    """Bad input at the edge: nothing was changed."""

    exit_code = 2


class ConfigError(UsageError):
    """`gpuflex.toml` is unreadable or invalid; names the file, key and value."""

    def __init__(self, path: str, message: str, *, key: str | None = None) -> None:
        where = f"{path}: {key}: " if key else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.key = key


class UnknownJobError(UsageError):
    def __init__(self, job: str) -> None:
        super().__init__(f"no job {job!r}.", hint="Run 'gpuflex status' to list jobs.")
        self.job = job


class DatabaseError(UsageError):
    """The database cannot be opened or created where the config says."""


class IllegalTransition(GpuflexError):
    """A state machine was asked for a move its documentation does not allow."""

    def __init__(self, what: str, current: str, target: str) -> None:
        super().__init__(f"{what} cannot go from {current} to {target}.")
        self.current = current
        self.target = target


class TransportError(GpuflexError):
    """A command on a host could not be run (connection, timeout, host key)."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host


class CommandTimeout(TransportError):
    """A command on a host did not finish within its bound (`timeout_s` seconds)."""

    def __init__(self, host: str, message: str, timeout_s: float) -> None:
        super().__init__(host, message)
        self.timeout_s = timeout_s


class JobError(GpuflexError):
    """A job operation failed (scale refused, no worker answered, ...)."""
