"""Slurm's everyday verbs (gpuflex.cli.verbs_cmd): cancel of several jobs and by filters,
hold/release, update, requeue, in-process. The queue here is rows that can never start
(5 workers on a 4-slot pool), so no process is started; the verbs on running jobs, and
--after's kinds carried out, are in tests/e2e/test_verbs_jobs.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app, verbs_cmd
from gpuflex.config import load_config
from gpuflex.control import access, verbs
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from gpuflex.errors import UnknownJobError, UsageError
from gpuflex.jobspec import After, parse_after
from gpuflex.states import JobState
from tests.conftest import db_dump, db_rows, write_config

ME = access.caller()


@pytest.fixture
def queue(home) -> Path:
    """Jobs 1 "train", 2 "train", 3 "eval" (mine, queued), 4 "train" (alice's, queued),
    5 "done" (mine, succeeded). carol is an admin."""
    cfg = write_config(home, extra='\n[access]\nadmins = ["carol"]\n')
    svc = JobService(load_config(str(cfg)))
    svc.refresh()
    with svc.sessions.begin() as s:
        for i, (name, user, state) in enumerate([("train", ME, "queued"), ("train", ME, "queued"),
                                                 ("eval", ME, "queued"), ("train", "alice", "queued"),
                                                 ("done", ME, "succeeded")]):
            s.add(Job(token=f"t{i}", name=name, state=state, argv=["true"], workdir=str(home), env={},
                      min_workers=5, max_workers=5, gpus_per_worker=1, user=user,
                      **({"ended_at": time.time(), "exit_code": 0} if state == "succeeded" else {})))
    svc.close()
    return cfg


def run(cfg: Path, home: Path, *args: str):
    r = CliRunner().invoke(app, list(args), env={"HOME": str(home), "GPUFLEX_CONFIG": str(cfg), "COLUMNS": "200"})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


def states(db_path: Path) -> dict[int, str]:
    return dict(db_rows(db_path, "SELECT id, state FROM jobs"))


def refused(cfg, home, db_path, *args: str) -> str:
    """The one error line of a refused command, the database unchanged."""
    before = db_dump(db_path)
    r = run(cfg, home, *args)
    lines = r.stderr.strip().splitlines()
    assert (r.exit_code, len(lines)) == (2, 1) and lines[0].startswith("error: "), (r.exit_code, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr
    assert db_dump(db_path) == before
    return lines[0]


def test_references_are_checked_before_any_database_and_given_once():
    assert verbs_cmd._refs(["3", "train", "3", "5_1"]) == ["3", "train", "5_1"]
    with pytest.raises(UnknownJobError):
        verbs_cmd._refs(["3", "{}"])


# ---- cancel -----------------------------------------------------------------------------------------
def test_cancel_takes_several_ids_and_names(queue, home, db_path):
    r = run(queue, home, "cancel", "1", "eval")
    assert (r.exit_code, r.stdout.strip()) == (0, "cancelled 2 job(s): 1,3")
    assert states(db_path) == {1: "cancelled", 2: "queued", 3: "cancelled", 4: "queued", 5: "succeeded"}
    by = db_rows(db_path, "SELECT data FROM events WHERE job_id = 3 AND kind = 'state'")
    assert json.loads(by[-1][0])["by"] == ME


def test_an_unknown_or_ended_job_among_several_cancels_nothing(queue, home, db_path):
    assert refused(queue, home, db_path, "cancel", "1", "99") == \
        "error: no job '99'. Run 'gpuflex status' to list jobs."
    assert "job 5 is already succeeded; nothing cancelled" in refused(queue, home, db_path, "cancel", "1", "5")


def test_cancel_by_name_and_state_takes_only_the_callers_jobs(queue, home, db_path):
    r = run(queue, home, "cancel", "--name", "train", "--state", "queued")
    assert (r.exit_code, r.stdout.strip()) == (0, "cancelled 2 job(s): 1-2")
    assert states(db_path)[4] == "queued"   # alice's "train": filters select the caller's own


def test_a_filter_matching_nothing_says_so_and_exits_0(queue, home, db_path):
    before = db_dump(db_path)
    r = run(queue, home, "cancel", "--name", "nothing-of-that-name", "--state", "running")
    assert (r.exit_code, r.stdout.strip()) == (0, "no job matches --name nothing-of-that-name --state running; "
                                                  "nothing cancelled.")
    assert db_dump(db_path) == before


def test_filters_restrict_the_ids_given(queue, home, db_path):
    r = run(queue, home, "cancel", "1", "3", "--name", "eval")
    assert (r.exit_code, r.stdout.strip()) == (0, "cancelled 1 job(s): 3")
    assert states(db_path)[1] == "queued"


@pytest.mark.parametrize("args,fragment", [
    (["cancel"], "give a JOB (id or name) or a filter"),
    (["cancel", "--state", "succeeded"], "--state succeeded: an ended job cannot be cancelled"),
    (["cancel", "--state", "bogus"], "--state 'bogus': give one of"),
    (["cancel", "--user", "no-such-user-here"], "--user 'no-such-user-here'"),
], ids=["nothing", "ended-state", "bad-state", "unknown-user"])
def test_cancel_refuses_bad_filters(queue, home, db_path, args, fragment):
    assert fragment in refused(queue, home, db_path, *args)


def test_another_users_jobs_by_filter_are_refused_unless_admin(queue, home, db_path, monkeypatch):
    monkeypatch.setattr(access, "caller", lambda: "bob")
    line = refused(queue, home, db_path, "cancel", "--user", "alice")
    assert line == "error: job 4 belongs to alice; only alice or an admin ([access] admins) may cancel it."
    monkeypatch.setattr(access, "caller", lambda: "carol")
    r = run(queue, home, "cancel", "--user", "alice")
    assert (r.exit_code, r.stdout.strip()) == (0, "cancelled 1 job(s): 4")
    assert db_rows(db_path, "SELECT exit_reason FROM jobs WHERE id = 4") == [("cancelled by carol (admin)",)]


# ---- hold / release -------------------------------------------------------------------------------
def test_hold_and_release_several_queued_jobs(queue, home, db_path):
    r = run(queue, home, "hold", "1", "3")
    assert (r.exit_code, r.stdout.splitlines()) == (0, ["job 1 held", "job 3 held"])
    one = json.loads(run(queue, home, "status", "1", "--json").stdout)
    assert (one["state"], one["held"]) == ("queued", True)
    assert one["queue_reason"].startswith(f"held by {ME}: 'gpuflex release 1'")
    assert "queued (held)" in run(queue, home, "status").stdout
    assert run(queue, home, "hold", "1").stdout.strip() == "job 1 was held already"
    r = run(queue, home, "release", "1", "3")
    assert (r.exit_code, r.stdout.splitlines()) == (0, ["job 1 released", "job 3 released"])
    one = json.loads(run(queue, home, "status", "1", "--json").stdout)
    assert one["held"] is False and not one["queue_reason"].startswith("held")
    kinds = [k for (k,) in db_rows(db_path, "SELECT kind FROM events WHERE job_id = 1 ORDER BY id")]
    assert kinds[-2:] == ["released", "queued"] and "held" in kinds


def test_a_held_job_is_never_placed(queue, home, db_path):
    """Job 6 would fit at once (1 worker on 4 free slots): held first, it stays queued."""
    with JobService(load_config(str(queue))).sessions.begin() as s:
        s.add(Job(token="t6", name="small", state="queued", argv=["true"], workdir=str(home), env={},
                  min_workers=1, max_workers=1, gpus_per_worker=1, user=ME, held=True))
    assert run(queue, home, "status").exit_code == 0
    assert states(db_path)[6] == "queued"


def test_hold_of_an_ended_job_or_another_users_is_refused(queue, home, db_path, monkeypatch):
    assert "job 5 is succeeded: only a queued job can be held" in refused(queue, home, db_path, "hold", "1", "5")
    assert "job 5 is succeeded: only a queued job can be released" in refused(queue, home, db_path, "release", "5")
    monkeypatch.setattr(access, "caller", lambda: "bob")
    assert "job 4 belongs to alice" in refused(queue, home, db_path, "hold", "4")


# ---- update -----------------------------------------------------------------------------------
def test_update_a_queued_jobs_time_and_priority(queue, home, db_path):
    r = run(queue, home, "update", "1", "2", "--time", "2h", "--priority", "7")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["job 1 updated: time limit none -> 02:00:00, priority 0 -> 7",
                                     "job 2 updated: time limit none -> 02:00:00, priority 0 -> 7"]
    assert db_rows(db_path, "SELECT time_limit_s, priority FROM jobs WHERE id IN (1, 2)") == [(7200.0, 7)] * 2
    ev = db_rows(db_path, "SELECT kind, data FROM events WHERE job_id = 1 AND kind = 'updated'")
    assert json.loads(ev[0][1])["priority"] == "7"


@pytest.mark.parametrize("args,fragment", [
    (["update", "1"], "give --time and/or --priority"),
    (["update", "1", "--time", "0"], "--time"),
    (["update", "1", "--priority", "9999999999"], "--priority"),
    (["update", "1", "5", "--priority", "2"], "job 5 is succeeded: only a queued or running job can be updated"),
], ids=["nothing", "time-zero", "priority-range", "ended"])
def test_update_refuses_bad_input(queue, home, db_path, args, fragment):
    assert fragment in refused(queue, home, db_path, *args)


def test_a_running_jobs_time_limit_is_only_lowered():
    """The rule, on rows (no process): raising a running job's limit is refused."""
    job = Job(id=8, name="x", state=JobState.RUNNING, time_limit_s=600.0, priority=0, user=ME)
    with pytest.raises(UsageError, match="can only be lowered"):
        verbs.update(None, [job], 3600.0, None)
    assert job.time_limit_s == 600.0


# ---- requeue ------------------------------------------------------------------------------------
def test_requeue_of_a_queued_or_ended_job_is_refused(queue, home, db_path):
    assert "job 1 is queued: only a running job can be requeued." in refused(queue, home, db_path, "requeue", "1")
    assert "job 5 is succeeded: only a running job can be requeued (submit it again)." in \
        refused(queue, home, db_path, "requeue", "5")


# ---- --after's spellings ----------------------------------------------------------------------------
@pytest.mark.parametrize("text,after", [
    ("12,13", After(afterok=(12, 13))),
    ("afterok:12:13", After(afterok=(12, 13))),
    ("afterany:7,afternotok:8", After(afterany=(7,), afternotok=(8,))),
    ("singleton", After(singleton=True)),
    ("afterok:3,singleton", After(afterok=(3,), singleton=True)),
])
def test_after_spellings(text, after):
    assert parse_after(text) == after


@pytest.mark.parametrize("text", ["afterfoo:3", "afterok:", "afterok:x", "3?4", "afterok:3,afternotok:3", ""])
def test_after_refusals(text):
    with pytest.raises(UsageError, match="--after"):
        parse_after(text)


def test_submit_records_the_kinds_and_an_unknown_id_among_them_is_refused(queue, home, db_path):
    assert "--after 99: there is no job 99" in refused(queue, home, db_path, "submit", "--after",
                                                        "afterany:1,afternotok:99", "--", "true")
    r = run(queue, home, "submit", "--json", "--after", "afterany:1,afternotok:2,singleton",
            "--", "true")
    assert r.exit_code == 0, r.stderr
    job = json.loads(r.stdout)
    assert (job["after"], job["dependency"]) == ([], {"afterany": [1], "afternotok": [2], "singleton": True})
    assert job["queue_reason"] == "waiting for job 1 (queued) (afterany), job 2 (queued) (afternotok)"


def test_an_arrays_id_holds_its_queued_jobs_and_an_ended_array_refuses(queue, home, db_path):
    """Array 6 (6 succeeded, 7 queued) and array 8 (8, 9 succeeded)."""
    with JobService(load_config(str(queue))).sessions.begin() as s:
        for i, (array, state) in enumerate([(6, "succeeded"), (6, "queued"), (8, "succeeded"), (8, "succeeded")]):
            s.add(Job(token=f"a{i}", name=f"arr{array}", state=state, argv=["true"], workdir=str(home), env={},
                      min_workers=5, max_workers=5, gpus_per_worker=1, user=ME, array_id=array, array_index=i % 2))
    r = run(queue, home, "hold", "6")
    assert (r.exit_code, r.stdout.strip()) == (0, "job 7 held")
    assert "job 8 is already succeeded; nothing cancelled" in refused(queue, home, db_path, "cancel", "1", "8")
    assert "job 8 is succeeded: only a queued job can be held" in refused(queue, home, db_path, "hold", "8")


def test_singleton_waits_for_the_callers_jobs_of_its_name_not_another_users(queue, home, db_path):
    r = run(queue, home, "submit", "--json", "--name", "train", "--after", "singleton", "--", "true")
    assert r.exit_code == 0, r.stderr
    job = json.loads(r.stdout)
    assert (job["state"], job["dependency"]) == ("queued", {"singleton": True})
    # jobs 1 and 2 are mine and queued ahead; alice's job 4 of that name is hers
    assert job["queue_reason"] == "waiting for job 1 (queued), job 2 (queued) of the same name 'train' (singleton)"
