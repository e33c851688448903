"""gpuflex.policy.facts: the policy's inputs and actions, plain data. What they derive
(a job's phase, whether it runs as a gang), and that the rules' module hands out the same
classes (gpuflex.policy.outcomes and .lifecycle re-export them)."""

from __future__ import annotations

import pytest

from gpuflex.policy import facts, lifecycle, outcomes
from gpuflex.policy.facts import INPLACE, RESTART, JobFacts
from gpuflex.states import JobState


def _job(**kw) -> JobFacts:
    return JobFacts(**{"id": 1, "state": JobState.RUNNING, "min_workers": 1, "workers": (), **kw})


@pytest.mark.parametrize("generation,state,phase", [
    (0, JobState.RUNNING, "generation 1, forming"),
    (3, JobState.RUNNING, "generation 3, steady"),
    (4, JobState.SCALING, "generation 4, resizing"),
])
def test_the_phase_is_told_from_the_generation_and_the_state(generation, state, phase):
    assert _job(generation=generation, state=state).phase == phase


@pytest.mark.parametrize("elastic,gang", [(INPLACE, False), (RESTART, True), (None, True)])
def test_every_job_but_an_in_place_one_is_a_gang(elastic, gang):
    assert _job(elastic=elastic).gang is gang


def test_the_rules_modules_hand_out_the_same_classes():
    for name in ("JobFacts", "WorkerFacts", "Observation", "ProcSeen", "EndWorker", "Adopt", "Record",
                 "SetState", "Requeue", "Finish", "INPLACE", "RESTART"):
        assert getattr(outcomes, name) is getattr(facts, name), name
    assert lifecycle.Finish is facts.Finish and lifecycle.Observation is facts.Observation
