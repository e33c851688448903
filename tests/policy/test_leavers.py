"""gpuflex.policy.leavers: when the command that shrank a job records its leavers' ends."""

from __future__ import annotations

from gpuflex.policy.leavers import POLL_S, LeaverSeen, WatchStep, watch_step


def test_a_leaver_seen_gone_is_recorded_at_once_and_the_watch_ends_with_none_left():
    assert watch_step((LeaverSeen(3, False),), now=0.0, deadline=30.0) == WatchStep(record=True, done=True)


def test_one_gone_of_two_is_recorded_and_the_other_still_watched():
    step = watch_step((LeaverSeen(4, True), LeaverSeen(3, False)), now=0.0, deadline=30.0)
    assert step == WatchStep(record=True, done=False, still=(4,), wait_s=POLL_S)


def test_leavers_still_alive_are_watched_without_a_refresh_until_the_deadline():
    assert watch_step((LeaverSeen(3, True),), now=10.0, deadline=30.0) == \
        WatchStep(record=False, done=False, still=(3,), wait_s=POLL_S)
    assert watch_step((LeaverSeen(3, True),), now=29.9, deadline=30.0).wait_s < POLL_S


def test_at_the_deadline_the_watch_stops_and_names_the_leavers_left_to_the_next_command():
    step = watch_step((LeaverSeen(5, True), LeaverSeen(2, None), LeaverSeen(1, False)), now=30.0, deadline=30.0)
    assert step == WatchStep(record=True, done=True, still=(2, 5))


def test_a_host_that_does_not_answer_is_not_a_leaver_gone():
    assert watch_step((LeaverSeen(3, None),), now=0.0, deadline=30.0).record is False


def test_no_leaver_nothing_to_watch():
    assert watch_step((), now=0.0, deadline=30.0) == WatchStep(record=False, done=True)
