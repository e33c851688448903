"""The queue's decisions without processes (gpuflex.policy.preemption): dependency gates,
array caps, preemption plans; and time limits: their spellings, and which runs reached
theirs (gpuflex.policy.reconcile.timed_out)."""

from __future__ import annotations

import dataclasses

import pytest

from rich.console import Console

import gpuflex.cli.render as render
from gpuflex.config import parse_config
from gpuflex.control.launch import run_deadline
from gpuflex.control.pool import Pool
from gpuflex.control.queueing import Room
from gpuflex.control.requests import ArrayRef, SubmitRequest, parse_ref
from gpuflex.control.service import JobService
from gpuflex.db.models import Job
from gpuflex.errors import UsageError
from gpuflex.jobspec import format_time, parse_array, parse_time
from gpuflex.policy.lifecycle import JobFacts, Observation, ProcSeen, WorkerFacts
from gpuflex.policy.placement import HostFree
from gpuflex.policy.reconcile import timed_out
from gpuflex.policy.preemption import (AFTERANY, AFTERNOTOK, Dependency, HeldWorker, Shrink, Stop, Victim,
                                       array_gate, could_preempt, dependency_gate, plan_preemption,
                                       singleton_gate)
from gpuflex.states import JobState as S
from gpuflex.states import WorkerState
from tests.fakes.hosts import FakeHost, World

# ---- dependencies ---------------------------------------------------------------------------


def dep(ref: int, *states: S, array: bool = False, kind: str = "afterok") -> Dependency:
    return Dependency(ref, tuple((ref + i, s) for i, s in enumerate(states)), array=array, kind=kind)


def test_a_job_waits_naming_each_dependency_not_done_and_its_state():
    gate = dependency_gate([dep(12, S.RUNNING), dep(13, S.QUEUED), dep(14, S.SUCCEEDED)])
    assert (gate.open, gate.cancel) == (False, None)
    assert gate.wait == "waiting for job 12 (running), job 13 (queued)"


def test_every_dependency_succeeded_opens_the_gate():
    assert dependency_gate([dep(12, S.SUCCEEDED), dep(5, S.SUCCEEDED, S.SUCCEEDED, array=True)]).open
    assert dependency_gate([]).open


@pytest.mark.parametrize("state,words", [(S.FAILED, "failed"), (S.CANCELLED, "was cancelled"),
                                         (S.TIMEOUT, "timed out")])
def test_a_dependency_that_ended_badly_cancels_the_job_with_that_reason(state, words):
    gate = dependency_gate([dep(13, S.QUEUED), dep(12, state)])
    assert gate.cancel == f"job 12 {words}" and not gate.open


def test_an_array_id_stands_for_every_job_of_the_array():
    waiting = dependency_gate([dep(5, S.SUCCEEDED, S.RUNNING, S.QUEUED, S.SUCCEEDED, array=True)])
    assert waiting.wait == "waiting for array 5 (2 of 4 not done)"
    failed = dependency_gate([dep(5, S.SUCCEEDED, S.FAILED, S.QUEUED, array=True)])
    assert failed.cancel == "job 6 of array 5 failed"


def test_an_id_that_names_no_job_any_more_waits_and_says_so():
    assert dependency_gate([Dependency(99, ())]).wait == "waiting for job 99 (unknown)"


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.FAILED, S.CANCELLED, S.TIMEOUT])
def test_afterany_opens_once_the_job_ended_however(state):
    assert dependency_gate([dep(12, state, kind=AFTERANY)]).open


@pytest.mark.parametrize("state", [S.QUEUED, S.RUNNING])
def test_afterany_and_afternotok_wait_while_the_job_has_not_ended(state):
    for kind in (AFTERANY, AFTERNOTOK):
        gate = dependency_gate([dep(12, state, kind=kind)])
        assert (gate.cancel, gate.wait) == (None, f"waiting for job 12 ({state.value}) ({kind})")


@pytest.mark.parametrize("state", [S.FAILED, S.CANCELLED, S.TIMEOUT])
def test_afternotok_opens_when_the_job_ended_badly(state):
    assert dependency_gate([dep(12, state, kind=AFTERNOTOK)]).open


def test_afternotok_on_a_job_that_succeeded_can_never_start_and_cancels():
    gate = dependency_gate([dep(12, S.SUCCEEDED, kind=AFTERNOTOK)])
    assert gate.cancel == "job 12 succeeded (afternotok:12 waits for a failure)"


def test_afternotok_on_an_array_waits_for_all_and_opens_when_one_failed():
    assert dependency_gate([dep(5, S.SUCCEEDED, S.RUNNING, array=True, kind=AFTERNOTOK)]).wait == \
        "waiting for array 5 (1 of 2 not done) (afternotok)"
    assert dependency_gate([dep(5, S.SUCCEEDED, S.FAILED, array=True, kind=AFTERNOTOK)]).open
    assert dependency_gate([dep(5, S.SUCCEEDED, S.SUCCEEDED, array=True, kind=AFTERNOTOK)]).cancel == \
        "every job of array 5 succeeded (afternotok:5 waits for a failure)"


def test_kinds_mix_and_an_afterok_that_failed_still_cancels():
    gate = dependency_gate([dep(3, S.FAILED, kind=AFTERNOTOK), dep(4, S.CANCELLED, kind=AFTERANY),
                            dep(5, S.SUCCEEDED)])
    assert gate.open
    assert dependency_gate([dep(3, S.FAILED, kind=AFTERANY), dep(5, S.FAILED)]).cancel == "job 5 failed"


def test_singleton_waits_for_the_others_of_its_name_and_opens_without_them():
    assert singleton_gate("train", []).open
    gate = singleton_gate("train", [(3, S.RUNNING), (4, S.QUEUED)])
    assert (gate.cancel, gate.wait) == (None, "waiting for job 3 (running), job 4 (queued) of the same "
                                              "name 'train' (singleton)")


# ---- arrays ---------------------------------------------------------------------------------
@pytest.mark.parametrize("limit,running,open_", [(None, 9, True), (4, 3, True), (4, 4, False), (1, 1, False)])
def test_an_array_runs_at_most_its_cap(limit, running, open_):
    gate = array_gate(5, limit, running)
    assert gate.open is open_
    if not open_:
        assert gate.wait == f"waiting for a slot of array 5: {running} of at most {limit} running"


def test_a_job_outside_an_array_has_no_cap():
    assert array_gate(None, 2, 7).open


def test_an_array_task_reference_is_id_underscore_index():
    assert parse_ref("5_3") == ArrayRef(5, 3)
    assert parse_ref(" 12 ") == 12 and parse_ref("run-5_3") == "run-5_3"
    with pytest.raises(UsageError, match="job ids go from 1"):
        parse_ref("5_99999999999")


# ---- preemption -----------------------------------------------------------------------------
def workers(host: str, *devices: int, first_wid: int = 0) -> tuple[HeldWorker, ...]:
    return tuple(HeldWorker(first_wid + i, host, (d,)) for i, d in enumerate(devices))


def victim(job_id: int, priority: int, devices: tuple[int, ...], elastic: str | None = None,
           requeue: bool = False, min_workers: int | None = None, host: str = "h") -> Victim:
    return Victim(job_id, priority, elastic, requeue, len(devices) if min_workers is None else min_workers,
                  workers(host, *devices))


def plan(victims, need: int, priority: int = 10, free: tuple[int, ...] = (), coming=()):
    return plan_preemption([HostFree("h", free, slots=True)], coming, need, 1, priority, victims)


def test_in_place_jobs_shrink_toward_min_first_newest_workers_first():
    v = [victim(1, 0, (0, 1, 2, 3), elastic="inplace", min_workers=1),
         victim(2, 0, (4, 5), requeue=True)]
    p = plan(v, 2)
    assert p.ok and p.actions == (Shrink(1, (2, 3)),)


def test_only_as_many_as_needed_lowest_priority_first():
    v = [victim(1, 5, (0, 1), requeue=True), victim(2, 1, (2, 3), requeue=True),
         victim(3, 1, (4, 5), elastic="restart", min_workers=1)]
    p = plan(v, 2)
    assert p.ok and p.actions == (Stop(3),)    # priority 1, the newest of the two
    assert plan(v, 4).actions == (Stop(3), Stop(2))
    assert plan(v, 6).actions == (Stop(3), Stop(2), Stop(1))


def test_a_shrink_that_is_not_enough_gives_way_to_one_stop_of_that_job():
    v = [victim(1, 0, (0, 1, 2), elastic="inplace", requeue=True, min_workers=2)]
    assert plan(v, 2).actions == (Stop(1),)


def test_an_action_made_useless_by_a_later_one_is_dropped():
    # the shrink of job 1 frees one device, not enough; the stop of job 2 alone frees both
    v = [victim(1, 0, (0, 1), elastic="inplace", min_workers=1), victim(2, 0, (2, 3), requeue=True)]
    assert plan(v, 2).actions == (Stop(2),)


def test_gangs_equal_or_higher_priority_and_resizing_jobs_are_never_preempted():
    assert not plan([victim(1, 0, (0, 1))], 1).ok                                   # a gang
    assert not plan([victim(1, 10, (0, 1), requeue=True)], 1).ok                    # same priority
    assert not plan([victim(1, 0, (0, 1), elastic="inplace", min_workers=2)], 1).ok   # at its MIN
    busy = Victim(1, 0, "inplace", False, 1, workers("h", 0, 1), can_shrink=False)
    assert not plan([busy], 1).ok


def test_an_interactive_session_is_never_preempted_whatever_its_priority_or_shape():
    """A pinned victim (`gpuflex run`, issue 33): neither stopped nor shrunk, even where the
    same job unpinned would be; the others still are."""
    shapes = [dict(requeue=True), dict(elastic="restart", min_workers=1), dict(elastic="inplace", min_workers=1)]
    for shape in shapes:
        free = victim(1, 0, (0, 1), **shape)
        pinned = dataclasses.replace(free, pinned=True)
        assert plan([free], 1).ok and could_preempt([free], 10)
        assert not plan([pinned], 1).ok and not could_preempt([pinned], 10)
    both = [dataclasses.replace(victim(1, 0, (0, 1), requeue=True), pinned=True), victim(2, 0, (2,), requeue=True)]
    assert plan(both, 1).actions == (Stop(2),)


def test_a_job_could_preempt_only_what_a_plan_may_stop_or_shrink():
    never = [victim(1, 0, (0, 1)), victim(2, 10, (2,), requeue=True),
             victim(3, 0, (3, 4), elastic="inplace", min_workers=2)]
    assert not could_preempt(never, 10) and not plan(never, 1).ok
    assert could_preempt(never + [victim(4, 0, (5,), requeue=True)], 10)
    assert could_preempt([victim(5, 0, (6, 7), elastic="inplace", min_workers=1)], 10)
    assert not could_preempt([victim(5, 0, (6, 7), elastic="inplace", min_workers=1)], 0)
    # so a full pool of such jobs lets the placing pass skip reading fair share's usage
    assert not Room([HostFree("h", (), slots=True)], [], never).could_start(10)
    assert Room([HostFree("h", (8,), slots=True)], [], never).could_start(10)


def test_nobody_is_preempted_when_even_all_of_them_would_not_make_room():
    v = [victim(1, 0, (0,), requeue=True), victim(2, 0, (1, 2), elastic="inplace", min_workers=1)]
    assert plan(v, 4).ok is False and plan(v, 4).actions == ()


def test_devices_leavers_are_giving_back_count_and_nothing_more_is_preempted():
    v = [victim(1, 0, (0, 1), requeue=True)]
    p = plan(v, 2, free=(2,), coming=workers("h", 3, first_wid=7))
    assert p.ok and p.actions == ()


def test_preemption_counts_whole_workers_on_one_host():
    """A 2-device worker needs both devices on one host: one freed device on each of two
    hosts is no room."""
    v = [Victim(1, 0, None, True, 1, (HeldWorker(0, "a", (0,)),)),
         Victim(2, 0, None, True, 1, (HeldWorker(0, "b", (0,)),)),
         Victim(3, 0, None, True, 1, (HeldWorker(0, "a", (1,)),))]
    free = [HostFree("a", (), True), HostFree("b", (), True)]
    p = plan_preemption(free, (), 1, 2, 10, v)
    assert p.ok and set(p.actions) == {Stop(1), Stop(3)}


# ---- time limits ----------------------------------------------------------------------------
@pytest.mark.parametrize("text,seconds", [("90s", 90), ("30m", 1800), ("4h", 14400), ("2d", 172800),
                                          ("1-12:00:00", 129600), ("5", 300), ("1:30", 90),
                                          ("01:00:00", 3600), ("2-3", 2 * 86400 + 3 * 3600), ("0.5s", 0.5)])
def test_time_limits_take_slurm_spellings(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["0", "0s", "00:00:00", "5x", "", "-1", "1-", "367d", "1:2:3:4", "s"])
def test_a_time_that_is_no_limit_is_refused_naming_it(text):
    with pytest.raises(UsageError, match="--time"):
        parse_time(text)


def test_times_are_written_as_slurm_writes_them():
    assert [format_time(s) for s in (0, 59.9, 3600, 86400, 129600 + 61)] == [
        "00:00:00", "00:00:59", "01:00:00", "1-00:00:00", "1-12:01:01"]


# ---- which runs reached their limit (policy.reconcile.timed_out) ----------------------------
def limited_job(*wids: int, started: float = 1000.0, limit: float | None = 60.0) -> JobFacts:
    job = Job(state=S.RUNNING, started_at=started, time_limit_s=limit)
    return JobFacts(id=1, state=S.RUNNING, min_workers=1, started_at=started, deadline=run_deadline(job),
                    workers=tuple(WorkerFacts(w, "h", WorkerState.RUNNING) for w in wids))


@pytest.mark.parametrize("now,procs,out", [
    (1059.0, {0: (True, None)}, False),                    # before the deadline
    (1060.0, {0: (True, None)}, True),                     # at it, still running: this command stops it
    (1070.0, {0: (False, 1061.0)}, True),                  # its supervisor ended it after the deadline
    (1070.0, {0: (False, 1050.0), 1: (False, 1059.0)}, False),   # all ended before: their exit codes decide
    (1070.0, {0: (False, 1050.0)}, True),                  # worker 1's host did not answer
    (1070.0, {0: (False, None), 1: (False, 1059.0)}, True),   # gone without an exit record
], ids=["early", "running", "supervised", "ended-before", "unreachable", "lost"])
def test_a_run_is_timed_out_once_its_deadline_passed_and_a_worker_did_not_end_before_it(now, procs, out):
    seen = Observation({w: ProcSeen(alive, 0 if end else None, end, exited=end is not None)
                        for w, (alive, end) in procs.items()})
    assert timed_out(limited_job(0, 1), seen, now) is out


def test_a_run_without_a_limit_never_times_out():
    assert not timed_out(limited_job(0, limit=None), Observation({0: ProcSeen(True)}), 10**12)


# ---- preemption carried out, on simulated hosts (tests/fakes/hosts.py) ----------------------
@pytest.fixture
def sim(tmp_path):
    """The real service, DB and executor over one simulated 4-GPU host."""
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=4)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"}, "jobs": {"cancel_grace_s": 2},
                        "hosts": [{"name": "pool", "address": "10.9.1.1", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    svc.world = world
    yield svc
    svc.close()


def submit(svc: JobService, tmp_path, lo: int, hi: int, priority: int = 0, **kw) -> int:
    return svc.submit(SubmitRequest(argv=["python3", "train.py"], min_workers=lo, max_workers=hi,
                                    priority=priority, workdir=str(tmp_path), **kw))


def test_an_in_place_job_shrinks_for_a_higher_priority_one_which_starts_once_they_left(sim, tmp_path):
    low = submit(sim, tmp_path, 2, 4)
    high = submit(sim, tmp_path, 2, 2, priority=10)
    waiting = sim.job(high)
    assert (waiting.state, waiting.queue_reason) == (S.QUEUED, f"preempting job {low} (shrinking by 2)")
    events = [(e.kind, e.message) for e in sim.job(low).events]
    assert ("preempted", f"preempted by job {high} (priority 10): worker(s) 2, 3 leave") in events
    assert [w.state for w in sim.job(low).workers] == [WorkerState.STARTING] * 2 + [WorkerState.LEAVING] * 2
    freed = sorted(d for w in sim.job(low).workers[2:] for d in w.gpus)
    sim.refresh(probe=True)
    assert sim.job(high).queue_reason.endswith("; preempted workers are leaving")   # nothing more preempted
    assert [e.kind for e in sim.job(low).events].count("preempted") == 1
    for wid, proc in sim.world.workers().items():   # the leavers reach their step boundary and exit 0
        if wid in (2, 3):
            sim.world.end(proc, 0)
    sim.refresh(probe=True)
    placed, shrunk = sim.job(high), sim.job(low)
    assert placed.state is S.RUNNING and sorted(d for w in placed.workers for d in w.gpus) == freed
    assert (shrunk.state, len([w for w in shrunk.workers if not w.state.final]), shrunk.restarts) == (
        S.RUNNING, 2, 0)


def test_a_requeue_job_is_stopped_and_requeued_and_the_waiting_one_starts_in_the_same_command(sim, tmp_path):
    low = submit(sim, tmp_path, 4, 4, requeue=True)
    high = submit(sim, tmp_path, 2, 2, priority=10)
    assert sim.job(high).state is S.RUNNING
    stopped = sim.job(low)
    assert (stopped.state, stopped.restarts) == (S.QUEUED, 1)
    assert [e.message for e in stopped.events if e.kind == "state"][-1] == \
        f"queued: preempted by job {high} (priority 10)"
    assert ("preempting", f"preempting job {low} (requeued)") in [(e.kind, e.message) for e in sim.job(high).events]


def test_a_gang_without_requeue_is_never_preempted(sim, tmp_path):
    gang = submit(sim, tmp_path, 4, 4)
    high = submit(sim, tmp_path, 2, 2, priority=10)
    assert sim.job(gang).state is S.RUNNING and not [e for e in sim.job(gang).events if e.kind == "preempted"]
    assert sim.job(high).queue_reason.startswith("waiting for 2 free GPUs")


def test_an_array_on_simulated_hosts_caps_its_running_jobs_groups_in_status_and_cancels_as_one(sim, tmp_path):
    first = submit(sim, tmp_path, 1, 1, array=parse_array("0-3%2"), name="sweep")
    jobs = sim.jobs()
    assert [(j.id, j.array_id, j.array_index, j.state) for j in jobs] == [
        (first, first, 0, S.RUNNING), (first + 1, first, 1, S.RUNNING),
        (first + 2, first, 2, S.QUEUED), (first + 3, first, 3, S.QUEUED)]
    assert jobs[2].queue_reason == f"waiting for a slot of array {first}: 2 of at most 2 running"
    envs = sorted((p.env["GPUFLEX_ARRAY_ID"], p.env["GPUFLEX_ARRAY_INDEX"]) for p in sim.world.procs.values()
                  if not p.coordinator)
    assert envs == [(str(first), "0"), (str(first), "1")]
    assert sim.job(f"{first}_3").id == first + 3

    console = Console(width=200, record=True)
    console.print(render.jobs_table(jobs, {}))
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in console.export_text().splitlines()
            if line.startswith("│")]
    assert rows[0][:3] == [f"array {first}", "sweep", "4 jobs: 2 queued, 2 running (at most 2 running)"]
    assert [row[:3] for row in rows[1:]] == [[str(first + i), f"sweep[{i}]", s]
                                            for i, s in enumerate(["running"] * 2 + ["queued"] * 2)]

    done = sim.cancel(str(first))
    assert [j.id for j in done] == [first + i for i in range(4)]
    assert {j.state for j in sim.jobs()} == {S.CANCELLED}


def test_an_arrays_name_cancels_every_job_of_it_not_ended_and_a_tasks_id_that_task_alone(sim, tmp_path):
    """A name means its newest job; when that job is one of an array's, `cancel NAME` means
    the whole array (as the array's id does), not the task submitted last."""
    alone = submit(sim, tmp_path, 1, 1, name="sweep")     # older, of the same name, in no array
    first = submit(sim, tmp_path, 1, 1, array=parse_array("0-3%2"), name="sweep")
    assert [j.id for j in sim.cancel(str(first + 1))] == [first + 1]    # a task's own id: that task
    assert sim.job(first + 2).state is S.RUNNING                      # its slot went to the next one
    assert [j.id for j in sim.cancel("sweep")] == [first, first + 2, first + 3]
    assert [sim.job(first + i).state for i in range(4)] == [S.CANCELLED] * 4
    assert sim.job(alone).state is S.RUNNING
    with pytest.raises(UsageError, match=f"^array {first}: every job is already ended; nothing to cancel"):
        sim.cancel("sweep")   # still the newest of that name: the older job is not reached for
    assert sim.job(alone).state is S.RUNNING
