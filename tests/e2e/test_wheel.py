"""gpuflex installs from a wheel (issue 14 item 1, issue 26 item 1): the wheel carries its
migrations and declares every package it needs; an installed copy, away from the source
tree, creates its database and runs each kind of job to `succeeded`: in place, a gang,
restart-elastic.

The wheel is built without network (setuptools from this environment). Two fresh venvs, as
a lab installs it (README, "Setting up a lab"): the control host's, where pip installs the
wheel with its declared dependencies from the package index, and a GPU host's, where it
installs the wheel alone (`--no-deps`). Of this environment both borrow only torch and the
packages torch requires, linked into one folder that a .pth names: a copy of torch would
cost ~750 MB and ~15 s a run here, and a download on a fresh machine. So a package that
gpuflex uses but does not declare (numpy once was: every in-place job of a wheel install
failed at its formation) fails here, as on a lab's first day."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import REPO as ROOT
from tests.conftest import GpuflexCLI, cleanup_jobs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]   # builds and installs the wheel

EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=300, cwd=out)
    assert build.returncode == 0, build.stderr[-3000:]
    [whl] = out.glob("gpuflex-*.whl")
    return whl


def torch_and_its_requirements() -> list[importlib.metadata.Distribution]:
    """torch's distribution and those it requires (markers evaluated, no extras), recursively."""
    seen, todo, found = set(), ["torch"], []
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        name = canonicalize_name(dist.metadata["Name"])
        if name not in seen:
            seen.add(name)
            found.append(dist)
            todo += [r.name for r in map(Requirement, dist.requires or [])
                     if r.marker is None or r.marker.evaluate({"extra": ""})]
    return found


def link_torch(into: Path) -> Path:
    """A folder of links to torch's files and its requirements' (packages and dist-info, so
    pip sees torch installed), nothing else of this environment."""
    into.mkdir()
    for dist in torch_and_its_requirements():
        site = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or ()} - {"..", "__pycache__"}:
            (into / top).symlink_to(site / top)
    return into


@dataclass(frozen=True)
class Venv:
    python: Path
    site: Path


def venv_with_torch(path: Path, torch_dir: Path) -> Venv:
    """A venv (no pip, no system site-packages) whose site-packages names `torch_dir`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "torch.pth").write_text(f"{torch_dir}\n")
    return Venv(python, Path(site))


def pip_install(venv: Venv, *args: str) -> None:
    """This environment's pip, installing into `venv` (its own packages seen only there)."""
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv.python), "install", "--no-compile",
                        "--disable-pip-version-check", "-q", *args], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def compile_what_runs(venv: Venv, imports: str | None = None) -> None:
    """gpuflex, and what `imports` loads, compiled once (pip's --no-compile skipped all of it):
    where PYTHONDONTWRITEBYTECODE is set, every command and worker would compile them again.
    Not all of site-packages, which takes tens of seconds on 2 cores, nor torch, which is
    not the venv's."""
    subprocess.run([str(venv.python), "-m", "compileall", "-q", str(venv.site / "gpuflex")],
                   check=True, capture_output=True, timeout=300)
    if imports:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        subprocess.run([str(venv.python), "-c", f"import {imports}"], check=True, env=env, timeout=300)


@dataclass(frozen=True)
class Installed:
    control: Venv   # the wheel and its declared dependencies
    host: Venv      # the wheel alone, beside torch (a GPU host)
    torch_dir: Path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Installed:
    base = tmp_path_factory.mktemp("venvs")
    torch_dir = link_torch(base / "torch")
    control, host = venv_with_torch(base / "control", torch_dir), venv_with_torch(base / "host", torch_dir)
    pip_install(control, str(wheel))
    pip_install(host, "--no-deps", str(wheel))
    compile_what_runs(control, "gpuflex.cli, alembic.command")
    compile_what_runs(host)
    return Installed(control, host, torch_dir)


class WheelCLI(GpuflexCLI):
    """The control venv's `gpuflex`, run with nothing of this environment: no PYTHONPATH, no
    VIRTUAL_ENV, none of this venv's scripts on PATH, the working directory outside the repo."""

    def __init__(self, home: Path, config: Path, venv: Venv) -> None:
        super().__init__(home, config)
        self.script = str(venv.python.parent / "gpuflex")

    def env(self, **extra: str) -> dict[str, str]:
        env = super().env(**extra)
        for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(key, None)
        ours = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", os.defpath).split(os.pathsep) if p != ours)
        return env


@pytest.fixture
def lab(installed, tmp_path):
    """A local pool of 7 CPU slots whose `python` is the GPU host's venv; the control venv's CLI."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    cfg = work / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{work}/g.db"\n\n[jobs]\ncancel_grace_s = 3\n\n'
                   f'[[hosts]]\nname = "local"\naddress = "local"\ngpus = "cpu:7"\nworkdir = "{work}/work"\n'
                   f'python = "{installed.host.python}"\n')
    cli = WheelCLI(work, cfg, installed.control)
    yield cli
    cleanup_jobs(cli, work / "g.db")


def test_the_wheel_holds_every_package_and_the_migrations(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "gpuflex").rglob("*.py")
                if "__pycache__" not in p.parts}
    missing = sorted(p for p in packages if not any(n.startswith(p + "/") for n in names))
    assert not missing, f"packages left out of the wheel (add them to pyproject's list): {missing}"
    versions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert versions and all(f"gpuflex/migrations/versions/{v}" in names for v in versions)
    assert {"gpuflex/migrations/env.py", "gpuflex/migrations/script.py.mako"} <= names


def loaded_files(venv: Venv, imports: str, cli: WheelCLI) -> tuple[list[Path], list[Path]]:
    """The files of the modules that `import {imports}` loads in `venv`, and its stdlib's folders."""
    code = (f"import sys, sysconfig, {imports}\n"
            "print(sysconfig.get_path('stdlib'), sysconfig.get_path('platstdlib'))\n"
            "print(*sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)}))\n")
    p = subprocess.run([str(venv.python), "-c", code], capture_output=True, text=True, env=cli.env(),
                       cwd=cli.home, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    stdlib, files = p.stdout.splitlines()
    # torch names two of its modules' files "_classes.py" and "_ops.py": not a path
    return [Path(f) for f in files.split() if Path(f).is_absolute()], [Path(d) for d in stdlib.split()]


def test_the_venvs_hold_the_wheel_torch_and_pips_packages_and_nothing_of_the_source_tree(installed, lab):
    """Every module gpuflex loads comes from the venv's own site-packages, the torch folder
    or the standard library; numpy, a test-only package here, is not there at all."""
    for venv, imports in ((installed.control, "gpuflex.cli, gpuflex.db.engine, gpuflex.elastic"),
                          (installed.host, "gpuflex.hosts.hostops, gpuflex.elastic.coordinator.main, gpuflex.elastic")):
        files, stdlib = loaded_files(venv, imports, lab)
        allowed = [venv.site, installed.torch_dir, *stdlib]
        assert [f for f in files if not any(f.is_relative_to(d) for d in allowed)] == []
        assert venv.site / "gpuflex" / "elastic" / "__init__.py" in files
        numpy = subprocess.run([str(venv.python), "-c", "import numpy"], capture_output=True, env=lab.env(),
                               timeout=60)
        assert numpy.returncode != 0


def test_an_installed_wheel_upgrades_its_database_and_runs_each_kind_of_job_to_succeeded(installed, lab, tmp_path):
    """A plain command, an in-place job of the elastic example, a gang and a restart-elastic
    job of the restart example, at once on 7 slots, their workers run by the GPU host's venv."""
    where = subprocess.run([str(installed.control.python), "-c", "import gpuflex.db.engine as e; "
                            "print(e.MIGRATIONS_DIR)"], capture_output=True, text=True, env=lab.env(), cwd=lab.home)
    assert Path(where.stdout.strip()).is_relative_to(installed.control.site), where   # not the source tree's
    lab.ok("db", "upgrade")
    python = str(installed.host.python)
    restart = [python, str(EXAMPLES / "restart" / "ddp_ckpt.py"), "--epochs", "1", "--hidden", "16"]
    jobs = {
        "plain": lab.submit([python, "-c", "print('from the wheel')"]),
        "inplace": lab.submit([python, str(EXAMPLES / "elastic_mlp.py"), "--epochs", "2", "--hidden", "16"],
                              "--workers", "1:2"),
        "gang": lab.submit([*restart, "--ckpt-dir", str(tmp_path / "gang")], "--workers", "2"),
        "restart": lab.submit([*restart, "--ckpt-dir", str(tmp_path / "restart")], "--elastic", "restart",
                              "--workers", "1:2"),
    }
    assert {k: (j["elastic"], len(j["workers"])) for k, j in jobs.items()} == {
        "plain": (None, 1), "inplace": ("inplace", 2), "gang": (None, 2), "restart": ("restart", 2)}
    final = {k: lab.wait_final(j["id"]) for k, j in jobs.items()}
    logs = {k: lab("logs", str(j["id"])).stdout[-3000:] for k, j in final.items() if j["state"] != "succeeded"}
    assert {k: j["state"] for k, j in final.items()} == dict.fromkeys(jobs, "succeeded"), logs
    inplace = final["inplace"]
    assert (inplace["world_size"], inplace["generation"], inplace["exit_code"]) == (2, 1, 0), inplace  # formed
    assert "from the wheel" in lab.ok("logs", str(jobs["plain"]["id"])).stdout


def test_a_gpu_host_needs_only_torch_beside_gpuflex():
    """What runs on a GPU host (hostops, the relay, the coordinator, the runtime) imports no
    control-side package: `pip install --no-deps gpuflex-*.whl` beside torch is enough there."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('sqlalchemy', 'alembic', 'pydantic', 'pydantic_core', 'typer',\n"
        "                                   'click', 'rich', 'paramiko', 'filelock'):\n"
        "            raise ImportError('not on a GPU host: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import gpuflex.hosts.hostops, gpuflex.hosts.relay, gpuflex.elastic.coordinator.main, gpuflex.elastic\n"
        "from gpuflex.elastic import ElasticRun\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
