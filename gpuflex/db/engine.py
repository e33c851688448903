"""Engine from a URL (SQLite or PostgreSQL), SQLite pragmas, and migrations applied under
the database's "migration" lock (gpuflex.db.locks).

Every failure to open the database is a DatabaseError (exit 2 in the CLI) whose hint says
what to fix: the URL, the file's place and modes, the server, or the driver (PostgreSQL
needs the extra `gpuflex[postgres]`, psycopg 3). Sessions from `open_database` check before
each commit that this process still holds the advisory locks it took (a server's lock
is lost with its connection), so nothing is committed by a command that lost its lock.
"""

from __future__ import annotations

import grp
import os
import re
import stat
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from gpuflex.db.locks import LOCK_SUFFIXES, database_lock, shared_directory, verify_held
from gpuflex.db.url import connect_args, shown, space_note, sqlite_path, where
from gpuflex.errors import DatabaseError
from gpuflex.hosts.private import private_dir, tighten_file

def migrations_dir() -> Path:
    """The Alembic scripts: `gpuflex/migrations` inside an installed wheel (mapped there from
    the repository's top-level `migrations/` at build time), else the repository's own."""
    inside = Path(__file__).resolve().parents[1] / "migrations"
    if (inside / "env.py").is_file():
        return inside
    return Path(__file__).resolve().parents[2] / "migrations"


MIGRATIONS_DIR = migrations_dir()
_HINT = "Set [database] url in gpuflex.toml to a writable SQLite file (sqlite:///path/gpuflex.db)."
_SERVER_HINT = ("Check [database] url in gpuflex.toml "
                "(postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE) and that the server is up.")
_DRIVER_HINT = "Install the PostgreSQL driver: pip install 'gpuflex[postgres]' (psycopg 3)."


def make_engine(url: str) -> Engine:
    """An engine for `url`; for SQLite the file is made private, or the group's in a shared
    directory (see `prepare_database`), and WAL + busy timeout set; for a server, a connect timeout and TCP keepalives.

    Raises DatabaseError when the URL is malformed, its driver is not installed, or the
    file cannot be created or opened. (A server is first reached by `upgrade`.)
    """
    try:
        path = sqlite_path(url)
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError) as e:
        raise DatabaseError(f"not a usable database URL {_masked(url)!r}: {e}.", hint=_HINT) from None
    if path is not None:
        prepare_database(path)
        check_writable(path)
        url = parsed.set(database=str(path)).render_as_string(hide_password=False)
    try:
        engine = sa.create_engine(url, connect_args=connect_args(parsed))
    except ImportError as e:
        # a dialect whose driver is not installed (psycopg without gpuflex[postgres])
        raise DatabaseError(f"cannot use the database URL {shown(url)!r}: the driver is not installed "
                            f"({e}).", hint=_DRIVER_HINT if parsed.get_backend_name() == "postgresql"
                            else _HINT) from None
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as e:   # an unknown dialect
        raise DatabaseError(f"cannot use the database URL {shown(url)!r}: {e}.", hint=_HINT) from None
    if path is not None:
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "handle_error", _sqlite_full)
    else:
        event.listen(engine, "handle_error", _server_lost)
        event.listen(engine, "handle_error", _server_out_of_resources)
    return engine


def _server_lost(context) -> None:
    """A server's connection lost in the middle of a command (it restarted, the network
    broke): one DatabaseError line instead of a traceback. The server rolls back the
    transaction it had open; one lost during its COMMIT may or may not have committed."""
    if context.is_disconnect and context.connection is not None and not context.is_pre_ping:
        detail = " ".join(str(context.original_exception).split()) or type(context.original_exception).__name__
        raise DatabaseError(f"lost the connection to the database {where(context.engine.url)} in the "
                            f"middle of the command: {detail}.",
                            hint="Check that the server is up, then run 'gpuflex status' to see what took effect.")


# SQLSTATE class 53, "insufficient resources": disk_full (53100, the server's disk filled
# during the command), out_of_memory, too_many_connections, ...
_SERVER_RESOURCES = "53"


def _server_out_of_resources(context) -> None:
    """A server that refused a statement for want of a resource (its disk full, above all):
    one DatabaseError line instead of a traceback, as SQLite's full disk gets. The server
    rolled back the statement's transaction: nothing of the change was committed."""
    state = getattr(context.original_exception, "sqlstate", None) or ""
    if state.startswith(_SERVER_RESOURCES):
        detail = " ".join(str(context.original_exception).split()) or type(context.original_exception).__name__
        raise DatabaseError(f"the database server {where(context.engine.url)} could not write: {detail} "
                            f"(SQLSTATE {state}); the change under way was not committed.",
                            hint="Free space (or the resource named) on the database server, then run the "
                                 "command again.")


_SQLITE_WRITE_FAILED = ("database or disk is full", "disk I/O error")


def _sqlite_full(context) -> None:
    """A SQLite write that failed for want of space (its disk filled during the command):
    one DatabaseError line instead of a traceback. SQLite rolls the statement back, and the
    session the transaction; the file stays whole."""
    detail = " ".join(str(context.original_exception).split())
    if any(m in detail for m in _SQLITE_WRITE_FAILED):
        path = Path(str(context.engine.url.database))
        raise DatabaseError(f"cannot write the database {path}: {detail}{space_note(path.parent)}; "
                            "the change under way was not committed.",
                            hint="Free space on that disk, then run the command again.")


def _masked(url: str) -> str:
    """A URL that does not parse, its password masked as well as can be told."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if at and ":" in creds:
        return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"
    return url


SHARED_FILE_MODE = 0o660


def prepare_database(path: Path) -> None:
    """The SQLite file at `path` made ready before its first open: the group's in a shared
    directory (`shared_directory`), else its owner's alone (`private_database`)."""
    if shared_directory(path.parent):
        shared_database(path)
    else:
        private_database(path)


def shared_database(path: Path) -> None:
    """The database and its lock files in a shared directory, read/write for the group
    (0660, whatever the umask): created so when missing, and ours that lack it (made by
    an older gpuflex, or while the directory was private) widened to it, never
    narrowed. SQLite gives its -wal, -shm and -journal files the database's mode, and
    the setgid directory gives every file its group. A file that is not there yet and
    cannot be created (a directory we may not write) is left to `check_writable`."""
    for suffix in ("", *LOCK_SUFFIXES):
        try:
            fd = os.open(f"{path}{suffix}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, SHARED_FILE_MODE)
        except OSError:
            continue
        try:
            os.fchmod(fd, SHARED_FILE_MODE)   # the umask took bits off
        finally:
            os.close(fd)
    for suffix in ("", "-wal", "-shm", "-journal", *LOCK_SUFFIXES):
        try:
            st = os.lstat(f"{path}{suffix}")
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() \
                    and stat.S_IMODE(st.st_mode) & SHARED_FILE_MODE != SHARED_FILE_MODE:
                os.chmod(f"{path}{suffix}", stat.S_IMODE(st.st_mode) | SHARED_FILE_MODE)
        except OSError:
            continue


def private_database(path: Path) -> None:
    """The SQLite file at `path`, its owner's alone: missing directories are created 0700,
    a missing file 0600 (SQLite gives its -wal and -shm files the file's mode), and our
    files left by an older gpuflex lose their group and other bits. A directory that
    exists is left as the user made it. (A database several users share lives in a
    shared directory: `shared_database`.)

    Raises DatabaseError when the directory or the file cannot be created.
    """
    try:
        private_dir(str(path.parent), claim=False)
    except (FileExistsError, NotADirectoryError):  # something on the way is a file
        raise DatabaseError(f"cannot create the database directory {path.parent}: "
                            f"a file of that name is in the way.", hint=_HINT) from None
    except PermissionError as e:
        if os.path.isdir(path.parent):   # (Path.is_dir raises EACCES on 3.11)
            return   # an existing directory we may not enter: said by check_writable
        raise DatabaseError(f"cannot create the database directory {path.parent}: {e.strerror or e}.",
                            hint=_HINT) from None
    except OSError as e:
        raise DatabaseError(f"cannot create the database directory {path.parent}: {e.strerror or e}.",
                            hint=_HINT) from None
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        pass
    except OSError:
        pass   # not writable: said below, in the words users know
    for suffix in ("", "-wal", "-shm", "-journal", *LOCK_SUFFIXES):
        try:
            tighten_file(f"{path}{suffix}")
        except OSError:
            pass


def check_writable(path: Path) -> None:
    """DatabaseError unless this user may write the database and its directory (SQLite
    creates -wal, -shm and lock files there), saying what to do: for a shared directory,
    join its group; for a file of another user's, ask them to open it to the group."""
    directory = path.parent
    if os.access(directory, os.W_OK | os.X_OK) and (not path.exists() or os.access(path, os.R_OK | os.W_OK)):
        return
    shared = shared_directory(directory)
    if shared and not os.access(directory, os.W_OK | os.X_OK):
        st = os.stat(directory)
        group = _group_name(st.st_gid)
        raise DatabaseError(f"permission denied on the database directory {directory} (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}, group {group}): ask the lab's admin to add you "
                            f"to the group {group} (then log in again), or set [database] url in gpuflex.toml "
                            f"to a database of your own.")
    if shared:
        raise DatabaseError(f"the database {path} is not writable by you: ask its owner to run "
                            f"'gpuflex db upgrade' (it opens the file to the group), or to run "
                            f"chmod g+rw {path}.")
    raise DatabaseError(f"the database {path} is not writable.", hint=_HINT)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def alembic_config(engine: Engine):
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision(engine: Engine) -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(engine)).get_current_head()


_REVISION_LINE = re.compile(r"^(down_revision|revision) = (?:'([0-9A-Za-z_]+)'|None)$", re.M)


def plain_head(directory: Path = MIGRATIONS_DIR) -> str | None:
    """The head revision, read from the scripts' `revision = '...'` and `down_revision =
    '...'` lines without importing Alembic (its import and the scripts' compilation
    took ~0.4 s of every command on a loaded host); None when some script does not
    have them in that plain form, or they do not make one chain: Alembic reads them."""
    revisions, parents = set(), set()
    for script in (directory / "versions").glob("*.py"):
        found = dict((key, value or None) for key, value in _REVISION_LINE.findall(script.read_text("utf-8")))
        if set(found) != {"revision", "down_revision"}:
            return None
        revisions.add(found["revision"])
        parents.add(found["down_revision"])
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 and len(parents) == len(revisions) else None


def stamped_revision(engine: Engine) -> str | None:
    """The revision the database records (Alembic's table, read with plain queries);
    None when it records none. Raises what the driver raises (sa.exc.DBAPIError)."""
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table("alembic_version"):
            return None
        rows = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
    return rows[0] if len(rows) == 1 else None


def upgrade(engine: Engine) -> bool:
    """Bring the schema to head. Returns True when a migration ran.

    A database at head is told without Alembic (`plain_head`, `stamped_revision`: every
    command opens the database). Otherwise the upgrade is taken under a file lock beside
    the database, and the revision is read again inside the lock, so concurrent first
    uses migrate once.
    """
    quick = plain_head()
    try:
        if quick is not None and stamped_revision(engine) == quick:
            return False
        if current_revision(engine) == head_revision(engine):
            return False
    except sa.exc.DBAPIError as e:  # unopenable, a file that is not a database, no server
        if "database is locked" not in str(e.orig):
            raise _unopenable(engine, e) from None
        # another process is creating or migrating it (SQLite answers a change of journal
        # mode during that at once, busy timeout or not): wait for it under the lock
    with database_lock(engine.url.render_as_string(hide_password=False), "migration").held():
        from alembic import command
        try:
            if current_revision(engine) == head_revision(engine):
                return False
        except sa.exc.DBAPIError as e:
            raise _unopenable(engine, e) from None
        migrating = _transactional_ddl(engine)
        try:
            command.upgrade(alembic_config(migrating), "head")
        finally:
            if migrating is not engine:
                migrating.dispose()
        return True


def _transactional_ddl(engine: Engine) -> Engine:
    """The engine an upgrade runs on: for SQLite one of its own whose transactions begin
    with an explicit BEGIN, so that the whole upgrade commits at once or not at all.
    Python's sqlite3 driver begins a transaction only before INSERT/UPDATE/DELETE and runs
    CREATE/ALTER/DROP in autocommit, so a first command interrupted while it created the
    database (Ctrl-C, SIGTERM) left half a schema that the next command could not migrate
    ('table hosts already exists'). SQLAlchemy's documented recipe for pysqlite; only
    here, not for the commands' sessions, whose locking it would change."""
    if engine.dialect.name != "sqlite":
        return engine   # PostgreSQL's DDL is transactional, and alembic runs it so
    migrating = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)
    event.listen(migrating, "connect", _migration_pragmas)
    event.listen(migrating, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return migrating


def _migration_pragmas(dbapi_conn, _record) -> None:
    """As `_sqlite_pragmas`, but foreign keys off: a batch migration rebuilds a table
    (a copy, DROP TABLE, a rename), and with them on, the DROP of `jobs` deleted every
    worker and event row through ON DELETE CASCADE (an upgrade from 0005 or older lost the
    whole history). SQLite's own procedure for a schema change: foreign keys off outside
    the transaction, `PRAGMA foreign_key_check` before the commit (migrations/env.py)."""
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=OFF")
    cur.close()
    dbapi_conn.isolation_level = None   # no implicit BEGIN/COMMIT: the "begin" event's BEGIN


def _unopenable(engine: Engine, e: sa.exc.DBAPIError) -> DatabaseError:
    detail = " ".join(str(e.orig).split()) or type(e.orig).__name__
    sqlite = engine.url.get_backend_name() == "sqlite"
    full = space_note(Path(str(engine.url.database)).parent) if sqlite else ""
    return DatabaseError(f"cannot open the database {where(engine.url)}: {detail}{full}.",
                         hint="Free space on that disk, then run the command again." if full
                         else _HINT if sqlite else _SERVER_HINT)


def open_database(url: str) -> sessionmaker[Session]:
    """Engine + schema at head + a session factory: the one entry point the service uses."""
    engine = make_engine(url)
    upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    event.listen(sessions, "before_commit", lambda _session: verify_held())
    return sessions
