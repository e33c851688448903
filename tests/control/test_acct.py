"""`gpuflex acct` (gpuflex.control.acct): the ended jobs' rows, their device time counted
as `report` counts it, pages chained by a cursor that lose and repeat no job, totals that
are the sums of the rows (and agree with `report --by user`), filters, and bad input.

The jobs are written straight into the database of a real config (no process runs);
the command runs in this process through typer's runner.
"""

from __future__ import annotations

import csv
import io
import json
import time

import pytest

from gpuflex.config import load_config
from gpuflex.control import acct
from gpuflex.control.service import JobService
from gpuflex.db.models import Event, Host, Job, Worker
from tests.conftest import db_dump, write_config

H = 3600.0


def run(cfg, *args: str, code: int = 0, stderr: bool = False) -> str:
    from typer.testing import CliRunner

    from gpuflex.cli import app

    r = CliRunner().invoke(app, ["--config", str(cfg), "acct", *args], env={"COLUMNS": "250"})
    assert r.exit_code == code, r.output
    return r.stderr if stderr else r.output if code else r.stdout


def add_job(s, token: str, user: str, name: str, state: str, created: float, ended: float | None,
            workers: list[tuple[str, list[int], float, float | None]], sizes: list[tuple[float, dict]] = (),
            exit_code: int | None = 0) -> Job:
    j = Job(token=token, name=name, state=state, argv=["x"], workdir="/", env={}, min_workers=1, max_workers=4,
            gpus_per_worker=1, user=user, created_at=created, ended_at=ended, exit_code=exit_code,
            exit_reason=f"{state} for the test")
    for wid, (host, gpus, start, end) in enumerate(workers):
        j.workers.append(Worker(wid=wid, host=host, gpus=gpus, state="exited" if end else "running",
                                log_path="l", exit_path="e", started_at=start, ended_at=end))
    for at, data in sizes:
        kind = "state" if "state" in data else "scale"
        j.events.append(Event(time=at, kind=kind, message=kind, data=data, count=1))
    s.add(j)
    return j


@pytest.fixture
def pool(home):
    """A config whose "local" host is CPU slots, an owned GPU host and a lab GPU host, and
    jobs of alice, bob and carol (one still running, one queued: never in acct)."""
    cfg = write_config(home)
    svc = JobService(load_config(str(cfg)))
    now = time.time()
    try:
        svc.refresh()
        with svc.sessions.begin() as s:
            s.add_all([Host(name="owned", address="10.0.0.8", owner="prof"), Host(name="lab", address="10.0.0.9")])
            # alice: 2 GPUs x 1 h on the owned host (harvested), then grown to 3 workers for 0.5 h on lab
            add_job(s, "a1", "alice", "train", "succeeded", now - 3 * H, now - 1.4 * H,
                    [("owned", [0], now - 2 * H, now - 1.5 * H), ("owned", [1], now - 2 * H, now - 1.5 * H),
                     ("lab", [0], now - 2 * H, now - 1.5 * H)],
                    [(now - 2 * H, {"state": "running", "world_size": 2}), (now - 1.8 * H, {"members": [0, 1, 2], "ok": True}),
                     (now - 1.4 * H, {"state": "succeeded"})])
            # bob: 2 CPU slots for 1 h, failed
            add_job(s, "b1", "bob", "sweep", "failed", now - 5 * H, now - 3.9 * H,
                    [("local", [0, 1], now - 5 * H, now - 4 * H)],
                    [(now - 5 * H, {"state": "running", "world_size": 1}), (now - 3.9 * H, {"state": "failed"})],
                    exit_code=3)
            # carol: cancelled while queued, no worker
            add_job(s, "c1", "carol", "probe", "cancelled", now - 2 * H, now - 1 * H, [], exit_code=None)
            # more of alice's, to page through
            for i in range(5):
                add_job(s, f"a{i + 2}", "alice", "train" if i % 2 else "eval", "succeeded", now - 1 * H, now - 0.5 * H,
                        [("lab", [1], now - 0.9 * H, now - 0.6 * H)])
            add_job(s, "r1", "bob", "live", "running", now - 1 * H, None, [("lab", [2], now - 0.5 * H, None)])
            add_job(s, "q1", "bob", "waiting", "queued", now - 1 * H, None, [])
    finally:
        svc.close()
    return cfg


def test_a_row_holds_the_jobs_device_time_wait_elapsed_and_world_sizes(pool):
    listed = json.loads(run(pool, "--json"))["jobs"]
    assert len(listed) == 8   # every ended job; the running and the queued one are not listed
    rows = {r["name"] + r["user"]: r for r in listed}
    a = next(r for r in json.loads(run(pool, "--json", "--user", "alice", "--limit", "10"))["jobs"]
             if r["world_size_max"] == 3)
    assert a["gpu_hours"] == pytest.approx(1.5, abs=1e-3)              # 3 GPUs x 0.5 h
    assert a["harvested_gpu_hours"] == pytest.approx(1.0, abs=1e-3)    # the two on the owned host
    assert (a["slot_hours"], a["device"]) == (0.0, "gpu")
    assert a["wait_s"] == pytest.approx(H, abs=1) and a["elapsed_s"] == pytest.approx(0.5 * H, abs=1)
    assert (a["world_size_min"], a["world_size_max"]) == (2, 3)
    assert [n for _, n in a["world_sizes"]] == [2, 3, 0]
    assert {h["host"]: h["device_hours"] for h in a["hosts"]} == {"owned": pytest.approx(1.0, abs=1e-3),
                                                                 "lab": pytest.approx(0.5, abs=1e-3)}
    b = rows["sweepbob"]
    assert (b["device"], b["gpu_hours"], b["slot_hours"]) == ("cpu-slot", 0.0, pytest.approx(2.0, abs=1e-3))
    assert (b["state"], b["exit_code"], b["exit_reason"]) == ("failed", 3, "failed for the test")
    c = rows["probecarol"]
    assert (c["started_at"], c["wait_s"], c["elapsed_s"], c["device"], c["world_size_max"]) == (None, None, 0.0, None, 0)


def test_pages_chain_by_cursor_newest_first_losing_and_repeating_no_job(pool):
    everything = [r["id"] for r in json.loads(run(pool, "--json", "--limit", "0"))["jobs"]]
    assert len(everything) == 8 and everything == sorted(everything, reverse=True)
    seen, cursor = [], None
    while True:
        page = json.loads(run(pool, "--json", "--limit", "3", *(["--cursor", str(cursor)] if cursor else [])))
        assert len(page["jobs"]) <= 3
        seen += [r["id"] for r in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == everything
    assert run(pool, "--limit", "3", stderr=True) == f"more: add --cursor {everything[2]} for the next page\n"
    rows = list(csv.DictReader(io.StringIO(run(pool, "--csv", "--limit", "0"))))
    assert [int(r["id"]) for r in rows] == everything and list(rows[0]) == acct.FIELDS


def test_totals_are_the_sums_of_the_rows_and_agree_with_report_by_user(pool):
    rows = json.loads(run(pool, "--json", "--limit", "0"))["jobs"]
    totals = json.loads(run(pool, "--totals", "--json"))
    assert totals["jobs"] == len(rows)
    for u in totals["by_user"]:
        mine = [r for r in rows if r["user"] == u["user"]]
        assert u["jobs"] == len(mine)
        for k in ("gpu_hours", "harvested_gpu_hours", "slot_hours"):
            assert u[k] == pytest.approx(sum(r[k] for r in mine), abs=1e-5)
    for h in totals["by_host"]:
        assert h["device_hours"] == pytest.approx(
            sum(x["device_hours"] for r in rows for x in r["hosts"] if x["host"] == h["host"]), abs=1e-5)
    assert {h["host"] for h in totals["by_host"]} == {"owned", "lab", "local"}
    # report counts each user's device time inside its window; the running job's too, so bob's
    # GPU time is left out of the comparison (his live worker's)
    from typer.testing import CliRunner

    from gpuflex.cli import app

    r = CliRunner().invoke(app, ["--config", str(pool), "report", "--by", "user", "--since", "6h", "--json"])
    report = {u["user"]: u for u in json.loads(r.stdout)["by_user"]}
    ours = {u["user"]: u for u in totals["by_user"]}
    for k in ("gpu_hours", "harvested_gpu_hours", "slot_hours"):
        assert ours["alice"][k] == pytest.approx(report["alice"][k], abs=1e-3)
    assert ours["bob"]["slot_hours"] == pytest.approx(report["bob"]["slot_hours"], abs=1e-3)
    text = run(pool, "--totals")
    assert "by user (8 job(s))" in text and "by host" in text and "slot-h" in text


def test_filters_choose_by_user_state_name_and_end_time(pool):
    def ids(*args: str) -> list[str]:
        return sorted((r["user"], r["name"], r["state"]) for r in json.loads(run(pool, "--json", "--limit", "0", *args))["jobs"])

    assert ids("--user", "bob") == [("bob", "sweep", "failed")]
    assert ids("--user", "bob,carol") == [("bob", "sweep", "failed"), ("carol", "probe", "cancelled")]
    assert ids("--state", "failed", "--state", "cancelled") == [("bob", "sweep", "failed"), ("carol", "probe", "cancelled")]
    assert len(ids("--name", "eval")) == 3
    assert ids("--until", "3h") == [("bob", "sweep", "failed")]            # ended 3.9 h ago
    assert len(ids("--since", "45m")) == 5                                   # alice's five ended 0.5 h ago
    assert ids("--since", "2h", "--until", "1.2h") == [("alice", "train", "succeeded")]
    assert "no ended job matches" in run(pool, "--name", "nothing")


@pytest.mark.parametrize("args, message", [
    (["--since", "1h", "--until", "2h"], "--until is before --since"),
    (["--since", "yesterday"], "--since 'yesterday': expected a duration"),
    (["--state", "running"], "acct lists ended jobs"),
    (["--state", "done"], "--state 'done'"),
    (["--user", "no-such-user-here"], "no unix user of that name"),
    (["--limit", "20000"], "--limit 20000"),
    (["--cursor", "0"], "--cursor 0"),
    (["--json", "--csv"], "choose one"),
    (["--totals", "--limit", "5"], "--totals sums every matching job"),
    (["--mine", "--user", "bob"], "one of --user NAME and --mine"),
])
def test_bad_input_is_one_line_and_exit_2_with_the_database_unchanged(pool, home, args, message):
    before = db_dump(home / "g.db")
    out = run(pool, *args, code=2)
    assert message in out and "Traceback" not in out and len(out.strip().splitlines()) == 1
    assert db_dump(home / "g.db") == before


def test_rows_without_the_world_sizes_are_the_same_rows_less_those(pool):
    """`--totals` and the web's accounting read rows without their world sizes over time
    (a third of the reading): everything else is the same row."""
    svc = JobService(load_config(str(pool)))
    try:
        whole, lean = list(svc.acct_rows(acct.Filter())), list(svc.acct_rows(acct.Filter(), world=False))
    finally:
        svc.close()
    world = ("world_sizes", "world_size_min", "world_size_max")
    assert [{k: v for k, v in r.items() if k not in world} for r in whole] == \
        [{k: v for k, v in r.items() if k not in world} for r in lean]
    assert any(r["world_size_max"] == 3 for r in whole) and all(r["world_sizes"] == [] for r in lean)
