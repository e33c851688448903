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
