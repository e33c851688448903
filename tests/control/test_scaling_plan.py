"""The one plan of a scale (gpuflex.control.scaling: check_target, plan_scale), the same
for an in-place and a restart job, without processes or a database: the job and the pool's
free devices are stand-ins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpuflex.control.scaling import ScalePlan, check_target, plan_scale
from gpuflex.errors import JobError, UsageError
from gpuflex.policy.placement import Assignment, HostFree
from gpuflex.states import JobState


def job(*wids: int, state: JobState = JobState.RUNNING, lo: int = 1, hi: int = 4):
    return SimpleNamespace(id=7, state=state, min_workers=lo, max_workers=hi, gpus_per_worker=1,
                           members=[SimpleNamespace(wid=w) for w in wids])


def ops(*free: HostFree):
    return SimpleNamespace(session=None, pool=SimpleNamespace(free=lambda session: list(free)))


def test_a_shrink_drops_the_newest_members():
    assert plan_scale(ops(), job(0, 3, 5), 1) == ScalePlan(drop=(5, 3))


def test_a_grow_takes_free_devices_for_the_newcomers():
    got = plan_scale(ops(HostFree("a", (2, 3))), job(0, 1), 4)
    assert got.drop == () and sorted(got.add, key=lambda a: a.devices) == [Assignment("a", (2,)), Assignment("a", (3,))]


def test_a_grow_without_enough_free_devices_is_refused():
    with pytest.raises(JobError, match="cannot grow to 4"):
        plan_scale(ops(HostFree("a", (2,))), job(0, 1), 4)


def test_the_same_size_plans_nothing():
    assert plan_scale(ops(), job(0, 1), 2) == ScalePlan()


@pytest.mark.parametrize("state,n,match", [
    (JobState.QUEUED, 2, "only running jobs can be scaled"),
    (JobState.RUNNING, 5, "takes 1..4 workers; 5 is outside"),
    (JobState.RUNNING, 0, "takes 1..4 workers; 0 is outside"),
])
def test_a_target_outside_min_max_or_of_a_job_not_running_is_refused(state, n, match):
    with pytest.raises(UsageError, match=match):
        check_target(job(0, state=state), n)

