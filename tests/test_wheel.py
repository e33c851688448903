"""gpuflex installs from a wheel (issue 14 item 1): the wheel carries its migrations, and an
installed copy, away from the source tree, creates its database, submits and shows a job.

The wheel is built without network (setuptools from this environment); the fresh venv gets
no gpuflex but the wheel's, and borrows this environment's dependencies (torch among them)
through a plain path entry, which does not run this environment's editable-install hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=300, cwd=out)
    assert build.returncode == 0, build.stderr[-3000:]
    [whl] = out.glob("gpuflex-*.whl")
    return whl


def test_the_wheel_holds_every_package_and_the_migrations(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "gpuflex").rglob("*.py")
                if "__pycache__" not in p.parts}
    missing = sorted(p for p in packages if not any(n.startswith(p + "/") for n in names))
    assert not missing, f"packages left out of the wheel (add them to pyproject's list): {missing}"
    versions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert versions and all(f"gpuflex/migrations/versions/{v}" in names for v in versions)
    assert {"gpuflex/migrations/env.py", "gpuflex/migrations/script.py.mako"} <= names


def test_an_installed_wheel_upgrades_its_database_submits_and_shows_a_job(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies, not gpuflex: this environment's site-packages holds gpuflex only as
    # an editable hook (.pth), which a path entry does not run
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    with zipfile.ZipFile(wheel) as z:   # what pip does for a pure wheel, without pip
        z.extractall(site)
    script = venv / "bin" / "gpuflex"
    script.write_text(f"#!{py}\nimport sys\nfrom gpuflex.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    work = tmp_path / "elsewhere"
    work.mkdir()
    cfg = work / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{work}/g.db"\n\n[[hosts]]\nname = "local"\n'
                   f'address = "local"\ngpus = "cpu:2"\nworkdir = "{work}/work"\npython = "{py}"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPUFLEX_CONFIG")}
    env.update(HOME=str(work), GPUFLEX_CONFIG=str(cfg))

    def run(*args: str) -> subprocess.CompletedProcess:
        p = subprocess.run([str(script), *args], capture_output=True, text=True, env=env, cwd=work, timeout=120)
        assert p.returncode == 0, f"gpuflex {' '.join(args)}: {p.stdout}\n{p.stderr}"
        return p

    where = subprocess.run([str(py), "-c", "import gpuflex.db.engine as e; print(e.__file__); "
                            "print(e.MIGRATIONS_DIR)"], capture_output=True, text=True, env=env, cwd=work)
    module, migrations = where.stdout.split()
    assert module.startswith(site) and migrations.startswith(site), where.stdout   # not the source tree
    run("db", "upgrade")
    job = json.loads(run("submit", "--json", "--", str(py), "-c", "print('from the wheel')").stdout)
    assert job["state"] in ("running", "succeeded")
    for _ in range(60):
        shown = json.loads(run("status", str(job["id"]), "--json").stdout)
        if shown["state"] == "succeeded":
            break
        subprocess.run(["sleep", "1"])
    assert shown["state"] == "succeeded", shown
    assert "from the wheel" in run("logs", str(job["id"])).stdout


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
        "import gpuflex.hosts.hostops, gpuflex.hosts.relay, gpuflex.elastic.coordinator, gpuflex.elastic\n"
        "from gpuflex.elastic import ElasticRun\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
