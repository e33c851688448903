"""Owners and permissions (issue 14): a job's owner, and admins, may change it; anyone else
is refused with exit 2, one line naming the owner, and the database unchanged. The
caller's identity is faked by replacing `gpuflex.control.access.caller`, the one function
that says who runs the command."""

from __future__ import annotations

import grp
import json
import pwd
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.config import load_config, parse_config
from gpuflex.control import access
from gpuflex.control.service import JobService
from gpuflex.db.models import Event, Job, Worker
from tests.conftest import GpuflexCLI, cleanup_jobs, db_dump, db_rows, write_config

SECRET_ENV = "s3cr3t-value-of-the-key"
STORE_PORT = 47123


@pytest.fixture
def lab(home):
    """A DB holding alice's jobs, none of which can start (5 workers on a 4-slot pool):
    1 "train" (queued, --env API_KEY, a secret and a store port recorded), 2 and 3 an
    array (id 2), 4 "done" (succeeded, one worker with a log and a crash event whose
    traceback is its output)."""
    def make(admins: tuple[str, ...] = ()) -> Path:
        extra = f"\n[access]\nadmins = {json.dumps(list(admins))}\n" if admins else ""
        cfg = write_config(home, extra=extra)
        svc = JobService(load_config(str(cfg)))
        svc.refresh()
        with svc.sessions.begin() as s:
            def job(name: str, state: str = "queued", **kw) -> Job:
                j = Job(token=f"t{name}{kw.get('array_index', '')}", name=name, state=state, argv=["true"],
                        workdir=str(home), env=kw.pop("env", {}), min_workers=5, max_workers=5,
                        gpus_per_worker=1, user="alice", **kw)
                s.add(j)
                s.flush()
                return j
            job("train", env={"API_KEY": SECRET_ENV}, store_port=STORE_PORT, store_addr="127.0.0.1")
            first = job("sweep", array_index=0)
            first.array_id = first.id
            job("sweep", array_id=first.id, array_index=1)
            done = job("done", state="succeeded", exit_code=0, started_at=time.time(), ended_at=time.time(),
                       world_size=1)
            done.workers.append(Worker(wid=0, rank=0, host="local", gpus=[0], state="exited", exit_code=0,
                                       log_path=str(home / "w0.log"), exit_path=str(home / "w0.exit")))
            done.events.append(Event(kind="state", message="succeeded: all workers exited 0"))
            done.events.append(Event(kind="crash", message="worker 0 crashed", data={
                "wid": 0, "host": "local", "error": "ValueError: bad batch",
                "traceback": ["Traceback (most recent call last):", f"ValueError: token {SECRET_ENV}"]}))
        svc.close()
        (home / "w0.log").write_text("epoch 1 loss 0.5\n")
        return cfg
    return make


def as_user(monkeypatch, name: str) -> None:
    monkeypatch.setattr(access, "caller", lambda: name)


def invoke(config: Path, home: Path, *args: str):
    r = CliRunner().invoke(app, list(args), env={"HOME": str(home), "GPUFLEX_CONFIG": str(config),
                                                 "COLUMNS": "200"})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


def refused_line(r) -> str:
    assert r.exit_code == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stdout + r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize("args, verb, job_id", [
    (("cancel", "1"), "cancel", 1),
    (("cancel", "train"), "cancel", 1),
    (("cancel", "2"), "cancel", 2),          # an array's id: every job of it
    (("cancel", "2_1"), "cancel", 3),
    (("cancel", "sweep"), "cancel", 2),      # an array's name: every job of it, the first refused first
    (("scale", "1", "2"), "scale", 1),
    (("scale", "1", "2", "--wait"), "scale", 1),
])
def test_another_users_change_is_refused_naming_the_owner(lab, home, db_path, monkeypatch, args, verb, job_id):
    cfg = lab(admins=("carol", "@no-such-group-here"))
    as_user(monkeypatch, "bob")
    before = db_dump(db_path)
    line = refused_line(invoke(cfg, home, *args))
    assert line == (f"error: job {job_id} belongs to alice; only alice or an admin ([access] admins) "
                    f"may {verb} it.")
    assert db_dump(db_path) == before


def test_the_owner_may_cancel_their_own_job(lab, home, db_path, monkeypatch):
    cfg = lab()
    as_user(monkeypatch, "alice")
    r = invoke(cfg, home, "cancel", "2")
    assert r.exit_code == 0, r.stderr
    states = _states(db_path)
    assert (states[1], states[2], states[3]) == ("queued", "cancelled", "cancelled")
    assert _cancel_records(db_path, 3) == ("cancelled by alice", "cancelled: cancelled by alice", "alice")


def _cancel_records(db_path: Path, job_id: int) -> tuple[str, str, str]:
    """The job's reason, and its cancel event's message and `by`."""
    reason = db_rows(db_path, "SELECT exit_reason FROM jobs WHERE id = ?", (job_id,))[0][0]
    message, data = db_rows(db_path, "SELECT message, data FROM events WHERE job_id = ? AND kind = 'state' "
                            "ORDER BY id DESC LIMIT 1", (job_id,))[0]
    return reason, message, json.loads(data).get("by")


def _states(db_path: Path) -> dict[int, str]:
    return dict(db_rows(db_path, "SELECT id, state FROM jobs"))


def test_an_admin_by_name_may_cancel_and_scale_another_users_job(lab, home, db_path, monkeypatch):
    cfg = lab(admins=("carol",))
    as_user(monkeypatch, "carol")
    r = invoke(cfg, home, "cancel", "1")
    assert r.exit_code == 0, r.stderr
    assert _states(db_path)[1] == "cancelled"
    # the history names the admin, not "user"; status shows it as the job's reason
    assert _cancel_records(db_path, 1) == ("cancelled by carol (admin)", "cancelled: cancelled by carol (admin)",
                                           "carol")
    assert json.loads(invoke(cfg, home, "status", "1", "--json").stdout)["exit_reason"] == \
        "cancelled by carol (admin)"
    # past the owner check, scale says what is wrong with the job itself
    line = refused_line(invoke(cfg, home, "scale", "3", "2"))
    assert "belongs to" not in line and "3" in line


def test_an_admin_by_primary_group_may_cancel(lab, home, db_path, monkeypatch):
    me = pwd.getpwuid(__import__("os").getuid())
    group = grp.getgrgid(me.pw_gid).gr_name
    cfg = lab(admins=(f"@{group}",))
    as_user(monkeypatch, me.pw_name)
    assert invoke(cfg, home, "cancel", "1").exit_code == 0
    assert _states(db_path)[1] == "cancelled"


def test_an_admin_by_supplementary_group():
    member = next(((g.gr_name, m) for g in grp.getgrall() for m in g.gr_mem if _known_user(m)), None)
    if member is None:
        pytest.skip("no unix group here lists a member")
    group, user = member
    config = parse_config({"access": {"admins": [f"@{group}"]}}, "t.toml")
    assert access.is_admin(config, user)
    assert access.may_change(config, "alice", user)
    assert not access.is_admin(parse_config({"access": {"admins": ["@nobody-group-x"]}}, "t.toml"), user)
    assert not access.is_admin(config, "no-such-user-xyz")


def _known_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def test_the_caller_is_the_real_user_not_USER(monkeypatch):
    monkeypatch.setenv("USER", "alice")
    monkeypatch.setenv("LOGNAME", "alice")
    assert access.caller() == pwd.getpwuid(__import__("os").getuid()).pw_name


def test_status_shows_the_owner_and_filters_by_user(lab, home, monkeypatch):
    cfg = lab()
    with JobService(load_config(str(cfg))).sessions.begin() as s:
        s.add(Job(token="tb", name="bobs", state="queued", argv=["true"], workdir=str(home), env={},
                  min_workers=5, max_workers=5, gpus_per_worker=1, user="bob"))
    as_user(monkeypatch, "bob")
    everyone = json.loads(invoke(cfg, home, "status", "--json").stdout)
    assert [(j["id"], j["owner"], j["user"]) for j in everyone] == \
        [(1, "alice", "alice"), (2, "alice", "alice"), (3, "alice", "alice"), (4, "alice", "alice"), (5, "bob", "bob")]
    assert [j["id"] for j in json.loads(invoke(cfg, home, "status", "--json", "--mine").stdout)] == [5]
    # alice is no unix user here, but she owns jobs: her name is known
    assert [j["id"] for j in json.loads(invoke(cfg, home, "status", "--json", "--user", "alice").stdout)] == \
        [1, 2, 3, 4]
    assert json.loads(invoke(cfg, home, "status", "--json", "--user", "root").stdout) == []
    table = invoke(cfg, home, "status", "--user", "bob").stdout
    assert "OWNER" in table and "bobs" in table and "train" not in table


@pytest.mark.parametrize("args, fragment", [
    (("status", "--user", "no-such-user-xyz"), "--user 'no-such-user-xyz': there is no unix user"),
    (("status", "--user", "alice", "--mine"), "give one of JOB, --user NAME and --mine"),
    (("status", "1", "--mine"), "give one of JOB, --user NAME and --mine"),
])
def test_status_user_bad_input(lab, home, db_path, monkeypatch, args, fragment):
    cfg = lab()
    before = db_dump(db_path)
    assert fragment in refused_line(invoke(cfg, home, *args))
    assert db_dump(db_path) == before


def test_another_user_sees_no_secret(lab, home, db_path, monkeypatch):
    """status --json of alice's jobs, as bob: no job secret, store port, --env value (its
    name stays) or crash traceback (the job's output; the error's line stays)."""
    cfg = lab()
    secret = db_rows(db_path, "SELECT secret FROM jobs WHERE id = 1")[0][0]
    as_user(monkeypatch, "bob")
    out = "".join(invoke(cfg, home, *a).stdout for a in (("status", "1", "--json"), ("status", "--json"),
                                                          ("status", "4", "--json"), ("status", "1")))
    assert "API_KEY" in out and "ValueError: bad batch" in out
    for hidden in (secret, SECRET_ENV, str(STORE_PORT), "Traceback"):
        assert hidden not in out
    as_user(monkeypatch, "alice")   # the owner's own view holds the traceback
    assert json.loads(invoke(cfg, home, "status", "4", "--json").stdout)["last_crash"]["traceback"][1] == \
        f"ValueError: token {SECRET_ENV}"


@pytest.mark.parametrize("verb, what", [("logs", "logs"), ("events", "events")])
def test_a_jobs_output_and_history_are_its_owners_and_the_admins(lab, home, db_path, monkeypatch, verb, what):
    """logs and events of alice's job: bob is refused (one line naming the owner, exit 2,
    nothing written); alice and carol, an admin, read them."""
    cfg = lab(admins=("carol",))
    as_user(monkeypatch, "bob")
    before = db_dump(db_path)
    assert refused_line(invoke(cfg, home, verb, "4")) == \
        f"error: job 4 belongs to alice; only alice or an admin ([access] admins) may read its {what}."
    assert db_dump(db_path) == before
    for reader in ("alice", "carol"):
        as_user(monkeypatch, reader)
        r = invoke(cfg, home, verb, "4")
        assert r.exit_code == 0, r.stderr
        assert ("epoch 1 loss 0.5" if verb == "logs" else "worker 0 crashed") in r.stdout


def alices_job_running_on_the_local_host(cfg, home) -> None:
    """Job 1 (alice's) running one worker on the local host, a pid nobody here can signal."""
    with JobService(load_config(str(cfg))).sessions.begin() as s:
        job = s.get(Job, 1)
        job.state, job.world_size, job.started_at = "running", 1, time.time()
        job.workers.append(Worker(wid=0, rank=0, host="local", gpus=[0], state="running", pid=999999, pgid=999999,
                                  log_path=str(home / "a.log"), exit_path=str(home / "a.exit")))


def test_another_users_running_processes_are_neither_reconciled_nor_cancelled(lab, home, db_path, monkeypatch):
    """alice's job 1 runs a worker (pid and exit record hers alone) on the local host, which
    each user's gpuflex reaches as themselves: bob's refresh leaves it to her commands
    (it is not marked lost), and carol, an admin, is refused rather than recording a stop
    of processes she cannot signal."""
    cfg = lab(admins=("carol",))
    alices_job_running_on_the_local_host(cfg, home)
    as_user(monkeypatch, "bob")
    assert invoke(cfg, home, "status", "1", "--json").exit_code == 0
    assert db_rows(db_path, "SELECT state, exit_code FROM workers WHERE job_id = 1") == [("running", None)]
    assert _states(db_path)[1] == "running"
    as_user(monkeypatch, "carol")
    line = refused_line(invoke(cfg, home, "cancel", "1"))
    assert line.startswith("error: job 1 runs as alice on local, which gpuflex reaches as each user")
    assert _states(db_path)[1] == "running"
    # through one shared SSH account, the admin's command could reach them: not refused for that
    config = parse_config({"hosts": [{"name": "local", "address": "gpu1.lab", "user": "gpuflex"}]}, "t.toml")
    with JobService(load_config(str(cfg))).sessions() as s:
        assert access.reaches(config, s.get(Job, 1))


def test_an_ended_job_of_another_user_gets_the_commands_own_answer(lab, home, db_path, monkeypatch):
    cfg = lab()
    as_user(monkeypatch, "bob")
    before = db_dump(db_path)
    assert "already succeeded; nothing to cancel" in refused_line(invoke(cfg, home, "cancel", "4"))
    assert db_dump(db_path) == before
    assert "belongs to" not in refused_line(invoke(cfg, home, "scale", "4", "2"))


def test_another_users_queued_job_keeps_its_place_until_its_owner_starts_it(lab, home, db_path, monkeypatch):
    """The local host runs a job as whoever starts it, so bob's command does not start
    alice's queued job (1 worker, priority 1: first in the queue); it holds its device for her, so
    bob's own job (4 workers on 4 slots) does not jump the queue; her next command starts
    hers. Nobody preempts for a job they cannot start."""
    cfg = lab()
    with JobService(load_config(str(cfg))).sessions.begin() as s:
        for j in s.query(Job).filter(Job.state == "queued"):
            j.state = "cancelled"                 # the lab's 5-worker jobs out of the way
        s.add(Job(token="tfirst", name="first", state="queued", argv=["sleep", "60"], workdir=str(home),
                  env={}, min_workers=1, max_workers=1, gpus_per_worker=1, user="alice", priority=1))
    try:
        as_user(monkeypatch, "bob")
        assert invoke(cfg, home, "submit", "--workers", "4", "--", "sleep", "60").exit_code == 0
        assert invoke(cfg, home, "status").exit_code == 0
        rows = dict(db_rows(db_path, "SELECT name, state FROM jobs WHERE state IN ('queued', 'running')"))
        assert rows == {"first": "queued", "sleep": "queued"}, rows
        reason = db_rows(db_path, "SELECT queue_reason FROM jobs WHERE name = 'first'")[0][0]
        assert "starts at alice's next gpuflex command" in reason and "run as alice on local" in reason
        as_user(monkeypatch, "alice")
        assert invoke(cfg, home, "status").exit_code == 0
        rows = dict(db_rows(db_path, "SELECT name, state FROM jobs WHERE state IN ('queued', 'running')"))
        assert rows == {"first": "running", "sleep": "queued"}, rows
    finally:
        cleanup_jobs(GpuflexCLI(home, cfg), db_path)


def test_root_listed_as_admin_may_change_another_users_running_job_on_the_local_host(lab, home, db_path,
                                                                                    monkeypatch):
    """Root reaches every process (access.reaches_all): where carol, an admin, is refused
    (above), root listed in [access] admins cancels it; root not listed is refused as anyone."""
    cfg = lab(admins=("root",))
    alices_job_running_on_the_local_host(cfg, home)
    as_user(monkeypatch, "root")
    assert access.reaches_all()
    r = invoke(cfg, home, "cancel", "1")
    assert r.exit_code == 0, r.stderr
    assert _cancel_records(db_path, 1)[0] == "cancelled by root (admin)"
    as_user(monkeypatch, "carol")
    assert not access.reaches_all()
    other = write_config(home, name="other.toml", extra='\n[access]\nadmins = ["carol"]\n')
    as_user(monkeypatch, "root")
    assert "may cancel it" in refused_line(invoke(other, home, "cancel", "2"))
