"""A gang's crash beside a peer whose host went down (the 2-hour soak, issue 28), on
simulated hosts (tests/fakes/hosts.py): the verdict waits while the peer's host does not
answer, and is the host's loss, not a crash, once it answers with the peer gone."""

from __future__ import annotations

from gpuflex.control.requests import SubmitRequest
from gpuflex.states import JobState
from tests.fakes.hosts import two_hosts


def test_a_restart_jobs_crash_beside_a_rebooted_peer_is_relaunched_as_a_fault(tmp_path):
    world, svc = two_hosts(tmp_path)
    try:
        job_id = svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=1, max_workers=2,
                                          elastic="restart", retries=0, workdir=str(tmp_path)))
        workers = world.workers()
        on_a = next(p for p in workers.values() if p.host == "a")
        on_b = next(p for p in workers.values() if p.host == "b")
        world.down.add("a")                 # a reboots: its worker dies with it, unseen
        world.end(on_a, None)
        world.end(on_b, 1)                  # b's all-reduce then fails: a reset connection, exit 1
        svc.refresh()
        job = svc.job(job_id)
        assert job.state is JobState.RUNNING and job.restarts == 0, job.state
        kinds = [e.kind for e in svc.job(job_id).events]
        assert "crash-deferred" in kinds and "crash" not in kinds, kinds
        svc.refresh()                       # still down: the same event, counted
        assert [e.kind for e in svc.job(job_id).events].count("crash-deferred") == 1
        world.down.discard("a")             # a answers: its worker left no exit record
        svc.refresh()
        events = svc.job(job_id).events
        assert "crash" not in [e.kind for e in events], [(e.kind, e.message) for e in events]
        (failed,) = [e for e in events if e.kind == "worker-failed"]
        assert failed.data["wid"] == on_a.wid and "judged the loss, not a crash" in failed.message, failed.message
        (restart,) = [e for e in events if e.kind == "state" and (e.data or {}).get("cause") == "fault"]
        assert svc.job(job_id).restarts == 1, restart.message
    finally:
        svc.close()
