"""The job DB: migrations give exactly the models' schema, WAL, and one upgrade under a lock."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from tests.conftest import db_rows
from gpuflex.db.engine import (current_revision, head_revision, make_engine, open_database, plain_head,
                               stamped_revision, upgrade)
from gpuflex.db.models import Base, Host, Job
from gpuflex.errors import DatabaseError


def _url(path) -> str:
    return f"sqlite:///{path}"


def test_migrations_give_exactly_the_models_schema(tmp_path):
    engine = make_engine(_url(tmp_path / "g.db"))
    assert upgrade(engine) is True
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True,
                                                     "compare_server_default": True})
        diffs = compare_metadata(ctx, Base.metadata)
        tables = set(sa.inspect(conn).get_table_names())
    assert diffs == []
    assert tables == set(Base.metadata.tables) | {"alembic_version"}


def test_head_is_recorded_once_and_a_second_upgrade_does_nothing(tmp_path):
    engine = make_engine(_url(tmp_path / "g.db"))
    assert current_revision(engine) is None
    assert upgrade(engine) is True
    assert current_revision(engine) == head_revision(engine)
    assert upgrade(engine) is False
    assert db_rows(tmp_path / "g.db", "SELECT version_num FROM alembic_version") == [
        (head_revision(engine),)]


def test_the_test_sessions_template_gives_exactly_the_migrated_database(tmp_path, monkeypatch):
    """tests/schema_template.py: outside this folder a test's new database gets a replay of
    a template migrated once per session; it must be the database the migrations give,
    object for object (SQLite's own indexes and sequence table included) and row for row."""
    from alembic import command

    from tests.schema_template import Template

    def everything(engine) -> tuple:
        with engine.connect() as conn:
            objects = conn.exec_driver_sql("SELECT type, name, tbl_name, sql FROM sqlite_master "
                                           "ORDER BY type, name").all()
            tables = [name for kind, name, _, _ in objects if kind == "table"]
            return objects, {t: conn.exec_driver_sql(f'SELECT * FROM "{t}"').all() for t in tables}

    migrated = make_engine(_url(tmp_path / "migrated.db"))
    assert upgrade(migrated) is True
    (tmp_path / "template").mkdir()
    template = Template(command.upgrade, tmp_path / "template")
    monkeypatch.setattr(command, "upgrade", template.upgrade)
    replayed = make_engine(_url(tmp_path / "replayed.db"))
    assert upgrade(replayed) is True
    assert "schema" in vars(template)   # the replay, not the real scripts, made it
    assert upgrade(replayed) is False
    assert everything(replayed) == everything(migrated)
    assert len(everything(migrated)[0]) > 10


def test_the_head_read_without_alembic_is_alembics_and_an_odd_script_leaves_it_to_alembic(tmp_path):
    engine = make_engine(_url(tmp_path / "g.db"))
    assert plain_head() == head_revision(engine)
    assert stamped_revision(engine) is None
    upgrade(engine)
    assert stamped_revision(engine) == plain_head()
    (tmp_path / "m" / "versions").mkdir(parents=True)
    (tmp_path / "m" / "versions" / "0001_a.py").write_text("revision = '0001'\ndown_revision = None\n")
    (tmp_path / "m" / "versions" / "0002_b.py").write_text("revision = '0002'\ndown_revision = '0001'\n")
    assert plain_head(tmp_path / "m") == "0002"
    (tmp_path / "m" / "versions" / "0003_merge.py").write_text("revision = '0003'\n"
                                                               "down_revision = ('0001', '0002')\n")
    assert plain_head(tmp_path / "m") is None


def test_sqlite_runs_in_wal_mode_with_a_busy_timeout_and_foreign_keys(tmp_path):
    engine = make_engine(_url(tmp_path / "g.db"))
    upgrade(engine)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    # WAL is a property of the file: a plain sqlite3 connection sees it too
    assert db_rows(tmp_path / "g.db", "PRAGMA journal_mode") == [("wal",)]


def test_open_database_creates_missing_directories_and_expands_home(home):
    sessions = open_database("sqlite:///~/deep/er/g.db")
    assert (home / "deep" / "er" / "g.db").is_file()
    with sessions.begin() as s:
        s.add(Host(name="h", address="local"))
    with sessions() as s:
        assert [h.name for h in s.scalars(sa.select(Host))] == ["h"]


def test_deleting_a_job_cascades_to_its_workers_and_events(tmp_path):
    from gpuflex.db.models import Event, Worker

    sessions = open_database(_url(tmp_path / "g.db"))
    with sessions.begin() as s:
        job = Job(token="t1", name="j", state="queued", argv=["x"], workdir="/", env={},
                  min_workers=1, max_workers=1, gpus_per_worker=1, user="u")
        job.workers.append(Worker(wid=0, host="local", gpus=[0], state="starting",
                                  log_path="/l", exit_path="/e"))
        job.events.append(Event(kind="k", message="m"))
        s.add(job)
    with sessions.begin() as s:
        s.execute(sa.delete(Job))  # a bulk delete: only the FK's ON DELETE CASCADE can help
    assert db_rows(tmp_path / "g.db", "SELECT count(*) FROM workers") == [(0,)]
    assert db_rows(tmp_path / "g.db", "SELECT count(*) FROM events") == [(0,)]


_OPEN_AND_REPORT = textwrap.dedent("""
    import json, sys
    from gpuflex.db.engine import make_engine, upgrade, current_revision
    engine = make_engine(sys.argv[1])
    ran = upgrade(engine)
    print(json.dumps({"ran": ran, "rev": current_revision(engine)}))
""")


def test_concurrent_first_use_migrates_once(tmp_path):
    url = _url(tmp_path / "fresh" / "g.db")
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN_AND_REPORT, url],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    head = head_revision(make_engine(url))
    assert [r["rev"] for r in results] == [head] * 4
    assert sum(r["ran"] for r in results) == 1
    assert db_rows(tmp_path / "fresh" / "g.db", "SELECT version_num FROM alembic_version") == [(head,)]


def test_concurrent_cli_commands_on_a_fresh_db_all_succeed(home, config_path, db_path):
    from tests.conftest import GpuflexCLI

    cli = GpuflexCLI(home, config_path)
    procs = [subprocess.Popen([cli.script, "status", "--json"], env=cli.env(), cwd=home,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert json.loads(out) == []
    assert len(db_rows(db_path, "SELECT version_num FROM alembic_version")) == 1
    # the configured host and its 4 slots are mirrored once, not once per command
    assert db_rows(db_path, "SELECT name FROM hosts") == [("local",)]
    assert db_rows(db_path, "SELECT count(*) FROM gpus") == [(4,)]


def test_db_upgrade_command_reports_the_revision(home, config_path, db_path):
    from tests.conftest import GpuflexCLI

    cli = GpuflexCLI(home, config_path)
    first = cli.ok("db", "upgrade")
    head = db_rows(db_path, "SELECT version_num FROM alembic_version")[0][0]
    assert f"upgraded to revision {head}" in first.stdout
    second = cli.ok("db", "upgrade")
    assert f"already at revision {head}" in second.stdout


@pytest.mark.parametrize("url,fragment", [
    ("sqlite:///{tmp}/afile/g.db", "a file of that name is in the way"),
    ("sqlite:///{tmp}/adir", "cannot open the database"),
    ("sqlite:///{tmp}/notadb", "file is not a database"),
    ("nosuchdialect://x/y", "cannot use the database URL"),
], ids=["parent-is-a-file", "path-is-a-directory", "not-a-database", "unknown-dialect"])
def test_unusable_database_is_a_database_error(tmp_path, url, fragment):
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    (tmp_path / "notadb").write_text("this is not sqlite\n" * 10)
    with pytest.raises(DatabaseError) as info:
        open_database(url.format(tmp=tmp_path))
    assert fragment in str(info.value)
    assert info.value.exit_code == 2
    assert (tmp_path / "notadb").read_text() == "this is not sqlite\n" * 10


def test_a_first_upgrade_interrupted_between_revisions_leaves_nothing_and_the_next_one_completes(
        tmp_path, monkeypatch):
    """A Ctrl-C or SIGTERM while the first command creates the database: SQLite's driver
    committed each CREATE TABLE as it ran, so the next command found half a schema and
    failed ('table hosts already exists'). The whole upgrade is one transaction now."""
    from gpuflex.db import engine as E
    made = E.alembic_config

    def interrupted(engine):
        cfg = made(engine)

        def stop(*, step, **_):   # after the first revision's DDL, before the next one
            raise KeyboardInterrupt
        cfg.attributes["on_version_apply"] = stop
        return cfg

    path = tmp_path / "g.db"
    engine = make_engine(_url(path))
    monkeypatch.setattr(E, "alembic_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        upgrade(engine)
    assert db_rows(path, "SELECT name FROM sqlite_master WHERE type = 'table'") == []
    monkeypatch.setattr(E, "alembic_config", made)
    assert upgrade(engine) is True
    assert current_revision(engine) == head_revision(engine)


def _one_row_each(conn) -> dict[str, int]:
    """A row in every table of the schema as it is (any revision): its NOT NULL columns
    without a default filled by their declared type, each `*_id` pointing at row 1 of its
    table (written with foreign keys off: the order of the tables does not matter). The
    number of rows per table."""
    conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
    tables = [t for (t,) in conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table' "
                                                 "AND name != 'alembic_version'")]
    for table in tables:
        cols, values = [], []
        for _, name, kind, notnull, default, _pk in conn.exec_driver_sql(f"PRAGMA table_info({table})"):
            if name.endswith("_id") or name == "id":
                cols.append(name), values.append(1)
            elif notnull and default is None:
                kind = kind.upper()
                cols.append(name)
                values.append(1 if "INT" in kind else 1.0 if kind in ("FLOAT", "REAL") else 0 if "BOOL" in kind
                              else "{}" if kind == "JSON" else "x")
        conn.exec_driver_sql(f"INSERT INTO {table} ({', '.join(f'[{c}]' for c in cols)}) VALUES ({', '.join('?' * len(cols))})",
                             tuple(values))
    return {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar() for t in tables}


@pytest.mark.parametrize("start", ["0001", "0005", "0011"])
def test_an_upgrade_keeps_every_row_of_an_older_database(tmp_path, start):
    """0006 and 0012 rebuild `jobs` (batch mode: copy, DROP, rename); with foreign keys on,
    the DROP cascaded to every worker and event of every job."""
    from alembic import command
    from gpuflex.db import engine as E
    path = tmp_path / "g.db"
    engine = make_engine(_url(path))
    migrating = E._transactional_ddl(engine)
    command.upgrade(E.alembic_config(migrating), start)
    migrating.dispose()
    with engine.connect() as conn:
        before = _one_row_each(conn)
        conn.commit()
        conn.exec_driver_sql("PRAGMA foreign_keys=ON")   # as the pool's connections are made
    assert upgrade(engine) is True
    with engine.connect() as conn:
        after = {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar() for t in before}
        assert conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall() == []
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1   # the commands' connections: on
    assert after == before and before["workers"] == before["events"] == 1


def test_a_sqlite_write_that_finds_the_disk_full_is_one_database_error_and_commits_nothing(tmp_path, monkeypatch):
    """SQLite's "database or disk is full" at a commit (its disk filled during the command;
    a real full disk: tests/e2e/test_database_disk_full.py) is one line naming the file."""
    sessions = open_database(f"sqlite:///{tmp_path}/g.db")
    engine = sessions.kw["bind"]

    def full(*_a, **_k):
        raise sqlite3.OperationalError("database or disk is full")

    with pytest.raises(DatabaseError, match=rf"cannot write the database {tmp_path}/g.db: database or disk is "
                                            "full; the change under way was not committed"):
        with sessions.begin() as s:
            s.add(Host(name="h", address="local"))
            s.flush()
            monkeypatch.setattr(engine.dialect, "do_commit", full)
    monkeypatch.undo()
    assert db_rows(tmp_path / "g.db", "SELECT count(*) FROM hosts") == [(0,)]
