"""What a reconcile decides before the lifecycle policy (gpuflex.policy.reconcile), as
tables: (job, what was observed, now) -> a time-out, or the workers to stop. No processes,
no database."""

from __future__ import annotations

import pytest

from gpuflex.elastic.protocol.wire import parse_status
from gpuflex.policy.lifecycle import JobFacts, Observation, ProcSeen, WorkerFacts
from gpuflex.policy.reconcile import LEFT_OUT, STRAY, FirstLook, Stop, first_look, left_out_alive, strays
from gpuflex.states import JobState as J
from gpuflex.states import WorkerState as W

NOW = 1000.0
BOUND = 120.0
ALIVE, DEAD = ProcSeen(alive=True), ProcSeen(alive=False)


def job(*workers: WorkerFacts, deadline: float | None = None, asked_at: float | None = None) -> JobFacts:
    return JobFacts(id=1, state=J.SCALING, min_workers=1, workers=workers, generation=2, world_size=2,
                    deadline=deadline, resize_asked_at=asked_at)


def w(wid: int, state: W = W.RUNNING, pgid: int | None = 100) -> WorkerFacts:
    return WorkerFacts(wid, "a", state, pgid=pgid)


def seen(procs: dict, **status) -> Observation:
    return Observation(procs, coordinator=parse_status({"generation": 2, "members": [0, 1], **status}))


def test_a_settled_job_needs_nothing_before_the_policy():
    assert first_look(job(w(0), w(1)), seen({0: ALIVE, 1: ALIVE}, desired=[0, 1]), NOW, BOUND) == FirstLook()


def test_the_time_limit_comes_first_and_alone():
    """A run past its deadline ends: no stray is stopped on the way (stopping the job stops them)."""
    facts = job(w(0), w(1), w(5, W.STARTING), deadline=NOW - 1)
    got = first_look(facts, seen({0: ALIVE, 1: ALIVE, 5: ALIVE}, desired=[0, 1]), NOW, BOUND)
    assert got == FirstLook(time_out=True)


@pytest.mark.parametrize("state,proc,pgid,status,stopped", [
    (W.STARTING, ALIVE, 100, {}, True),                      # never asked for: the command died half-way
    (W.STARTING, None, None, {}, True),                      # its row without a process group
    (W.STARTING, DEAD, 100, {}, False),                      # dead: the policy reaps it by its exit
    (W.STARTING, ALIVE, 100, {"desired": [0, 1, 5]}, False),   # wanted: it is warming up
    (W.STARTING, ALIVE, 100, {"known": [0, 1, 5]}, False),   # known (rejected, released): it ends itself
    (W.STARTING, ALIVE, 100, {"members": [0, 1, 5]}, False),
], ids=["unknown-alive", "no-group", "dead", "desired", "known", "member"])
def test_a_starting_worker_the_coordinator_never_heard_of_is_a_stray(state, proc, pgid, status, stopped):
    procs = {0: ALIVE, 1: ALIVE, **({5: proc} if proc is not None else {})}
    got = strays(job(w(0), w(1), w(5, state, pgid)), seen(procs, **{"desired": [0, 1], **status}), NOW - BOUND)
    assert [x.wid for x in got] == ([5] if stopped else [])


@pytest.mark.parametrize("asked_at,stopped", [
    (NOW - BOUND - 1, True),    # asked long ago: it never left
    (NOW - BOUND + 1, False),   # still within its bound to leave
    (None, True),               # no request on record at all
], ids=["overdue", "in-time", "never-asked"])
def test_a_leaver_still_alive_long_after_the_shrink_was_asked_is_a_stray(asked_at, stopped):
    facts = job(w(0), w(1), w(2, W.LEAVING), asked_at=asked_at)
    got = first_look(facts, seen({0: ALIVE, 1: ALIVE, 2: ALIVE}, desired=[0, 1]), NOW, BOUND)
    assert got == FirstLook(stops=(Stop((2,), STRAY),) if stopped else ())


def test_without_the_coordinators_word_nothing_is_a_stray():
    facts = job(w(0), w(5, W.STARTING), w(2, W.LEAVING), asked_at=0.0)
    procs = {0: ALIVE, 5: ALIVE, 2: ALIVE}
    assert strays(facts, Observation(procs, coordinator=None), NOW) == []
    assert strays(facts, seen(procs), NOW) == []   # it answered, without `desired`


def test_a_newcomer_left_out_of_a_resize_and_still_running_is_stopped():
    left = [{"n": 1, "wid": 3, "reason": "late", "phase": "warm-up"}, {"n": 2, "wid": 4, "reason": "late"}]
    facts = job(w(0), w(1), w(3, W.STARTING), w(4, W.STARTING))
    observed = seen({0: ALIVE, 1: ALIVE, 3: ALIVE, 4: DEAD}, desired=[0, 1], known=[0, 1, 3, 4], left_out=left)
    assert [x.wid for x in left_out_alive(facts, observed)] == [3]   # 4 is dead: the policy reaps it
    got = first_look(facts, observed, NOW, BOUND)
    assert got == FirstLook(stops=(Stop((3,), LEFT_OUT),))
    assert set(got.without_stopped(observed).procs) == {0, 1, 4}


def test_a_stray_that_is_also_left_out_is_stopped_once_as_a_stray():
    facts = job(w(0), w(1), w(3, W.STARTING))
    observed = seen({0: ALIVE, 1: ALIVE, 3: ALIVE}, desired=[0, 1], left_out=[{"n": 1, "wid": 3}])
    assert first_look(facts, observed, NOW, BOUND) == FirstLook(stops=(Stop((3,), STRAY),))


def test_nothing_stopped_leaves_what_was_seen_as_it_was():
    observed = seen({0: ALIVE}, desired=[0])
    assert FirstLook().without_stopped(observed) is observed
