"""`gpuflex submit --resume-from PATH` (issue 13), the control side: the checkpoint directory
of an earlier job, checked at the edge (an in-place job only; on a pool of this machine, a
readable checkpoint directory nobody but the caller could have written), stored absolute
as `jobs.resume_from`, shown in the job's JSON and given to every worker as
GPUFLEX_RESUME_FROM. Reading the checkpoint is the runtime's (gpuflex.elastic)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import gpuflex.cli.render as render
from gpuflex.cli import app
from gpuflex.config import load_config, parse_config
from gpuflex.control.pool import Pool
from gpuflex.control.resume import check_checkpoint_dir
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.elastic.protocol.env import RESUME_FROM, WorkerEnv
from gpuflex.errors import UsageError
from gpuflex.jobspec import resume_path
from tests.conftest import db_dump, py
from tests.fakes.hosts import FakeHost, World

IS_ROOT = os.getuid() == 0


def checkpoint_dir(root: Path, name: str = "ck", files: tuple[str, ...] = ("checkpoint.pt",)) -> Path:
    """A checkpoint directory as the runtime leaves one: 0700, its files 0600."""
    d = root / name
    d.mkdir(mode=0o700)
    for f in files:
        (d / f).write_bytes(b"not read by the control side")
        (d / f).chmod(0o600)
    return d


# ---- the path, pure -------------------------------------------------------------------------
@pytest.mark.parametrize("value,expected", [
    ("ck", "/home/u/ck"),                         # relative: against the caller's cwd
    ("./runs/../ck/", "/home/u/ck"),              # normalised
    ("/data//jobs/./ck", "/data/jobs/ck"),
    ("~/ck", "HOME/ck"),                          # ~ expanded (a path copied from status --json)
])
def test_the_path_is_made_absolute_against_the_callers_cwd_and_normalised(value, expected, home):
    assert resume_path(value, "inplace", "/home/u") == expected.replace("HOME", str(home))


@pytest.mark.parametrize("elastic,words", [
    (None, "this is a gang job"),
    ("restart", "this is a restart job, whose script resumes from its own checkpoints"),
])
def test_only_an_in_place_job_resumes_from_gpuflexs_checkpoint(elastic, words):
    with pytest.raises(UsageError, match="--resume-from applies to in-place jobs") as e:
        resume_path("/ck", elastic, "/")
    assert words in str(e.value)


def test_the_worker_environment_carries_the_path_both_ways():
    env = WorkerEnv(checkpoint_dir="/w/ck", resume_from="/data/old job/ck")
    assert env.to_env()[RESUME_FROM] == "/data/old job/ck"
    assert WorkerEnv.from_environ(env.to_env()) == env
    assert RESUME_FROM not in WorkerEnv().to_env() and WorkerEnv.from_environ({}).resume_from is None


# ---- bad input at the CLI: exit 2, one line, the database unchanged ---------------------------
def _bad_dirs(home: Path) -> dict[str, Path]:
    """Checkpoint directories each failing one check (named by the words its refusal holds)."""
    out = {"is not a directory": home / "a-file", "no such directory": home / "nowhere"}
    out["is not a directory"].write_text("x")
    out["holds no checkpoint.pt or checkpoint.prev.pt"] = checkpoint_dir(home, "empty", ())
    d = checkpoint_dir(home, "open-dir")
    d.chmod(0o775)
    out["the directory is writable by group or others (mode 775)"] = d
    d = checkpoint_dir(home, "open-file", ("checkpoint.pt", "checkpoint.prev.pt"))
    (d / "checkpoint.prev.pt").chmod(0o666)
    out["checkpoint.prev.pt is writable by group or others (mode 666)"] = d
    d = checkpoint_dir(home, "dir-file", ())
    (d / "checkpoint.pt").mkdir(mode=0o700)
    out["checkpoint.pt is not a regular file"] = d
    d = checkpoint_dir(home, "broken-link", ())
    (d / "checkpoint.pt").symlink_to(home / "gone")
    out["checkpoint.pt vanished (or is a broken link)"] = d
    d = checkpoint_dir(home, "open-dcp")
    (d / "dcp" / "step-3").mkdir(mode=0o700, parents=True)
    (d / "dcp").chmod(0o700)
    (d / "dcp" / "step-3" / ".metadata").write_bytes(b"a pickle")
    (d / "dcp" / "step-3" / ".metadata").chmod(0o622)
    out["dcp/step-3/.metadata is writable by group or others (mode 622)"] = d
    return out


def submit_cli(home: Path, config_path: Path, *args: str):
    return CliRunner().invoke(app, ["submit", *args, "--", "python3", "train.py"],
                              env={"HOME": str(home), "GPUFLEX_CONFIG": str(config_path)})


def check_refused(home: Path, config_path: Path, db_path: Path, args: list[str], words: str) -> None:
    JobService(load_config(str(config_path))).refresh()
    before = db_dump(db_path)
    r = submit_cli(home, config_path, *args)
    assert r.exit_code == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert db_dump(db_path) == before


def test_each_bad_checkpoint_directory_is_refused_naming_the_failed_check(config_path, db_path, home):
    for words, path in _bad_dirs(home).items():
        check_refused(home, config_path, db_path, ["--workers", "1:2", "--resume-from", str(path)], words)


@pytest.mark.parametrize("args,words", [
    (["--workers", "2"], "this is a gang job"),
    (["--workers", "1:2", "--elastic", "restart"], "this is a restart job"),
])
def test_a_gang_or_restart_job_with_resume_from_is_refused(config_path, db_path, home, args, words):
    ck = checkpoint_dir(home)
    check_refused(home, config_path, db_path, [*args, "--resume-from", str(ck)], words)


@pytest.mark.parametrize("value,words", [
    ("", "--resume-from '': give the checkpoint directory of an earlier job"),
    ("ck\nrm -rf", "holds a NUL byte, a line break or bytes that are not UTF-8"),
])
def test_an_empty_path_or_one_with_a_line_break_is_refused(config_path, db_path, home, value, words):
    check_refused(home, config_path, db_path, ["--workers", "1:2", "--resume-from", value], words)


@pytest.mark.skipif(not IS_ROOT, reason="giving a directory to another user takes root")
def test_a_checkpoint_directory_of_another_user_is_refused(config_path, db_path, home):
    ck = checkpoint_dir(home)
    os.chown(ck / "checkpoint.pt", 65534, -1)
    check_refused(home, config_path, db_path, ["--workers", "1:2", "--resume-from", str(ck)],
                  "checkpoint.pt belongs to uid 65534, not to you")


def test_an_unreadable_checkpoint_is_refused(home, monkeypatch):
    """As root every file reads, so the caller's access is what `os.access` answers here."""
    ck = checkpoint_dir(home)
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).endswith("checkpoint.pt"))
    with pytest.raises(UsageError, match="you cannot read checkpoint.pt"):
        check_checkpoint_dir(str(ck))


# ---- a good submit ----------------------------------------------------------------------------
def test_a_good_path_is_stored_absolute_shown_and_given_to_every_worker(gf, home, tmp_path):
    """A real in-place job on the local pool: each worker writes what it was given."""
    ck = checkpoint_dir(home, files=("checkpoint.prev.pt",))   # the previous one alone will do
    (home / "runs").mkdir()
    out = home / "out"
    out.mkdir()
    code = ("import os; p = os.path.join(%r, os.environ['GPUFLEX_WORKER_ID']); "
            "open(p, 'w').write(os.environ.get('GPUFLEX_RESUME_FROM', 'unset'))" % str(out))
    job = gf.submit(py(code), "--workers", "2:2", "--elastic", "inplace", "--resume-from", "runs/../ck/")
    assert job["resume_from"] == str(ck)
    done = gf.wait_final(job["id"])
    assert done["resume_from"] == str(ck) and done["checkpoint_dir"]
    assert sorted(p.name for p in out.iterdir()) == ["0", "1"]
    assert {p.read_text() for p in out.iterdir()} == {str(ck)}


def test_a_job_without_resume_from_has_none_and_its_workers_no_variable(gf, home):
    out = home / "env"
    job = gf.submit(py("import os; open(%r, 'w').write(os.environ.get('GPUFLEX_RESUME_FROM', 'unset'))"
                       % str(out)), "--workers", "1:1", "--elastic", "inplace")
    assert job["resume_from"] is None
    gf.wait_final(job["id"])
    assert out.read_text() == "unset"


def test_on_ssh_hosts_the_path_is_the_workers_to_check_and_every_worker_gets_it(tmp_path):
    """A pool of remote hosts (simulated: tests/fakes/hosts.py): the path names a directory
    over there, so nothing here is looked at; it is stored normalised and passed on."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=2)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"},
                        "hosts": [{"name": "a", "address": "10.9.1.1", "workdir": "/w"},
                                  {"name": "b", "address": "10.9.1.2", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    try:
        job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=4,
                                          workdir=str(tmp_path), resume_from="/shared/runs//7/ck/"))
        info = svc.job(job_id, events=False)
        assert render.job_json(info)["resume_from"] == "/shared/runs/7/ck"
        with svc.sessions() as s:
            token = svc.get(s, job_id).token
        procs = world.workers(token).values()
        assert len(procs) == 4 and {p.env[RESUME_FROM] for p in procs} == {"/shared/runs/7/ck"}
    finally:
        svc.close()


def test_submit_help_names_the_option():
    r = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "--resume-from" in r.stdout
