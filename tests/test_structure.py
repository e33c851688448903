"""The package's shape, checked from its source: layers without import cycles, the CLI away
from the models, the runtime on torch and the standard library only, no reaching into
another module's private names.

Imports are read with `ast`, so imports inside functions and under `if TYPE_CHECKING:`
count as much as top-level ones: a cycle through any of them still ties the modules
together for a reader.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "gpuflex"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def imported(name: str, tree: ast.Module) -> set[str]:
    """Every module (of any package) that `name` imports, anywhere in its source."""
    out: set[str] = set()
    for node in ast.walk(tree):
        out |= import_names(name, node)
    return out


def import_names(name: str, node: ast.AST) -> set[str]:
    """The modules one statement of module `name` imports (none for any other statement):
    a relative import resolved against `name`, and `from gpuflex.x import y` naming the
    submodule y counted as y."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        base = name.split(".")
        base = base[:len(base) - node.level + (1 if name in MODULES and MODULES[name].name == "__init__.py" else 0)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return {mod} | {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES}


def edges(name: str) -> set[str]:
    """The gpuflex modules `name` depends on. Importing `a.b.c` runs `a` and `a.b` too,
    but a package's `__init__` that only re-exports is not counted as a dependency of
    its own submodules (else every `gpuflex.x.y` would depend on `gpuflex.x`)."""
    return {m for m in imported(name, TREES[name]) if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_reader_sees_imports_inside_functions_and_type_checking_blocks():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpuflex.config import Config\n"
                     "def f():\n    import gpuflex.errors\n")
    assert {"gpuflex.config", "gpuflex.errors"} <= imported("gpuflex.states", tree)


def test_no_import_cycles_in_the_package():
    graph = {name: edges(name) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cli_imports_no_database_models():
    offenders = {name: sorted(m for m in edges(name) if m == "gpuflex.db.models")
                 for name in MODULES if name.startswith("gpuflex.cli")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_policy_is_pure():
    """Decisions import no database, transport, process or control code."""
    banned = ("gpuflex.db", "gpuflex.hosts", "gpuflex.control", "gpuflex.cli", "sqlalchemy", "paramiko",
              "subprocess", "socket")
    bad = {}
    for name in MODULES:
        if name.startswith("gpuflex.policy"):
            hits = sorted(m for m in imported(name, TREES[name]) if m.startswith(banned))
            if hits:
                bad[name] = hits
    assert bad == {}


def test_the_runtime_imports_only_torch_the_standard_library_and_itself():
    allowed_roots = set(sys.stdlib_module_names) | {"torch", "__future__"}
    bad = {}
    for name in MODULES:
        if not name.startswith("gpuflex.elastic"):
            continue
        for m in imported(name, TREES[name]):
            root = m.split(".")[0]
            if m.startswith("gpuflex.elastic") or root in allowed_roots:
                continue
            if m.startswith("numpy"):   # read only if the script imported it (its RNG state)
                continue
            bad.setdefault(name, []).append(m)
    assert bad == {}


def _elastic_part(module: str) -> str | None:
    """The sub-package of gpuflex.elastic a module belongs to ("" for the package itself)."""
    if module == "gpuflex.elastic":
        return ""
    if module.startswith("gpuflex.elastic."):
        return module.split(".")[2]
    return None


def _crossings(select, allowed) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for name in MODULES:
        if select(name):
            hits = sorted(m for m in imported(name, TREES[name]) if not allowed(m))
            if hits:
                bad[name] = hits
    return bad


def test_the_elastic_sub_packages_are_the_ones_the_package_docstring_lists():
    listed = {line.split()[0].rstrip("/") for line in TREES["gpuflex.elastic"].body[0].value.value.splitlines()
              if line.startswith("    ") and line.split()[0].endswith("/")}
    found = {p.name for p in (PKG / "elastic").iterdir() if (p / "__init__.py").exists()}
    assert listed == found and found >= {"protocol", "coordinator", "membership", "state", "sharding", "data", "run"}
    assert sorted(p.name for p in (PKG / "elastic").glob("*.py")) == ["__init__.py", "torch_compat.py"]
    assert "torch_compat.py" in TREES["gpuflex.elastic"].body[0].value.value


def test_the_protocol_imports_no_torch_and_no_other_part_of_the_runtime():
    """What the control side and the coordinator share with the workers: it must load on a
    machine without torch and must not drag the worker's code into gpuflex's processes."""
    assert _crossings(lambda n: _elastic_part(n) == "protocol",
                      lambda m: not m.startswith("torch") and _elastic_part(m) in (None, "", "protocol")) == {}


def test_the_coordinator_never_imports_a_workers_membership_state_or_data():
    assert _crossings(lambda n: _elastic_part(n) == "coordinator",
                      lambda m: _elastic_part(m) in (None, "", "protocol", "coordinator")) == {}


def test_the_control_side_imports_only_the_runtimes_protocol():
    assert _crossings(lambda n: n.startswith("gpuflex.") and _elastic_part(n) is None,
                      lambda m: _elastic_part(m) in (None, "", "protocol")) == {}


def test_the_direction_rules_catch_a_crossing():
    tree = ast.parse("from gpuflex.elastic.state import tree\nimport torch\n")
    hits = {m for m in imported("gpuflex.elastic.protocol.keys", tree)
            if m.startswith("torch") or _elastic_part(m) not in (None, "", "protocol")}
    assert hits == {"gpuflex.elastic.state", "gpuflex.elastic.state.tree", "torch"}


def test_no_tensor_is_read_through_numpy():
    """`Tensor.numpy()` imports numpy, which gpuflex does not require (a GPU host has torch
    and the standard library): it failed every formation of a wheel install (issue 26)."""
    calls = sorted(f"{name}:{node.lineno}" for name, tree in TREES.items() for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "numpy" and not node.args)
    assert calls == []


def test_the_examples_read_no_tensor_through_numpy():
    """The examples run on the same torch-only GPU hosts (their reports hash the parameters'
    bytes): ddp_tutorial.py, the torchrun example, called `.numpy()` on every run."""
    root = Path(__file__).resolve().parents[1] / "examples"
    calls = sorted(f"{path.relative_to(root)}:{node.lineno}" for path in root.rglob("*.py")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "numpy" and not node.args)
    assert calls == []


def test_the_store_protocol_and_worker_environment_are_imported_without_torch():
    import subprocess

    code = ("import sys, gpuflex.elastic.protocol.keys, gpuflex.elastic.protocol.env, gpuflex.control.launch; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def private_definitions() -> dict[str, set[str]]:
    """Underscore names defined in each module: functions, classes, and attributes set on
    `self` or at class level."""
    defs: dict[str, set[str]] = {}
    for name, tree in TREES.items():
        found = defs.setdefault(name, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                found.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
    return {k: {n for n in v if n.startswith("_") and not n.startswith("__")} for k, v in defs.items()}


def test_no_module_reaches_into_another_modules_private_names():
    defs = private_definitions()
    owners: dict[str, set[str]] = {}
    for mod, names in defs.items():
        for n in names:
            owners.setdefault(n, set()).add(mod)
    bad = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and node.module \
                            and node.module.startswith("gpuflex"):
                        bad.append(f"{name} imports {node.module}.{a.name}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                mods = owners.get(node.attr, set())
                if mods and name not in mods:
                    bad.append(f"{name}:{node.lineno} uses .{node.attr} (defined in {', '.join(sorted(mods))})")
    assert bad == []


def self_as_any(tree: ast.Module) -> list[int]:
    """The lines of methods whose `self` is annotated `Any` (or `typing.Any`)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args:
            first = node.args.args[0]
            ann = first.annotation
            if first.arg == "self" and (isinstance(ann, ast.Name) and ann.id == "Any"
                                        or isinstance(ann, ast.Attribute) and ann.attr == "Any"):
                out.append(node.lineno)
    return out


def test_no_method_types_its_self_as_any():
    """`self: Any` is how a mixin reaches the attributes of the class it is mixed into: it
    hides which object a method works on (ElasticRun's parts were such mixins; they hold
    a RunContext instead)."""
    hits = sorted(f"{name}:{line}" for name, tree in TREES.items() for line in self_as_any(tree))
    assert hits == []


def gpuflex_bases(tree: ast.Module) -> dict[str, list[str]]:
    """Each class of a module with its bases that are gpuflex classes: defined in the module,
    or reached through a name imported from gpuflex (`Base`, `module.Base`)."""
    ours = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("gpuflex")):
            ours.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            ours.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("gpuflex"))
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            roots = []
            for base in node.bases:
                root = base
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in ours:
                    roots.append(ast.unparse(base))
            out[node.name] = roots
    return out


def test_the_run_is_composed_not_mixed():
    """ElasticRun's parts (gpuflex/elastic/run/) are objects over one RunContext, not mixins:
    no class there inherits from more than one gpuflex class."""
    mixed = {f"{name}.{cls}": bases for name, tree in TREES.items() if name.startswith("gpuflex.elastic.run.")
             for cls, bases in gpuflex_bases(tree).items() if len(bases) > 1}
    assert mixed == {}


def test_the_shape_checks_catch_a_mixin_and_a_self_typed_any():
    tree = ast.parse("from typing import Any, Protocol\nfrom gpuflex.elastic.run.startup import StartUp\n"
                     "from gpuflex.elastic.run import user_calls\nclass Local: pass\n"
                     "class Run(StartUp, user_calls.UserCalls, Protocol): pass\n"
                     "class Steps(Local, Exception):\n    def backward(self: Any) -> None: ...\n"
                     "    def fine(self) -> None: ...\n")
    assert gpuflex_bases(tree) == {"Local": [], "Run": ["StartUp", "user_calls.UserCalls"], "Steps": ["Local"]}
    assert self_as_any(tree) == [7]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_readable_in_size(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= 420, f"{name} has {lines} lines"


# What gpuflex.elastic.torch_compat wraps: torch's (numpy's, CPython's) private fields and
# modules. Named anywhere else, as an attribute, a string or an import, they are a use.
WRAPPED = {"_foreach_copy_", "_execution_engine", "_world", "_shutdown_workers", "_BatchNorm", "_dynamo",
           "OptimizedModule", "_fsdp_param_group", "_module_info", "_orig_size", "_parameters", "_buffers",
           "_composable", "_composable_state", "_module_state_mapping", "REGISTRY_KEY", "STATE_KEY",
           "_pre_forward_hook_handle", "_post_forward_hook_handle", "_is_fsdp_managed_module",
           "_fsdp_use_orig_params", "mtrand", "_rand", "_bit_generator", "_inst"}
PUBLIC_UNDERSCORED = {"_exit"}   # os._exit: documented, and no other way to end without cleanup


def foreign_private_uses(name: str, tree: ast.Module, owned: set[str]) -> list[str]:
    """Where module `name` uses a private name of torch, numpy or CPython: a name in WRAPPED
    (attribute, string or import), a `torch._x` / `numpy._x` module path, or any underscored
    attribute that no gpuflex module defines (read off something other than self or cls)."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            paths = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module or ''}.{a.name}" for a in node.names]
            for path in paths:
                parts = path.split(".")
                if parts[0] in ("torch", "numpy") and any(p.startswith("_") and not p.startswith("__")
                                                          or p in WRAPPED for p in parts[1:]):
                    hits.append(f"{name}:{node.lineno} imports {path}")
        elif isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if node.attr in WRAPPED or (private and not on_self and node.attr not in owned
                                        and node.attr not in PUBLIC_UNDERSCORED):
                hits.append(f"{name}:{node.lineno} uses .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in WRAPPED or node.value.startswith(("torch._", "numpy._")):
                hits.append(f"{name}:{node.lineno} names {node.value!r}")
    return hits


def test_only_torch_compat_uses_private_names_of_torch_numpy_or_cpython():
    owned = set().union(*private_definitions().values())
    hits = [h for name, tree in TREES.items() if name != "gpuflex.elastic.torch_compat"
            for h in foreign_private_uses(name, tree, owned)]
    assert hits == []


def test_the_private_name_finder_finds_each_kind_of_use():
    tree = ast.parse("import torch._dynamo\nfrom torch.distributed import _composable_state\n"
                     "torch._foreach_copy_(a, b)\nm._buffers['x']\ngetattr(c10d, '_world')\n"
                     "it._some_new_field\nself._mine\nos._exit(0)\nx._owned\n")
    assert sorted(foreign_private_uses("m", tree, {"_owned"})) == [
        "m:1 imports torch._dynamo", "m:2 imports torch.distributed._composable_state",
        "m:3 uses ._foreach_copy_", "m:4 uses ._buffers", "m:5 names '_world'", "m:6 uses ._some_new_field"]
