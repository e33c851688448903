"""PostgreSQL as the job database (issue 14 item 3), the concurrency contract on both
backends, and bad database input (item 6).

Against the session's throw-away server (tests/pgbed.py): the migrations give exactly the
models' schema; the CLI submits, scales and cancels through it; the advisory locks exclude
each other per purpose and per database, and a lock lost with its connection is never
taken for held (nothing is committed). On SQLite and on PostgreSQL alike, many commands at
once (submits, status loops, harvest ticks) record every job once, give no device twice
and fail none. A malformed URL, an unreachable server, a missing driver, a read-only
SQLite file and a directory the user cannot enter each end in one line and exit 2, with
nothing changed.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from gpuflex.db.engine import current_revision, head_revision, make_engine, open_database, upgrade
from gpuflex.db.locks import AdvisoryLock, database_lock
from gpuflex.db.models import Base, Host
from gpuflex.errors import DatabaseError
from tests import REPO
from tests.conftest import GpuflexCLI, db_dump, write_config
from tests.cli.test_bad_input import assert_rejected, make_run

pytestmark = pytest.mark.postgres   # the PostgreSQL server, and the CLI as processes against it and SQLite

LIVE = ("starting", "running", "leaving")


def configured(home: Path, url: str, slots: int = 4) -> Path:
    """write_config's gpuflex.toml (one local host of `slots` CPU slots) with `url` as the DB."""
    cfg = write_config(home, slots=slots)
    cfg.write_text(cfg.read_text().replace(f"sqlite:///{home}/g.db", url))
    return cfg


def rows(url: str, sql: str) -> list[tuple]:
    if url.startswith("sqlite"):
        engine = sa.create_engine(url)
    else:
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def until(pred, what: str, deadline_s: float = 30):
    end = time.monotonic() + deadline_s
    while not (value := pred()):
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.1)
    return value


def stop_everything(cfg: Path) -> None:
    """Cancel every job not ended, newest first (so no queued one starts on the way)."""
    from gpuflex.config import load_config
    from gpuflex.control.service import JobService

    svc = JobService(load_config(str(cfg)))
    try:
        for job in sorted(svc.jobs(), key=lambda j: -j.id):
            if job.state in ("queued", "running", "scaling"):
                svc.cancel(str(job.id))
    finally:
        svc.close()


# ---- the schema and the CLI --------------------------------------------------------------
def test_migrations_give_exactly_the_models_schema_on_postgresql(pg_url):
    engine = make_engine(pg_url)
    assert current_revision(engine) is None
    assert upgrade(engine) is True
    assert upgrade(engine) is False
    assert current_revision(engine) == head_revision(engine)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        assert compare_metadata(ctx, Base.metadata) == []
        assert set(sa.inspect(conn).get_table_names()) == set(Base.metadata.tables) | {"alembic_version"}
    engine.dispose()


_UPGRADE = ("import json, sys\nfrom gpuflex.db.engine import make_engine, upgrade, current_revision\n"
            "e = make_engine(sys.argv[1])\nprint(json.dumps([upgrade(e), current_revision(e)]))\n")


def test_concurrent_first_use_migrates_once_under_the_advisory_lock(pg_url):
    procs = [subprocess.Popen([sys.executable, "-c", _UPGRADE, pg_url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    head = head_revision(make_engine(pg_url))
    assert sorted(results) == [[False, head]] * 3 + [[True, head]]
    assert rows(pg_url, "SELECT version_num FROM alembic_version") == [(head,)]


def test_the_queries_that_read_json_fields_answer_as_on_sqlite(pg_url):
    from gpuflex.db import queries
    from gpuflex.db.models import Event, Job

    sessions = open_database(pg_url)
    with sessions.begin() as s:
        job = Job(token="tq", name="q", state="running", argv=["x"], workdir="/", env={},
                  min_workers=1, max_workers=1, gpus_per_worker=1, user="u")
        job.events += [Event(kind="k", message="m", data={"wid": 1, "count": 3}),
                       Event(kind="k", message="m", data={"wid": 1, "count": 5}),
                       Event(kind="k", message="m", data={"wid": 2}),
                       Event(kind="r", message="m", data={"cause": "oom"}, count=4),
                       Event(kind="r", message="m", data={"cause": "other"})]
        s.add(job)
        s.flush()
        assert queries.max_count_by_wid(s, job.id, "k", 0) == {1: 5, 2: 0}
        assert queries.events_by_cause(s, job.id, "r", ["oom", "other", "none"]) == {"oom": 4, "other": 1, "none": 0}
        assert queries.job_states(s, [job.id, 999]) == {job.id: [(job.id, "running")], 999: []}


def test_submit_status_scale_cancel_through_postgresql(home, pg_url):
    cfg = configured(home, pg_url)
    gf = GpuflexCLI(home, cfg)
    try:
        assert "upgraded to revision" in gf.ok("db", "upgrade").stdout
        job = gf.submit(["sleep", "300"], "--name", "pg", "--workers", "1:3", "--elastic", "restart")
        assert (job["state"], len(job["workers"])) == ("running", 3)
        assert "resizing to 1" in gf.ok("scale", "pg", "1").stdout
        job = gf.json("status", "pg")
        assert job["target_workers"] == 1
        assert [w["gpus"] for w in job["workers"] if w["state"] in LIVE] == [[0]]
        gf.ok("cancel", "pg")
        assert gf.json("status", "pg")["state"] == "cancelled"
        assert rows(pg_url, "SELECT name, state FROM jobs") == [("pg", "cancelled")]
        assert rows(pg_url, "SELECT count(*) FROM workers WHERE state IN ('starting', 'running', 'leaving')") == [(0,)]
        assert "already at revision" in gf.ok("db", "upgrade").stdout
    finally:
        stop_everything(cfg)


# ---- the advisory locks ------------------------------------------------------------------
def test_advisory_locks_exclude_each_other_per_purpose_and_per_database(pg_cluster, pg_url):
    other_db = pg_cluster.database()
    ops = database_lock(pg_url, "ops")
    assert isinstance(ops, AdvisoryLock)
    assert ops.acquire()
    try:
        second = database_lock(pg_url, "ops")
        assert second.acquire(blocking=False) is False
        assert second.holder().startswith(f"pid {os.getpid()} on ")
        for lock in (database_lock(pg_url, "harvest"), database_lock(other_db, "ops")):
            assert lock.acquire(blocking=False) is True   # another purpose, another database
            lock.release()
        waited: list[bool] = []
        waiter = threading.Thread(target=lambda: waited.append(second.acquire()))
        waiter.start()
        until(lambda: rows(pg_url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                   "AND NOT granted") == [(1,)], "the second ops lock to wait")
        assert waited == []
    finally:
        ops.release()
    waiter.join(timeout=30)
    assert waited == [True] and second.holds() and not ops.holds()
    second.release()
    assert rows(pg_url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == [(0,)]


def test_a_lock_lost_with_its_connection_is_not_taken_for_held(pg_cluster, pg_url):
    sessions = open_database(pg_url)
    lock = database_lock(pg_url, "ops")
    lock.acquire()
    assert lock.holds()
    pg_cluster.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                   f"WHERE application_name LIKE 'gpuflex ops pid {os.getpid()} %'", database="postgres")
    until(lambda: not lock.holds(), "the lock's connection to end")
    taker = database_lock(pg_url, "ops")
    assert taker.acquire(blocking=False)   # the server gave it away: someone else may act now
    with pytest.raises(DatabaseError, match="lost the connection that held the database's ops lock"):
        with sessions.begin() as s:
            s.add(Host(name="h", address="local"))
    assert rows(pg_url, "SELECT count(*) FROM hosts") == [(0,)]   # nothing committed
    lock.release()
    taker.release()
    with sessions.begin() as s:   # no lock held: commits go through again
        s.add(Host(name="h", address="local"))
    assert rows(pg_url, "SELECT name FROM hosts") == [("h",)]


# ---- many commands at once, on both backends --------------------------------------------
SUBMITS = 10   # with 3 status loops and 3 harvest ticks: 16 commands at once
SLOTS = 2   # each running job has a coordinator that imports torch: keep them few


@pytest.fixture(params=["sqlite", "postgresql"])
def backend_url(request, home) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{home}/g.db"
    return request.getfixturevalue("pg_url")


def test_many_commands_at_once_record_every_job_once_and_give_no_device_twice(home, backend_url):
    cfg = configured(home, backend_url, slots=SLOTS)
    gf = GpuflexCLI(home, cfg)
    status_loop = f"for i in 1 2; do {gf.script} status --json >/dev/null || exit 1; done"
    argvs = [[gf.script, "submit", "--name", f"c{i}", "--", "sleep", "300"] for i in range(SUBMITS)]
    argvs += [["sh", "-c", status_loop]] * 3 + [[gf.script, "harvest"]] * 3
    try:
        procs = [subprocess.Popen(argv, env=gf.env(), cwd=home, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for argv in argvs]
        results = [(p.args, *p.communicate(timeout=300), p.returncode) for p in procs]
        failed = [r for r in results if r[3] != 0 or "error" in r[2] or "Traceback" in r[2]]
        assert failed == []
        names = sorted(n for (n,) in rows(backend_url, "SELECT name FROM jobs"))
        assert names == sorted(f"c{i}" for i in range(SUBMITS))
        live = rows(backend_url, "SELECT w.host, w.gpus FROM workers w JOIN jobs j ON j.id = w.job_id "
                                 "WHERE w.state IN ('starting', 'running', 'leaving')")
        devices = [(host, d) for host, gpus in live for d in (json.loads(gpus) if isinstance(gpus, str) else gpus)]
        assert len(devices) == len(set(devices)) == SLOTS   # the pool full, no device twice
        states = sorted(s for (s,) in rows(backend_url, "SELECT state FROM jobs"))
        assert states == ["queued"] * (SUBMITS - SLOTS) + ["running"] * SLOTS
    finally:
        stop_everything(cfg)


# ---- bad database input ------------------------------------------------------------------
def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]   # closed again when this returns: nothing listens


@pytest.mark.parametrize("url,fragments", [
    ("postgresql+psycopg://gpuflex:s3cret@127.0.0.1:notaport/db", ("not a usable database URL",)),
    ("postgresql+psycopg://gpuflex:s3cret@127.0.0.1:{port}/db",
     ("cannot open the database 127.0.0.1:{port}/db", "Connection refused", "server is up")),
], ids=["malformed", "unreachable"])
def test_a_bad_server_url_is_one_line_and_exit_2(home, url, fragments):
    port = _closed_port()
    f = home / "c.toml"
    f.write_text(f'[database]\nurl = "{url.format(port=port)}"\n')
    for kind in ("clirunner", "script"):
        line = assert_rejected(make_run(kind, home)(f, "submit", "--", "true"),
                               *(x.format(port=port) for x in fragments))
        assert "s3cret" not in line
    assert sorted(p.name for p in home.iterdir()) == ["c.toml"]


def test_an_unknown_role_is_one_line_and_exit_2(home, pg_cluster):
    f = home / "c.toml"
    f.write_text(f'[database]\nurl = "{pg_cluster.url("postgres", role="nosuchrole")}"\n')
    assert_rejected(make_run("clirunner", home)(f, "status"), "cannot open the database",
                    'role "nosuchrole" does not exist', "[database] url")


def test_a_missing_driver_says_which_extra_to_install(home, tmp_path_factory):
    shadow = tmp_path_factory.mktemp("no_psycopg") / "psycopg"   # psycopg as if not installed
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'psycopg'\")\n")
    f = home / "c.toml"
    f.write_text('[database]\nurl = "postgresql+psycopg://gpuflex@127.0.0.1:5432/db"\n')
    gf = GpuflexCLI(home, f)
    p = gf("status", env=gf.env(PYTHONPATH=str(shadow.parent)))
    assert_rejected((p.returncode, p.stdout, p.stderr), "the driver is not installed",
                    "pip install 'gpuflex[postgres]'")
    assert sorted(x.name for x in home.iterdir()) == ["c.toml"]


def _as_nobody():
    """How to run the CLI as an unprivileged user: Debian's python3 (ours lives under /root,
    which other users cannot enter) with this checkout and our site-packages on its path."""
    system = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.access(system, os.X_OK):
        pytest.skip("needs root and /usr/bin/python3 to run the CLI as another user")
    version = subprocess.run([system, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(f"/usr/bin/python3 is {version}, not {sys.version_info[:2]}: cannot share our packages")
    user = pwd.getpwnam("nobody")
    path = f"{REPO}:{sysconfig.get_paths()['purelib']}"

    def run(config: Path, *args: str):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(config.parent),
               "GPUFLEX_CONFIG": str(config), "PYTHONPATH": path, "COLUMNS": "200"}
        p = subprocess.run([system, "-c", "from gpuflex.cli import main; main()", *args],
                           capture_output=True, text=True, timeout=120, env=env, cwd=config.parent,
                           user=user.pw_uid, group=user.pw_gid, extra_groups=[])
        return p.returncode, p.stdout, p.stderr

    return run


def test_a_read_only_sqlite_file_and_a_closed_directory_change_nothing(home):
    run = _as_nobody()
    base = Path(tempfile.mkdtemp(prefix="gpuflex-ro-"))   # /tmp/pytest-of-root is closed to nobody
    try:
        base.chmod(0o755)
        shared, closed = base / "shared", base / "closed"
        shared.mkdir(mode=0o755)
        closed.mkdir(mode=0o700)
        ro_cfg = configured(base, f"sqlite:///{shared}/g.db")
        GpuflexCLI(home, ro_cfg).ok("db", "upgrade")   # root's database, read-only for nobody
        before = db_dump(shared / "g.db")
        assert_rejected(run(ro_cfg, "submit", "--", "true"), f"the database {shared}/g.db is not writable",
                        "[database] url")
        assert db_dump(shared / "g.db") == before
        closed_cfg = base / "closed.toml"
        closed_cfg.write_text(f'[database]\nurl = "sqlite:///{closed}/sub/g.db"\n')
        assert_rejected(run(closed_cfg, "status"), f"cannot create the database directory {closed}/sub",
                        "Permission denied", "[database] url")
        assert list(closed.iterdir()) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_server_lost_in_the_middle_of_a_command_is_a_database_error(pg_cluster, pg_url):
    sessions = open_database(pg_url)
    with sessions() as s:
        s.add(Host(name="h", address="local"))
        s.flush()
        pg_cluster.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       f"WHERE datname = '{pg_url.rsplit('/', 1)[1]}' AND pid <> pg_backend_pid()")
        with pytest.raises(DatabaseError, match="lost the connection to the database 127.0.0.1:.* in the middle"):
            s.commit()
    assert rows(pg_url, "SELECT count(*) FROM hosts") == [(0,)]
