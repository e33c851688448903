"""Every command and command group has --help with an example."""

from __future__ import annotations

import re
import subprocess

import pytest
import typer.main
from typer.testing import CliRunner

from gpuflex.cli import app
from tests.conftest import gpuflex_script


def command_paths(cmd, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The root, every group and every command (of the click tree typer builds), as argv."""
    out = [prefix]
    if getattr(cmd, "commands", None):
        for name, sub in sorted(cmd.commands.items()):
            out += command_paths(sub, prefix + (name,))
    return out


PATHS = command_paths(typer.main.get_command(app))


def test_the_walk_finds_every_contract_command():
    names = {" ".join(p) for p in PATHS}
    assert names >= {"", "submit", "status", "scale", "cancel", "logs", "events", "hosts",
                     "db", "db upgrade"}


@pytest.mark.parametrize("path", PATHS, ids=[" ".join(p) or "gpuflex" for p in PATHS])
def test_help_has_an_example(path, home):
    for flag in ("--help", "-h"):
        result = CliRunner().invoke(app, [*path, flag], env={"COLUMNS": "120"})
        assert result.exit_code == 0, result.output
        assert "Example:" in result.output
        assert "Usage:" in result.output
        assert f"gpuflex {' '.join(path)}".strip() in result.output.replace("  ", " ")


def test_help_needs_no_config_or_database(home):
    (home / "gpuflex.toml").write_text("this is = = not toml")
    p = subprocess.run([gpuflex_script(), "db", "upgrade", "--help"], capture_output=True,
                       text=True, cwd=home, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Example: gpuflex db upgrade" in p.stdout
    assert list(home.iterdir()) == [home / "gpuflex.toml"]


def bracketed(text: str) -> list[str]:
    """The "[name]" words of a help text as its reader should see them (a config table's
    name, "[jobs]"), the markup escape "\\[" undone."""
    return re.findall(r"\[[A-Za-z_][A-Za-z0-9_.-]*\]", text.replace("\\[", "["))


@pytest.mark.parametrize("path", PATHS, ids=[" ".join(p) or "gpuflex" for p in PATHS])
def test_help_prints_every_bracketed_name_literally(path, home):
    """typer reads help texts as rich markup, where "[jobs]" is a tag: it must not vanish."""
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    wanted = bracketed(cmd.help or "") + [b for p in cmd.params for b in bracketed(getattr(p, "help", None) or "")]
    out = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "400"}).output
    for word in wanted:
        assert word in out, f"{word} vanished from 'gpuflex {' '.join(path)} --help'"


def test_submit_help_names_the_config_defaults(home):
    out = " ".join(CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "400"}).output.split())
    assert "Default: [jobs] default_time." in out
    assert "Default: [notify] url." in out


def test_scale_help_says_what_a_resize_does_to_each_kind_of_job(home):
    """Not "in place" for every job: a restart job is stopped and launched again at N."""
    out = " ".join(CliRunner().invoke(app, ["scale", "--help"], env={"COLUMNS": "400"}).output.split())
    assert "Resize a running elastic job in place" not in out
    assert "An in-place job (--elastic inplace, the default for MIN:MAX) resizes in place at its next step " \
           "boundary" in out
    assert "A restart job (--elastic restart) is stopped (SIGTERM, the grace period, SIGKILL) and launched again " \
           "at N workers, resuming from its own checkpoint." in out
    assert "A fixed gang (--workers N) is not resized." in out


def test_the_command_list_gives_each_command_one_sentence_unbroken(home):
    """typer kept a docstring's own line breaks in `gpuflex --help`'s list, which broke
    'status' and four others mid-sentence; each summary is now its first paragraph, one
    line (rich wraps it to the terminal)."""
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        doc = (cmd.help or "").strip()
        if doc and not hasattr(cmd, "commands"):   # a group's (hosts, db) help is one line already
            assert cmd.short_help == " ".join(doc.split("\n\n")[0].split()), name
    listing = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "400"}).output
    status = group.commands["status"].short_help
    assert status.startswith("Show the jobs not ended") and status in listing   # one line, whole


def test_version_prints_the_packages_version_and_needs_no_config(home):
    from gpuflex import __version__
    (home / "gpuflex.toml").write_text("this is = = not toml")
    result = CliRunner().invoke(app, ["--version"], env={"HOME": str(home)})
    assert (result.exit_code, result.output) == (0, f"gpuflex {__version__}\n")
