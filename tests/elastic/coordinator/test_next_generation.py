"""Which generation comes next (gpuflex.elastic.coordinator.next_generation.decide), as
tables: one full read of the store -> a decision. No store, no processes, no clock."""

from __future__ import annotations

import dataclasses

import pytest

from gpuflex.elastic.coordinator.forming import NEVER_JOINED, Outcome
from gpuflex.elastic.coordinator.next_generation import (Decision, End, Hold, Publish, Seen, Settled, Unreachable,
                                                         decide)


def steady(members=(0, 1, 2), desired=None, **kw) -> Seen:
    """Generation 3 of `members`, verified, nothing pending unless told."""
    base = Seen(generation=3, members=tuple(members), desired=tuple(sorted(desired if desired is not None else members)),
                rejected=frozenset(), min_workers=2, prev=(0, 1), ok=True, verified=True)
    return dataclasses.replace(base, **kw)


# ---- the first generation ---------------------------------------------------------------------
def test_the_first_generation_waits_for_the_formation_watch():
    assert decide(Seen(0, (), (0, 1), frozenset(), 1)) == Decision()


def test_the_first_generation_forms_without_the_workers_the_watch_dropped():
    out = Outcome(members=[0, 2], dropped=[1], message="formed without 1")
    got = decide(Seen(0, (), (0, 1, 2), frozenset(), 1, first=out))
    assert got == Decision(Publish((0, 2), "initial", "formed without 1", reject=(1,), desired=(0, 2)))


def test_a_first_formation_that_ends_or_holds_the_job_says_so():
    end = Outcome([], [0, 1], "", end="no worker ever joined")
    assert decide(Seen(0, (), (0, 1), frozenset(), 1, first=end)).step == End("no worker ever joined", NEVER_JOINED)
    hold = Outcome([], [1], "", hold="too few", phase="generation 1, forming")
    assert decide(Seen(0, (), (0, 1), frozenset(), 2, first=hold)).step == Hold("too few", (1,), "generation 1, forming")


# ---- rollback ---------------------------------------------------------------------------------
def test_a_failed_state_check_rolls_back_to_the_previous_members_rejecting_the_newcomers():
    seen = steady(members=(0, 1, 2), prev=(0, 1), ok=False, verdict_reason="checksums differ")
    assert decide(seen) == Decision(Publish((0, 1), "rollback", "state check failed; back to [0, 1]", desired=(0, 1),
                                            failure=(3, "state check failed: checksums differ")), rollback=(2,))


def test_a_rollback_that_would_fall_below_min_holds_and_still_rejects_the_newcomers():
    seen = steady(members=(0, 1, 2), prev=(0, 1), ok=False, alive_not_done=lambda w: w != 1)
    assert decide(seen) == Decision(Hold("rolling back generation 3 would leave 1 worker(s), below the job's "
                                         "minimum of 2", (1,), "generation 3, rolling back"), rollback=(2,))


# ---- a formation that did not complete ---------------------------------------------------------
def test_a_joining_formation_that_dropped_workers_publishes_a_recovery_counted_as_a_failure():
    out = Outcome(members=[0, 1], dropped=[2], message="formation: 2 did not arrive")
    seen = steady(ok=None, verified=False, joining=out)
    assert decide(seen).step == Publish((0, 1), "recover", "formation: 2 did not arrive", reject=(2,),
                                        desired=(0, 1), failure=(3, "formation: 2 did not arrive"))


# ---- recovery ---------------------------------------------------------------------------------
def test_a_recovery_waits_until_every_member_has_reported_gone_stale_or_finished():
    assert decide(steady(failed=(0,))) == Decision()   # 1 and 2 have not seen it yet


def test_the_reporters_and_the_ready_newcomers_form_the_next_generation_without_the_stale():
    seen = steady(members=(0, 1, 2), desired=(0, 1, 2, 5), failed=(0, 1), stale=(2,), desired_new=(5,), ready_new=(5,),
                  fail_reason=lambda w: "NCCL timeout")
    assert decide(seen).step == Publish((0, 1, 5), "recover", "lost worker(s) [2]: NCCL timeout", desired=(0, 1, 5),
                                        failure=(3, "NCCL timeout"))


def test_a_recovery_without_a_lost_worker_re_forms_the_same_members():
    seen = steady(members=(0, 1), failed=(0, 1), fail_reason=lambda w: "a collective failed")
    assert decide(seen).step.message == \
        "re-formed after a failed collective in generation 3 (no worker lost): a collective failed"


@pytest.mark.parametrize("verified,phase", [(True, "steady"), (False, "forming")])
def test_a_recovery_below_min_holds_naming_the_lost_and_the_phase(verified, phase):
    seen = steady(members=(0, 1, 2), failed=(0,), stale=(1, 2), verified=verified)
    assert decide(seen).step == Hold("would fall to 1 worker(s), below the job's minimum of 2 (lost worker(s) [1, 2])",
                                     (1, 2), f"generation 3, {phase}")


def test_a_finished_member_counts_as_decided():
    seen = steady(members=(0, 1, 2), failed=(0, 1), gone=lambda w: w == 2, fail_reason=lambda w: "x")
    assert decide(seen).step == Publish((0, 1), "recover", "lost worker(s) [2]: x", desired=(0, 1), failure=(3, "x"))


# ---- resize -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seen,step", [
    (steady(), Settled()),
    (steady(desired=(0, 1, 2, 3), desired_new=(3,), ready_new=()), None),   # the newcomer warms up
    (steady(desired=(0, 1, 2, 3), desired_new=(3,), ready_new=(3,)), Publish((0, 1, 2, 3), "resize", "resize 3 -> 4")),
    (steady(desired=(0, 1)), Publish((0, 1), "resize", "resize 3 -> 2")),
    (steady(desired=(5,), desired_new=(5,), ready_new=(5,)),
     Unreachable("no current member would be kept, so the job's state would be lost")),
    (steady(desired=(0,)), Unreachable("1 worker(s) is below the job's minimum of 2")),
    (steady(desired=(0, 1, 2, 4)), Unreachable("worker(s) [4] cannot join again: rejected, or left the job earlier")),
], ids=["settled", "warming-up", "grow", "shrink", "no-member-kept", "below-min", "cannot-rejoin"])
def test_a_resize_publishes_the_desired_membership_once_every_newcomer_is_ready(seen, step):
    assert decide(seen) == Decision(step)


def test_an_unverified_generation_without_failures_waits():
    assert decide(steady(ok=None, verified=False)) == Decision()
