"""Engine from a URL, SQLite pragmas, and migrations applied under a file lock."""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from gpuflex.db.locks import LOCK_SUFFIXES, database_lock
from gpuflex.db.url import sqlite_path
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


def make_engine(url: str) -> Engine:
    """An engine for `url`; for SQLite the file is made private (see `private_database`)
    and WAL + busy timeout set.

    Raises DatabaseError when the file cannot be created or opened.
    """
    try:
        path = sqlite_path(url)
    except sa.exc.ArgumentError as e:
        raise DatabaseError(f"not a usable database URL {url!r}: {e}.", hint=_HINT) from None
    if path is not None:
        private_database(path)
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise DatabaseError(f"the database {path} is not writable.", hint=_HINT)
        url = sa.engine.make_url(url).set(database=str(path)).render_as_string(hide_password=False)
    try:
        engine = sa.create_engine(url, connect_args={"timeout": 30} if path else {})
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError) as e:
        # an unknown dialect, or a driver that is not installed
        shown = sa.engine.make_url(url).render_as_string(hide_password=True)
        raise DatabaseError(f"cannot use the database URL {shown!r}: {e}.", hint=_HINT) from None
    if path is not None:
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def private_database(path: Path) -> None:
    """The SQLite file at `path`, its owner's alone: missing directories are created 0700,
    a missing file 0600 (SQLite gives its -wal and -shm files the file's mode), and our
    files left by an older gpuflex lose their group and other bits. A directory that
    exists is left as the user made it. Several users sharing one database is not
    supported yet.

    Raises DatabaseError when the directory or the file cannot be created.
    """
    try:
        private_dir(str(path.parent), claim=False)
    except (FileExistsError, NotADirectoryError):  # something on the way is a file
        raise DatabaseError(f"cannot create the database directory {path.parent}: "
                            f"a file of that name is in the way.", hint=_HINT) from None
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


def upgrade(engine: Engine) -> bool:
    """Bring the schema to head. Returns True when a migration ran.

    Taken under a file lock beside the database, and the revision is read again inside
    the lock, so concurrent first uses migrate once.
    """
    from alembic import command

    head = head_revision(engine)
    try:
        if current_revision(engine) == head:
            return False
    except sa.exc.DatabaseError as e:  # unopenable, or a file that is not a database
        raise DatabaseError(f"cannot open the database {engine.url.database}: {e.orig}.",
                            hint=_HINT) from None
    with database_lock(str(engine.url), "migration").held():
        if current_revision(engine) == head:
            return False
        command.upgrade(alembic_config(engine), "head")
        return True


def open_database(url: str) -> sessionmaker[Session]:
    """Engine + schema at head + a session factory: the one entry point the service uses."""
    engine = make_engine(url)
    upgrade(engine)
    return sessionmaker(engine, expire_on_commit=False)
