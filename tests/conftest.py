"""Shared fixtures: a throw-away home, a per-test gpuflex.toml, the CLI two ways, DB dumps.

Every test gets HOME and the working directory set to its own tmp_path, so nothing reads
or writes the real home, and `./gpuflex.toml` lookups see only what the test wrote.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# A pytest-xdist worker starts with COLUMNS=80 in its environment, and rich fixes a
# console's width from COLUMNS when the console is made (gpuflex.cli.common's, at import):
# every in-process CLI call of that worker then printed 80 columns wide, whatever COLUMNS
# the call gave. Without it the width is read at each print (the calls give 200).
os.environ.pop("COLUMNS", None)

# One intra-op thread for the torch this process and its direct children run (the
# standalone reference runs, the in-process unit tests), as a job's workers get from their
# CPU share. With torch's default (one thread per core), OpenMP's threads spin between the
# small ops of these tiny models, and on a loaded 2-core machine the spinning was most of
# the CPU: the elastic example's reference run took 22 to 27 s of CPU instead of 5 to 7 s,
# for the same parameters bit for bit. The console script does not inherit it
# (GpuflexCLI.env): a job's workers get their share as from a user's shell.
OMP_SET_HERE = "OMP_NUM_THREADS" not in os.environ
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests import schema_template as schema_template_mod
from tests.tiers import file_key, fast_tier_starts_no_process, heaviest_first, mark_tiers  # noqa: F401 (an autouse fixture)

FINAL_STATES = {"succeeded", "failed", "cancelled", "timeout"}
# generous: a job launch starts a coordinator that imports torch, on a busy 2-core box
JOB_DEADLINE_S = 180
# the commands the tests poll, which read and refresh: `GpuflexCLI.json` runs them in the
# test's own process, where gpuflex is imported already. A console-script process costs
# ~1 s of CPU to start on this 2-core machine, and polling a job every second or half
# second with one starved that job's own processes of a core (a whole suite's polls were
# most of its CPU). Every other call, and every call from a thread, is the console script.
POLLED = frozenset({"status", "events", "hosts"})


def gpuflex_script() -> str:
    """The installed `gpuflex` console script (beside this interpreter, else on PATH)."""
    here = Path(sys.executable).parent / "gpuflex"
    if here.exists():
        return str(here)
    found = shutil.which("gpuflex")
    if not found:
        pytest.fail("the gpuflex console script is not installed (pip install -e .)")
    return found


def write_config(tmp_path: Path, *, slots: int = 4, grace_s: float = 3, name: str = "g.toml",
                 extra: str = "") -> Path:
    """A gpuflex.toml with one local CPU-slot host and its DB and workdir under tmp_path."""
    cfg = tmp_path / name
    cfg.write_text(
        f'[database]\nurl = "sqlite:///{tmp_path}/g.db"\n\n'
        f"[jobs]\ncancel_grace_s = {grace_s}\n\n"
        f'[[hosts]]\nname = "local"\naddress = "local"\ngpus = "cpu:{slots}"\n'
        f'workdir = "{tmp_path}/work"\n' + extra
    )
    return cfg


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by the markers it adds
def pytest_collection_modifyitems(items):
    """Each test's tier markers from the fixtures it uses, and the heaviest files first
    (tests/tiers.py)."""
    mark_tiers(items)
    heaviest_first(items)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """HOME and cwd are tmp_path; no $GPUFLEX_CONFIG leaks in from outside."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("GPUFLEX_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def config_path(home) -> Path:
    return write_config(home)


@pytest.fixture
def db_path(home) -> Path:
    return home / "g.db"


class GpuflexCLI:
    """Runs the installed console script in a subprocess with the test's config and home."""

    def __init__(self, home: Path, config: Path | None) -> None:
        self.home = home
        self.config = config
        self.script = gpuflex_script()

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["HOME"] = str(self.home)
        env.pop("GPUFLEX_CONFIG", None)
        if OMP_SET_HERE:
            env.pop("OMP_NUM_THREADS", None)
        if self.config is not None:
            env["GPUFLEX_CONFIG"] = str(self.config)
        env["COLUMNS"] = "200"
        env.update(extra)
        return env

    def __call__(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.script, *args], capture_output=True, text=True,
                              timeout=timeout, env=env or self.env(), cwd=cwd or self.home)

    def ok(self, *args: str) -> subprocess.CompletedProcess:
        p = self(*args)
        assert p.returncode == 0, f"gpuflex {' '.join(args)} -> {p.returncode}\n{p.stdout}\n{p.stderr}"
        assert "Traceback" not in p.stdout + p.stderr
        return p

    def json(self, *args: str):
        if args[0] in POLLED and self.script == gpuflex_script() \
                and threading.current_thread() is threading.main_thread():
            return json.loads(self.inside(*args, "--json"))
        return json.loads(self.ok(*args, "--json").stdout)

    def inside(self, *args: str, timeout: float = 120) -> str:
        """`gpuflex ARGS` run in this process (the same command objects, environment,
        working directory and exit-code rules as the console script, and its `timeout`),
        its stdout; the test fails as `ok` fails it, on an exit code, a traceback or an
        exception."""
        from tests import clirun

        here = os.getcwd()
        os.chdir(self.home)
        try:
            r = clirun.run(args, self.env(), timeout_s=timeout)
        finally:
            os.chdir(here)
        assert r.exit_code == 0, f"gpuflex {' '.join(args)} -> {r.exit_code}\n{r.stdout}\n{r.stderr}"
        assert "Traceback" not in r.stdout + r.stderr
        return r.stdout

    def submit(self, argv: list[str], *options: str) -> dict:
        """`gpuflex submit OPTIONS --json -- ARGV`; returns the job object it prints."""
        p = self.ok("submit", *options, "--json", "--", *argv)
        return json.loads(p.stdout)

    def wait_final(self, job_id: int, deadline_s: float = JOB_DEADLINE_S) -> dict:
        """Poll `status ID --json` (each call is a refresh) until the job's state is final."""
        end = time.monotonic() + deadline_s
        while True:
            job = self.json("status", str(job_id))
            if job["state"] in FINAL_STATES:
                return job
            if time.monotonic() > end:
                pytest.fail(f"job {job_id} still {job['state']} after {deadline_s} s: {job}")
            time.sleep(1.0)


@pytest.fixture
def gf(home, config_path, db_path):
    """The console script with this test's config; cancels and kills leftovers at teardown."""
    cli = GpuflexCLI(home, config_path)
    yield cli
    cleanup_jobs(cli, db_path)


BUSY_SLOTS = 3   # of write_config's 4: a job that needs 2 waits now, though the pool could hold it


@pytest.fixture
def busy_slots(home, config_path, db_path) -> dict:
    """Job 1 ("busy") running on 3 of the 4 slots of the test's host, its workers a real
    `sleep` that never ends by itself: a job submitted after it that needs 2 or more slots
    waits because the pool is busy now (a job the pool could never hold is refused).
    At teardown every job left is cancelled newest first, so no waiting job is ever started
    by the slots coming free, then leftovers are killed."""
    from tests import clirun

    def invoke(*args: str):
        r = clirun.invoke(home, config_path, *args)
        assert r.exit_code == 0, f"gpuflex {' '.join(args)} -> {r.exit_code}\n{r.stdout}\n{r.stderr}"
        return r

    job = json.loads(invoke("submit", "--json", "--name", "busy", "--workers", str(BUSY_SLOTS),
                            "--", "sleep", "600").stdout)
    assert (job["id"], job["state"], len(job["workers"])) == (1, "running", BUSY_SLOTS), job
    yield job
    try:
        for (job_id,) in db_rows(db_path, "SELECT id FROM jobs ORDER BY id DESC"):
            if db_rows(db_path, "SELECT state FROM jobs WHERE id = ?", (job_id,))[0][0] not in FINAL_STATES:
                invoke("cancel", str(job_id))
    finally:
        cleanup_jobs(GpuflexCLI(home, config_path), db_path)


def wait_for(cli: "GpuflexCLI", job_id: int, pred, what: str, deadline_s: float = 300,
             every_s: float = 1.0) -> dict:
    """`status --json` of the job, polled until `pred` holds; the test fails (with the job
    and the end of its logs) once the job has ended or `deadline_s` passed."""
    end = time.monotonic() + deadline_s
    while True:
        job = cli.json("status", str(job_id))
        if pred(job):
            return job
        if job["state"] in FINAL_STATES or time.monotonic() > end:
            pytest.fail(f"job {job_id}: gave up waiting for {what}: {json.dumps(job)[:2000]}\n"
                        + cli("logs", str(job_id)).stdout[-4000:])
        time.sleep(every_s)


def cleanup_jobs(cli: GpuflexCLI, db_path: Path) -> None:
    """Cancel every job that is not final, then SIGKILL any process group the DB names."""
    if not db_path.exists():
        return
    for job_id, state in db_rows(db_path, "SELECT id, state FROM jobs"):
        if state not in FINAL_STATES:
            cli("cancel", str(job_id), timeout=60)
    from gpuflex.hosts.hostops import group_alive

    pgids = [r[0] for r in db_rows(db_path, "SELECT pgid FROM workers WHERE pgid IS NOT NULL")]
    pgids += [r[0] for r in db_rows(db_path, "SELECT store_pgid FROM jobs WHERE store_pgid IS NOT NULL")]
    for pgid in pgids:
        if group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def db_rows(db_path: Path, sql: str, params: tuple = ()) -> list[tuple]:
    con = sqlite3.connect(str(db_path), timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def db_dump(db_path: Path) -> dict[str, list[tuple]]:
    """Every row of every table (sorted), to prove a command changed nothing."""
    con = sqlite3.connect(str(db_path), timeout=30)
    try:
        tables = [r[0] for r in con.execute(
            "SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {t: sorted(con.execute(f'SELECT * FROM "{t}"').fetchall(), key=repr) for t in tables}
    finally:
        con.close()


def py(code: str) -> list[str]:
    """argv running `code` with this interpreter (the workers' python)."""
    return [sys.executable, "-c", code]


def add_finished_job(config_path: Path, name: str, logs: list[Path]) -> int:
    """Record a succeeded job whose workers wrote `logs` (no processes); returns its id."""
    from gpuflex.config import load_config
    from gpuflex.control import access
    from gpuflex.control.service import JobService
    from gpuflex.db.models import Job, Worker

    svc = JobService(load_config(str(config_path)))
    try:
        svc.refresh()
        with svc.sessions.begin() as s:
            job = Job(token=f"t{time.time_ns()}"[-12:], name=name, state="succeeded", argv=["true"],
                      workdir=str(config_path.parent), env={}, min_workers=len(logs),
                      max_workers=len(logs), gpus_per_worker=1, user=access.caller(), world_size=len(logs),
                      exit_code=0, started_at=time.time(), ended_at=time.time())
            for wid, log in enumerate(logs):
                job.workers.append(Worker(wid=wid, rank=wid, host="local", gpus=[wid], state="exited",
                                          exit_code=0, log_path=str(log), exit_path=f"{log}.exit"))
            s.add(job)
            s.flush()
            return job.id
    finally:
        svc.close()


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` (e.g. "256k") mounted at `path` (made here) for the block: a real
    full disk. Skips the test where it cannot be mounted (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                                            str(path)], capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(autouse=True)
def gpuflex_logger_restored():
    """An in-process CLI run (CliRunner) sets the "gpuflex" logger's level and handler, as
    the CLI does for its process; put them back so a later test's log capture sees what it
    would alone."""
    logger = logging.getLogger("gpuflex")
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


@pytest.fixture(autouse=True, scope="session")
def cli_built_once():
    """Every in-process CLI call (typer's CliRunner, here and in the tests' own modules)
    reuses the click command built from the app (tests/clirun.py, `built_command`)."""
    import typer.testing

    def built(typer_app):
        from tests import clirun   # here: importing it imports gpuflex.cli

        return clirun.built_command(typer_app)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(typer.testing, "_get_command", built)
        yield


@pytest.fixture(scope="session")
def schema_template(tmp_path_factory):
    """The session's template database (tests/schema_template.py), migrated on first use."""
    from alembic import command
    from alembic.script import ScriptDirectory

    return schema_template_mod.Template(command.upgrade, tmp_path_factory.mktemp("schema-template"),
                                        ScriptDirectory.from_config)


@pytest.fixture(autouse=True)
def migrated_once(request, monkeypatch):
    """A new SQLite database of this process gets the template's schema instead of running
    every migration again (tests/schema_template.py), except in REAL_MIGRATIONS' files."""
    if file_key(request.node.path).startswith(schema_template_mod.REAL_MIGRATIONS):
        return
    from alembic import command
    from alembic.script import ScriptDirectory

    template = request.getfixturevalue("schema_template")
    monkeypatch.setattr(command, "upgrade", template.upgrade)
    monkeypatch.setattr(ScriptDirectory, "from_config", template.script_directory)


@pytest.fixture(scope="session")
def pg_cluster():
    """One throw-away PostgreSQL server for the whole session (tests/pgbed.py), stopped at
    its end. Skips where PostgreSQL is missing and cannot be installed (not root); as root
    a missing one is a failure, since `make test` installs it."""
    from tests import pgbed

    reason = pgbed.missing_reason()
    if reason is not None:
        if os.geteuid() == 0:
            pytest.fail(f"{reason}: run make test, or apt-get install postgresql")
        pytest.skip(reason)
    cluster = pgbed.start_cluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(pg_cluster) -> str:
    """The URL of a fresh, empty database of the session's PostgreSQL server."""
    return pg_cluster.database()


def exits_without_teardown(worker):
    """An mp.spawn worker that used gloo, made to leave with os._exit(0) once it returned
    (an exception still reaches mp.spawn): torch 2.13's gloo threads can free a work that
    holds a Python object while the interpreter finalizes, and the process then aborts
    ("terminate called without an active exception"; examples/torchrun/ddp_tutorial.py).
    That is torch's exit, not the test's subject: 2 in 8 runs of tests/e2e/test_fsdp_reshard_processes.py aborted."""
    @functools.wraps(worker)
    def run(*args):
        worker(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return run
