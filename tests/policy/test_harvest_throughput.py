"""The harvest plan under `[harvest] policy = "throughput"` (issue 32): the allocation's
sizes as Grow / Shrink actions with a Note (the event) for each reason. Pure."""

from __future__ import annotations

import dataclasses

from gpuflex.config import HarvestSettings
from gpuflex.policy.harvest import Grow, JobView, Note, Shrink, plan
from gpuflex.policy.throughput import Model, Point
from tests.policy.test_harvest import NOW, g, w

S = HarvestSettings(interval_s=60, idle_samples=3, reclaim_deadline_s=30, policy="throughput")


def pts(model: Model, *sizes: int) -> tuple[Point, ...]:
    return tuple(Point(n, 1, model.throughput(n), 4) for n in sizes)


def job(id, workers, model=None, sizes=(1, 2), lo=1, hi=4, user="", state="running", **kw) -> JobView:
    return JobView(id=id, state=state, min_workers=lo, max_workers=hi, harvest=True, workers=tuple(workers),
                   user=user or f"u{id}", points=pts(model, *sizes) if model else (), **kw)


def test_idle_gpus_go_to_the_job_that_scales_with_a_note_of_why():
    linear, flat = Model(1.0, 0.0), Model(1.0, 0.4)
    jobs = [job(1, [w(0, "a:0")], linear, user="ann"), job(2, [w(0, "a:1")], flat, user="ann")]
    p = plan(jobs, [g("a:0"), g("a:1"), g("b:0"), g("b:1")], S, NOW)
    assert [(a.job, a.host, a.devices) for a in p.of(Grow)] == [(1, "b", (0,)), (1, "b", (1,))]
    assert [n.reason for n in p.of(Note)] == ["job 1 1->3: one more worker adds 100%; one more worker adds 50%"]
    fair = plan(jobs, [g("a:0"), g("a:1"), g("b:0"), g("b:1")], dataclasses.replace(S, policy="fair"), NOW)
    assert sorted(a.job for a in fair.of(Grow)) == [1, 2]     # today's policy: one each


def test_a_user_below_fair_share_gets_a_worker_before_a_better_scaling_job_of_a_user_above_it():
    linear, flat = Model(1.0, 0.0), Model(1.0, 0.4)     # flat: 1 -> 2 still adds 11%
    jobs = [job(1, [w(0, "a:0")], linear, user="ann"), job(2, [w(0, "a:1")], flat, user="bob")]
    p = plan(jobs, [g("a:0"), g("a:1"), g("b:0"), g("b:1")], S, NOW)
    assert sorted(a.job for a in p.of(Grow)) == [1, 2]    # 2 GPUs each: nobody below 4 / 2


def test_a_poorly_scaling_job_shrinks_its_newest_worker_so_a_queued_job_can_start():
    weak = Model(1.0, 0.2)
    running = job(12, [w(0, "a:0"), w(1, "a:1"), w(2, "b:0")], weak, sizes=(2, 3), user="alice")
    queued = job(15, [], state="queued", user="carol")
    p = plan([running, queued], [g("a:0"), g("a:1"), g("b:0")], S, NOW)
    (s,) = p.of(Shrink)
    assert s.job == 12 and s.wids == (2,) and "job 15 needs 1" in s.reason
    assert not p.of(Grow)


def test_a_job_with_too_few_measurements_stays_and_says_why():
    once = job(3, [w(0, "a:0"), w(1, "a:1")], Model(1.0, 0.5), sizes=(2,), user="a")
    p = plan([once, job(4, [], state="queued", user="a")], [g("a:0"), g("a:1")], S, NOW)
    assert not p.of(Shrink)
    assert [n.reason for n in p.of(Note)] == \
        ["job 3 stays at 2: too few measurements: 2 world sizes needed (measured at 2 worker(s) only)"]
    # another user's job waiting while a holds the pool: fair share shrinks it all the same
    fair = plan([once, job(4, [], state="queued", user="b")], [g("a:0"), g("a:1")], S, NOW)
    assert [(s.job, s.wids) for s in fair.of(Shrink)] == [(3, (1,))]
    assert fair.of(Shrink)[0].reason == ("job 3 2->1: a is above their share and job 4 of b, below theirs, "
                                         "needs 1 (its scaling not measured yet)")


def test_a_job_resized_lately_is_left_alone():
    linear = Model(1.0, 0.0)
    recent = job(1, [w(0, "a:0")], linear, resized_at=NOW - 10)
    p = plan([recent], [g("a:0"), g("a:1")], S, NOW)
    assert not p.of(Grow) and "resized less than 300 s ago" in p.of(Note)[0].reason


def test_a_grow_placed_only_in_part_says_the_size_it_reached_and_why_not_the_rest():
    linear = Model(1.0, 0.0)
    # 3 idle GPUs counted, but b's two are this job's released stragglers: it may take a:1 only
    shy = job(1, [w(0, "a:0")], linear, shunned=frozenset({("b", 0), ("b", 1)}))
    p = plan([shy], [g("a:0"), g("a:1"), g("b:0"), g("b:1")], S, NOW)
    assert [(a.host, a.devices) for a in p.of(Grow)] == [("a", (1,))]
    (note,) = p.of(Note)
    assert note.reason.startswith("job 1 1->2 (1->4 planned; 2 worker(s) not placed: no host has 1 idle GPU(s)")
    assert note.reason.endswith("): one more worker adds 100%; one more worker adds 50%; one more worker adds 33%")


def test_a_grow_placed_not_at_all_says_the_job_stays():
    linear = Model(1.0, 0.0)
    # two idle GPUs, one per host: a worker of 2 GPUs fits on neither
    pair = job(1, [w(0, "a:0,1")], linear, gpus_per_worker=2)
    p = plan([pair], [g("a:0"), g("a:1"), g("a:2"), g("b:0")], S, NOW)
    assert not p.of(Grow)
    (note,) = p.of(Note)
    assert note.reason.startswith("job 1 stays at 1 (1->2 planned; 1 worker(s) not placed: no host has 2 idle GPU(s)")


def test_evening_out_shares_counts_a_gpu_on_its_way_before_it_shrinks_anyone():
    mild, linear, flat = Model(1.0, 0.05), Model(1.0, 0.0), Model(0.2, 0.15)
    # 9 GPUs, 3 users, a share of 3 each: bob (1) is 2 below, dave (1) too but cannot use more
    ann = job(1, [w(i, f"a:{i}") for i in range(6)], mild, sizes=(5, 6), hi=8, user="ann")
    bob = job(2, [w(0, "b:0")], linear, hi=8, user="bob")
    dave = job(3, [w(0, "b:1")], flat, user="dave")
    held = [g(f"a:{i}") for i in range(6)] + [g("b:0"), g("b:1")]
    # b:2 idle, not long enough yet: it is on its way to bob, so ann gives one worker, not two
    (s,) = plan([ann, bob, dave], held + [g("b:2", streak=1)], S, NOW).of(Shrink)
    assert s.job == 1 and len(s.wids) == 1 and "bob is below their share" in s.reason


def test_queued_harvest_jobs_start_at_their_owners_fair_share_the_furthest_below_first():
    from gpuflex.policy.harvest import Place
    # 6 GPUs; ann's jobs could use 6 (2 held), bob's 5 (1 held): shares of 3 each. bob's
    # queued job is placed first (he holds 1 of his 3, ann 2 of hers), with 2 workers (his 3
    # less the 1), then ann's with 1; the fair policy places ann's (the older) on all 3 free
    # GPUs and bob's waits
    gpus = [g(f"a:{i}") for i in range(3)] + [g(f"b:{i}") for i in range(3)]
    jobs = [job(1, [w(0, "a:0"), w(1, "a:1")], hi=2, user="ann"), job(2, [w(0, "b:0")], hi=1, user="bob"),
            job(3, [], state="queued", hi=4, user="ann"), job(4, [], state="queued", hi=4, user="bob")]
    p = plan(jobs, gpus, S, NOW)
    assert [(a.job, sum(len(x.devices) for x in a.assignments)) for a in p.of(Place)] == [(4, 2), (3, 1)]
    fair = plan(jobs, gpus, dataclasses.replace(S, policy="fair"), NOW)
    assert [(a.job, sum(len(x.devices) for x in a.assignments)) for a in fair.of(Place)] == [(3, 3)]
