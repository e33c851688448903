"""The fast tier's two promises (tests/tiers.py): a test that starts a process is marked,
and every module of gpuflex is imported by a unit test, so `make test-fast` loads all of it."""

from __future__ import annotations

import ast
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers import FIXTURE_TIERS, TEST_TIERS, TIERS, StartedAProcess, file_key

from tests import REPO as ROOT
from tests import TESTS


# ---- a fast-tier test cannot start a process --------------------------------------------

@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"]),
    lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
    lambda: os.system("true"),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
], ids=["run", "popen", "system", "multiprocessing"])
def test_a_fast_test_that_starts_a_process_is_stopped(start, fast_tier_starts_no_process):
    with pytest.raises(StartedAProcess, match="mark it with one of e2e"):
        start()
    assert len(fast_tier_starts_no_process) == 1
    # the guard would fail this test at teardown as well (for starts on other threads);
    # here the start was the point
    fast_tier_starts_no_process.clear()


@pytest.mark.e2e
def test_a_marked_test_may_start_a_process():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                          text=True, check=True).stdout == "42\n"


# ---- every module is imported by a unit test ---------------------------------------------

def modules() -> set[str]:
    """Every module of the package, dotted; `__main__` modules are the entry points that only
    call a main() some other module holds, and are left out."""
    found = set()
    for path in (ROOT / "gpuflex").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def wholly_marked(tree: ast.Module) -> bool:
    """The module sets `pytestmark` to one of the tiers: none of its tests is a unit test."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr in TIERS for n in ast.walk(node.value))
    return False


def imported_by(tree: ast.Module, known: set[str]) -> set[str]:
    """The gpuflex modules an import statement anywhere in the file names, and their packages."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    found = set()
    for name in names:
        parts = name.split(".")
        found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return found & known


def has_a_unit_test(path: Path, tree: ast.Module) -> bool:
    """Whether a test of the file is in the fast tier, as far as its source says: the file is
    not marked whole, and a test takes no tier fixture (tests/tiers.py's, or one of the
    file's own fixtures that takes one) and is not named in TEST_TIERS."""
    if wholly_marked(tree):
        return False
    tier_fixtures = {k.split("::")[-1] for k in FIXTURE_TIERS if "::" not in k or k.startswith(f"{file_key(path)}::")}
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    args = {f.name: {a.arg for a in f.args.args} for f in functions}
    grew = True
    while grew:   # the file's own fixtures that use a tier fixture are tier fixtures
        more = {name for name, used in args.items() if not name.startswith("test_") and used & tier_fixtures}
        grew = bool(more - tier_fixtures)
        tier_fixtures |= more
    named = TEST_TIERS.get(file_key(path), {})
    return any(name.startswith("test_") and name not in named and not used & tier_fixtures
               for name, used in args.items())


def unit_test_files() -> dict[Path, ast.Module]:
    """The test files with a test in the fast tier, parsed."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(TESTS.rglob("test_*.py"))}
    return {p: tree for p, tree in trees.items() if has_a_unit_test(p, tree)}


def test_every_module_is_imported_by_a_unit_test():
    known = modules()
    imported = set()
    for tree in unit_test_files().values():
        imported |= imported_by(tree, known)
    assert sorted(known - imported) == [], "modules no unit test imports: write a unit test for each"


def test_the_import_check_sees_each_kind_of_import_statement():
    known = {"gpuflex", "gpuflex.a", "gpuflex.a.b", "gpuflex.c", "gpuflex.d"}
    tree = ast.parse("import gpuflex.a.b\nfrom gpuflex import c\ndef f():\n    from gpuflex.d import x\n")
    assert imported_by(tree, known) == known
    assert imported_by(ast.parse("from . import a\nimport os\n"), known) == set()


def test_a_file_whose_tests_all_use_tier_fixtures_is_not_a_unit_test_file(tmp_path):
    def unit(source: str) -> bool:
        return has_a_unit_test(tmp_path / "test_x.py", ast.parse(source))

    assert unit("def test_a(tmp_path): pass\ndef test_b(gf): pass\n")
    assert not unit("def test_b(gf): pass\n")
    assert not unit("def pool(ssh_hosts): pass\ndef lab(pool): pass\ndef test_c(lab): pass\n")
    assert not unit("import pytest\npytestmark = pytest.mark.e2e\ndef test_a(): pass\n")


def test_a_module_marked_whole_is_not_a_unit_test_file():
    assert wholly_marked(ast.parse("import pytest\npytestmark = pytest.mark.e2e\n"))
    assert wholly_marked(ast.parse("import pytest\npytestmark = [pytest.mark.ssh, pytest.mark.slow]\n"))
    assert not wholly_marked(ast.parse("import pytest\npytestmark = pytest.mark.filterwarnings('x')\n"))
    assert not wholly_marked(ast.parse("import pytest\n@pytest.mark.e2e\ndef test_x(): pass\n"))


def test_every_test_tiers_names_is_a_test_of_its_module():
    """A renamed test drops out of TEST_TIERS silently (the guard then fails it); a name
    that matches nothing is stale and goes."""
    for file, names in TEST_TIERS.items():
        tree = ast.parse((TESTS / file).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert sorted(set(names) - defined) == [], file
    for key in FIXTURE_TIERS:
        if "::" in key:
            file, name = key.split("::")
            assert f"def {name}(" in (TESTS / file).read_text(), key
