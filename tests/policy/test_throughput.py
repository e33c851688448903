"""The throughput model (issue 32): points, the fit, predictions and margins. Pure."""

from __future__ import annotations

import pytest

from gpuflex.policy.throughput import Model, Point, fit, hosts_at, merge, summary, why_not


def points_of(model: Model, sizes, hosts=lambda n: 1) -> list[Point]:
    return [Point(n, hosts(n), model.throughput(n, hosts(n)), 3) for n in sizes]


@pytest.mark.parametrize("truth", [Model(1.0, 0.0), Model(1.0, 0.05), Model(0.2, 0.1), Model(1.0, 0.02, 0.3)])
def test_the_fit_recovers_the_model_the_points_came_from(truth):
    pts = points_of(truth, [1, 2, 3, 4, 6], hosts=lambda n: 1 + (n > 2))
    got = fit(pts)
    assert got is not None
    for n in range(1, 9):
        assert got.throughput(n, 2) == pytest.approx(truth.throughput(n, 2), rel=1e-6)


def test_a_compute_bound_job_scales_near_linearly_and_a_communication_bound_one_does_not():
    compute = fit(points_of(Model(1.0, 0.001), [1, 2, 4]))
    comm = fit(points_of(Model(0.2, 0.1), [1, 2, 4]))
    assert compute.efficiency(4, 5) > 0.9
    assert comm.gain(2, 3) < 0.05 and comm.efficiency(4, 5) < 0   # one more worker loses
    assert comm.gain(4, 3) > 0                                    # one fewer gains


def test_a_term_that_would_be_negative_is_dropped_so_throughput_never_scales_superlinearly():
    # noisy points that a free fit would explain with b < 0 (more workers -> less time each)
    pts = [Point(1, 1, 100.0), Point(2, 1, 210.0), Point(4, 1, 440.0)]
    m = fit(pts)
    assert m is not None and m.b >= 0 and m.c >= 0 and m.a > 0


@pytest.mark.parametrize("pts,words", [
    ([], "none measured yet"),
    ([Point(2, 1, 50.0, 9)], "measured at 2 worker(s) only"),
    ([Point(2, 1, 50.0), Point(2, 2, 40.0)], "measured at 2 worker(s) only"),
])
def test_too_few_points_give_no_model_and_say_why(pts, words):
    assert fit(pts) is None
    assert "too few measurements" in why_not(pts) and words in why_not(pts)


def test_points_of_one_size_merge_into_their_readings_weighted_mean():
    assert merge([Point(2, 1, 10.0, 1), Point(2, 1, 40.0, 2), Point(3, 1, 5.0)]) == \
        [Point(2, 1, 30.0, 3), Point(3, 1, 5.0, 1)]


def test_hosts_assumed_at_a_size_never_exceed_it():
    assert [hosts_at(n, 2, 4) for n in (1, 2, 4, 6)] == [1, 2, 2, 2]


def test_the_summary_gives_points_predictions_for_min_to_max_and_both_margins():
    pts = points_of(Model(1.0, 0.05), [1, 2, 4])
    s = summary(pts, 1, 5, 3, 1)
    assert [p["world"] for p in s["predicted"]] == [1, 2, 3, 4, 5]
    assert s["why_not"] is None and s["model"]["a"] == pytest.approx(1.0)
    assert s["one_more"]["gain"] == pytest.approx(Model(1.0, 0.05).gain(3, 4), abs=1e-3)
    assert s["one_fewer"]["gain"] < 0
    at_max = summary(pts, 1, 3, 3, 1)
    assert at_max["one_more"] is None and at_max["one_fewer"] is not None
    few = summary(pts[:1], 1, 5, 1, 1)
    assert few["model"] is None and few["predicted"] == [] and few["points"] and "too few" in few["why_not"]


def test_two_sizes_on_two_host_counts_fit_without_the_host_term_instead_of_dividing_by_zero():
    # seen in the allocation trace: 2 workers on 2 hosts, then 3 on 1 host. Three terms
    # from two points is singular; rounding left a pivot of 1e-16 and a zero diagonal
    pts = [Point(world=2, hosts=2, samples_per_s=1.6299449542498017, readings=15),
           Point(world=3, hosts=1, samples_per_s=2.5174601801615313, readings=7)]
    m = fit(pts)
    assert m is not None and m.a > 0
    for p in pts:   # two of the terms fit both points exactly
        assert m.throughput(p.world, p.hosts) == pytest.approx(p.samples_per_s, rel=1e-6)
    s = summary(pts, 1, 4, world=3, hosts=1)
    assert s["model"] is not None and len(s["predicted"]) == 4
