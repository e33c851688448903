"""CLI start-up (issue 30): `gpuflex --help` and the command modules import no heavy package
a command may not need. Importing the CLI (every command's module, to build the parser) is
all `--help` does; what a command needs beyond that (pydantic for the config, SQLAlchemy's
ORM for the database, Alembic to migrate, paramiko for an SSH host, torch for a job's
workers, prometheus_client for the metrics server) is imported inside the command.

The fast test reads the imports that run when a module is imported (its top level, `try`
and `if` blocks, class bodies; not function bodies, not `if TYPE_CHECKING:`) with `ast`,
from gpuflex.cli down through every gpuflex module they reach. The end-to-end one asks a
fresh interpreter what `--help` loaded.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from tests.test_structure import MODULES, TREES, import_names

# what no command's module may import at its top: each is a command's own business
HEAVY = ("torch", "alembic", "paramiko", "prometheus_client", "sqlalchemy", "pydantic", "pydantic_core",
         "numpy", "starlette", "uvicorn", "psycopg")
# gpuflex's own modules that bring those in (the config: pydantic; the rest: SQLAlchemy)
HEAVY_OWN = ("gpuflex.config", "gpuflex.db", "gpuflex.control.service", "gpuflex.control.views")


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time(name: str, tree: ast.Module) -> set[str]:
    """The modules `name` imports when it is imported: statements run at import (the top,
    `if`/`try`/`with` blocks, class bodies), not functions and not `if TYPE_CHECKING:`."""
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update(import_names(name, node))
            elif isinstance(node, ast.If):
                if not _type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Try, ast.With, ast.ClassDef)):
                visit(node.body)
                for part in ("handlers", "orelse", "finalbody"):
                    for sub in getattr(node, part, ()):
                        visit(sub.body if isinstance(sub, ast.ExceptHandler) else [sub])
    visit(tree.body)
    return out


def loaded_by(start: str) -> set[str]:
    """Every module importing `start` runs (the parent packages of each gpuflex module too)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for n in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:
            if n in seen:
                continue
            seen.add(n)
            if n in MODULES:
                todo.extend(import_time(n, TREES[n]))
    return seen


def heavy_in(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY or m.startswith(HEAVY_OWN))


def test_the_cli_and_the_console_script_import_no_heavy_package_at_start():
    assert heavy_in(loaded_by("gpuflex.cli")) == []
    assert heavy_in(loaded_by("gpuflex.console")) == []


def test_the_reader_follows_imports_that_run_and_skips_those_that_do_not():
    tree = ast.parse("from typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\nelse:\n"
                     "    import c\ntry:\n    import d\nexcept ImportError:\n    import e\n"
                     "class K:\n    import f\ndef g():\n    import h\n")
    assert import_time("gpuflex.states", tree) == {"typing", "a", "c", "d", "e", "f"}


def test_the_check_sees_a_heavy_import_reached_through_another_module(monkeypatch):
    monkeypatch.setitem(TREES, "gpuflex.errors", ast.parse("import gpuflex.config\n"))
    assert "gpuflex.config" in heavy_in(loaded_by("gpuflex.cli"))


@pytest.mark.e2e
def test_help_in_a_fresh_interpreter_loads_none_of_them():
    """What `gpuflex --help` loaded, asked of the interpreter itself."""
    code = ("import io, json, sys, contextlib\nsys.argv = ['gpuflex', '--help']\n"
            "from gpuflex.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        main()\n    except SystemExit:\n        pass\nprint(json.dumps(sorted(sys.modules)))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(p.stdout))
    assert "gpuflex.cli" in loaded
    assert heavy_in(loaded) == []
