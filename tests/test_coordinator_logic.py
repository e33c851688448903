"""The coordinator's generation logic (gpuflex.elastic.generations) against an in-memory
store and a hand-driven clock: which generation it publishes, when, and what it tells
the workers. No processes, no sockets."""

from __future__ import annotations

import json

import pytest

from gpuflex.elastic import keys
from gpuflex.elastic.generations import IDLE_TICK_S, Generations
from tests.fakes.store_fake import Clock, FakeStore

HB_TIMEOUT_S = 3.0
SECRET = "ab" * 32


class Job:
    """A store, a clock, the logic (with a job secret), and the workers' side of the
    protocol: their records signed as Rendezvous.set signs them."""

    def __init__(self, initial: list[int], start_timeout_s: float = 600) -> None:
        self.store, self.clock = FakeStore(), Clock()
        self.gens = Generations(self.store, initial, hb_timeout_s=HB_TIMEOUT_S,
                                start_timeout_s=start_timeout_s, clock=self.clock, wall=self.clock,
                                secret=SECRET)
        self.signer = self.gens.signer

    def write(self, key: str, value: str = "1") -> None:
        """A worker's write: the signed record, then the events counter (as Rendezvous.set does)."""
        self.store.set(key, self.signer.sign(key, value))
        self.store.add(keys.EVENTS, 1)

    def beat(self, *wids: int) -> None:
        for w in wids:
            self.store.add(keys.hb(w), 1)

    def ready(self, *wids: int) -> None:
        for w in wids:
            self.beat(w)
            self.write(keys.ready(w), "0")

    def record(self, g: int) -> dict | None:
        raw = self.store.data.get(keys.members(g))
        return None if raw is None else json.loads(self.signer.verify(keys.members(g), raw))

    def latest(self) -> int:
        return int(self.store.data.get(keys.LATEST, b"0"))

    def verify(self, g: int) -> None:
        """Rank 0's verdict, then its timings after the first step."""
        self.write(keys.verdict(g), '{"ok": true}')
        self.write(keys.timings(g), json.dumps({"generation": g, "pause": 0.1}))
        self.gens.tick()

    def settled(self, members: list[int]) -> "Job":
        self.ready(*members)
        self.gens.tick()
        self.verify(1)
        assert self.gens.status()["settled"]
        return self


@pytest.mark.parametrize("initial,ready,waited,published", [
    ([0, 1], [0, 1], 0, [0, 1]),        # everyone ready: at once
    ([0, 1], [0], 0, None),              # one missing: wait
    ([0, 1], [0], 601, [0]),             # past the start timeout: go with those ready
    ([0, 1], [], 601, None),             # nobody ready: nothing to form
])
def test_the_first_generation_waits_for_the_initial_workers(initial, ready, waited, published):
    job = Job(initial, start_timeout_s=600)
    job.ready(*ready)
    job.clock.advance(waited)
    job.gens.tick()
    rec = job.record(1)
    if published is None:
        assert rec is None and job.latest() == 0
    else:
        assert rec["members"] == published and rec["kind"] == "initial" and rec["prev"] == []
        assert job.latest() == 1


@pytest.mark.parametrize("start,desired,ready,published", [
    ([0, 1], [0, 1, 2], [2], [0, 1, 2]),   # grow once the newcomer is ready
    ([0, 1], [0, 1, 2], [], None),          # ... and not before
    ([2, 3], [0, 2, 3], [0], [2, 3, 0]),    # survivors first: rank 0 holds the state
    ([0, 1, 2], [1], [], [1]),              # shrink: no newcomer to wait for
    ([0, 1], [0, 1], [], None),             # nothing to change
])
def test_a_resize_publishes_survivors_then_ready_newcomers(start, desired, ready, published):
    job = Job(start).settled(start)
    assert job.gens.resize(desired) == sorted(desired)
    assert json.loads(job.store.data[keys.DESIRED]) == sorted(desired)
    job.ready(*ready)
    job.gens.tick()
    if published is None:
        assert job.latest() == 1
    else:
        rec = job.record(2)
        assert (rec["members"], rec["kind"], rec["prev"]) == (published, "resize", start)


def test_a_resize_waits_until_the_current_generation_is_verified():
    job = Job([0, 1])
    job.ready(0, 1)
    job.gens.tick()            # generation 1 published, not verified yet
    job.gens.resize([0, 1, 2])
    job.ready(2)
    job.gens.tick()
    assert job.latest() == 1
    job.verify(1)
    assert job.record(2)["members"] == [0, 1, 2]


@pytest.mark.parametrize("bad", [[], "0,1", [0, "1"], None])
def test_a_resize_to_something_other_than_a_list_of_ids_is_refused(bad):
    job = Job([0, 1]).settled([0, 1])
    with pytest.raises(ValueError):
        job.gens.resize(bad)
    assert job.gens.desired == [0, 1]


def test_a_failure_waits_for_every_member_then_recovers_with_the_reporters():
    job = Job([0, 1, 2]).settled([0, 1, 2])
    job.write(keys.fail(1, 0), "peer died")
    job.beat(0, 1, 2)
    job.gens.tick()
    assert job.latest() == 1          # 1 and 2 have not reported and still beat: undecided
    job.write(keys.fail(1, 1), "peer died")
    job.clock.advance(HB_TIMEOUT_S + 0.1)
    job.beat(0, 1)                    # worker 2 is silent past the timeout: stale
    job.gens.tick()
    rec = job.record(2)
    assert (rec["members"], rec["kind"], rec["prev"]) == ([0, 1], "recover", [0, 1, 2])
    assert "lost worker(s) [2]" in rec["message"]
    assert job.gens.desired == [0, 1] and json.loads(job.store.data[keys.DESIRED]) == [0, 1]


def test_a_member_that_finished_does_not_hold_up_a_recovery():
    job = Job([0, 1]).settled([0, 1])
    job.write(keys.done(1))
    job.write(keys.fail(1, 0), "peer gone")
    job.gens.tick()
    assert job.record(2)["members"] == [0]


def test_a_copy_that_fails_its_check_is_rolled_back_and_the_newcomer_rejected():
    job = Job([0, 1]).settled([0, 1])
    job.gens.resize([0, 1, 2])
    job.ready(2)
    job.gens.tick()
    assert job.record(2)["members"] == [0, 1, 2]
    job.write(keys.verdict(2), '{"ok": false, "reason": "state checksum mismatch"}')
    job.beat(0, 1)
    job.gens.tick()
    rec = job.record(3)
    assert (rec["members"], rec["kind"]) == ([0, 1], "rollback")
    assert job.store.check([keys.rejected(2)]) and job.gens.desired == [0, 1]
    status = job.gens.status()
    rolled = [h for h in status["history"] if h["generation"] == 2][0]
    assert rolled["ok"] is False and "rolled back: state checksum mismatch" in rolled["message"]
    job.gens.resize([0, 1, 2])        # a rejected worker is never taken again
    job.verify(3)
    job.gens.tick()
    assert 2 not in job.record(job.latest())["members"]


def test_a_worker_wanted_then_dropped_before_joining_is_released():
    job = Job([0, 1]).settled([0, 1])
    job.gens.resize([0, 1, 2])        # worker 2 is starting, not ready yet
    job.gens.tick()
    assert not job.store.check([keys.released(2)])
    job.gens.resize([0, 1])
    job.gens.tick()
    assert job.store.check([keys.released(2)]) and job.latest() == 1


def test_a_workers_resize_request_becomes_the_desired_membership():
    job = Job([0, 1]).settled([0, 1])
    job.write(keys.DESIRED_REQUEST, json.dumps({"members": [1], "seq": 1}))
    job.gens.tick()
    assert json.loads(job.store.data[keys.DESIRED]) == [1]
    assert job.record(2)["members"] == [1]


def test_a_settled_job_reads_only_the_events_counter_until_the_idle_period_ends():
    job = Job([0, 1]).settled([0, 1])
    job.gens.tick()                   # settled: the next ticks are cheap
    job.store.set(keys.PROGRESS, json.dumps({"step": 7}))   # progress bumps no event
    job.gens.tick()
    assert job.gens.progress is None
    job.clock.advance(IDLE_TICK_S)
    job.beat(0, 1)
    job.gens.tick()
    assert job.gens.progress == {"step": 7}
    job.write(keys.fail(1, 0), "x")   # an event: read at once; then pending, read every tick
    job.gens.tick()
    job.store.set(keys.PROGRESS, json.dumps({"step": 8}))
    job.gens.tick()
    assert job.gens.progress == {"step": 8} and job.latest() == 1   # worker 1 still undecided


def test_a_finished_job_publishes_nothing_more():
    job = Job([0, 1]).settled([0, 1])
    job.write(keys.FINISHED)
    job.gens.resize([0, 1, 2])
    job.ready(2)
    job.gens.tick()
    assert job.gens.status()["finished"] is True and job.latest() == 1


def test_status_is_settled_only_when_verified_with_timings_and_as_desired():
    job = Job([0, 1])
    job.ready(0, 1)
    job.gens.tick()
    assert job.gens.status()["settled"] is False          # published, not verified
    job.write(keys.verdict(1), '{"ok": true}')
    job.gens.tick()
    status = job.gens.status()
    assert status["settled"] is True and status["history"][0]["verified"] is False   # no timings yet
    job.write(keys.timings(1), json.dumps({"pause": 0.2}))
    job.gens.tick()
    status = job.gens.status()
    assert status["history"][0]["verified"] is True and status["history"][0]["timings"] == {"pause": 0.2}
    job.gens.resize([0])
    assert job.gens.status()["settled"] is False
