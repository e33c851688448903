"""benchmarks/soak_plan.py, the multi-host soak's schedule and figures, without processes:
a seed gives the same schedule, every fault kind is injected once the run holds a round of
them, host faults never overlap each other nor database faults theirs, and the arguments
stay in their bounds."""

from __future__ import annotations

import sys

import pytest

from tests import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import soak_plan  # noqa: E402
from soak_plan import FAULTS, Plan, make_schedule  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_a_seed_gives_the_same_schedule_and_another_seed_another(seed):
    plan = make_schedule(seed, 15)
    assert plan == make_schedule(seed, 15)
    assert plan != make_schedule(seed + 1, 15)
    assert [p.at for p in plan] == sorted(p.at for p in plan)
    assert all(0 < p.at < 15 * 60 for p in plan)


@pytest.mark.parametrize("seed", range(20))
def test_every_fault_kind_appears_in_a_run_as_long_as_a_round(seed):
    minutes = soak_plan.ROUND_S / 60 + 1
    kinds = {p.action for p in make_schedule(seed, minutes)}
    assert set(FAULTS) <= kinds, set(FAULTS) - kinds


@pytest.mark.parametrize("seed", range(20))
def test_host_faults_and_database_faults_never_overlap_their_like(seed):
    plan = Plan(partition_s=30, reboot_s=60)
    sched = make_schedule(seed, 60, plan)
    host = [p for p in sched if p.action in soak_plan.HOST_FAULTS]
    for a, b in zip(host, host[1:]):
        assert b.at >= a.at + a.args["hold_s"], (a, b)
        assert a.args["hold_s"] == (30 if a.action == "partition" else 60)
        assert a.args["host"] in plan.hosts
    db = [p for p in sched if p.action in soak_plan.DB_FAULTS]
    for a, b in zip(db, db[1:]):
        assert b.at >= a.at + a.args.get("hold_s", 0), (a, b)
    for p in sched:
        if p.action == "disk_full":
            assert soak_plan.DISK_FULL_S[0] <= p.args["hold_s"] <= soak_plan.DISK_FULL_S[1]
            assert p.args["during"] in ("submit", "tick")
        elif p.action == "pg_restart":
            assert p.args["during"] in ("submit", "scale", "tick")
        elif p.action == "submit":
            assert p.args["kind"] in soak_plan.KINDS and 0 <= p.args["user"] < soak_plan.USERS
        elif p.action in ("scale", "kill_worker", "kill_newcomer", "kill_coordinator"):
            assert 0 <= p.args["u"] < 1


def test_a_sixty_minute_run_submits_every_kind_from_every_user():
    sched = make_schedule(3, 60)
    subs = [p.args for p in sched if p.action == "submit"]
    assert {s["kind"] for s in subs} == set(soak_plan.KINDS)
    assert {s["user"] for s in subs} == set(range(soak_plan.USERS))


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="minutes"):
        make_schedule(0, 0.5)
    with pytest.raises(ValueError, match="host"):
        make_schedule(0, 5, Plan(hosts=()))


def test_percentiles_and_the_recovery_rows():
    assert soak_plan.percentile([], 50) is None
    assert soak_plan.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert soak_plan.percentile([float(x) for x in range(1, 101)], 99) == 99.0
    assert soak_plan.pick([], 0.3) is None and soak_plan.pick(["a", "b"], 0.99) == "b"
    R = soak_plan.Recovered
    rows = soak_plan.recovery_rows({"kill_worker": [R(2.0, 7), R(4.0, 8)]}, {"reboot": 1})
    assert len(rows) == len(FAULTS)
    assert rows[FAULTS.index("kill_worker")].split()[:2] == ["kill_worker", "2"]
    assert "p50    2.0 s" in rows[FAULTS.index("kill_worker")] and "bound 60 s" in rows[FAULTS.index("kill_worker")]
    assert "1 not measured" in rows[FAULTS.index("reboot")]
    # a recovery over its bound is counted and named; a relaunch is allowed RELAUNCH_S more
    slow = {"kill_worker": [R(70.0, 7), R(100.0, 8, relaunched=True), R(130.0, 9, relaunched=True)],
            "kill_coordinator": [R(100.0, 3, relaunched=True)], "pg_restart": [R(31.0)]}
    rows = soak_plan.recovery_rows(slow, {})
    assert "(bound 60 s, 120 s through a relaunch; 2 over; 2 through a relaunch)" in rows[FAULTS.index("kill_worker")]
    assert "(bound 90 s; 1 over; 1 through a relaunch)" in rows[FAULTS.index("kill_coordinator")]
    assert "(bound 30 s; 1 over)" in rows[FAULTS.index("pg_restart")]
    assert rows[len(FAULTS):] == [
        "  over: pg_restart: 31.0 s (bound 30 s)",
        "  over: kill_worker of job 7: 70.0 s in place (bound 60 s)",
        "  over: kill_worker of job 9: 130.0 s through a relaunch (bound 120 s)",
        "  over: kill_coordinator of job 3: 100.0 s through a relaunch (bound 90 s)"]


def job(id=5, owner="b", state="running", generation=2, restarts=0, step=None):
    return {"id": id, "owner": owner, "state": state, "generation": generation, "restarts": restarts, "step": step}


def test_a_jobs_step_comes_from_its_owners_view_when_that_saw_the_same_generation():
    other = job()                               # the admin's or another user's: no step
    views = {"b": {5: job(step=41)}, "a": {5: other}}
    assert soak_plan.with_step(other, views)["step"] == 41
    assert other["step"] is None                # the record read is not changed
    for stale in (job(step=41, generation=1), job(step=41, restarts=1), job(step=41, state="scaling")):
        assert soak_plan.with_step(other, {"b": {5: stale}})["step"] is None
    assert soak_plan.with_step(other, {"b": {}})["step"] is None
    assert soak_plan.with_step(other, {"b": {5: job(step="7")}})["step"] is None   # not an int
    assert soak_plan.with_step(job(owner="c"), views)["step"] is None               # c never looked


def test_int_rows_keeps_the_rows_of_integers_only():
    out = "3|4101\n4|\n\nx|1\n5|4107|1\n 6|4200 \n"
    assert soak_plan.int_rows(out, 2) == [(3, 4101), (6, 4200)]
    assert soak_plan.int_rows("", 2) == []
