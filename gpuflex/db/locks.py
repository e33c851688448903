"""One lock abstraction for everything that must not run twice at once against one database.

Three locks, chosen by purpose with `database_lock(url, purpose)`:
- "migration": `open_database` upgrades the schema under it (blocking), so concurrent
  first uses migrate once;
- "ops": every mutating command (placing, scaling, cancelling, a tick's actions) runs
  under it (blocking), so two commands never place the same job twice;
- "harvest": one harvest tick at a time; a second tick tries it without waiting and skips.

For SQLite the locks are files beside the database (`<db>.lock`, `<db>.ops.lock`,
`<db>.harvest.lock`), held with flock through the maintained `filelock` package: the
kernel drops them when a process dies, so a crashed command never leaves one held.
A database that is not a file has no lock yet for "migration" and "ops" (`NoLock`): a
server database would take an advisory lock (PostgreSQL's pg_advisory_lock) here, as one
more `Lock` chosen in `database_lock`. The harvest lock needs no database at all, so for
such a URL it is a file in the temp directory named after the URL.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

import filelock

from gpuflex.db.url import sqlite_path

_SUFFIX = {"migration": ".lock", "ops": ".ops.lock", "harvest": ".harvest.lock"}
LOCK_SUFFIXES = tuple(_SUFFIX.values())   # the files beside a SQLite database


class Lock(abc.ABC):
    """An exclusive lock shared by every process that uses one database.

    Not reentrant across `Lock` objects: take each lock once per process at a time."""

    @abc.abstractmethod
    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock; wait for it when `blocking`. True when taken, False when it is
        held elsewhere (only without `blocking`)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the lock back (taken by this object's `acquire`)."""

    def holder(self) -> str:
        """Who holds the lock, as well as can be told ("another process" when unknown)."""
        return "another process"

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The lock, waited for, for the length of a `with` block."""
        self.acquire()
        try:
            yield
        finally:
            self.release()


class FileLock(Lock):
    """flock on a file (through `filelock`); the holder writes "pid N, since HH:MM:SS"
    into it so that a process that finds it held can say by whom."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # a new filelock object per Lock (not a singleton): two Locks on one file exclude
        # each other even inside one process, as two processes do
        self._lock = filelock.FileLock(str(path), mode=0o600, is_singleton=False)

    def acquire(self, blocking: bool = True) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(blocking=blocking)
        except filelock.Timeout:
            return False
        self.path.write_text(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}")
        return True

    def release(self) -> None:
        self._lock.release()

    def holder(self) -> str:
        try:
            return self.path.read_text(errors="replace").strip()[:200] or super().holder()
        except OSError:
            return super().holder()


class NoLock(Lock):
    """No lock: a database for which no lock is implemented yet (see the module docstring)."""

    def acquire(self, blocking: bool = True) -> bool:
        return True

    def release(self) -> None:
        pass


def database_lock(url: str, purpose: str) -> Lock:
    """The lock for `purpose` ("migration", "ops" or "harvest") of the database at `url`."""
    suffix = _SUFFIX[purpose]
    path = sqlite_path(url)
    if path is not None:
        return FileLock(Path(str(path) + suffix))
    if purpose == "harvest":
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        return FileLock(Path(tempfile.gettempdir()) / f"gpuflex-harvest-{digest}.lock")
    return NoLock()
