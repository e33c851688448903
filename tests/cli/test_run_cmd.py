"""`gpuflex run` and `gpuflex alloc` (gpuflex.cli.run_cmd), in-process: what they refuse
before they fork or spawn anything or open the database (one line, exit 2, nothing recorded). Sessions that run,
and a full pool, are in tests/e2e/test_interactive_sessions.py."""

from __future__ import annotations

import pytest

from gpuflex.cli import run_cmd  # noqa: F401 (the module under test)
from gpuflex.hosts import terminal
from tests import clirun


@pytest.mark.parametrize("args,message", [
    (["--gpus", "0", "--", "true"], "--gpus 0: give a whole number from 1 to 4096."),
    (["--time", "soon", "--", "true"], "--time"),
    (["--time", "0", "--", "true"], "--time '0': a time limit is more than 0"),
    (["--", "tr\0ue"], "holds a NUL byte"),
])
def test_bad_input_is_one_line_and_exit_2_with_nothing_recorded(home, config_path, db_path, args, message):
    r = clirun.invoke(home, config_path, "run", *args)
    assert r.exit_code == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not db_path.exists()   # refused before the database was opened


@pytest.mark.parametrize("args,message", [(["--gpus", "-1"], "--gpus -1: give a whole number"),
                                          (["--time", "1x"], "--time")])
def test_alloc_refuses_bad_input_before_opening_the_database(home, config_path, db_path, args, message):
    r = clirun.invoke(home, config_path, "alloc", *args)
    assert r.exit_code == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not db_path.exists()


def test_help_gives_an_example(home, config_path):
    r = clirun.invoke(home, config_path, "run", "--help")
    assert r.exit_code == 0 and "gpuflex run --gpus 1 --time 2h -- python" in r.stdout
    assert "e.g. --gpus 2" in r.stdout and "E.g. --time 2h" in r.stdout
    r = clirun.invoke(home, config_path, "alloc", "--help")
    assert r.exit_code == 0 and "gpuflex alloc --gpus 2 --time 4h" in r.stdout


def test_exit_codes_read_as_a_shells():
    assert terminal.exit_code(3 << 8) == 3     # exited with 3
    assert terminal.exit_code(15) == 128 + 15  # killed by SIGTERM
