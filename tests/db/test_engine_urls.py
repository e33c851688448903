"""make_engine keeps the driver and query of a SQLite URL while it resolves the file's path."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from gpuflex.db.engine import make_engine
from gpuflex.errors import DatabaseError


@pytest.mark.parametrize("url,driver,query", [
    ("sqlite+pysqlite:///{tmp}/x.db", "sqlite+pysqlite", {}),
    ("sqlite:///{tmp}/x.db?timeout=5", "sqlite", {"timeout": "5"}),
    ("sqlite+pysqlite:///{tmp}/x.db?uri=true", "sqlite+pysqlite", {"uri": "true"}),
], ids=["driver", "query", "driver-and-uri"])
def test_driver_and_query_survive(tmp_path, url, driver, query):
    engine = make_engine(url.format(tmp=tmp_path))
    assert engine.url.drivername == driver
    assert dict(engine.url.query) == query
    assert engine.url.database == str(tmp_path / "x.db")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    assert (tmp_path / "x.db").is_file()


def test_the_home_directory_is_expanded_beside_a_driver_and_query(home):
    engine = make_engine("sqlite+pysqlite:///~/sub/x.db?timeout=5")
    assert engine.url.drivername == "sqlite+pysqlite"
    assert dict(engine.url.query) == {"timeout": "5"}
    assert engine.url.database == str(home / "sub" / "x.db")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    assert (home / "sub" / "x.db").is_file()


def test_an_unknown_sqlite_driver_is_a_database_error(tmp_path):
    with pytest.raises(DatabaseError) as info:
        make_engine(f"sqlite+nosuchdriver:///{tmp_path}/x.db")
    assert "cannot use the database URL" in str(info.value)


def _handle(engine, exc) -> None:
    """SQLAlchemy's handle_error hook of `engine`, as a failed statement on it calls it."""
    from types import SimpleNamespace
    ctx = SimpleNamespace(original_exception=exc, engine=engine, is_disconnect=False, connection=None,
                          is_pre_ping=False)
    for listener in engine.dialect.dispatch.handle_error:
        listener(ctx)


def test_a_server_whose_disk_filled_is_one_database_error_line_not_a_traceback():
    """PostgreSQL's disk full (SQLSTATE 53100) in the middle of a command, as the multi-host
    soak found it: one DatabaseError naming the server and the cause; other errors pass."""
    errors = pytest.importorskip("psycopg.errors")
    engine = make_engine("postgresql+psycopg://u@127.0.0.1:5/gf")
    full = errors.DiskFull('could not extend file "base/16385/16403": No space left on device')
    with pytest.raises(DatabaseError) as e:
        _handle(engine, full)
    text = str(e.value)
    assert "\n" not in text and "127.0.0.1:5/gf" in text and "No space left on device" in text, text
    assert "53100" in text and "not committed" in text
    _handle(engine, errors.UniqueViolation("duplicate key"))   # not a resource: left to its caller
