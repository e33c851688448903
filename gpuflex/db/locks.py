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

For PostgreSQL they are advisory locks (`AdvisoryLock`): pg_advisory_lock(NAMESPACE, key
of the purpose) taken on a connection of the lock's own, held open for the lock's life
("harvest" with pg_try_advisory_lock). Advisory locks belong to one database of the
server, so two gpuflex databases on one server never wait for each other, and the server
drops them when the connection ends, so a crashed command, or a control host that died,
never leaves one held. That cuts both ways: a held lock whose connection is lost is
no longer held, and another command may take it. So the holder must not commit as if it
still held it: `verify_held()` asks the server about every advisory lock this process
holds, and `gpuflex.db.engine` calls it before every commit (a lost lock rolls the
transaction back with a DatabaseError: nothing is changed).

Any other database gets no lock (`NoLock`) for "migration" and "ops", and a file in the
temp directory named after the URL for "harvest".
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import inspect
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import filelock
import sqlalchemy as sa

from gpuflex.db.url import connect_args, is_postgresql, sqlite_path, where
from gpuflex.errors import DatabaseError

log = logging.getLogger(__name__)

WAIT_NOTE_S = 10.0   # a wait for a lock longer than this is logged with who holds it
_SUFFIX = {"migration": ".lock", "ops": ".ops.lock", "harvest": ".harvest.lock"}
LOCK_SUFFIXES = tuple(_SUFFIX.values())   # the files beside a SQLite database
ACTOR: list[str] = []   # what this process is (the CLI sets its command: "scale"), in the holder's name


def actor() -> str:
    """This process's command and pid, as a lock's holder is named: "scale pid 12"."""
    return " ".join([*ACTOR[:1], f"pid {os.getpid()}"])


class Lock(abc.ABC):
    """An exclusive lock shared by every process that uses one database.

    Not reentrant across `Lock` objects: take each lock once per process at a time."""

    purpose = "database"   # "migration", "ops" or "harvest" where known: what a wait's note names

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
        """The lock, waited for, for the length of a `with` block. A wait longer than
        WAIT_NOTE_S is logged (a warning: stderr, for a command) with who holds the lock,
        so a command that seems stuck says what it waits for."""
        note = threading.Timer(WAIT_NOTE_S, self._note_wait)
        note.daemon = True
        note.start()
        try:
            self.acquire()
        finally:
            note.cancel()
        try:
            yield
        finally:
            self.release()

    def _note_wait(self) -> None:
        try:
            who = self.holder()
        except Exception:   # noqa: BLE001 (a note never fails the command that waits)
            who = "another process"
        log.warning("waiting %.0f s so far for the database's %s lock, held by %s", WAIT_NOTE_S, self.purpose, who)


def shared_directory(directory: Path) -> bool:
    """Whether `directory` is a lab's shared one: group-writable with the setgid bit (made
    with `install -d -m 2770 -g lab DIR`, so what is created in it belongs to the group)."""
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) and bool(mode & stat.S_ISGID) and bool(mode & stat.S_IWGRP)


_PRESERVE = "preserve_lock_file" in inspect.signature(filelock.FileLock.__init__).parameters


class FileLock(Lock):
    """flock on a file (through `filelock`); the holder writes "pid N, since HH:MM:SS"
    into it so that a process that finds it held can say by whom."""

    def __init__(self, path: Path, purpose: str | None = None) -> None:
        self.path = path
        self.purpose = purpose or self.purpose
        # a new filelock object per Lock (not a singleton): two Locks on one file exclude
        # each other even inside one process, as two processes do
        # and keep the file on release: filelock 4 unlinks it otherwise, so a waiter's
        # chmod or a lab's group mode (0660 in a shared directory) would race a new file
        shared = shared_directory(path.parent)
        keep = {"preserve_lock_file": True} if _PRESERVE else {}
        self._lock = filelock.FileLock(str(path), mode=0o660 if shared else 0o600, is_singleton=False, **keep)

    def acquire(self, blocking: bool = True) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(blocking=blocking)
        except filelock.Timeout:
            return False
        try:
            self.path.write_text(f"{actor()}, since {time.strftime('%H:%M:%S')}")
        except OSError:   # a full disk: the flock is the lock, the text only names its holder
            pass
        return True

    def release(self) -> None:
        self._lock.release()

    def holder(self) -> str:
        try:
            return self.path.read_text(errors="replace").strip()[:200] or super().holder()
        except OSError:
            return super().holder()


# pg_advisory_lock(int, int): the first key says "gpuflex", the second the purpose;
# both positive, so pg_locks shows them as they are (its classid/objid are unsigned)
NAMESPACE = int.from_bytes(b"gflx", "big") & 0x7FFFFFFF
_PURPOSE_KEY = {"migration": 1, "ops": 2, "harvest": 3}
_HELD: set["AdvisoryLock"] = set()   # this process's advisory locks now held (verify_held)
_MINE = ("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
         "AND pid = pg_backend_pid() AND database = (SELECT oid FROM pg_database "
         "WHERE datname = current_database()) AND classid = :ns AND objid = :key AND objsubid = 2)")
# state_change: when the holder's connection last went idle, i.e. when it got the lock
# (or last checked it, see verify_held)
_WHO = ("SELECT a.application_name, a.client_addr, coalesce(a.state_change, a.backend_start) FROM pg_locks l "
        "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND l.classid = :ns AND l.objid = :key AND l.objsubid = 2 LIMIT 1")


class AdvisoryLock(Lock):
    """A PostgreSQL advisory lock on a connection of its own (see the module docstring).

    Raises DatabaseError when the server cannot be reached or the connection fails while
    waiting."""

    def __init__(self, url: str, purpose: str) -> None:
        self.url = url
        self.purpose = purpose
        self.params = {"ns": NAMESPACE, "key": _PURPOSE_KEY[purpose]}
        self._conn: sa.engine.Connection | None = None

    def _connect(self) -> sa.engine.Connection:
        # the holder's name, for holder(): pg_stat_activity shows it to every user
        name = f"gpuflex {self.purpose} {actor()} on {socket.gethostname()}"[:63]
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool,
                                  connect_args={**connect_args(self.url), "application_name": name})
        try:
            return engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except BaseException:
            engine.dispose()
            raise

    def acquire(self, blocking: bool = True) -> bool:
        if self._conn is not None:
            raise RuntimeError(f"the {self.purpose} lock is already held by this object")
        try:
            conn = self._connect()
        except sa.exc.DBAPIError as e:
            raise _unreachable(self.url, e) from None
        try:
            if blocking:
                conn.execute(sa.text("SELECT pg_advisory_lock(:ns, :key)"), self.params)
            elif not conn.execute(sa.text("SELECT pg_try_advisory_lock(:ns, :key)"), self.params).scalar():
                _close(conn)
                return False
        except sa.exc.DBAPIError as e:
            _close(conn)
            raise _unreachable(self.url, e) from None
        self._conn = conn
        _HELD.add(self)
        return True

    def release(self) -> None:
        _HELD.discard(self)
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.execute(sa.text("SELECT pg_advisory_unlock(:ns, :key)"), self.params)
        except sa.exc.SQLAlchemyError:
            pass   # the connection is gone, and the server dropped the lock with it
        finally:
            _close(conn)

    def holds(self) -> bool:
        """Whether the server still counts the lock as this object's: False once its
        connection is lost (the server has dropped the lock then) or after `release`."""
        if self._conn is None:
            return False
        try:
            return bool(self._conn.execute(sa.text(_MINE), self.params).scalar())
        except sa.exc.SQLAlchemyError:   # lost now, or invalidated by an earlier loss
            return False

    def holder(self) -> str:
        try:
            conn = self._connect()
        except sa.exc.DBAPIError:
            return super().holder()
        try:
            row = conn.execute(sa.text(_WHO), self.params).first()
        except sa.exc.DBAPIError:
            row = None
        finally:
            _close(conn)
        if row is None:
            return super().holder()
        name, addr, since = row
        who = name.removeprefix("gpuflex ").removeprefix(f"{self.purpose} ") if name else "a session"
        who += f" ({addr})" if addr and not name else ""
        return f"{who}, since {since.astimezone().strftime('%H:%M:%S')}" if since else who


def _close(conn: sa.engine.Connection) -> None:
    conn.close()
    conn.engine.dispose()


def verify_held() -> None:
    """Raise DatabaseError when an advisory lock this process holds was lost with its
    connection (another command may hold it now); called before every commit."""
    for lock in list(_HELD):
        if not lock.holds():
            raise DatabaseError(
                f"lost the connection that held the database's {lock.purpose} lock "
                f"({where(lock.url)}); the change under way was not committed.",
                # a command of several committed steps (a grow, a harvest tick) keeps the steps
                # before: the next command's reconcile ends what they started
                hint="Once the server answers, run 'gpuflex status' to see what took effect, "
                     "then the command again if need be.")


def _unreachable(url: str, e: sa.exc.DBAPIError) -> DatabaseError:
    detail = " ".join(str(e.orig).split()) or type(e.orig).__name__
    return DatabaseError(f"cannot reach the database {where(url)}: {detail}.",
                         hint="Check [database] url in gpuflex.toml and that the server is up.")


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
        return FileLock(Path(str(path) + suffix), purpose)
    if is_postgresql(url):
        return AdvisoryLock(url, purpose)
    if purpose == "harvest":
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        return FileLock(Path(tempfile.gettempdir()) / f"gpuflex-harvest-{digest}.lock", purpose)
    return NoLock()
