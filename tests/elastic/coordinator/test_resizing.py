"""gpuflex.elastic.coordinator.resizing: a resize's request checked, workers' signed
requests acted on once, and newcomers that never warm up left out."""

from __future__ import annotations

import pytest

from gpuflex.elastic.coordinator.failures import Heartbeats
from gpuflex.elastic.coordinator.resizing import (LEFT_OUT_KEPT, READY_WAITING, WARM_UP, Requests, WarmUps,
                                                  check_resize)
from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.auth import ForgeryLog


def test_a_resize_names_enough_worker_ids_of_a_live_job():
    assert check_resize([0, 2, 1], 2, None) == [0, 2, 1]
    with pytest.raises(ValueError, match="non-empty list of worker ids"):
        check_resize("0,1", 1, None)
    with pytest.raises(ValueError, match="below the job's minimum of 3"):
        check_resize([0, 1, 1], 3, None)
    with pytest.raises(ValueError, match="aborted: out of memory"):
        check_resize([0, 1], 1, {"reason": "out of memory"})


def test_a_request_is_acted_on_once_and_a_replay_is_noted():
    forged = ForgeryLog("test")
    requests = Requests(forged)
    assert requests.read(None, {0, 1, 2}, 1) is None
    assert requests.read({"members": [0, 1], "seq": 1}, {0, 1, 2}, 1) == [0, 1]
    assert requests.read({"members": [0, 1], "seq": 1}, {0, 1, 2}, 1) is None   # the same: done
    assert forged.count == 0
    assert requests.read({"members": [0], "seq": 0}, {0, 1, 2}, 1) is None      # older: a replay
    assert forged.summary() == {"count": 1, "last": keys.DESIRED_REQUEST}


@pytest.mark.parametrize("req", [{"members": [0, -1], "seq": 2}, {"members": [0], "seq": "2"}, [0, 1]],
                         ids=["not-an-id", "seq-not-int", "not-a-dict"])
def test_a_malformed_request_is_noted_and_ignored(req):
    forged = ForgeryLog("test")
    assert Requests(forged).read(req, {0, 1}, 1) is None
    assert forged.count == 1


def test_a_request_below_the_minimum_is_ignored_but_not_forged():
    forged = ForgeryLog("test")
    requests = Requests(forged)
    assert requests.read({"members": [0], "seq": 5}, {0, 1}, 2) is None
    assert forged.count == 0 and requests.seq == 5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def warm_ups(store: dict[str, bytes], clock: Clock, timeout_s: float = 10) -> WarmUps:
    beats = Heartbeats(store.__contains__, store.__getitem__, timeout_s=5, clock=clock)
    return WarmUps(timeout_s, beats, clock=clock, wall=lambda: 1000.0)


def test_a_newcomer_that_never_beats_is_left_out_after_the_timeout():
    clock, store = Clock(), {}
    w = warm_ups(store, clock)
    assert w.overdue([3], lambda wid: False, generation=2) == []
    clock.now = 10.5
    assert w.overdue([3], lambda wid: False, generation=2) == [3]
    assert w.left_out == [{"n": 1, "wid": 3, "reason": "neither beat nor became ready within 10 s of being wanted",
                           "phase": WARM_UP, "generation": 2, "at": 1000.0}]


def test_a_newcomer_that_beats_may_warm_up_as_long_as_it_takes():
    clock, store = Clock(), {keys.hb(4): b"1"}
    w = warm_ups(store, clock)
    for beat in range(2, 50):
        clock.now += 4
        store[keys.hb(4)] = str(beat).encode()
        assert w.overdue([4], lambda wid: False, generation=1) == []


def test_a_newcomer_that_stops_beating_is_left_out_at_once_with_its_phase():
    clock, store = Clock(), {keys.hb(5): b"1"}
    w = warm_ups(store, clock)
    assert w.overdue([5], lambda wid: True, generation=1) == []
    clock.now = 6
    assert w.overdue([5], lambda wid: True, generation=1) == [5]
    assert w.left_out[-1]["phase"] == READY_WAITING
    assert "after it was ready" in w.left_out[-1]["reason"]


def test_only_the_newest_left_out_records_are_kept():
    clock = Clock()
    w = warm_ups({}, clock, timeout_s=1)
    w.overdue(list(range(LEFT_OUT_KEPT + 5)), lambda wid: False, generation=1)
    clock.now = 2
    assert len(w.overdue(list(range(LEFT_OUT_KEPT + 5)), lambda wid: False, generation=1)) == LEFT_OUT_KEPT + 5
    assert [r["n"] for r in w.left_out] == list(range(6, LEFT_OUT_KEPT + 6))


def test_the_warm_up_timeout_is_positive():
    with pytest.raises(ValueError, match="positive"):
        warm_ups({}, Clock(), timeout_s=0)
