"""One migration per test session: a new SQLite database's first upgrade replays what the
real migrations gave a template database once, instead of running every migration script
again for each test.

Most process-free tests open a database of their own, and its first upgrade ran the 16
scripts of migrations/versions (Alembic's batch mode rebuilds a table per script): ~0.3 s
of CPU on the idle 2-core machine, ~1 s on a loaded one, for each such test, the largest
share of the fast tier's time.

Only Alembic's `command.upgrade(config, "head")` on a SQLite database that holds no table
yet is replaced, and Alembic's reading of the scripts is done once per session. Everything of gpuflex's runs as it does for a user: the CLI, JobService,
`gpuflex.db.engine.upgrade` with its lock and its reads of the revision, and the engine the
migration runs on (its BEGIN IMMEDIATE, foreign keys off). The migrations themselves are
run for real where they are the subject, in the files REAL_MIGRATIONS names, and in every
test that starts a gpuflex process (the patch is this process's alone).
tests/db/test_engine.py checks that the replay gives exactly the migrated database.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

# Files (tests/tiers.py's `file_key`: the path under tests/) whose tests run the real
# migrations: the migration and `db upgrade` tests.
REAL_MIGRATIONS = ("db/", "cli/test_db_cmd.py")


@dataclass(frozen=True)
class Schema:
    """A migrated database: its CREATE statements in the order SQLite lists them, and the rows
    of each table (Alembic's revision row)."""

    statements: tuple[str, ...]
    rows: tuple[tuple[str, tuple[tuple, ...]], ...]


def read_schema(conn: sa.Connection) -> Schema:
    """The schema and rows of the database `conn` is connected to. SQLite's own objects
    (`sqlite_sequence`, the indexes of UNIQUE and PRIMARY KEY constraints) are made by the
    statements that need them, so they are not listed."""
    objects = conn.exec_driver_sql(
        "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%' "
        "ORDER BY rowid").all()
    tables = [name for kind, name, _ in objects if kind == "table"]
    rows = tuple((t, tuple(tuple(r) for r in conn.exec_driver_sql(f'SELECT * FROM "{t}"'))) for t in tables)
    # tables first: an index or trigger is created after the table it is on
    statements = tuple(sql for kind, _, sql in objects if kind == "table") \
        + tuple(sql for kind, _, sql in objects if kind != "table")
    return Schema(statements, tuple((t, r) for t, r in rows if r))


def is_empty(conn: sa.Connection) -> bool:
    return conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar() == 0


def replay(conn: sa.Connection, schema: Schema) -> None:
    for sql in schema.statements:
        conn.exec_driver_sql(sql)
    for table, rows in schema.rows:
        marks = ", ".join("?" * len(rows[0]))
        conn.exec_driver_sql(f'INSERT INTO "{table}" VALUES ({marks})', list(rows))


class Template:
    """`upgrade`, a stand-in for alembic.command.upgrade: a SQLite database with no table
    brought to head gets the template's schema and rows, in the migration's own transaction
    (the engine of `config.attributes["engine"]`); anything else goes to `real`. The
    template is migrated, by `real`, on the first call that needs it, in `directory`."""

    def __init__(self, real, directory: Path, real_scripts=None) -> None:
        self.real = real
        self.directory = directory
        self.building = False
        self.real_scripts = real_scripts
        self.scripts: dict[str, object] = {}

    @functools.cached_property
    def schema(self) -> Schema:
        """Migrated as a user's first command migrates (gpuflex.db.engine.upgrade), by the
        real scripts."""
        from gpuflex.db.engine import make_engine, upgrade

        engine = make_engine(f"sqlite:///{self.directory / 'template.db'}")
        self.building = True
        try:
            assert upgrade(engine), "the template database was not new"
            with engine.connect() as conn:
                return read_schema(conn)
        finally:
            self.building = False
            engine.dispose()

    def script_directory(self, config):
        """A stand-in for alembic's ScriptDirectory.from_config: the scripts of a location read
        once per session (`gpuflex.db.engine.head_revision` read and compiled all 16 of them
        twice per new database; they do not change while the tests run)."""
        location = config.get_main_option("script_location")
        if location not in self.scripts:
            self.scripts[location] = self.real_scripts(config)
        return self.scripts[location]

    def upgrade(self, config, revision: str, *args, **kwargs) -> None:
        engine = config.attributes.get("engine")
        if not self.building and revision == "head" and not args and not kwargs and engine is not None \
                and engine.dialect.name == "sqlite":
            with engine.begin() as conn:
                if is_empty(conn):
                    replay(conn, self.schema)
                    return
        self.real(config, revision, *args, **kwargs)
