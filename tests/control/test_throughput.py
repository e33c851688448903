"""The control side of issue 32's measurements: a running job's samples/s at each world
size and host count, kept as its "throughput" events, and `status JOB` showing them.

Through simulated hosts (tests/fakes/hosts.py): the real service, DB and reconcile, no
processes; the coordinator's progress record is given as the runtime shapes it."""

from __future__ import annotations

import pytest

from gpuflex.config import parse_config
from gpuflex.control import throughput
from gpuflex.control.pool import Pool
from gpuflex.control.service import JobService
from gpuflex.policy.throughput import Point
from tests.control.test_split import submit   # a 1:4 job, running on the simulated pool
from tests.fakes.hosts import FakeHost, World


@pytest.fixture
def sim(tmp_path):
    world = World(warmup_s=0.0, leave_s=(0.0, 0.0), gpus_per_host=2)
    cfg = parse_config({"database": {"url": f"sqlite:///{tmp_path}/g.db"},
                        "hosts": [{"name": "a", "address": "10.9.1.1", "workdir": "/w"},
                                  {"name": "b", "address": "10.9.1.2", "workdir": "/w"}]}, "<test>")
    svc = JobService(cfg, pool=Pool(cfg, lambda host: FakeHost(host, world)))
    yield world, svc
    svc.close()


def report(world: World, token: str, rate: float, when: float, **over) -> None:
    job = world.jobs[token]
    world.progress[token] = {"step": 40, "epoch": 0, "samples_per_s": rate, "time": when,
                             "generation": job.generation, "world_size": len(job.members), **over}


def test_readings_fold_into_one_point_per_size_each_counted_once(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    report(world, token, 40.0, 999.0)    # the generation's first reading: its first steps, left out
    svc.refresh()
    with svc.sessions() as s:
        assert throughput.points(s, job_id) == []
    report(world, token, 100.0, 1000.0)
    svc.refresh()
    svc.refresh()                        # the same record read again: not a second reading
    report(world, token, 200.0, 1001.0)
    svc.refresh()
    with svc.sessions() as s:
        assert throughput.points(s, job_id) == [Point(4, 2, 150.0, 2)]
    events = [e for e in svc.job(job_id).events if e.kind == "throughput"]
    assert len(events) == 1 and "150.0 samples/s at 4 worker(s) on 2 host(s) (2 reading(s))" in events[0].message


def test_the_first_reading_of_a_later_generation_at_the_same_size_is_left_out_too(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    for rate, when in ((40.0, 999.0), (100.0, 1000.0)):
        report(world, token, rate, when)
        svc.refresh()
    world.jobs[token].generation += 1     # a recovery at the same size: its steps start again
    for rate, when in ((30.0, 1001.0), (120.0, 1002.0)):
        report(world, token, rate, when)
        svc.refresh()
    with svc.sessions() as s:
        assert throughput.points(s, job_id) == [Point(4, 2, 110.0, 2)]


@pytest.mark.parametrize("over", [
    {"generation": -1},               # a record of an older generation
    {"world_size": 3},                # of another size
    {"samples_per_s": 0.0},           # nothing measured yet
    {"samples_per_s": float("nan")},
    {"time": None},
])
def test_a_reading_that_is_not_of_the_generation_now_or_not_a_rate_is_left_out(sim, tmp_path, over):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    report(world, token, 100.0, 1000.0, **over)
    svc.refresh()
    with svc.sessions() as s:
        assert throughput.points(s, job_id) == []


def test_the_scaling_view_says_too_few_measurements_with_one_size(sim, tmp_path):
    world, svc = sim
    job_id, token = submit(world, svc, tmp_path)
    for when in (999.0, 1000.0):         # the first left out
        report(world, token, 100.0, when)
        svc.refresh()
    view = throughput.scaling(svc.sessions, job_id, 1, 4, 4, 2)
    assert view["model"] is None and view["points"][0]["world"] == 4
    text = throughput.scaling_text(view)
    assert "4w/2h 100/s" in text and "too few measurements" in text and "leaves it at its size" in text


def test_the_scaling_text_with_a_model_gives_the_prediction_and_margins():
    view = {"points": [{"world": 1, "hosts": 1, "samples_per_s": 100.0}, {"world": 2, "hosts": 1, "samples_per_s": 190.0}],
            "model": {"a": 0.01, "b": 0.0, "c": 0.0}, "predicted": [{"world": 1, "samples_per_s": 100.0}],
            "one_more": {"gain": 0.04, "efficiency": 0.08}, "one_fewer": None}
    text = throughput.scaling_text(view)
    assert "predicted 1w 100/s" in text and "one more worker +4% (efficiency 0.08)" in text
    assert throughput.scaling_text({"points": []}) == ""
