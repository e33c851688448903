"""`submit --sync` in-process (issue 33): the cap refusal leaving nothing recorded, the
code's address recorded and shown, and where each host's workers run. The job here waits
`--after` a queued job that can never start (5 workers on 4 slots), so no process is
started; the sending itself is tests/hosts/test_sync.py's and, over SSH,
tests/e2e/ssh/test_sync_ssh.py's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.config import load_config
from gpuflex.control import access
from gpuflex.control.launch import pack_code, worker_cwd
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from gpuflex.hosts.sync import cached_tar, pack_bytes
from tests.conftest import db_dump, db_rows, write_config


def run(cfg: Path, home: Path, *args: str):
    r = CliRunner().invoke(app, list(args), env={"HOME": str(home), "GPUFLEX_CONFIG": str(cfg), "COLUMNS": "200"})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


@pytest.fixture
def src(home) -> Path:
    d = home / "src"
    d.mkdir()
    (d / "train.py").write_text("print('hi')\n")
    (d / "weights.bin").write_bytes(b"x" * 3000)
    return d


def blocked(cfg: Path) -> None:
    """Job 1: queued forever (5 workers on 4 slots), for --after to wait on."""
    svc = JobService(load_config(str(cfg)))
    svc.refresh()
    with svc.sessions.begin() as s:
        s.add(Job(token="t0", name="big", state="queued", argv=["true"], workdir="/", env={},
                  min_workers=5, max_workers=5, gpus_per_worker=1, user=access.caller()))
    svc.close()


def test_over_the_cap_is_refused_with_nothing_recorded(home, src):
    cfg = write_config(home, extra="")
    cfg.write_text(cfg.read_text().replace("[jobs]\n", "[jobs]\nsync_cap_mib = 0.001\n"))
    blocked(cfg)
    before = db_dump(home / "g.db")
    r = run(cfg, home, "submit", "--sync", "--workdir", str(src), "--", "python", "train.py")
    assert r.exit_code == 2
    assert "over the cap of 0.0 MiB" in r.stderr and "weights.bin" in r.stderr and "Traceback" not in r.stderr
    assert db_dump(home / "g.db") == before


def test_sync_records_the_code_and_status_shows_it(home, src):
    cfg = write_config(home)
    blocked(cfg)
    r = run(cfg, home, "submit", "--sync", "--after", "1", "--workdir", str(src), "--json", "--", "python", "train.py")
    assert r.exit_code == 0, r.stderr
    sha = pack_bytes(src)[1].sha256
    job = json.loads(r.stdout)
    assert (job["sync"], job["code_sha256"], job["state"]) == (True, sha, "queued")
    assert Path(cached_tar(sha)).is_file()
    assert db_rows(home / "g.db", "SELECT sync, code_sha256 FROM jobs WHERE id = 2") == [(1, sha)]
    shown = run(cfg, home, "status", "2").stdout
    assert f"code: {sha[:12]} (--sync" in shown


def test_no_sync_anywhere_packs_nothing(home, src):
    cfg = write_config(home)
    blocked(cfg)
    r = run(cfg, home, "submit", "--after", "1", "--workdir", str(src), "--json", "--", "python", "train.py")
    assert json.loads(r.stdout)["code_sha256"] is None
    assert not (home / ".local/state/gpuflex/code").exists()


def test_no_sync_overrides_the_pools_sync_true(home, src):
    cfg = write_config(home)
    cfg.write_text(cfg.read_text().replace("[jobs]\n", "[jobs]\nsync = true\n"))
    blocked(cfg)
    r = run(cfg, home, "submit", "--no-sync", "--after", "1", "--workdir", str(src), "--json", "--", "python", "x.py")
    assert r.exit_code == 0, r.stderr
    assert (json.loads(r.stdout)["sync"], json.loads(r.stdout)["code_sha256"]) == (False, None)
    assert not (home / ".local/state/gpuflex/code").exists()   # nothing packed
    r = run(cfg, home, "submit", "--after", "1", "--workdir", str(src), "--json", "--", "python", "x.py")
    assert json.loads(r.stdout)["code_sha256"] == pack_bytes(src)[1].sha256   # the pool's default
    (src / "task.toml").write_text('[job]\nsync = false\nafter = "1"\nrun = "python x.py"\n')
    r = run(cfg, home, "submit", "--workdir", str(src), "--json", str(src / "task.toml"))
    assert json.loads(r.stdout)["code_sha256"] is None, r.stderr   # a task file's sync = false too


def test_a_host_with_sync_true_runs_the_sent_code_others_the_submit_directory(home, src):
    cfg = write_config(home, extra='sync = true\n\n[[hosts]]\nname = "far"\naddress = "far.lab"\ngpus = "cpu:2"\n')
    config = load_config(str(cfg))
    sha = pack_code(config, None, str(src))   # a host syncs: packed without --sync
    assert sha == pack_bytes(src)[1].sha256
    row = Job(workdir=str(src), sync=False, code_sha256=sha)
    assert worker_cwd(config, config.host("local"), row) == f"{home}/work/.gpuflex/code/{sha}"
    assert worker_cwd(config, config.host("far"), row) == str(src)
    row.sync = True   # --sync: every host
    assert worker_cwd(config, config.host("far"), row) == f"~/gpuflex/.gpuflex/code/{sha}"


def test_a_script_inside_the_synced_workdir_is_named_from_the_sent_copy(home, src):
    cfg = write_config(home)
    blocked(cfg)
    (src / "mine.sh").write_text("#!/bin/sh\n#GPUFLEX --priority 3\necho hi\n")
    (src / "mine.sh").chmod(0o755)
    r = run(cfg, home, "submit", "--sync", "--after", "1", "--workdir", "src", "--json", "src/mine.sh")
    job = json.loads(r.stdout)
    assert (job["argv"], job["priority"]) == (["./mine.sh"], 3)
    r = run(cfg, home, "submit", "--after", "1", "--workdir", "src", "--json", "src/mine.sh")
    assert json.loads(r.stdout)["argv"] == [str(src / "mine.sh")]   # without --sync: the path read
