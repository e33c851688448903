"""The lifecycle policy as tables: (job, what was observed) -> what reconcile writes. No I/O."""

from __future__ import annotations

import dataclasses

import pytest

from gpuflex.elastic.coordinator.forming import never_joined_reason
from gpuflex.elastic.protocol.keys import ABORTED_EXIT, EVICTED_EXIT, ORPHAN_EXIT, STORE_LOST_EXIT
from gpuflex.elastic.protocol.wire import parse_status
from gpuflex.policy.lifecycle import (Adopt, EndWorker, Finish, JobFacts, Observation, ProcSeen,
                                      Record, Requeue, SetState, WorkerFacts, decide, outcome)
from gpuflex.states import JobState as J
from gpuflex.states import WorkerState as W

ALIVE = ProcSeen(alive=True)


def gone(rc: int | None, ended_at: float | None = 5.0) -> ProcSeen:
    """A group that ended: with an exit record of `rc`, or (None) without one."""
    return ProcSeen(alive=False, returncode=rc, ended_at=ended_at, exited=rc is not None)


def job(*workers: WorkerFacts, state: J = J.RUNNING, gen: int = 1, world: int | None = None,
        min_workers: int = 1, recorded: frozenset[int] = frozenset()) -> JobFacts:
    return JobFacts(id=7, state=state, min_workers=min_workers, workers=tuple(workers), generation=gen,
                    world_size=len(workers) if world is None else world, started_at=100.0, recorded=recorded)


def w(wid: int, host: str = "a", state: W = W.RUNNING, gen: int = 1, rc: int | None = None,
      started_at: float = 100.0) -> WorkerFacts:
    return WorkerFacts(wid, host, state, gen, started_at, rc)


def observed(procs: dict, coordinator: dict | None = None, **kw) -> Observation:
    """What was seen, the coordinator's reply parsed as gpuflex.control.observe parses it."""
    return Observation(procs, coordinator=None if coordinator is None else parse_status(coordinator), **kw)


def coord(gen: int, members: list[int], settled: bool = True, history: list | None = None) -> dict:
    return {"ok": True, "generation": gen, "members": members, "settled": settled, "history": history or []}


@pytest.mark.parametrize("seen,end", [
    (gone(0), EndWorker(1, W.EXITED, 0, 5.0)),
    (gone(3), EndWorker(1, W.FAILED, 3, 5.0)),
    (gone(None), EndWorker(1, W.LOST, None, None)),
], ids=["exit-0", "exit-3", "no-exit-record"])
def test_a_worker_whose_group_is_gone_ends_by_its_exit_record(seen, end):
    facts = job(w(0), w(1))
    actions = decide(facts, observed({0: ALIVE, 1: seen}, coordinator=coord(1, [0, 1])))
    assert actions[0] == end
    assert [a for a in actions if isinstance(a, EndWorker)] == [end]


def test_live_workers_and_a_settled_coordinator_change_nothing():
    facts = job(w(0), w(1))
    assert decide(facts, observed({0: ALIVE, 1: ALIVE}, coordinator=coord(1, [0, 1]))) == \
        [Adopt(1, (0, 1))]


def test_a_new_generation_is_adopted_recorded_once_and_ends_the_scaling():
    hist = [{"kind": "initial", "generation": 1, "verified": True, "message": "formed"},
            {"kind": "resize", "generation": 2, "verified": True, "timings": {"total": 0.1}},
            {"kind": "resize", "generation": 3, "verified": False}]
    facts = job(w(0), w(1), w(2, state=W.STARTING, gen=0), state=J.SCALING, recorded=frozenset({1}))
    actions = decide(facts, observed({0: ALIVE, 1: ALIVE, 2: ALIVE}, coordinator=coord(2, [0, 1, 2], history=hist)))
    assert actions == [
        Adopt(2, (0, 1, 2)),
        Record("scale", "generation 2: scale", {"generation_kind": "resize", "generation": 2, "verified": True,
                                                 "timings": {"total": 0.1}}),
        SetState(J.RUNNING, "world size 3 at generation 2"),
    ]


def test_an_older_generation_than_recorded_is_not_adopted():
    facts = job(w(0), gen=4)
    assert decide(facts, observed({0: ALIVE}, coordinator=coord(3, [0]))) == []


def test_an_unreachable_host_is_noted_and_its_workers_lost_once_the_job_went_on_without_them():
    facts = job(w(0, "a"), w(1, "b"), w(2, "b", state=W.STARTING, gen=0))
    seen = observed({0: ALIVE}, unreachable={"b": "b: connection refused"}, coordinator=coord(2, [0]))
    assert decide(facts, seen) == [
        Record("host-unreachable", "b: connection refused", {"host": "b"}),
        Adopt(2, (0,)),
        EndWorker(1, W.LOST),          # left behind by generation 2; the starting newcomer is kept
    ]


def test_a_gangs_crash_while_a_peers_host_is_silent_is_one_counted_event_then_that_hosts_loss():
    """The host-unreachable event is left out while the crash waits (the deferral names the
    host): one event a repeat counts, not two that alternate at every command."""
    facts = dataclasses.replace(job(w(0, "a"), w(1, "b")), elastic="restart")
    seen = observed({1: gone(1)}, unreachable={"a": "a: connect timed out"}, coordinator=coord(1, [0, 1]))
    (wait,) = [a for a in decide(facts, seen, now=500.0) if isinstance(a, Record)]
    assert wait.kind == "crash-deferred" and wait.data["peer_host"] == "a", wait
    assert not [a for a in decide(facts, seen, now=500.0) if isinstance(a, (Requeue, Finish))]
    later = dataclasses.replace(facts, crash_deferred_at=500.0)
    requeue = decide(later, seen, now=600.0)[-1]
    assert isinstance(requeue, Requeue) and requeue.cause == "fault" and "worker 0 on a" in requeue.reason, requeue


def test_a_starting_newcomer_on_an_unreachable_host_is_lost_once_the_coordinator_left_it_out():
    """FM-ssh's start-up cell: the host died while its newcomer warmed up; the coordinator
    left it out, so the job will never take it in (it used to stay "starting")."""
    facts = job(w(0, "a"), w(2, "b", state=W.STARTING, gen=0), w(3, "b", state=W.STARTING, gen=0))
    status = dict(coord(2, [0]), left_out=[{"n": 1, "wid": 2, "reason": "stopped beating", "phase": "warm-up"}])
    ended = [a for a in decide(facts, observed({0: ALIVE}, unreachable={"b": "down"}, coordinator=status))
             if isinstance(a, EndWorker)]
    assert ended == [EndWorker(2, W.LOST)]


def test_a_first_generation_worker_on_an_unreachable_host_is_lost_once_the_coordinator_rejected_it():
    """The start-up x SSH host cell: the first formation's deadline went on without worker 1
    (rejected); its host is gone, so its row would stay "starting" until the host answered."""
    facts = job(w(0, "a"), w(1, "b", state=W.STARTING, gen=0), w(2, "b", state=W.STARTING, gen=0))
    status = dict(coord(1, [0]), rejected=[1, True, "2"])      # what is no id is not trusted
    ended = [a for a in decide(facts, observed({0: ALIVE}, unreachable={"b": "down"}, coordinator=status))
             if isinstance(a, EndWorker)]
    assert ended == [EndWorker(1, W.LOST)]


def test_an_unreachable_host_whose_workers_are_still_members_loses_nobody():
    facts = job(w(0, "a"), w(1, "b"))
    seen = observed({0: ALIVE}, unreachable={"b": "down"}, coordinator=coord(1, [0, 1]))
    assert not [a for a in decide(facts, seen) if isinstance(a, EndWorker)]


def test_a_silent_coordinator_that_is_gone_is_noted_as_a_lost_store():
    facts = job(w(0))
    assert decide(facts, observed({0: ALIVE}, coordinator=None, coordinator_alive=False)) == \
        [Record("store-lost", "the job's coordinator (store) is gone")]
    assert decide(facts, observed({0: ALIVE}, coordinator=None, coordinator_alive=True)) == []


def test_a_settled_job_below_its_minimum_is_requeued():
    facts = job(w(0), w(1), min_workers=2)
    actions = decide(facts, observed({0: ALIVE, 1: gone(None)}, coordinator=coord(2, [0])))
    assert actions[-1] == Requeue("fell to 1 worker(s), below its minimum of 2; restarting from its "
                                  "checkpoint when it fits", "below-min")
    unsettled = decide(facts, observed({0: ALIVE, 1: gone(None)}, coordinator=coord(2, [0], settled=False)))
    assert not [a for a in unsettled if isinstance(a, Requeue)]


@pytest.mark.parametrize("workers,expected", [
    ([w(0, state=W.EXITED, rc=0), w(1, state=W.EXITED, rc=0)],
     Finish(J.SUCCEEDED, 0, "all workers exited 0")),
    ([w(0, state=W.EXITED, rc=0), w(1, state=W.FAILED, rc=3)],
     Finish(J.FAILED, 3, "worker 1 failed (exit code 3)")),
    ([w(0, state=W.LOST), w(1, state=W.EXITED, rc=0)],
     Requeue("worker 0 on a was lost (no exit record: killed with its supervisor, or its host went down; exit code "
             "137) in generation 1, steady, beside members that exited 0; restarting from its checkpoint", "fault")),
    ([w(0, state=W.FAILED, rc=STORE_LOST_EXIT), w(1, state=W.FAILED, rc=STORE_LOST_EXIT)],
     Requeue("the job store on its host was lost in generation 1, steady; restarting from the last checkpoint",
             "store-lost")),
    # a leaver of an earlier generation that was evicted does not fail the job
    ([w(0, state=W.FAILED, rc=EVICTED_EXIT, gen=1), w(1, state=W.EXITED, rc=0, gen=2)],
     Finish(J.SUCCEEDED, 0, "all workers exited 0")),
    # workers of an earlier run (before the job's started_at) are history
    ([w(0, state=W.FAILED, rc=STORE_LOST_EXIT, gen=2, started_at=50.0), w(1, state=W.EXITED, rc=0, gen=2)],
     Finish(J.SUCCEEDED, 0, "all workers exited 0")),
], ids=["all-0", "one-failed", "one-lost", "store-lost", "old-leaver", "earlier-run"])
def test_the_outcome_is_judged_by_the_last_generation_of_the_current_run(workers, expected):
    assert outcome(job(*workers), workers, generation=2 if any(x.generation == 2 for x in workers) else 1) \
        == expected


def test_the_last_worker_ending_finishes_the_job_in_the_same_reconcile():
    facts = job(w(0, state=W.EXITED, rc=0), w(1))
    actions = decide(facts, observed({1: gone(0)}, coordinator=coord(1, [0, 1])))
    assert actions == [EndWorker(1, W.EXITED, 0, 5.0), Adopt(1, (0, 1)),
                       Finish(J.SUCCEEDED, 0, "all workers exited 0")]


@pytest.mark.parametrize("report,already,want", [
    (None, 0, None),
    ({"count": 0, "last": None}, 0, None),
    ({"count": 3, "last": "members/7"}, 0,
     Record("forged", "ignored 3 forged store record(s) (last: members/7)", {"count": 3, "last": "members/7"})),
    ({"count": 3, "last": "members/7"}, 3, None),   # already an event: not again at every command
    ({"count": 5, "last": "desired_request"}, 3,
     Record("forged", "ignored 2 forged store record(s) (last: desired_request)",
            {"count": 5, "last": "desired_request"})),
    ({"count": "9", "last": "x"}, 0, None),          # not a count: nothing believed
], ids=["none", "zero", "new", "same", "more", "malformed"])
def test_forged_store_records_the_coordinator_ignored_are_one_event_per_new_count(report, already, want):
    facts = dataclasses.replace(job(w(0)), forged_recorded=already)
    status = {**coord(1, [0]), **({"forged": report} if report is not None else {})}
    got = [a for a in decide(facts, observed({0: ALIVE}, coordinator=status)) if isinstance(a, Record)]
    assert got == ([want] if want else [])


FULL = "checkpoint at step 40 failed: No space left on device (/ckpt/checkpoint.pt)"


@pytest.mark.parametrize("progress,already,want", [
    (None, {}, None),
    ({"wid": 0, "step": 3, "checkpoint_failures": 0, "checkpoint_error": None}, {}, None),
    ({"wid": 0, "checkpoint_failures": 1, "checkpoint_error": FULL}, {},
     Record("checkpoint-failed", f"worker 0: {FULL}; training goes on (1 failed so far)", {"wid": 0, "count": 1})),
    ({"wid": 0, "checkpoint_failures": 1, "checkpoint_error": FULL}, {0: 1}, None),   # once, not at every command
    ({"wid": 0, "checkpoint_failures": 2, "checkpoint_error": FULL}, {0: 1},
     Record("checkpoint-failed", f"worker 0: {FULL}; training goes on (2 failed so far)", {"wid": 0, "count": 2})),
    # a new rank 0 counts from 1 again: its own failures are not hidden by another worker's
    ({"wid": 2, "checkpoint_failures": 1, "checkpoint_error": FULL}, {0: 3},
     Record("checkpoint-failed", f"worker 2: {FULL}; training goes on (1 failed so far)", {"wid": 2, "count": 1})),
    ({"wid": 0, "checkpoint_failures": True, "checkpoint_error": FULL}, {}, None),   # not a count
    # the coordinator kept the reason the worker's next successful write cleared
    ({"wid": 0, "checkpoint_failures": {"count": 2, "last_error": FULL, "last_time": 9.0}, "checkpoint_error": None},
     {0: 1}, Record("checkpoint-failed", f"worker 0: {FULL}; training goes on (2 failed so far)",
                    {"wid": 0, "count": 2}, at=9.0)),   # dated by the coordinator's last_time
    ({"wid": 0, "checkpoint_failures": {"count": 0, "last_error": None, "last_time": None}}, {}, None),
], ids=["none", "zero", "new", "same", "more", "new-rank-0", "malformed", "kept-reason", "kept-none"])
def test_failed_checkpoint_writes_are_one_event_per_new_count_of_each_worker(progress, already, want):
    facts = dataclasses.replace(job(w(0), w(2)), checkpoint_failures_recorded=already)
    status = {**coord(1, [0, 2]), **({"progress": progress} if progress is not None else {})}
    got = [a for a in decide(facts, observed({0: ALIVE, 2: ALIVE}, coordinator=status)) if isinstance(a, Record)]
    assert got == ([want] if want else [])


# ---- crashes are bugs, signals are faults ---------------------------------------------------
ZERO = "ZeroDivisionError: division by zero"
TB = ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>', "    1 / 0", ZERO]
SHOWN = TB[1:]   # without Python's header line: the frames and the error say it all


def crashed_record(wid: int) -> dict:
    return {"wid": wid, "error": ZERO, "traceback": TB, "phase": "forward"}


def crash_of(wid: int, rc: int | None, tb=SHOWN, phase: str | None = "forward", error: str = ZERO) -> dict:
    return {"wid": wid, "host": "a", "error": error, "traceback": list(tb), "phase": phase, "exit_code": rc}


def test_an_exception_on_one_rank_fails_the_job_at_once_with_its_traceback():
    facts = job(w(0), w(1), w(2), min_workers=2)
    status = {**coord(1, [0, 1, 2]), "crashed": [crashed_record(1)]}
    actions = decide(facts, observed({0: ALIVE, 1: gone(1), 2: ALIVE}, coordinator=status))
    assert actions == [
        EndWorker(1, W.FAILED, 1, 5.0), Adopt(1, (0, 1, 2)),
        Record("crash", f"worker 1 on a crashed: {ZERO}", crash_of(1, 1)),
        Finish(J.FAILED, 1, "\n".join([f"worker 1 on a crashed (exit code 1, in forward): {ZERO}", *SHOWN])),
    ]


def test_a_crashed_record_fails_the_job_before_the_process_is_reaped():
    facts = job(w(0), w(1))
    status = {**coord(1, [0, 1]), "crashed": [crashed_record(0)]}
    actions = decide(facts, observed({0: ALIVE, 1: ALIVE}, coordinator=status))
    assert actions[-2:] == [Record("crash", f"worker 0 on a crashed: {ZERO}", crash_of(0, None)),
                            Finish(J.FAILED, 1, "\n".join([f"worker 0 on a crashed (in forward): {ZERO}", *SHOWN]))]


def test_a_crash_without_a_record_takes_its_error_from_the_tail_of_the_log():
    facts = job(w(0), w(1))
    tail = ("step 3", "Fatal Python error: Aborted", "")
    actions = decide(facts, observed({0: ALIVE, 1: gone(4)}, coordinator=coord(1, [0, 1]), log_tails={1: tail}))
    assert actions[-2:] == [
        Record("crash", "worker 1 on a crashed: Fatal Python error: Aborted",
               crash_of(1, 4, tail, None, "Fatal Python error: Aborted")),
        Finish(J.FAILED, 4, "worker 1 on a crashed (exit code 4): Fatal Python error: Aborted\n"
                            "step 3\nFatal Python error: Aborted\n")]
    # nothing in the log: the exit code is the error
    quiet = decide(facts, observed({0: ALIVE, 1: gone(4)}, coordinator=coord(1, [0, 1])))
    assert quiet[-1] == Finish(J.FAILED, 4, "worker 1 on a crashed (exit code 4): exit code 4")


@pytest.mark.parametrize("retries,crash_restarts,restarts,expected", [
    (0, 0, 0, Finish(J.FAILED, 1, "\n".join([f"worker 1 on a crashed (exit code 1, in forward): {ZERO}", *SHOWN]))),
    (2, 0, 0, Requeue(f"worker 1 on a crashed: {ZERO}; restart 1 of 2", "crash")),
    (2, 1, 3, Requeue(f"worker 1 on a crashed: {ZERO}; restart 2 of 2", "crash")),   # faults do not count
    (2, 2, 2, Finish(J.FAILED, 1, "\n".join([f"worker 1 on a crashed (exit code 1, in forward): {ZERO}", *SHOWN]),
                     restarts=2)),
], ids=["no-retries", "first-retry", "faults-do-not-count", "retries-spent"])
def test_a_crash_restarts_the_job_while_its_retries_allow(retries, crash_restarts, restarts, expected):
    facts = dataclasses.replace(job(w(0), w(1)), retries=retries, crash_restarts=crash_restarts, restarts=restarts)
    status = {**coord(1, [0, 1]), "crashed": [crashed_record(1)]}
    assert decide(facts, observed({0: ALIVE, 1: gone(1)}, coordinator=status))[-1] == expected


@pytest.mark.parametrize("seen", [gone(-9), gone(-11), gone(None), gone(EVICTED_EXIT)],
                         ids=["sigkill", "sigsegv", "no-exit-record", "evicted"])
def test_a_death_by_signal_or_the_runtime_s_own_exit_stays_an_elastic_fault(seen):
    facts = dataclasses.replace(job(w(0), w(1), w(2), min_workers=2), retries=0)
    actions = decide(facts, observed({0: ALIVE, 1: seen, 2: ALIVE}, coordinator=coord(1, [0, 1, 2])))
    assert not [a for a in actions if isinstance(a, (Finish, Requeue))]
    assert not [a for a in actions if isinstance(a, Record) and a.kind == "crash"]


def test_a_crash_of_a_worker_from_an_earlier_run_is_history():
    facts = job(w(0, state=W.FAILED, rc=1, started_at=50.0), w(1))
    assert decide(facts, observed({1: ALIVE}, coordinator=coord(1, [1]))) == [Adopt(1, (1,))]


def test_a_crash_in_the_last_reconcile_fails_a_job_whose_workers_all_ended():
    workers = [w(0, state=W.EXITED, rc=0), w(1, state=W.FAILED, rc=1, gen=1), w(2, state=W.EXITED, rc=0, gen=2)]
    assert outcome(job(*workers), workers, generation=2) == \
        Finish(J.FAILED, 1, "worker 1 on a crashed (exit code 1): exit code 1")


# ---- held below MIN, abort -----------------------------------------------------------------
def test_a_job_held_below_its_minimum_is_requeued_and_its_survivors_stopped():
    facts = job(w(0), w(1), w(2), min_workers=2)
    status = {**coord(1, [0, 1, 2], settled=False), "held": {"reason": "a recovery would leave 1 worker(s), "
                                                                        "below the minimum of 2", "since": 9.0}}
    actions = decide(facts, observed({0: ALIVE, 1: gone(None), 2: gone(None)}, coordinator=status))
    assert actions[-1] == Requeue("a recovery would leave 1 worker(s), below the minimum of 2; restarting "
                                  "from its checkpoint when it fits", "below-min")   # an older coordinator


def test_a_crash_wins_over_the_hold_it_caused():
    facts = job(w(0), w(1), min_workers=2)
    status = {**coord(1, [0, 1], settled=False), "crashed": [crashed_record(1)],
              "held": {"reason": "worker 1 crashed", "since": 9.0}}
    actions = decide(facts, observed({0: ALIVE, 1: gone(1)}, coordinator=status))
    assert isinstance(actions[-1], Finish) and actions[-1].state is J.FAILED
    assert not [a for a in actions if isinstance(a, Requeue)]


def test_an_abort_fails_the_job_with_its_reason():
    facts = dataclasses.replace(job(w(0), w(1)), restarts=1)
    reason = "the same failure 3 times: state checksums differ across members (tensor 'bn.running_mean', worker 1)"
    status = {**coord(4, [0, 1], settled=False), "abort": {"reason": reason}}
    actions = decide(facts, observed({0: ALIVE, 1: ALIVE}, coordinator=status))
    assert actions[-1] == Finish(J.FAILED, ABORTED_EXIT, f"aborted: {reason}", restarts=1)
    # the workers exited ABORTED_EXIT before the reason could be read: still failed
    ended = [w(0, state=W.FAILED, rc=ABORTED_EXIT), w(1, state=W.FAILED, rc=ABORTED_EXIT)]
    assert outcome(job(*ended), ended, generation=1) == \
        Finish(J.FAILED, ABORTED_EXIT, "aborted by its coordinator: the same failure repeated")


NEVER_JOINED = never_joined_reason(2, 60)
ABORT_AT = 50.0   # the coordinator's time of the abort; `gone` ends workers at 5.0 unless told


def ended(rc: int | None, at: float) -> ProcSeen:
    return gone(rc, ended_at=at)


def test_the_abort_a_coordinator_left_in_the_run_s_directory_fails_the_job_once_it_is_gone():
    """A plain script's job: the coordinator ended it, stopped its workers (SIGTERM, after the
    abort) and then itself (its orphan timeout): the next command reads the record, whole."""
    recorded = {"reason": NEVER_JOINED, "cause": "never-joined", "at": ABORT_AT}
    seen = observed({0: ended(-15, ABORT_AT + 1), 1: ended(-15, ABORT_AT + 1)}, coordinator=None,
                       coordinator_alive=False, coordinator_exit=ORPHAN_EXIT, recorded_abort=recorded)
    actions = decide(job(w(0), w(1), gen=0), seen)
    assert actions[-1] == Finish(J.FAILED, ABORTED_EXIT, f"aborted: {NEVER_JOINED}")
    assert "--elastic restart, or as a fixed-size gang (--workers N without --elastic)" in actions[-1].reason
    assert not [a for a in actions if isinstance(a, Requeue)]
    # the same with the coordinator still there to say it
    status = {**coord(0, [], settled=False), "abort": recorded}
    assert decide(job(w(0), w(1), gen=0), dataclasses.replace(seen, coordinator=parse_status(status), recorded_abort=None,
                                                              coordinator_alive=True))[-1] == actions[-1]


@pytest.mark.parametrize("procs,last", [
    # a peer of the stopped rank 0 exits 1 after the abort: its doing, not a crash
    ({0: ended(-15, ABORT_AT + 1), 1: ended(1, ABORT_AT + 2)}, Finish(J.FAILED, ABORTED_EXIT, f"aborted: {NEVER_JOINED}")),
    ({0: ALIVE, 1: ended(1, ABORT_AT + 2)}, Finish(J.FAILED, ABORTED_EXIT, f"aborted: {NEVER_JOINED}")),
    # a crash before it came first: the crash decides (as a command then would have seen)
    ({0: ALIVE, 1: ended(1, ABORT_AT - 1)}, Finish(J.FAILED, 1, "worker 1 on a crashed (exit code 1): exit code 1")),
    # every worker ended before it: their exits decide (a short plain script succeeded)
    ({0: ended(0, ABORT_AT - 2), 1: ended(0, ABORT_AT - 1)}, Finish(J.SUCCEEDED, 0, "all workers exited 0")),
], ids=["crash-after", "crash-after-one-alive", "crash-before", "all-ended-before"])
def test_the_first_to_happen_decides_between_the_abort_and_the_workers_ends(procs, last):
    recorded = {"reason": NEVER_JOINED, "cause": "never-joined", "at": ABORT_AT}
    seen = observed(procs, coordinator={**coord(0, [], settled=False), "abort": recorded})
    actions = decide(job(w(0), w(1), gen=0), seen)
    assert actions[-1] == last, actions
    assert bool([a for a in actions if isinstance(a, Record) and a.kind == "crash"]) == (last.exit_code == 1)


def test_a_crashed_record_of_a_worker_still_alive_wins_over_an_abort_as_it_did():
    """The runtime writes its crashed record before it exits: the crash is the cause."""
    status = {**coord(2, [0, 1], settled=False), "crashed": [crashed_record(1)],
              "abort": {"reason": "the same failure 3 times", "cause": "repeated", "at": ABORT_AT}}
    actions = decide(job(w(0), w(1), gen=2), observed({0: ALIVE, 1: ALIVE}, coordinator=status))
    assert [a.kind for a in actions if isinstance(a, Record)] == ["crash"]
    assert isinstance(actions[-1], Finish) and ZERO in actions[-1].reason


# ---- a restarted job never ends plainly ------------------------------------------------------
def test_a_restarted_job_s_success_carries_its_restarts():
    ended = [w(0, state=W.EXITED, rc=0), w(1, state=W.EXITED, rc=0)]
    facts = dataclasses.replace(job(*ended), restarts=2)
    assert outcome(facts, ended, generation=1) == Finish(J.SUCCEEDED, 0, "all workers exited 0", restarts=2)


# ---- history once, waiting -------------------------------------------------------------------
def test_history_is_recorded_once_per_run_rollbacks_included():
    hist = [{"kind": "initial", "generation": 1, "verified": True, "message": "formed"},
            {"kind": "resize", "generation": 2, "verified": True, "message": "resize 1 -> 2; rolled back: x"},
            {"kind": "rollback", "generation": 3, "verified": True, "message": "state check failed; back to [0]"}]
    facts = job(w(0), gen=3, recorded=frozenset({3}))   # the newest is enough: 1 and 2 came before it
    assert not [a for a in decide(facts, observed({0: ALIVE}, coordinator=coord(3, [0], history=hist)))
                if isinstance(a, Record)]
    fresh = [a for a in decide(job(w(0), gen=3), observed({0: ALIVE}, coordinator=coord(3, [0], history=hist)))
             if isinstance(a, Record)]
    assert [(a.kind, a.data["generation"]) for a in fresh] == [("formed", 1), ("scale", 2), ("rollback", 3)]


@pytest.mark.parametrize("created, at", [
    (1_700_000_000.5, 1_700_000_000.5), (7, 7.0),
    (None, None), (True, None), ("1700000000", None), (float("nan"), None), (float("inf"), None), (-1.0, None),
], ids=["time", "int", "absent", "bool", "text", "nan", "inf", "negative"])
def test_a_generations_event_is_dated_when_the_coordinator_published_it(created, at):
    """Not when a later command noticed it: the history entry's "created" (the coordinator's
    clock), when it is a time at all; else the event takes the time it is recorded."""
    hist = [{"kind": "initial", "generation": 1, "verified": True, "message": "formed",
             **({"created": created} if created is not None else {})}]
    records = [a for a in decide(job(w(0)), observed({0: ALIVE}, coordinator=coord(1, [0], history=hist)))
               if isinstance(a, Record)]
    assert [(r.kind, r.at) for r in records] == [("formed", at)]


def test_a_wait_is_dated_when_its_first_member_started_waiting():
    listed = [{"wid": 1, "for": [0], "since": 8.0, "phase": "boundary"},
              {"wid": 2, "for": [0], "since": 5.0, "phase": "boundary"}]
    status = {**coord(1, [0, 1, 2]), "waiting": listed}
    got = [a for a in decide(job(w(0), w(1), w(2)), observed({0: ALIVE, 1: ALIVE, 2: ALIVE}, coordinator=status))
           if isinstance(a, Record)]
    assert [(r.kind, r.at) for r in got] == [("waiting", 5.0)]


@pytest.mark.parametrize("listed,already,want", [
    (None, frozenset(), None),
    ([], frozenset(), None),
    ([{"wid": 1, "for": [0], "since": 3.0, "phase": "boundary"}], frozenset(),
     Record("waiting", "worker 1 waits for worker 0 (boundary)",
            {"waiting": [{"wid": 1, "for": [0], "phase": "boundary", "since": 3.0}]}, at=3.0)),
    # the same wait read again (a later `since` too): no new event
    ([{"wid": 1, "for": [0], "since": 4.0, "phase": "boundary"}], frozenset({(1, (0,), "boundary")}), None),
    ([{"wid": 1, "for": [0, 2], "since": 4.0, "phase": "backward"}], frozenset({(1, (0,), "boundary")}),
     Record("waiting", "worker 1 waits for workers 0, 2 (backward)",
            {"waiting": [{"wid": 1, "for": [0, 2], "phase": "backward", "since": 4.0}]}, at=4.0)),
    ([{"wid": 1, "for": [], "since": 4.0, "phase": "boundary"}], frozenset({(1, (0,), "boundary")}),
     Record("waiting", "no member is waiting any more", {"waiting": []})),
    ([{"wid": "1", "for": [0]}], frozenset(), None),    # not a worker id: nothing believed
], ids=["absent", "none", "new", "same", "changed", "ended", "malformed"])
def test_members_waiting_for_busy_ones_are_an_event_per_change(listed, already, want):
    facts = dataclasses.replace(job(w(0), w(1), w(2)), waiting=already)
    status = {**coord(1, [0, 1, 2]), **({"waiting": listed} if listed is not None else {})}
    got = [a for a in decide(facts, observed({0: ALIVE, 1: ALIVE, 2: ALIVE}, coordinator=status))
           if isinstance(a, Record)]
    assert got == ([want] if want else [])


# ---- a newcomer left out of a resize ----------------------------------------------------------
def test_a_newcomer_left_out_of_a_resize_is_an_event_naming_its_host_and_the_scaling_ends_saying_why():
    left = [{"n": 1, "wid": 2, "reason": "stopped beating while it warmed up, before it was ready",
             "phase": "warm-up", "generation": 1, "at": 9.0}]
    facts = job(w(0), w(1), w(2, "b", state=W.STARTING, gen=0), state=J.SCALING, world=2)
    actions = decide(facts, observed({0: ALIVE, 1: ALIVE, 2: gone(None)},
                                        coordinator={**coord(1, [0, 1]), "left_out": left}))
    why = "worker 2 on b left out of the resize (warm-up): stopped beating while it warmed up, before it was ready"
    assert Record("left-out", why, {"n": 1, "wid": 2, "host": "b", "phase": "warm-up"}, at=9.0) in actions
    assert actions[-1] == SetState(J.RUNNING, f"world size 2 at generation 1; {why}")
    again = dataclasses.replace(facts, state=J.RUNNING, left_out_recorded=1)
    assert not [a for a in decide(again, observed({0: ALIVE, 1: ALIVE}, coordinator={
        **coord(1, [0, 1]), "left_out": left})) if isinstance(a, Record)]


# ---- clean ends name the worker, its host and the phase ---------------------------------------
@pytest.mark.parametrize("held,named", [
    ({"workers": [1, 2], "phase": "generation 3, steady"}, "; worker 1 on b, worker 2 on c, in generation 3, steady"),
    ({"workers": [0], "phase": "generation 2, joining"}, "; worker 0 on a, in generation 2, joining"),
    ({"workers": [9], "phase": ""}, "; worker 9 on an unknown host"),
    ({"workers": "1", "phase": None}, ""),
], ids=["lost-in-steady", "formation", "unknown-worker", "malformed"])
def test_a_held_job_is_requeued_naming_each_worker_with_its_host_and_the_phase(held, named):
    facts = job(w(0, "a"), w(1, "b"), w(2, "c"), min_workers=2)
    reason = "would fall to 1 worker(s), below the job's minimum of 2 (lost worker(s) [1, 2])"
    status = {**coord(3, [0, 1, 2], settled=False), "held": {"reason": reason, "since": 9.0, **held}}
    actions = decide(facts, observed({0: ALIVE, 1: gone(None), 2: gone(None)}, coordinator=status))
    assert actions[-1] == Requeue(f"{reason}{named}; restarting from its checkpoint when it fits", "below-min")


@pytest.mark.parametrize("state,gen,phase", [
    (J.RUNNING, 3, "generation 3, steady"), (J.SCALING, 2, "generation 2, resizing"),
    (J.RUNNING, 0, "generation 1, forming")])
def test_a_lost_store_names_its_host_and_the_phase_the_job_was_in(state, gen, phase):
    ended = [w(0, state=W.FAILED, rc=STORE_LOST_EXIT, gen=gen), w(1, state=W.FAILED, rc=STORE_LOST_EXIT, gen=gen)]
    facts = dataclasses.replace(job(*ended, state=state, gen=gen), store_host="ctl")
    assert outcome(facts, ended, generation=gen) == Requeue(
        f"the job store on ctl was lost in {phase}; restarting from the last checkpoint", "store-lost")
    orphaned = decide(dataclasses.replace(facts, workers=(w(0, gen=gen),)),
                      observed({0: ALIVE}, coordinator=None, coordinator_alive=False, coordinator_exit=ORPHAN_EXIT))
    assert orphaned[-1].reason.endswith(f"(on ctl, in {phase})") and orphaned[-1].cause == "orphan"


# ---- a fault that leaves an in-place job no member --------------------------------------------
@pytest.mark.parametrize("seen,how", [
    (gone(-9), "was killed by signal 9 (exit code 137)"),
    (gone(None), "was lost (no exit record: killed with its supervisor, or its host went down; exit code 137)"),
], ids=["kill-9", "no-exit-record"])
def test_kill_9_of_an_in_place_jobs_only_worker_requeues_it_from_its_checkpoint_uncounted(seen, how):
    facts = dataclasses.replace(job(w(0, "a", gen=2), gen=2), retries=0, store_host="ctl")
    actions = decide(facts, observed({0: seen}, coordinator={**coord(2, [0], settled=False), "held": {
        "reason": "would fall to 0 worker(s)", "workers": [0], "phase": "generation 2, steady"}}))
    assert actions[-1] == Requeue(f"worker 0 on a {how} in generation 2, steady, and no member is left; "
                                  "restarting from its checkpoint", "fault")


@pytest.mark.parametrize("finished,kind", [(False, Requeue), (True, Finish)])
def test_members_that_exited_0_after_an_outside_stop_are_requeued_unless_the_training_finished(finished, kind):
    facts = job(w(0), w(1))
    stopped = {"wid": 1, "by": "a SIGTERM", "step": 3, "of": 90}
    last = decide(facts, observed({0: gone(0), 1: gone(0)},
                                  coordinator={**coord(1, [0, 1]), "finished": finished, "stopped": stopped}))[-1]
    assert isinstance(last, kind) and (kind is Finish) == (last == Finish(J.SUCCEEDED, 0, "all workers exited 0"))


def test_an_in_place_job_whose_member_was_killed_after_the_others_finished_resumes_from_its_checkpoint():
    """The third 2-hour soak's jobs 343 and 502: a worker kill -9ed while its peers exited 0,
    and the job failed "worker N failed (exit code -9)". The training ended,
    the killed member's part of the script after it did not (rank 0's report, say): the
    restart from the last step's checkpoint runs only that. A gang fails as before, and a
    fault that keeps coming back there ends the job (`stuck`)."""
    ended = [w(0, state=W.EXITED, rc=0), w(1, state=W.FAILED, rc=-9)]
    assert outcome(job(*ended), ended, generation=1) == Requeue(
        "worker 1 on a was killed by signal 9 (exit code 137) in generation 1, steady, beside members that exited 0; "
        "restarting from its checkpoint", "fault")
    gang = dataclasses.replace(job(*ended), elastic=None)
    assert outcome(gang, ended, generation=1) == Finish(J.FAILED, -9, "worker 1 failed (exit code -9)")
    again = dataclasses.replace(job(*ended), run_start_steps=(90, 90, 90), restart_causes=("fault", "fault"))
    stuck = outcome(again, ended, generation=1)
    assert isinstance(stuck, Finish) and stuck.state is J.FAILED and "each restarted from the checkpoint at step 90" \
        in stuck.reason
