"""gpuflex.db.url: what a database URL says about where its data lives (tests/db/test_engine_urls.py
holds how the engine resolves a SQLite URL's path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuflex.db.url import CONNECT_TIMEOUT_S, connect_args, is_postgresql, shown, space_note, sqlite_path, where


def test_a_sqlite_url_names_its_file_with_home_expanded(home):
    assert sqlite_path("sqlite:////srv/g.db") == Path("/srv/g.db")
    assert sqlite_path("sqlite+pysqlite:///~/g.db?timeout=5") == home / "g.db"


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "postgresql+psycopg://u@h/db"])
def test_a_database_without_a_file_has_no_path(url):
    assert sqlite_path(url) is None


def test_postgresql_is_told_by_the_backend_not_the_driver():
    assert is_postgresql("postgresql+psycopg://u@h/db") and is_postgresql("postgresql://h/db")
    assert not is_postgresql("sqlite:///g.db")


def test_a_shown_url_hides_its_password():
    assert shown("postgresql+psycopg://alice:s3cret@db.lab:5433/gpuflex") == \
        "postgresql+psycopg://alice:***@db.lab:5433/gpuflex"
    assert "s3cret" not in where("postgresql+psycopg://alice:s3cret@db.lab/gpuflex")


def test_where_names_the_file_or_the_server():
    assert where("sqlite:////srv/g.db") == "/srv/g.db"
    assert where("postgresql+psycopg://u@db.lab:5433/gpuflex") == "db.lab:5433/gpuflex"
    assert where("postgresql+psycopg:///gpuflex?host=/run/postgresql") == "/run/postgresql/gpuflex"
    assert where("postgresql+psycopg:///gpuflex") == "localhost/gpuflex"


def test_each_driver_gets_its_own_connect_arguments():
    assert connect_args("sqlite:///g.db") == {"timeout": 30}
    pg = connect_args("postgresql+psycopg://u@h/db")
    assert pg["connect_timeout"] == CONNECT_TIMEOUT_S and pg["keepalives"] == 1
    assert connect_args("postgresql+asyncpg://u@h/db") == {}


class _Vfs:
    def __init__(self, free_blocks: int) -> None:
        self.f_bavail, self.f_frsize = free_blocks, 4096


def test_a_nearly_full_disk_is_named_and_one_with_room_is_not(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "statvfs", lambda _p: _Vfs(3))
    assert space_note(tmp_path) == f" (the disk holding {tmp_path} is full: 12 KiB free)"
    monkeypatch.setattr(os, "statvfs", lambda _p: _Vfs(1 << 20))
    assert space_note(tmp_path) == ""


def test_a_directory_that_cannot_be_asked_gives_no_note(tmp_path):
    assert space_note(tmp_path / "missing") == ""
