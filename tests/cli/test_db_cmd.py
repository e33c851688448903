"""gpuflex.cli.db_cmd: `gpuflex db upgrade`."""

from __future__ import annotations

from gpuflex.cli import db_cmd
from gpuflex.db.engine import current_revision, make_engine
from tests.clirun import invoke


def test_upgrade_migrates_a_new_database_then_says_it_is_current(home, config_path, db_path):
    first = invoke(home, config_path, "db", "upgrade")
    assert first.exit_code == 0, first.output
    revision = current_revision(make_engine(f"sqlite:///{db_path}"))
    assert revision and first.stdout.strip() == f"database {db_path}: upgraded to revision {revision}"
    again = invoke(home, config_path, "db", "upgrade")
    assert again.stdout.strip() == f"database {db_path}: already at revision {revision}"


def test_upgrade_is_the_db_groups_one_command():
    assert [c.name for c in db_cmd.app.registered_commands] == ["upgrade"]
