"""gpuflex.control.observe.facts: the policy's view of a job read from the database; here
the steps its newest runs started at (run_start_steps), which decide whether a fault that
keeps coming back at the same checkpoint ends the job (policy.outcomes.stuck)."""

from __future__ import annotations

from gpuflex.control.observe import facts
from gpuflex.db.engine import open_database
from gpuflex.db.models import Event, Job
from gpuflex.policy.lifecycle import FORMED_KIND, STUCK_RUNS
from tests.cli.test_status_cmd import record_jobs


def _facts_after(config_path, db_path, formed: list, restarts: int):
    [jid] = record_jobs(config_path, ["running"])
    sessions = open_database(f"sqlite:///{db_path}")
    try:
        with sessions.begin() as s:
            job = s.get(Job, jid)
            job.restarts = restarts
            for i, timings in enumerate(formed):
                job.events.append(Event(kind=FORMED_KIND, message="formed", time=100.0 + i, data={
                    "generation_kind": "initial", "generation": 1, **({"timings": timings} if timings else {})}))
            job.events.append(Event(kind="scale", message="a resize", time=200.0,
                                    data={"generation": 2, "timings": {"step": 500}}))
            for i, cause in enumerate(["preempted", "fault", "shards-lost"]):
                job.events.append(Event(kind="state", message=f"requeued {i}", time=300.0 + i,
                                        data={"state": "queued", "cause": cause, "restarts": i + 1}))
            job.events.append(Event(kind="state", message="running", time=400.0, data={"state": "running"}))
        with sessions() as s:
            return facts(s.get(Job, jid))
    finally:
        sessions.kw["bind"].dispose()


def test_the_steps_the_newest_runs_started_at_oldest_first(config_path, db_path):
    formed = [{"step": 0}, {"step": 109}, {"step": 379}, {"step": 379}, {"step": 379}]
    got = _facts_after(config_path, db_path, formed, restarts=4)
    assert got.run_start_steps == (379, 379, 379) and STUCK_RUNS == 3   # a resize's step is not a run's start
    assert got.restart_causes == ("preempted", "fault", "shards-lost")   # the newest (up to 5), oldest first


def test_a_formation_without_a_step_reads_none_and_a_first_run_reads_nothing(config_path, db_path):
    odd = [{"step": 7}, {"step": "7"}, None, {"step": True}]
    assert _facts_after(config_path, db_path, odd, restarts=3).run_start_steps == (None, None, None)
    first = _facts_after(config_path, db_path, [{"step": 0}], restarts=0)
    assert first.run_start_steps == () and first.restart_causes == ()
