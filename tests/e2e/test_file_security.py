"""Issue 17, item 2: other users can neither read a job's secrets nor break its start.

The attacker is played for real: a unix user made for these tests (root only; skipped
otherwise) tries to read the database, the logs, the checkpoints and the job directory,
and creates `/tmp/gpuflex-*` directories before a job starts. Outputs are searched for
the job's secret and its --env values. Tests that start real processes run a tiny command
(no torch in the workers; the coordinator imports it).
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.config import HostConfig, parse_config
from gpuflex.control.pool import Pool
from gpuflex.control.requests import SubmitRequest
from gpuflex.control.service import JobService
from gpuflex.db.engine import open_database
from gpuflex.errors import TransportError
from gpuflex.hosts.transport import LocalTransport, SpawnSpec
from tests import REPO
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows, py, write_config
from tests.fakes.hosts import FakeHost, World

MALLORY = "gpuflex-mallory-f"   # this file's own attacker (other test files may make theirs)
ENV_VALUE = "s3cr3t-value"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes a second unix user")


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def mallory() -> str:
    """Another local user, removed at the end."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes a second unix user")
    made = False
    try:
        pwd.getpwnam(MALLORY)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", MALLORY], check=True)
        made = True
    yield MALLORY
    if made:
        subprocess.run(["userdel", "--remove", MALLORY], capture_output=True)


def as_user(user: str, command: str) -> subprocess.CompletedProcess:
    """`command` run by `sh` as `user` (no Python: the default interpreter lives under /root)."""
    return subprocess.run(["su", "-s", "/bin/sh", user, "-c", command], capture_output=True, text=True,
                          timeout=30)


@pytest.fixture
def open_tmp():
    """A directory under /tmp that every user may enter (pytest's own tmp is root's alone),
    so that only gpuflex's modes stand between the other user and the files."""
    d = tempfile.mkdtemp(prefix="gf-files-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)   # the usual umask: what the user's own files get
    yield
    os.umask(old)


# ---- the database ------------------------------------------------------------------------
def test_a_new_database_is_its_owners_alone(open_tmp, umask_022):
    sessions = open_database(f"sqlite:///{open_tmp}/state/sub/g.db")
    with sessions.begin() as s:   # a write: the -wal and -shm files exist now
        s.execute(__import__("sqlalchemy").text("CREATE TABLE t (x)"))
        files = sorted(p.name for p in (open_tmp / "state" / "sub").iterdir())
        assert {"g.db", "g.db-wal", "g.db-shm", "g.db.lock"} <= set(files)
        assert {f: mode(open_tmp / "state" / "sub" / f) for f in files} == {f: 0o600 for f in files}
    assert (mode(open_tmp / "state"), mode(open_tmp / "state" / "sub")) == (0o700, 0o700)
    assert mode(open_tmp) == 0o755   # a directory that was there is the user's business


def test_an_older_databases_world_readable_files_are_tightened(open_tmp, umask_022):
    db = open_tmp / "g.db"
    sessions = open_database(f"sqlite:///{db}")
    sessions.kw["bind"].dispose()
    for f in open_tmp.iterdir():
        os.chmod(f, 0o644)           # as the old gpuflex left them
    open_database(f"sqlite:///{db}")
    assert {f.name: mode(f) for f in open_tmp.iterdir()} == {f.name: 0o600 for f in open_tmp.iterdir()}


@root_only
def test_another_user_cannot_read_the_database(mallory, open_tmp, umask_022):
    sessions = open_database(f"sqlite:///{open_tmp}/g.db")
    (open_tmp / "public").write_text("readable\n")
    os.chmod(open_tmp / "public", 0o644)
    assert as_user(mallory, f"cat {open_tmp}/public").stdout == "readable\n"   # the probe works
    r = as_user(mallory, f"cat {open_tmp}/g.db")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    sessions.kw["bind"].dispose()


# ---- what hostops creates ----------------------------------------------------------------
def spawn_spec(base: Path, socket_dir: str, argv: list[str] | None = None) -> SpawnSpec:
    d = base / "work" / "jobs" / "tok"
    return SpawnSpec(argv=argv or ["sh", "-c", "echo hi; echo out > user-file"], cwd=str(base),
                     env={}, log=str(d / "worker-0.log"), exit_path=str(d / "worker-0.exit"),
                     private_dirs=[str(d), str(d / "checkpoints")], socket_dir=socket_dir)


def wait_exit(path: Path) -> None:
    end = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < end, f"no exit record {path}"
        time.sleep(0.05)


def test_a_spawned_processs_job_files_are_owner_only_and_the_users_own_files_keep_the_umask(
        open_tmp, umask_022):
    t = LocalTransport(HostConfig(name="local"))
    sock = f"/tmp/gpuflex-test-{os.urandom(8).hex()}"
    spec = spawn_spec(open_tmp, sock)
    try:
        t.spawn(spec)
        wait_exit(Path(spec.exit_path))
        d = open_tmp / "work" / "jobs" / "tok"
        dirs = (open_tmp / "work", open_tmp / "work" / "jobs", d, d / "checkpoints", sock)
        assert {p: mode(p) for p in dirs} == {p: 0o700 for p in dirs}
        assert (mode(spec.log), mode(spec.exit_path)) == (0o600, 0o600)
        assert mode(open_tmp / "user-file") == 0o644   # the script's own output: its umask
        assert t.cleanup([sock]) == [True] and not os.path.exists(sock)
    finally:
        shutil.rmtree(sock, ignore_errors=True)


@root_only
def test_hostops_never_uses_another_users_socket_directory_or_a_symlink(open_tmp):
    """With the old predictable name, a 0777 directory another user made first broke the
    job (PermissionError in its processes); now the spawn refuses it with a clear reason,
    before anything starts, and the caller picks a fresh name."""
    t = LocalTransport(HostConfig(name="local"))
    theirs = f"/tmp/gpuflex-test-{os.urandom(8).hex()}"
    os.mkdir(theirs)
    os.chmod(theirs, 0o777)
    os.chown(theirs, 4242, 4242)
    link = f"/tmp/gpuflex-test-{os.urandom(8).hex()}"
    os.symlink(str(open_tmp), link)
    wide = f"/tmp/gpuflex-test-{os.urandom(8).hex()}"
    os.mkdir(wide)
    os.chmod(wide, 0o777)   # ours, but others could have put things in it
    try:
        for d, why in ((theirs, "belongs to uid 4242"), (link, "is a symlink"), (wide, "not 0700")):
            with pytest.raises(TransportError, match=why):
                t.spawn(spawn_spec(open_tmp, d))
            assert t.cleanup([d]) == [d == wide]   # another user's and a symlink are left alone
        assert not (open_tmp / "work" / "jobs" / "tok" / "worker-0.exit").exists()   # nothing ran
    finally:
        for d in (theirs, wide):
            shutil.rmtree(d, ignore_errors=True)
        os.unlink(link)


# ---- secrets in outputs ------------------------------------------------------------------
def cli_run(home: Path, config: Path, *args: str) -> str:
    r = CliRunner().invoke(app, list(args), env={"HOME": str(home), "GPUFLEX_CONFIG": str(config),
                                                  "COLUMNS": "200"})
    assert r.exit_code == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_status_and_events_never_print_the_secret_or_an_env_value(home, config_path, db_path, busy_slots):
    out = cli_run(home, config_path, "submit", "--json", "--workers", "2", "--env", f"API_KEY={ENV_VALUE}",
                  "--", "python", "train.py")
    job = json.loads(out)
    assert (job["id"], job["state"], job["env"]) == (2, "queued", {"API_KEY": "<redacted>"})
    [(secret, env)] = db_rows(db_path, "SELECT secret, env FROM jobs WHERE id = 2")
    assert json.loads(env) == {"API_KEY": ENV_VALUE}     # the job still gets it
    all_secrets = [s for (s,) in db_rows(db_path, "SELECT secret FROM jobs")]   # the running job's too
    assert secret in all_secrets and all(all_secrets)
    outputs = [out] + [cli_run(home, config_path, *args) for args in (
        ("status",), ("status", "--json"), ("status", "2"), ("status", "2", "--json"),
        ("events", "2"), ("events", "2", "--json"), ("-v", "status", "2", "--json"),
        ("-v", "status", "1", "--json"))]
    for text in outputs:
        assert ENV_VALUE not in text and not any(s in text for s in all_secrets)
    assert "API_KEY" in outputs[4]


def test_a_bad_env_name_is_refused_without_echoing_its_value(home, config_path):
    r = CliRunner().invoke(app, ["submit", "--env", f"1API={ENV_VALUE}", "--", "true"],
                           env={"HOME": str(home), "GPUFLEX_CONFIG": str(config_path)})
    assert r.exit_code == 2 and "'1API'" in r.stderr and ENV_VALUE not in r.stdout + r.stderr


# ---- forged store records become events ---------------------------------------------------
class ForgedReport(FakeHost):
    """A simulated host whose coordinators report `forged` store records (as the real one
    does for records that fail authentication)."""

    forged: dict = {"count": 0, "last": None}

    def control_request(self, path, message, timeout=5.0):
        reply = super().control_request(path, message, timeout)
        return {**reply, "forged": dict(self.forged)} if message.get("op") == "status" else reply


def test_forged_records_the_coordinator_ignored_are_an_event_per_new_count(tmp_path):
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=2)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda h: ForgedReport(h, world)))
    try:
        job_id = svc.submit(SubmitRequest(argv=["python3", "t.py"], workdir=str(tmp_path)))

        def forged_events():
            return [(e.message, e.data) for e in svc.job(job_id).events if e.kind == "forged"]

        svc.refresh()
        assert forged_events() == []
        ForgedReport.forged = {"count": 2, "last": "members/7"}
        svc.refresh()
        svc.refresh()   # the same count again: no second event
        ForgedReport.forged = {"count": 3, "last": "desired_request"}
        svc.refresh()
        assert forged_events() == [
            ("ignored 2 forged store record(s) (last: members/7)", {"count": 2, "last": "members/7"}),
            ("ignored 1 forged store record(s) (last: desired_request)", {"count": 3, "last": "desired_request"})]
    finally:
        ForgedReport.forged = {"count": 0, "last": None}
        svc.close()


# ---- stale socket directories --------------------------------------------------------------
@pytest.fixture
def short_dir():
    d = Path(tempfile.mkdtemp(prefix="sw-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@root_only
def test_the_sweep_removes_only_our_stale_socket_directories_that_nothing_serves(tmp_path, short_dir):
    import socket

    from gpuflex.control.launch import SOCKET_NAME
    from gpuflex.hosts.hostops import sweep_socket_dirs

    root = short_dir   # a unix socket's path is at most 108 bytes
    kinds = ["empty", "dead-socket", "served", "fresh", "kept", "theirs", "link"]
    run = {k: f"gpuflex-{os.urandom(16).hex()}" for k in kinds}   # as control.launch names a run's
    for k in kinds[:6]:
        (root / run[k]).mkdir(mode=0o700)
    (root / "other-notours-prefix").mkdir()
    (root / "gpuflex-results").mkdir(mode=0o700)           # a user's own: it only starts alike
    (root / f"gpuflex-{os.urandom(16).hex()}-old").mkdir(mode=0o700)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(root / run["dead-socket"] / "w0.sock"))
    dead.close()                                   # the file stays, nobody listens: a killed worker
    served = socket.socket(socket.AF_UNIX)
    served.bind(str(root / run["served"] / "coord.sock"))
    served.listen(1)
    os.chown(root / run["theirs"], 4242, 4242)
    os.symlink(str(tmp_path), root / run["link"])
    old = time.time() - 3600
    for p in root.iterdir():
        if p.name != run["fresh"]:
            os.utime(p, (old, old), follow_symlinks=False)
    before = sorted(p.name for p in root.iterdir())
    try:
        removed = sweep_socket_dirs(str(root), SOCKET_NAME, [str(root / run["kept"])], 600)
    finally:
        served.close()
    assert sorted(removed) == sorted(str(root / run[k]) for k in ("dead-socket", "empty"))
    assert sorted(p.name for p in root.iterdir()) == sorted(set(before) - {run["dead-socket"], run["empty"]})
    assert (root / "gpuflex-results").is_dir() and tmp_path.exists()


# ---- real jobs, another real user ------------------------------------------------------------
def job_row(db: Path, job_id: int) -> dict:
    [(token, secret, socket_dir, state)] = db_rows(db, "SELECT token, secret, socket_dir, state FROM jobs "
                                                       "WHERE id = ?", (job_id,))
    return {"token": token, "secret": secret, "socket_dir": socket_dir, "state": state}


def wait_state(gf: GpuflexCLI, job_id: int, states: set[str]) -> dict:
    end = time.monotonic() + 180
    while True:
        job = gf.json("status", str(job_id))
        if job["state"] in states:
            return job
        assert time.monotonic() < end, f"job {job_id} still {job['state']}"
        time.sleep(0.5)


EXAMPLE = str(REPO / "examples" / "elastic_mlp.py")


@root_only
def test_another_user_can_neither_read_a_jobs_files_nor_break_its_start(mallory, open_tmp, umask_022):
    """The second job is the elastic example: its coordinator and its worker each serve a
    control socket in the run's directory, and it writes checkpoints."""
    cfg = open_tmp / "g.toml"                       # the DB in a directory everyone may enter
    cfg.write_text(f'[database]\nurl = "sqlite:///{open_tmp}/g.db"\n\n'
                   "[jobs]\ncancel_grace_s = 3\ncheckpoint_interval_s = 0.5\n\n"
                   f'[[hosts]]\nname = "local"\ngpus = "cpu:1"\nworkdir = "{open_tmp}/work"\n')
    gf = GpuflexCLI(open_tmp, cfg)
    db = open_tmp / "g.db"
    squatted: list[str] = []
    try:
        first = gf.submit(py("import time; time.sleep(3)"), "--name", "first")
        second = gf.submit([sys.executable, EXAMPLE, "--hidden", "32", "--epochs", "3", "--step-sleep", "0.02",
                            "--report", str(open_tmp / "report.json")],
                           "--name", "second", "--env", f"API_KEY={ENV_VALUE}")
        assert second["state"] == "queued"
        row = job_row(db, second["id"])
        # what another user could do with the token: the old predictable name, made first, 0777,
        # and names that would look like ours
        for d in (f"/tmp/gpuflex-{row['token']}", f"/tmp/gpuflex-{row['token']}-0",
                  f"/tmp/gpuflex-{os.urandom(16).hex()}"):
            r = as_user(mallory, f"mkdir -m 777 {d} && chmod 777 {d}")
            assert r.returncode == 0, r.stderr
            squatted.append(d)

        done = gf.wait_final(second["id"])
        job_dir = open_tmp / "work" / "jobs" / row["token"]
        log = job_dir / f"worker-{done['workers'][0]['wid']}.log"
        assert (done["state"], done["exit_code"]) == ("succeeded", 0), log.read_text()[-3000:]
        assert gf.wait_final(first["id"])["state"] == "succeeded"
        coordinator_log = (job_dir / "coordinator.log").read_text()
        assert "listening" in coordinator_log and "Traceback" not in coordinator_log + log.read_text()
        runs = [job_row(db, j["id"]) for j in (first, second)]
        assert all(r["socket_dir"].startswith("/tmp/gpuflex-") and len(r["socket_dir"]) == 45 for r in runs)
        assert not any(r["socket_dir"] in squatted for r in runs)
        assert [os.path.exists(r["socket_dir"]) for r in runs] == [False, False]   # removed at the end
        assert all(os.stat(d).st_uid == pwd.getpwnam(mallory).pw_uid for d in squatted)   # not used, not removed

        # another user reads nothing of it
        checkpoints = sorted((job_dir / "checkpoints").iterdir())
        assert checkpoints, "the example wrote no checkpoint"
        for command in (f"cat {db}", f"ls {open_tmp}/work", f"ls {job_dir}", f"cat {log}",
                        f"cat {checkpoints[0]}", f"cat {job_dir}/coordinator.log"):
            r = as_user(mallory, command)
            assert r.returncode != 0 and "Permission denied" in r.stderr, command
        # and not through the files' own modes either, with the directories opened up
        for d in (open_tmp / "work", open_tmp / "work" / "jobs", job_dir):
            os.chmod(d, 0o755)
        assert as_user(mallory, f"ls {job_dir}").returncode == 0
        files = [f for f in ("coordinator.log", "coordinator.exit", log.name, log.name[:-4] + ".exit")
                 if (job_dir / f).exists()]
        assert {"coordinator.log", log.name} <= set(files)
        for f in files:
            r = as_user(mallory, f"cat {job_dir}/{f}")
            assert r.returncode != 0 and "Permission denied" in r.stderr, f

        # nothing gpuflex prints or logs holds the secret or the --env value
        outputs = [gf.ok(*args).stdout for args in (
            ("status",), ("status", "--json"), ("status", str(second["id"])),
            ("status", str(second["id"]), "--json"), ("events", str(second["id"])),
            ("events", str(second["id"]), "--json"), ("logs", str(second["id"])))]
        outputs.append(coordinator_log)
        for text in outputs:
            assert row["secret"] not in text and ENV_VALUE not in text
    finally:
        cleanup_jobs(gf, db)
        for d in squatted:
            shutil.rmtree(d, ignore_errors=True)


@root_only
def test_a_cancelled_jobs_socket_directory_is_removed(open_tmp, umask_022):
    cfg = write_config(open_tmp, slots=1)
    gf = GpuflexCLI(open_tmp, cfg)
    db = open_tmp / "g.db"
    try:
        job = gf.submit(py("import time; time.sleep(120)"))
        wait_state(gf, job["id"], {"running"})
        sock = job_row(db, job["id"])["socket_dir"]
        end = time.monotonic() + 60
        while not glob.glob(f"{sock}/*.sock"):   # the coordinator's socket, once it is up
            assert time.monotonic() < end
            time.sleep(0.2)
        st = os.lstat(sock)
        assert (stat.S_ISDIR(st.st_mode), st.st_uid, mode(sock)) == (True, os.getuid(), 0o700)
        gf.ok("cancel", str(job["id"]))
        assert gf.json("status", str(job["id"]))["state"] == "cancelled"
        assert not os.path.exists(sock)
    finally:
        cleanup_jobs(gf, db)
