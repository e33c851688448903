"""`gpuflex status` without a job (issue 14): what it lists and how it reads it.

The table lists every job not ended and the newest ended ones (`jobs_cmd.ENDED_SHOWN`),
then one line counting the ended jobs left out; `--all` lists them all; `--json` lists
every job (the contract). `--user`, `--mine` and `--state` filter in the database, and
the listing is read in a number of queries that does not grow with the number of jobs.

Jobs are recorded straight through the models (no process): ended ones, and queued ones
that ask for more slots than the test's host holds, so no refresh ever starts them.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
from sqlalchemy import event
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.cli import render
from gpuflex.cli.jobs_cmd import ENDED_SHOWN
from gpuflex.config import load_config
from gpuflex.control import access
from gpuflex.control.service import JobService
from gpuflex.db.models import Event, Job, Worker
from gpuflex.policy.lifecycle import CRASH_KIND, WAITING_KIND
from tests.conftest import db_dump, write_config


def record_jobs(config_path: Path, states: list[str], *, owners: list[str] | None = None,
                history: bool = False) -> list[int]:
    """One job per state in `states` (ended ones ended in that order, a second apart; a
    queued one asks for 8 workers of the test's 4 slots), owned by `owners` in turn
    (default: the caller); with `history`, each has 2 workers, a crash event and, running
    ones, a wait. Returns their ids."""
    owners = owners or [access.caller()]
    svc = JobService(load_config(str(config_path)))
    now = time.time() - 3600
    try:
        with svc.sessions.begin() as s:
            jobs = [_job(i, state, owners[i % len(owners)], now + i, history) for i, state in enumerate(states)]
            s.add_all(jobs)
            s.flush()
            return [j.id for j in jobs]
    finally:
        svc.close()


def _job(i: int, state: str, owner: str, when: float, history: bool) -> Job:
    queued = state == "queued"
    job = Job(token=f"t{i}-{time.time_ns()}"[-20:], name=f"job-{i}", state=state, argv=["true"], workdir="/tmp",
              env={"KEY": "secret"}, min_workers=8 if queued else 2, max_workers=8 if queued else 2,
              gpus_per_worker=1, user=owner, created_at=when - 1, world_size=0 if queued else 2,
              started_at=None if queued else when - 0.5, ended_at=when if state in FINAL else None)
    if not history:
        return job
    for wid in range(2):
        job.workers.append(Worker(wid=wid, rank=wid, host="local", gpus=[wid], state="exited", exit_code=0,
                                  log_path=f"/tmp/{i}-{wid}.log", exit_path=f"/tmp/{i}-{wid}.exit"))
    job.events.append(Event(kind=CRASH_KIND, message="worker 1 crashed", time=when - 0.2,
                            data={"wid": 1, "host": "local", "error": f"boom {i}"}))
    job.events.append(Event(kind="state", message=f"{state}: moved", time=when - 0.1, data={"state": state}))
    if state == "running":
        job.events.append(Event(kind=WAITING_KIND, message="waiting", time=when,
                                data={"waiting": [{"wid": 0, "for": [1], "phase": "boundary", "since": when}]}))
    return job


FINAL = {"succeeded", "failed", "cancelled", "timeout"}


@pytest.fixture
def status(home, config_path):
    """`gpuflex status ARGS...` in-process -> (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        env = {"HOME": str(home), "GPUFLEX_CONFIG": str(config_path), "COLUMNS": "200"}
        r = CliRunner().invoke(app, ["status", *args], env=env)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception
        return r.exit_code, r.stdout, r.stderr

    return run


def table_ids(out: str) -> list[int]:
    """The job ids of a status table's rows."""
    cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    return [int(c) for c in cells if c.isdigit()]


def test_the_table_lists_jobs_not_ended_and_the_newest_ended_then_counts_the_rest(config_path, status):
    ended = record_jobs(config_path, ["succeeded", "failed", "cancelled", "timeout"] * 8)   # 32, oldest first
    waiting = record_jobs(config_path, ["queued"] * 3)
    code, out, err = status()
    assert code == 0, err
    assert table_ids(out) == sorted(ended[-ENDED_SHOWN:] + waiting)
    assert f"{len(ended) - ENDED_SHOWN} older ended job(s) not shown: gpuflex status --all" in out

    code, out, _ = status("--all")
    assert code == 0 and table_ids(out) == ended + waiting
    assert "not shown" not in out


def test_a_listing_with_nothing_left_out_has_no_older_line(config_path, status):
    ids = record_jobs(config_path, ["succeeded"] * 3 + ["queued"])
    code, out, _ = status()
    assert code == 0 and table_ids(out) == ids and "not shown" not in out


def test_json_lists_every_job_with_the_fields_of_one_job(config_path, status):
    ids = record_jobs(config_path, ["succeeded"] * (ENDED_SHOWN + 5) + ["queued"], history=True)
    code, out, err = status("--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [j["id"] for j in listed] == ids
    for one in (ids[0], ids[-1]):
        code, alone, _ = status(str(one), "--json")
        doc = json.loads(alone)
        assert "points" in doc.pop("scaling")   # issue 32: the one job's view adds its scaling
        assert code == 0 and [j for j in listed if j["id"] == one] == [doc]
    assert listed[0]["last_crash"]["error"] == "boom 0" and listed[0]["env"] == {"KEY": "<redacted>"}
    assert [w["rank"] for w in listed[0]["workers"]] == [0, 1]


def test_user_and_mine_filter_the_listing(config_path, status):
    me = access.caller()
    ids = record_jobs(config_path, ["succeeded", "queued"] * 30, owners=[me, "alice-14", "bob-14"])
    owner = {i: [me, "alice-14", "bob-14"][n % 3] for n, i in enumerate(ids)}
    code, out, _ = status("--user", "alice-14", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)] == [i for i in ids if owner[i] == "alice-14"]
    code, out, _ = status("--mine", "--all")
    assert code == 0 and table_ids(out) == [i for i in ids if owner[i] == me]
    code, out, _ = status("--user", "bob-14")
    bobs = [i for i in ids if owner[i] == "bob-14"]
    assert code == 0 and len(bobs) == 20 and table_ids(out) == bobs and "not shown" not in out
    assert status("--user", "nobody-here-14")[0] == 2


def test_state_filters_in_any_listing(config_path, status):
    ids = record_jobs(config_path, ["failed", "succeeded", "queued", "timeout"] * 12)
    state = {i: ["failed", "succeeded", "queued", "timeout"][n % 4] for n, i in enumerate(ids)}
    code, out, _ = status("--state", "failed,queued", "--json")
    assert code == 0 and [(j["id"], j["state"]) for j in json.loads(out)] == [
        (i, state[i]) for i in ids if state[i] in ("failed", "queued")]
    code, out, _ = status("--state", "failed", "--state", "timeout")
    ended = [i for i in ids if state[i] in ("failed", "timeout")]
    assert code == 0 and table_ids(out) == ended[-ENDED_SHOWN:]
    assert f"{len(ended) - ENDED_SHOWN} older ended job(s) not shown" in out


def test_bad_listing_options_are_one_error_line_and_change_nothing(config_path, db_path, status):
    record_jobs(config_path, ["succeeded", "queued"])
    before = db_dump(db_path)
    for args, words in [(("--state", "done"), "--state 'done': give one of queued, running"),
                        (("1", "--all"), "give them without JOB"),
                        (("1", "--state", "failed"), "give them without JOB")]:
        code, out, err = status(*args)
        assert (code, out) == (2, "") and err.startswith("error: ") and words in err
        assert len(err.strip().splitlines()) == 1
    assert db_dump(db_path) == before


def test_an_array_row_counts_all_its_jobs_when_some_are_left_out(config_path, status):
    ids = record_jobs(config_path, ["succeeded"] * (ENDED_SHOWN + 4))
    svc = JobService(load_config(str(config_path)))
    try:
        with svc.sessions.begin() as s:
            for n, i in enumerate(ids):
                job = s.get(Job, i)
                job.array_id, job.array_index, job.name = ids[0], n, "sweep"
    finally:
        svc.close()
    code, out, _ = status()
    assert code == 0 and f"{len(ids)} jobs: {len(ids)} succeeded" in out
    assert "4 older ended job(s) not shown" in out


@contextlib.contextmanager
def statements(svc: JobService):
    """A list that gathers every SQL statement the service's engine runs in the block."""
    engine, seen = svc.sessions.kw["bind"], []

    def count(conn, cursor, statement, *_args) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", count)


def listing_statements(config_path: Path, states: list[str]) -> dict[str, int]:
    """How many statements each listing takes over jobs in `states`, with their history."""
    record_jobs(config_path, states, history=True)
    svc = JobService(load_config(str(config_path)))
    try:
        out = {}
        for label, kwargs in [("table", {"ended": ENDED_SHOWN}), ("all", {}), ("mine", {"owner": access.caller()})]:
            with statements(svc) as seen:
                shown = svc.listing(**kwargs)
                render.listing(shown, {})
            assert shown.jobs
            out[label] = len(seen)
        return out
    finally:
        svc.close()


def test_the_listing_takes_a_number_of_statements_that_does_not_grow_with_the_jobs(tmp_path):
    mix = ["running", "queued", "succeeded", "failed"]
    (tmp_path / "few").mkdir()
    (tmp_path / "many").mkdir()
    few = listing_statements(write_config(tmp_path / "few"), mix)
    many = listing_statements(write_config(tmp_path / "many"), mix * 40)
    assert few == many
    assert max(many.values()) <= 8


def test_the_batched_records_match_one_jobs_record(config_path):
    ids = record_jobs(config_path, ["running", "queued", "failed", "running"], history=True)
    svc = JobService(load_config(str(config_path)))
    try:
        listed = {j.id: j for j in svc.listing().jobs}
        for i in ids:
            alone = svc.job(i, events=False)
            assert listed[i] == type(alone)(**{**alone.__dict__, "recent": ()})
        assert listed[ids[0]].waiting and not listed[ids[1]].waiting and listed[ids[2]].last_crash
    finally:
        svc.close()


def test_status_through_a_pipe_keeps_every_column_whole(home, config_path):
    """Rich cut output to a pipe to 80 columns (no terminal to measure): NOTE and the
    columns before it came out as "…". Through a pipe, with COLUMNS unset, every header
    and every note is whole; the jobs' workers and events tables too."""
    import subprocess

    from tests.conftest import GpuflexCLI

    queued, failed = record_jobs(config_path, ["queued", "failed"], history=True)
    reason = "failed: worker 1 on local failed with exit code 3 (a reason long enough to be cut at 80 columns)"
    with JobService(load_config(str(config_path))).sessions.begin() as s:
        s.get(Job, failed).exit_reason = reason
    env = GpuflexCLI(home, config_path).env()
    env.pop("COLUMNS")

    def piped(*args: str) -> str:
        p = subprocess.run([GpuflexCLI(home, config_path).script, *args], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, env=env, cwd=home, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout

    out = piped("status")
    assert "…" not in out
    header = next(line for line in out.splitlines() if "NAME" in line)
    assert header.replace("┃", " ").split() == ["ID", "NAME", "STATE", "WORKERS", "GEN", "STEP", "LEFT", "OWNER",
                                                "AGE", "NOTE"]
    note = json.loads(piped("status", str(queued), "--json"))["queue_reason"]
    assert note and note in out and reason in out
    one = piped("status", str(failed))
    assert "…" not in one
    assert reason in one and "worker 1 crashed" in one
    assert next(line for line in one.splitlines() if "RANK" in line).replace("┃", " ").split() == \
        ["RANK", "WID", "HOST", "DEVICES", "PID", "STATE", "GEN", "EXIT"]


def older_line(text: str) -> tuple[int, int] | None:
    """(how many older jobs, the next cursor) from a page's last line; None without one."""
    import re

    found = re.search(r"(\d+) older job\(s\) not shown: add --cursor (\d+) for the next page", text)
    return (int(found[1]), int(found[2])) if found else None


def test_all_pages_the_table_and_the_cursors_chain_to_every_job_once(config_path, status):
    ids = record_jobs(config_path, ["succeeded", "queued", "failed"] * 9)   # 27
    seen, args = [], ("--all", "--limit", "10")
    while True:
        code, out, err = status(*args)
        assert code == 0, err
        page = table_ids(out)
        assert page == sorted(page) and len(page) <= 10
        seen = page + seen
        line = older_line(out)
        if line is None:
            break
        assert line == (len(ids) - len(seen), page[0])
        args = ("--all", "--limit", "10", "--cursor", str(line[1]))
    assert seen == ids


def test_all_without_limit_is_a_page_of_the_newest(config_path, status):
    from gpuflex.cli.status_cmd import ALL_PAGE

    ids = record_jobs(config_path, ["succeeded"] * (ALL_PAGE + 3))
    code, out, _ = status("--all")
    assert code == 0 and table_ids(out) == ids[3:] and older_line(out) == (3, ids[3])


def test_streamed_json_parses_and_equals_the_jobs_records(config_path, status):
    # (no running job: the refresh would reconcile it with a host it never ran on)
    ids = record_jobs(config_path, ["succeeded", "cancelled", "queued", "failed"] * 3, history=True)
    code, out, err = status("--json")
    assert code == 0 and err == ""
    svc = JobService(load_config(str(config_path)))
    try:
        whole = [render.job_json(j) for j in svc.listing().jobs]
    finally:
        svc.close()
    assert json.loads(out) == json.loads(json.dumps(whole, default=str))
    assert len(out.splitlines()) == len(ids) + 2   # a job per line, between the brackets
    code, out, err = status("--json", "--limit", "5", "--cursor", str(ids[-2]))
    assert code == 0 and [j["id"] for j in json.loads(out)] == ids[-7:-2]
    assert older_line(err) == (len(ids) - 7, ids[-7])
    code, out, err = status("--json", "--all", "--limit", "0", "--state", "failed")
    assert code == 0 and [j["id"] for j in json.loads(out)] == ids[3::4] and err == ""
    code, out, _ = status("--json", "--user", "nobody-30")
    assert code == 2


def test_empty_listings_are_valid_json(config_path, status):
    code, out, _ = status("--json")
    assert code == 0 and json.loads(out) == []


def test_bad_paging_options_are_one_error_line_and_change_nothing(config_path, db_path, status):
    record_jobs(config_path, ["succeeded", "queued"])
    before = db_dump(db_path)
    for args, words in [(("--all", "--limit", "-1"), "--limit -1: give 1 to 10000 jobs per page"),
                        (("--json", "--limit", "10001"), "--limit 10001: give 1 to 10000"),
                        (("--all", "--cursor", "0"), "--cursor 0: give the job id a previous page ended at"),
                        (("--limit", "5"), "--limit and --cursor page 'status --all' and 'status --json'"),
                        (("--cursor", "5"), "add one of them"),
                        (("1", "--limit", "5"), "give them without JOB"),
                        (("--all", "--cursor", "x"), "Invalid value for '--cursor'")]:
        code, out, err = status(*args)
        assert (code, out) == (2, ""), args
        assert err.startswith("error: ") and words in err, err
        assert len(err.strip().splitlines()) == 1
    assert db_dump(db_path) == before


def test_a_page_takes_a_number_of_statements_that_does_not_grow_with_the_jobs(tmp_path):
    counts = []
    for n, name in [(1, "few"), (30, "many")]:
        (tmp_path / name).mkdir()
        config = write_config(tmp_path / name)
        record_jobs(config, ["running", "queued", "succeeded", "failed"] * n, history=True)
        svc = JobService(load_config(str(config)))
        try:
            with statements(svc) as seen:
                render.listing(svc.listing_page(None, None, 3, None), {})
            counts.append(len(seen))
        finally:
            svc.close()
    assert counts[0] == counts[1] and counts[1] <= 10
