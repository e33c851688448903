"""What a database URL says about where its data lives (for the engine and the locks)."""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa

# libpq: give up on a server that does not answer within this, and find out a dead peer
# of an open connection (a held lock's, above all) within about a minute
CONNECT_TIMEOUT_S = 10
_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}


def sqlite_path(url: str) -> Path | None:
    """The file behind a sqlite URL (with ~ expanded), or None for other databases."""
    u = sa.engine.make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        return None
    return Path(os.path.expanduser(u.database))


def is_postgresql(url: str) -> bool:
    return sa.engine.make_url(url).get_backend_name() == "postgresql"


def shown(url: str | sa.engine.URL) -> str:
    """The URL as it may be printed: the password masked."""
    return sa.engine.make_url(url).render_as_string(hide_password=True)


def where(url: str | sa.engine.URL) -> str:
    """Where the data lives, for messages: the file, or HOST:PORT/DATABASE of a server."""
    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite":
        return str(u.database)
    host = u.host or u.query.get("host") or "localhost"
    return f"{host}{f':{u.port}' if u.port else ''}/{u.database or ''}"


def connect_args(url: str | sa.engine.URL) -> dict:
    """Driver arguments for every connection to `url`: SQLite's busy wait, a server's
    connect timeout and TCP keepalives (psycopg passes them to libpq)."""
    u = sa.engine.make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        return {"timeout": 30}
    if backend == "postgresql" and u.get_driver_name() == "psycopg":
        return {"connect_timeout": CONNECT_TIMEOUT_S, **_KEEPALIVES}
    return {}


FULL_BELOW_BYTES = 1 << 20   # less free than this: a write of a page or a WAL frame may well fail


def space_note(directory: Path) -> str:
    """" (the disk holding DIRECTORY is full: N KiB free)" when it is nearly full, else "":
    SQLite says "disk I/O error" where the cause is a full disk (it cannot create its WAL),
    so the messages name the cause they can tell."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f" (the disk holding {directory} is full: {free // 1024} KiB free)" if free < FULL_BELOW_BYTES else ""
