"""gpuflex.policy.harvest_actions: a tick's actions as `gpuflex harvest --json` prints them
(the plan that makes them: tests/policy/test_harvest.py)."""

from __future__ import annotations

from gpuflex.policy.harvest_actions import Grow, Place, Plan, Requeue, Shrink
from gpuflex.policy.placement import Assignment


def test_each_action_is_named_and_its_tuples_become_lists():
    plan = Plan((Place(3, (Assignment("h1", (0, 1)),)), Grow(4, "h2", (2,)),
                 Requeue(5, (0, 1), (("h1", 0), ("h1", 1)), 10.0, "owner back"), Shrink(6, (3,), "adds 2%")))
    assert plan.to_json() == [
        {"action": "place", "job": 3, "assignments": [{"host": "h1", "devices": [0, 1]}]},
        {"action": "grow", "job": 4, "host": "h2", "devices": [2]},
        {"action": "requeue", "job": 5, "wids": [0, 1], "gpus": [["h1", 0], ["h1", 1]], "since": 10.0,
         "reason": "owner back"},
        {"action": "shrink", "job": 6, "wids": [3], "reason": "adds 2%"}]
    assert plan.of(Grow) == [Grow(4, "h2", (2,))] and plan.of(Shrink)[0].job == 6
