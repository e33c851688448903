"""Issue 12's split of a fixed global batch by speed: the share computation, the re-plan
rule, the plan as committed state, and the sampler cutting by shares (pure, no processes)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gpuflex.elastic.state import codec
from gpuflex.elastic.data.sampler import ElasticSampler
from gpuflex.elastic.data.micro import has_batch_norm
from gpuflex.elastic.data.shares import (REPLAN_GAIN, REPLAN_MIN_S, at_least, estimates, even_shares, predicted_step_s,
                                    proportional, rescale, speed_shares, worth_replanning)
from gpuflex.elastic.data.split_plan import EXCHANGE_EVERY, Meter, SplitPlan, split_mode
from gpuflex.elastic.state.tree import TensorRef, flatten

CASES = [
    # (weights, total, ids, expected)
    ([1.0], 64, None, [64]),                                  # one member
    ([1.0, 1.0, 1.0], 64, None, [22, 21, 21]),                # all equal: the remainder to the smaller id
    ([1.0, 1.0, 1.0], 64, [7, 3, 5], [21, 22, 21]),           # ... by member id, not position
    ([3.0, 1.0], 64, None, [48, 16]),                         # exact
    ([1.0, 1.0, 1 / 3], 64, None, [28, 27, 9]),               # one 3x slower of 3 (27.43, 27.43, 9.14)
    ([1.0, 1000.0], 10, None, [0, 10]),                       # extreme: the slow one gets 0
    ([0.0, 2.0, 0.0], 5, None, [0, 5, 0]),                    # zero weights get nothing
    ([0.0, 0.0], 5, None, [3, 2]),                            # all zero: even
    ([float("nan"), 1.0], 4, None, [0, 4]),                   # not finite: counts as 0
    ([1.0, 1.0], 0, None, [0, 0]),                            # an empty batch
    ([1.0, 1.0, 1.0, 1.0], 2, [4, 3, 2, 1], [0, 0, 1, 1]),    # fewer samples than members
]


@pytest.mark.parametrize("weights,total,ids,expected", CASES)
def test_proportional_shares_table(weights, total, ids, expected):
    got = proportional(weights, total, ids)
    assert got == expected
    assert sum(got) == total


def test_shares_always_sum_exactly_and_are_deterministic():
    rnd = random.Random(12)
    for _ in range(2000):
        n = rnd.randint(1, 9)
        weights = [rnd.choice([0.0, rnd.random(), rnd.uniform(1, 1e6), 1.0]) for _ in range(n)]
        total = rnd.randint(0, 5000)
        ids = rnd.sample(range(100), n)
        got = proportional(weights, total, ids)
        assert sum(got) == total and min(got) >= 0
        assert got == proportional(list(weights), total, list(ids))
        s = sum(w for w in weights if w > 0)
        if s > 0:   # within one sample of the exact share
            assert all(abs(g - total * w / s) < 1 for g, w in zip(got, weights))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="no members"):
        proportional([], 4)
    with pytest.raises(ValueError, match="distinct id"):
        proportional([1.0, 1.0], 4, [1, 1])
    with pytest.raises(ValueError, match="total"):
        proportional([1.0], -1)


def test_speed_shares_favour_the_fast_and_predict_the_step():
    sec = [0.001, 0.001, 0.003]
    shares = speed_shares(sec, 64)
    assert shares == [28, 27, 9]
    assert predicted_step_s(shares, sec) == pytest.approx(0.028)
    assert predicted_step_s(even_shares(3, 64), sec) == pytest.approx(0.063)
    assert even_shares(3, 64) == [22, 21, 21]


def test_the_replan_rule_is_hysteretic():
    sec = [0.001, 0.001, 0.003]
    even, fast = even_shares(3, 64), speed_shares(sec, 64)
    assert worth_replanning(even, fast, sec)
    assert not worth_replanning(fast, fast, sec)                 # the same plan
    nearly = [0.001, 0.001, 0.00103]                             # the speeds of a 3% difference
    assert not worth_replanning([22, 21, 21], speed_shares(nearly, 64), nearly)
    # exactly at the gain: re-planned; just above the threshold step time: not
    assert worth_replanning([2, 2], [1, 3], [1.0, 1.0 / 1.5], gain=1 / 3 + 1e-9) is False
    assert worth_replanning([2, 2], [1, 3], [1.0, 0.5], gain=REPLAN_GAIN)
    tiny = [1e-5, 1e-5, 3e-5]   # a step of well under a millisecond: 55 % shorter, but by 0.35 ms
    assert not worth_replanning(even, speed_shares(tiny, 64), tiny)
    assert worth_replanning(even, speed_shares(tiny, 64), tiny, min_s=REPLAN_MIN_S / 10)


def test_rescale_and_estimates():
    assert rescale([27, 27, 10], 64) == [27, 27, 10]
    assert rescale([27, 27, 10], 32) == [14, 13, 5]
    assert sum(rescale([0, 64, 0], 17)) == 17 and rescale([0, 64, 0], 17) == [0, 17, 0]
    assert estimates([0.0, 0.0], [1.0, 2.0]) == [1.0, 0.5]            # hints only
    assert estimates([0.002, 0.0], [1.0, 2.0]) == [0.002, 0.001]      # a newcomer scaled by its hint
    assert estimates([0.002, 0.0], [1.0, -1.0]) == [0.002, 0.002]     # a bad hint is 1


def test_sampler_cuts_by_shares_each_sample_once_including_the_short_last_batch():
    s = ElasticSampler(100, 64, epochs=2)   # the last batch of each epoch has 36 samples
    for shares in [(27, 27, 10), (0, 64, 0), (22, 21, 21)]:
        for step in range(s.total_steps):
            parts = [s.batch(step, r, 3, shares) for r in range(3)]
            ids = torch.cat([p.indices for p in parts])
            assert ids.tolist() == s.global_batch(step)[2].tolist()
            assert sum(p.weight for p in parts) == pytest.approx(1.0)
            if len(ids) == 64:
                assert [len(p.indices) for p in parts] == list(shares)
    assert [len(s.batch(1, r, 3, (27, 27, 10)).indices) for r in range(3)] == [15, 15, 6]
    with pytest.raises(ValueError, match="do not split"):
        s.batch(0, 0, 2, (27, 27, 10))


def test_meter_is_an_ewma_of_seconds_per_sample_and_ignores_empty_steps():
    m = Meter(alpha=0.5)
    m.add(0.0, 0)
    m.add(1.0, 0)
    assert m.sec == 0.0
    m.add(0.4, 4)
    assert m.sec == pytest.approx(0.1)
    m.add(0.6, 2)
    assert m.sec == pytest.approx(0.2)


def test_split_mode_from_argument_env_and_default():
    assert split_mode(None, {}) == "speed"
    assert split_mode(None, {"GPUFLEX_SPLIT": "even"}) == "even"
    assert split_mode("speed", {"GPUFLEX_SPLIT": "even"}) == "speed"
    with pytest.raises(ValueError, match="'fast'"):
        split_mode("fast", {})
    with pytest.raises(ValueError, match="GPUFLEX_SPLIT.*'x'"):
        split_mode(None, {"GPUFLEX_SPLIT": "x"})


def rows(wids, secs, hints=None, now=1000.0):
    hints = hints or [1.0] * len(wids)
    return [[float(w), s, h, now if i == 0 else 0.0] for i, (w, s, h) in enumerate(zip(wids, secs, hints))]


def test_plan_decisions_start_speeds_hysteresis_membership_and_stragglers():
    env = {"GPUFLEX_STRAGGLER_FACTOR": "2"}
    p = SplitPlan(64, environ=env)
    assert p.record() == {} and p.shares_for(3) is None
    first = p.decide(rows([0, 1, 2], [0.0, 0.0, 0.0], [1.0, 1.0, 2.0]), step=0, generation=1)
    assert first["reason"] == "start" and first["seq"] == 1 and first["old"] == {}
    assert first["predicted_step_s"] is None and first["previous_step_s"] is None   # hints have no unit
    assert p.shares_for(3) == (16, 16, 32)    # from the hints alone
    assert p.decide(rows([0, 1, 2], [0.0, 0.0, 0.0], [1.0, 1.0, 2.0]), step=8, generation=1) is None
    again = p.decide(rows([0, 1, 2], [0.001, 0.001, 0.003], now=1010.0), step=8, generation=1)
    assert again["reason"] == "speeds" and again["new"] == {"0": 28, "1": 27, "2": 9}
    assert again["previous_step_s"] == pytest.approx(0.096) and again["predicted_step_s"] == pytest.approx(0.028)
    assert p.start == 8 and p.slow_since == {"2": 1010.0}
    assert p.decide(rows([0, 1, 2], [0.001, 0.001, 0.003], now=1020.0), step=16, generation=1) is None
    assert p.slow_since == {"2": 1010.0}      # since the first time seen slow
    joined = p.decide(rows([0, 2, 5], [0.001, 0.003, 0.0], [1.0, 1.0, 1.0], now=1030.0), step=20, generation=2)
    assert joined["reason"] == "membership" and joined["old"] == {"0": 28, "1": 27, "2": 9}
    assert p.members == [0, 2, 5] and sum(p.shares) == 64 and p.shares[1] < p.shares[0]
    rec = p.record()
    assert rec["split"] == "speed" and [r["seq"] for r in rec["replans"]] == [1, 2, 3]
    assert rec["workers"]["0"]["relative"] == 1.0 and rec["workers"]["2"]["relative"] == pytest.approx(1 / 3, abs=1e-3)
    assert rec["workers"]["5"]["samples_per_s"] is None
    assert rec["workers"]["2"]["slow_since"] is None   # 0.003 is not 2x the median of (0.001, 0.003)
    json.dumps(rec)


def test_a_new_membership_is_split_even_unless_the_speeds_earn_more():
    p = SplitPlan(18, environ={})
    p.decide(rows([0, 1], [0.0, 0.0]), 0, 1)
    tiny = p.decide(rows([0, 2], [1.0e-5, 1.6e-5]), 16, 2)   # 0.1 ms steps: noise, not speed
    assert tiny["reason"] == "membership" and tiny["new"] == {"0": 9, "2": 9}
    real = p.decide(rows([0, 2, 3], [0.010, 0.016, 0.0]), 24, 3)
    assert real["new"] != {"0": 6, "2": 6, "3": 6} and real["new"]["0"] > real["new"]["2"]


def test_even_mode_replans_only_on_membership():
    p = SplitPlan(64, "even", environ={})
    assert p.decide(rows([0, 1, 2], [0.001, 0.001, 0.003]), 0, 1)["new"] == {"0": 22, "1": 21, "2": 21}
    assert p.decide(rows([0, 1, 2], [0.001, 0.001, 0.003]), 8, 1) is None
    assert p.record()["workers"]["2"]["share"] == 21


def test_plan_is_state_that_round_trips_through_the_safe_codec_and_is_the_same_on_every_rank():
    made = []
    for _ in range(3):   # three ranks, the same exchanged rows
        p = SplitPlan(64, environ={})
        for step, secs in [(0, [0.0, 0.0]), (8, [0.001, 0.004]), (16, [0.002, 0.002])]:
            p.decide(rows([3, 9], secs, now=5.0 + step), step, 1)
        made.append(p.state_dict())
    skeletons = [codec.encode(flatten(s)[0], TensorRef) for s in made]
    assert len(set(skeletons)) == 1
    back = SplitPlan(64, environ={})
    back.load_state_dict(codec.decode(skeletons[0], TensorRef))
    assert back.state_dict() == made[0] and back.shares_for(2) == (32, 32) and back.seq == 3
    assert back.due(17, 1) and not back.due(17, back.exchanged_in) and back.due(EXCHANGE_EVERY * 3, -1)


def test_the_loader_never_serves_a_batch_read_for_an_old_plan():
    """The read-ahead asks for the next steps with the plan last used; after a re-plan the
    requests of the old shares are discarded, and each batch served is the new plan's."""
    from torch.utils.data import TensorDataset

    from gpuflex.elastic.data.loader import Prefetcher

    ds = TensorDataset(torch.arange(100).float())
    sampler = ElasticSampler(100, 10, epochs=2, seed=4)
    pre = Prefetcher(ds, sampler, 1, prefetch_factor=3)
    try:
        plans = [(4, 3, 3)] * 5 + [(6, 3, 1)] * 5 + [None] * 5 + [(0, 10, 0)] * 5   # re-plans at 5, 10, 15
        for step, shares in enumerate(plans):
            b = sampler.batch(step, 1, 3, shares)
            (x,) = pre.get(b)
            assert x.long().tolist() == b.indices.tolist()
        assert 0 < pre.discarded <= 3 * 4
    finally:
        pre.close()


def test_the_plan_is_committed_undone_and_loaded_with_the_state_and_reported(monkeypatch):
    """The plan as the run's registered state: a re-plan made in a step that fails is undone
    with it; a checkpoint from before the plan loads; a standalone run reports its plan."""
    from gpuflex.elastic import ElasticRun

    monkeypatch.delenv("GPUFLEX_STORE", raising=False)
    monkeypatch.delenv("GPUFLEX_SPLIT", raising=False)
    with pytest.raises(ValueError, match="split must be one of speed, even, got 'fastest'"):
        ElasticRun(model=torch.nn.Linear(2, 1), optimizer=torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1),
                   num_samples=8, global_batch_size=4, steps=2, split="fastest")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = ElasticRun(model=model, optimizer=opt, num_samples=8, global_batch_size=4, steps=EXCHANGE_EVERY + 1)
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    for batch in run:
        loss = torch.nn.functional.mse_loss(model(x[batch.indices]), y[batch.indices])
        run.backward(loss)
        opt.step()
        opt.zero_grad()
    st = run.status()
    assert st["split"] == "speed" and st["workers"]["0"]["share"] == 4
    assert st["workers"]["0"]["samples_per_s"] > 0 and st["workers"]["0"]["relative"] == 1.0   # exchanged at step 8
    assert [r["reason"] for r in st["replans"]] == ["start"]

    state, plan = run.state, run.split
    state.distributed = True   # light commits are taken under gpuflex only
    state.commit()
    before = plan.state_dict()
    plan.decide(rows([0, 7], [0.001, 0.002]), step=run.step, generation=2)   # a re-plan in the step that fails
    assert plan.members == [0, 7]
    state.undo_step()
    assert plan.state_dict() == before
    tree = state.capture()
    del tree["objects"]["split"]   # a checkpoint written before the split plan existed
    state.apply_tree(tree)
    assert plan.state_dict() == before


@pytest.mark.parametrize("shares, least, ids, expected", [
    ([30, 33, 1], 2, None, [30, 32, 2]),        # a share of 1 is filled from the largest
    ([20, 20, 1, 1], 2, [4, 3, 2, 1], [19, 19, 2, 2]),  # the largest first, ties to the smaller id (3)
    ([30, 33, 1], 1, None, [30, 33, 1]),        # least 1: nothing to move
    ([5, 2, 0], 3, None, [3, 2, 2]),            # 7 samples cannot give 3 members 3 each: the even split
    ([1], 2, None, [1]),                         # alone: it keeps the batch
    ([4, 1, 0], 2, None, [2, 2, 1]),            # ... nor 5 samples 2 each to 3 members
    ([6, 1, 0], 2, None, [3, 2, 2]),            # a 0 is filled too: nobody gets an empty batch
])
def test_at_least_gives_every_member_its_least_and_keeps_the_total(shares, least, ids, expected):
    assert at_least(shares, least, ids) == expected
    assert sum(at_least(shares, least, ids)) == sum(shares)


@pytest.mark.parametrize("shares, least, ids, expected", [
    ([30, 33, 1], 2, None, [30, 34, 0]),        # a share of 1 goes to the largest
    ([20, 20, 1, 1], 2, [4, 3, 2, 1], [20, 22, 0, 0]),  # ties to the smaller id (3), each moved
    ([30, 33, 1], 1, None, [30, 33, 1]),        # least 1: nothing to move
    ([5, 2, 0], 3, None, [7, 0, 0]),            # a 0 stays 0
    ([1], 2, None, [1]),                         # alone: it keeps the batch
])
def test_with_empty_batches_allowed_small_shares_move_whole_and_keep_the_total(shares, least, ids, expected):
    assert at_least(shares, least, ids, empty_ok=True) == expected
    assert sum(at_least(shares, least, ids, empty_ok=True)) == sum(shares)


def test_a_batch_norm_model_is_never_given_a_share_of_one():
    """A speed split that would give the slowest member 1 sample gives it 2 with BatchNorm
    (0 only where the script takes an empty batch)."""
    speeds = [0.001, 0.001, 0.025]   # the third 25x slower: 1 sample of 64 by speed
    assert speed_shares(speeds, 64) == [32, 31, 1]
    assert speed_shares(speeds, 64, least=2) == [31, 31, 2]
    assert speed_shares(speeds, 64, least=2, empty_ok=True) == [33, 31, 0]


def test_a_member_far_slower_than_the_others_still_gets_a_sample():
    """Issue 28: rank 0's evaluation counted as slowness planned {0: 0, ...} and the script's
    collate of an empty batch raised. By default every member gets at least one sample."""
    assert speed_shares([8.0, 0.001, 0.0006], 32) == [1, 12, 19]
    assert speed_shares([0.0, 0.001, 0.001], 32) == [1, 15, 16]   # not measured yet: infinitely slow


    bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert has_batch_norm(bn) and not has_batch_norm(torch.nn.Linear(2, 2))
