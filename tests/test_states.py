"""Job and worker state machines: every documented move is allowed, every other one raises."""

from __future__ import annotations

import itertools

import pytest

from gpuflex.errors import GpuflexError, IllegalTransition
from gpuflex.states import JobState as J
from gpuflex.states import WorkerState as W

# The moves the JobState docstring documents (QUEUED -> FAILED is allowed by the code for
# a job that can never start; see the report: the docstring does not list it yet).
JOB_MOVES = {
    J.QUEUED: {J.RUNNING, J.CANCELLED, J.FAILED},
    J.RUNNING: {J.SCALING, J.SUCCEEDED, J.FAILED, J.CANCELLED, J.QUEUED, J.TIMEOUT},
    J.SCALING: {J.RUNNING, J.SUCCEEDED, J.FAILED, J.CANCELLED, J.QUEUED, J.TIMEOUT},
    J.SUCCEEDED: set(),
    J.TIMEOUT: set(),
    J.FAILED: set(),
    J.CANCELLED: set(),
}

# The WorkerState docstring's moves; STARTING -> LEAVING is used by a shrink that retires a
# newcomer that has not joined yet.
WORKER_MOVES = {
    W.STARTING: {W.RUNNING, W.LEAVING, W.EXITED, W.FAILED, W.LOST, W.STOPPED},
    W.RUNNING: {W.LEAVING, W.EXITED, W.FAILED, W.LOST, W.STOPPED},
    W.LEAVING: {W.EXITED, W.FAILED, W.LOST, W.STOPPED},
    W.EXITED: set(),
    W.FAILED: set(),
    W.LOST: set(),
    W.STOPPED: set(),
}

JOB_PAIRS = list(itertools.product(J, J))
WORKER_PAIRS = [(a, b) for a, b in itertools.product(W, W) if a != b or a.final or a is W.STARTING]


def test_the_tables_cover_every_state():
    assert set(JOB_MOVES) == set(J)
    assert set(WORKER_MOVES) == set(W)


@pytest.mark.parametrize("current,target", JOB_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in JOB_PAIRS])
def test_job_transition(current, target):
    if target in JOB_MOVES[current]:
        current.check_transition(target)
    else:
        with pytest.raises(IllegalTransition) as info:
            current.check_transition(target)
        assert (info.value.current, info.value.target) == (current.value, target.value)
        assert str(info.value) == f"job cannot go from {current.value} to {target.value}."
        assert isinstance(info.value, GpuflexError) and info.value.exit_code == 1


@pytest.mark.parametrize("current,target", WORKER_PAIRS,
                         ids=[f"{a.value}->{b.value}" for a, b in WORKER_PAIRS])
def test_worker_transition(current, target):
    if target in WORKER_MOVES[current]:
        current.check_transition(target)
    else:
        with pytest.raises(IllegalTransition) as info:
            current.check_transition(target)
        assert (info.value.current, info.value.target) == (current.value, target.value)
        assert str(info.value).startswith("worker cannot go from")


@pytest.mark.parametrize("state,final,active", [
    (J.QUEUED, False, False), (J.RUNNING, False, True), (J.SCALING, False, True),
    (J.SUCCEEDED, True, False), (J.FAILED, True, False), (J.CANCELLED, True, False),
])
def test_job_final_and_active(state, final, active):
    assert (state.final, state.active) == (final, active)


@pytest.mark.parametrize("state,final", [
    (W.STARTING, False), (W.RUNNING, False), (W.LEAVING, False),
    (W.EXITED, True), (W.FAILED, True), (W.LOST, True), (W.STOPPED, True),
])
def test_worker_final(state, final):
    assert state.final is final


def test_states_are_str_enums_with_the_contract_names():
    assert [s.value for s in J] == ["queued", "running", "scaling", "succeeded", "failed", "cancelled", "timeout"]
    assert J("running") is J.RUNNING and J.RUNNING == "running"
    assert W("stopped") is W.STOPPED and W.STOPPED == "stopped"
