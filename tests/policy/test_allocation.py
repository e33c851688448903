"""The throughput policy's decisions (issue 32), without processes: who grows, who
shrinks to start a queued job, who stays and why."""

from __future__ import annotations

import dataclasses

from gpuflex.policy.allocation import Elastic, Rules, Waiting, allocate, speedup
from gpuflex.policy.shares import fair_shares, starting
from gpuflex.policy.throughput import Model

LINEAR = Model(1.0, 0.0)            # compute-bound: n workers, n times as fast
FLAT = Model(0.2, 0.15)             # communication-bound: a second worker already loses
WEAK = Model(1.0, 0.2)              # 3 workers no faster than 2
MILD = Model(1.0, 0.05)             # best at 5, and 6 within noise of it
NEAR = Model(1.0, 0.07)             # 3 -> 4 adds 2.9%: under min_gain, over a resize's stall
RULES = Rules(horizon_s=900, stall_s=5, min_gain=0.05, hold_s=300)


def job(id, size, model=LINEAR, lo=1, hi=8, user=None, **kw) -> Elastic:
    return Elastic(id=id, user=user or f"u{id}", size=size, min_workers=lo, max_workers=hi, model=model,
                   measured=frozenset({1, size}), **kw)


def run(jobs, waiting=(), free=0, pool=16, room=None, now=1000.0):
    held = {}
    for j in jobs:
        held[j.user] = held.get(j.user, 0) + j.size * j.per_worker
    return allocate(jobs, waiting, free, held=held, pool=pool, room=room, rules=RULES, now=now)


def test_idle_devices_go_to_the_job_that_scales_and_not_to_the_one_that_does_not():
    a = run([job(1, 2, LINEAR), job(2, 2, FLAT)], free=4)
    assert a.sizes == {1: 6, 2: 1}       # the flat one even gives back its worker past the optimum
    reasons = {d.job: d.reason for d in a.changes}
    assert reasons[1].startswith("job 1 2->6: one more worker adds")
    assert "one fewer worker is" in reasons[2]


def test_a_poorly_scaling_job_is_shrunk_to_start_a_queued_one_and_says_so():
    a = run([job(12, 3, WEAK, user="alice"), job(13, 4, LINEAR, user="bob")],
            [Waiting(15, "carol", need=1)], free=0, pool=7)
    assert a.sizes[12] == 2 and a.sizes[13] == 4 and a.made_room_for == (15,)
    (d,) = a.changes
    assert d.reason.startswith("job 12 3->2: one fewer worker loses") and "job 15 needs 1" in d.reason


def test_a_linear_job_is_not_shrunk_for_an_equal_priority_job_unless_fair_share_says_so():
    same_user = run([job(1, 4, LINEAR, user="alice")], [Waiting(2, "alice", need=1)], pool=4)
    assert same_user.sizes == {1: 4} and same_user.made_room_for == ()
    other_user = run([job(1, 4, LINEAR, user="alice")], [Waiting(2, "bob", need=1)], pool=4)
    assert other_user.sizes == {1: 3} and other_user.made_room_for == (2,)   # bob is below his share


def test_nothing_is_shrunk_when_the_room_cannot_be_made_in_full():
    a = run([job(1, 2, WEAK, lo=1, user="a")], [Waiting(2, "b", need=3)], pool=2)
    assert a.sizes == {1: 2} and a.changes == () and a.made_room_for == ()


def test_a_higher_priority_job_is_never_shrunk_for_a_lower_one():
    a = run([job(1, 3, WEAK, priority=5)], [Waiting(2, "b", need=1, priority=0)], pool=3)
    assert a.sizes == {1: 3}


def test_too_few_measurements_leave_a_job_at_its_size_saying_why():
    one = Elastic(id=7, user="a", size=3, min_workers=1, max_workers=8, why_not="too few measurements: x",
                  measured=frozenset({3}))
    a = run([one], [Waiting(8, "a", need=1)], free=0, pool=3)
    assert a.sizes == {7: 3} and a.stays[0].reason == "job 7 stays at 3: too few measurements: x"
    assert a.made_room_for == ()


def test_fair_share_shrinks_a_job_not_measured_yet_but_never_below_its_users_share():
    """A user whose jobs started on a pool nobody else wanted holds it all, measured at one
    size each; another user's job arrives. Without this, it waits until those jobs end
    (hours in the allocation trace), its user far below their share."""
    one = Elastic(id=7, user="a", size=8, min_workers=1, max_workers=8, why_not="too few measurements: x",
                  measured=frozenset({8}))
    a = run([one], [Waiting(8, "b", need=2)], free=0, pool=8)
    assert a.sizes == {7: 6} and a.made_room_for == (8,) and a.stays == ()
    assert a.changes[0].reason == ("job 7 8->6: a is above their share and job 8 of b, below theirs, needs 2 "
                                   "(its scaling not measured yet)")
    # shares 4 and 4: a job needing 5 would take a below theirs, so nothing moves
    b = run([one], [Waiting(8, "b", need=5)], free=0, pool=8)
    assert b.sizes == {7: 8} and b.made_room_for == () and b.stays[0].reason.startswith("job 7 stays at 8")
    # a restart job never shrinks, and a measured job held after a resize gives before a held one
    r = dataclasses.replace(one, shrinkable=False)
    assert run([r], [Waiting(8, "b", need=2)], free=0, pool=8).sizes == {7: 8}
    measured = job(9, 4, LINEAR, user="a")
    c = run([dataclasses.replace(one, size=4), measured], [Waiting(8, "b", need=1)], free=0, pool=8)
    assert c.sizes == {7: 4, 9: 3}


def test_a_job_measured_at_one_size_grows_by_one_only_onto_devices_nobody_measured_wants():
    one = Elastic(id=7, user="a", size=2, min_workers=1, max_workers=8, measured=frozenset({2}))
    assert run([one], free=3).sizes == {7: 3}
    assert run([one, job(1, 2, LINEAR)], free=2).sizes == {7: 2, 1: 4}


def test_hysteresis_a_job_resized_lately_is_left_alone_and_a_small_gain_is_not_worth_a_resize():
    held = job(1, 2, LINEAR, resized_at=900.0)
    assert run([held], free=4, now=1000.0).sizes == {1: 2}
    assert run([held], free=4, now=1300.0).sizes == {1: 6}
    nearly_flat = Model(1.0, 0.09)       # 3->4 adds under 5%
    j = job(2, 3, nearly_flat)
    assert speedup(j, 4) / speedup(j, 3) - 1 < RULES.min_gain
    assert run([j], free=4).sizes[2] == 3


def test_grows_respect_max_quota_and_per_worker_devices():
    a = run([job(1, 2, LINEAR, hi=3), job(2, 1, LINEAR, per_worker=2, user="q")], free=5, room={"q": 2})
    assert a.sizes == {1: 3, 2: 2}


def test_a_restart_job_grows_but_is_never_shrunk():
    r = job(1, 4, FLAT, shrinkable=False)
    a = run([r], [Waiting(2, "b", need=1)], free=0, pool=4)
    assert a.sizes == {1: 4} and "restart job" in a.stays[0].reason


def test_the_same_inputs_give_the_same_decisions():
    jobs = [job(i, 2, LINEAR if i % 2 else FLAT) for i in range(6)]
    assert run(jobs, [Waiting(9, "z", 2)], free=3) == run(jobs, [Waiting(9, "z", 2)], free=3)


def test_a_user_below_their_share_takes_a_worker_from_one_above_it_and_the_move_is_not_undone():
    # pool 8, two users: a share of 4 each; alice holds 6, bob 2 and nothing is idle
    alice, bob = job(1, 6, MILD, user="alice"), job(2, 2, LINEAR, user="bob")
    a = run([alice, bob], free=0, pool=8)
    assert a.sizes == {1: 4, 2: 4}                     # each at their share, no further
    reasons = {d.job: d.reason for d in a.changes}
    assert reasons[1].startswith("job 1 6->4: one fewer worker loses") and "bob is below their share" in reasons[1]
    assert reasons[2].startswith("job 2 2->4: one more worker adds") and "bob is below their share" in reasons[2]
    # the next tick, from the new sizes: nobody moves back
    again = run([job(1, 4, MILD, user="alice"), job(2, 4, LINEAR, user="bob")], free=0, pool=8)
    assert again.sizes == {1: 4, 2: 4} and again.changes == ()


def test_a_user_below_their_share_needs_a_gain_that_pays_for_the_resize_not_one_above_the_noise_threshold():
    j = job(2, 3, NEAR, user="bob")
    gain = speedup(j, 4) / speedup(j, 3) - 1
    assert RULES.stall_s / RULES.horizon_s < gain < RULES.min_gain
    # evening out: bob (3 of a share of 4) takes alice's fifth worker
    assert run([job(1, 5, MILD, user="alice"), j], free=0, pool=8).sizes == {1: 4, 2: 4}
    # an idle device: bob's job is grown onto it
    assert run([job(1, 4, LINEAR, lo=4, hi=4, user="alice"), j], free=1, pool=8).sizes == {1: 4, 2: 4}
    # the same job of a user at or above their share is not: the gain is within noise
    alice = [job(1, 3, NEAR, user="alice"), job(2, 2, LINEAR, lo=2, hi=2, user="alice"),
             job(3, 2, FLAT, lo=2, user="bob")]
    assert run(alice, free=1, pool=8).sizes == {1: 3, 2: 2, 3: 2}


def test_evening_out_shares_takes_nothing_a_job_would_not_gain_from_nor_below_min_nor_from_a_higher_priority():
    # bob's job is past its optimum: a worker taken from alice would be wasted
    assert run([job(1, 6, MILD, user="alice"), job(2, 1, FLAT, user="bob")], free=0, pool=8).sizes == {1: 6, 2: 1}
    # alice's job is at its MIN
    assert run([job(1, 6, MILD, lo=6, user="alice"), job(2, 2, LINEAR, user="bob")], free=0, pool=8).sizes == {1: 6, 2: 2}
    # alice's job has the higher priority
    assert run([job(1, 6, MILD, user="alice", priority=1), job(2, 2, LINEAR, user="bob")],
               free=0, pool=8).sizes == {1: 6, 2: 2}
    # alice's job was resized lately (hysteresis)
    assert run([job(1, 6, MILD, user="alice", resized_at=900.0), job(2, 2, LINEAR, user="bob")],
               free=0, pool=8).sizes == {1: 6, 2: 2}


def test_evening_out_shares_counts_idle_devices_and_those_on_their_way_before_it_shrinks_anyone():
    # 9 devices, a share of 3 each: bob is 2 below; dave too, but one more worker would slow his job
    jobs = [job(1, 6, MILD, user="alice"), job(2, 1, LINEAR, user="bob"), job(3, 1, FLAT, user="dave")]
    held = {"alice": 6, "bob": 1, "dave": 1}
    # of 8, shares of 2.67: bob at 2 is still below his, alice far above hers; the second move
    # takes bob to 3, past his share by less than alice stays past hers (4), and nothing moves back
    assert allocate(jobs, (), 0, held=held, pool=8, rules=RULES, now=1000.0).sizes == {1: 4, 2: 3, 3: 1}
    after = [job(1, 4, MILD, user="alice"), job(2, 3, LINEAR, user="bob"), job(3, 1, FLAT, user="dave")]
    assert allocate(after, (), 0, held={"alice": 4, "bob": 3, "dave": 1}, pool=8, rules=RULES,
                    now=1000.0).changes == ()
    # with a 9th device on its way to being idle, alice gives one worker, not two
    assert allocate(jobs, (), 0, held=held, pool=9, rules=RULES, now=1000.0, coming=1).sizes == {1: 5, 2: 2, 3: 1}
    assert allocate(jobs, (), 0, held=held, pool=9, rules=RULES, now=1000.0).sizes == {1: 4, 2: 3, 3: 1}
    # idle: bob is grown onto it, and alice still gives only one
    assert allocate(jobs, (), 1, held=held, pool=9, rules=RULES, now=1000.0).sizes == {1: 5, 2: 3, 3: 1}


def test_fair_shares_fill_up_to_what_each_user_could_use_and_split_the_rest():
    assert fair_shares({"a": 8, "b": 8}, 8) == {"a": 4.0, "b": 4.0}
    assert fair_shares({"a": 1, "b": 8, "c": 8}, 9) == {"a": 1.0, "b": 4.0, "c": 4.0}   # a could use 1 only
    assert fair_shares({"a": 1, "b": 2, "c": 8}, 9) == {"a": 1.0, "b": 2.0, "c": 6.0}
    assert fair_shares({"a": 2, "b": 3}, 9) == {"a": 2.0, "b": 3.0}                     # more than they could use
    assert fair_shares({"a": 0, "b": 4}, 4) == {"a": 0.0, "b": 4.0}


def test_a_job_starts_with_what_its_users_share_leaves_never_below_min():
    s = starting([("ann", 2, 2), ("ann", 4, 0), ("bob", 3, 0)], idle=2)   # 4 devices: shares 2 and 2
    assert s.share == {"ann": 2.0, "bob": 2.0}
    assert s.most("ann", 4, 1, 1) == 1          # her share is held: MIN
    assert s.most("bob", 3, 1, 1) == 2
    assert s.most("bob", 3, 1, 2) == 1          # 2 devices a worker
    assert s.behind("bob") == 0.0 < s.behind("ann") == 1.0
    s.took("bob", 2)
    assert s.most("bob", 3, 1, 1) == 1 and s.behind("bob") == 1.0
