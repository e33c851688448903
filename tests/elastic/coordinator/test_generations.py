"""The coordinator's generation logic (gpuflex.elastic.coordinator.generations) against an in-memory
store and a hand-driven clock: which generation it publishes, when, and what it tells
the workers. No processes, no sockets."""

from __future__ import annotations

import json

import pytest

from gpuflex.elastic.coordinator import main as coordinator
from gpuflex.elastic.protocol import keys
from gpuflex.elastic.coordinator.failures import (BACKSTOP_MIN, TRACEBACK_LINES, FailureStreak, cause_of,
                                      listed_crash, waiting_record)
from gpuflex.elastic.coordinator.forming import never_joined_reason
from gpuflex.elastic.coordinator.generations import HISTORY_KEPT, IDLE_TICK_S, Generations
from tests.fakes.store_fake import Clock, FakeStore

HB_TIMEOUT_S = 3.0
SECRET = "ab" * 32


class Job:
    """A store, a clock, the logic (with a job secret), and the workers' side of the
    protocol: their records signed as Rendezvous.set signs them."""

    def __init__(self, initial: list[int], formation_timeout_s: float = 600, min_workers: int = 1,
                 max_failures: int = 3) -> None:
        self.store, self.clock = FakeStore(), Clock()
        self.gens = Generations(self.store, initial, hb_timeout_s=HB_TIMEOUT_S,
                                formation_timeout_s=formation_timeout_s, clock=self.clock, wall=self.clock,
                                secret=SECRET, min_workers=min_workers, max_failures=max_failures)
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

    def verify(self, g: int, step: int = 0) -> None:
        """Rank 0's verdict, then its timings after the first step (formed at `step`)."""
        self.write(keys.verdict(g), '{"ok": true}')
        self.write(keys.timings(g), json.dumps({"generation": g, "pause": 0.1, "step": step}))
        self.gens.tick()

    def all_fail(self, reason: str) -> None:
        """Every member of the newest generation reports a failed collective, then a tick."""
        g = self.latest()
        for w in self.record(g)["members"]:
            self.beat(w)
            self.write(keys.fail(g, w), reason.format(g=g, w=w))
        self.gens.tick()

    def crash(self, wid: int, error: str = "ZeroDivisionError: division by zero", **extra) -> None:
        self.write(keys.crashed(wid), json.dumps({"error": error, "traceback": extra.get(
            "traceback", ["Traceback (most recent call last):", '  File "train.py", line 9']),
            "phase": extra.get("phase", "training")}))

    def abort_record(self) -> dict | None:
        raw = self.store.data.get(keys.ABORT)
        return None if raw is None else json.loads(self.signer.verify(keys.ABORT, raw))

    def settled(self, members: list[int]) -> "Job":
        self.ready(*members)
        self.gens.tick()
        self.verify(1)
        assert self.gens.status()["settled"]
        return self


@pytest.mark.parametrize("initial,ready,waited,published", [
    ([0, 1], [0, 1], 0, [0, 1]),        # everyone ready: at once
    ([0, 1], [0], 0, None),              # one missing: wait
    ([0, 1], [0], 601, [0]),             # past the formation timeout: go with those ready
    ([0, 1], [], 601, None),             # nobody ready: nothing to form
])
def test_the_first_generation_waits_for_the_initial_workers(initial, ready, waited, published):
    job = Job(initial, formation_timeout_s=600)
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


def test_a_stop_agreed_before_the_end_is_in_status_and_its_text_is_not_the_stores():
    job = Job([0, 1]).settled([0, 1])
    job.write(keys.STOPPED, json.dumps({"wid": 1, "by": "a SIGTERM", "step": 30, "of": 320}))
    job.gens.tick()
    assert job.gens.status()["stopped"] == {"wid": 1, "by": "a SIGTERM", "step": 30, "of": 320}
    other = Job([0, 1]).settled([0, 1])
    other.write(keys.STOPPED, json.dumps({"wid": 1, "by": "\x1b[2J rm -rf /" * 50, "step": 3, "of": 9}))
    other.gens.tick()
    assert other.gens.status()["stopped"]["by"] == "a stop request"


@pytest.mark.parametrize("raw", ['{"wid": "1", "by": "a SIGTERM", "step": 3, "of": 9}', '[1, 2]', '"x"',
                                 '{"wid": 1, "by": "a SIGTERM", "step": true, "of": 9}'])
def test_a_malformed_or_unsigned_stop_record_is_not_reported(raw):
    job = Job([0, 1]).settled([0, 1])
    job.write(keys.STOPPED, raw)
    job.gens.tick()
    assert job.gens.status()["stopped"] is None
    unsigned = Job([0, 1]).settled([0, 1])
    unsigned.store.set(keys.STOPPED, json.dumps({"wid": 1, "by": "a SIGTERM", "step": 3, "of": 9}))
    unsigned.store.add(keys.EVENTS, 1)
    unsigned.gens.tick()
    assert unsigned.gens.status()["stopped"] is None


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


# ---- never below MIN ------------------------------------------------------------------------
@pytest.mark.parametrize("start,min_workers,lost,newcomers,ready,published", [
    ([0, 1, 2], 2, [1, 2], [], [], None),            # 1 survivor of 3, MIN 2: held
    ([0, 1, 2], 2, [1, 2], [3], [3], [0, 3]),        # a ready newcomer makes up MIN: published
    ([0, 1, 2], 2, [2], [], [], [0, 1]),             # 2 survivors: MIN holds, at once
    ([0, 1, 2], 3, [1, 2], [3, 4], [3], None),       # one of two newcomers ready: still held
    ([0, 1, 2], 3, [1, 2], [3, 4], [3, 4], [0, 3, 4]),
    ([0, 1], 1, [1], [], [], [0]),                   # the default MIN of 1
])
def test_a_recovery_below_min_is_held_until_newcomers_make_it_up(start, min_workers, lost, newcomers,
                                                                  ready, published):
    job = Job(start, min_workers=min_workers).settled(start)
    survivors = [w for w in start if w not in lost]
    if newcomers:
        job.gens.resize(survivors + newcomers)
    for w in survivors:
        job.write(keys.fail(1, w), "peer died")
    job.clock.advance(HB_TIMEOUT_S + 0.1)
    job.beat(*survivors)
    job.gens.tick()
    held = job.gens.status()["held"]
    if len(survivors) >= min_workers:
        assert held is None and job.record(2)["members"] == published
        return
    assert job.latest() == 1 and held["since"] == job.clock.now
    assert held["reason"] == (f"would fall to {len(survivors)} worker(s), below the job's minimum "
                              f"of {min_workers} (lost worker(s) {lost})")
    assert (held["workers"], held["phase"]) == (lost, "generation 1, steady")   # the control side adds hosts
    job.ready(*ready)
    job.beat(*survivors)
    job.gens.tick()
    if published is None:
        assert job.latest() == 1 and job.gens.status()["held"]["since"] == held["since"]
    else:
        rec = job.record(2)
        assert (rec["members"], rec["kind"]) == (published, "recover")
        assert job.gens.status()["held"] is None


def test_a_held_job_keeps_the_time_it_was_first_held():
    job = Job([0, 1], min_workers=2).settled([0, 1])
    job.write(keys.fail(1, 0), "peer died")
    job.clock.advance(HB_TIMEOUT_S + 0.1)
    job.beat(0)
    job.gens.tick()
    since = job.gens.status()["held"]["since"]
    for _ in range(3):
        job.clock.advance(IDLE_TICK_S)
        job.beat(0)
        job.gens.tick()
    assert job.gens.status()["held"]["since"] == since and job.latest() == 1
    assert job.gens.status()["settled"] is False


@pytest.mark.parametrize("ready,waited,held", [
    ([0], 601, "worker(s) [1, 2] did not become ready within 600 s while starting generation 1: "
               "1 worker(s) left, below the job's minimum of 2"),
    ([0, 1], 601, None),                         # past the timeout with MIN ready: published
    ([0], 10, None),                             # still within the start timeout: waiting
])
def test_the_first_generation_needs_min_workers(ready, waited, held):
    job = Job([0, 1, 2], min_workers=2)
    job.ready(*ready)
    job.clock.advance(waited)
    job.gens.tick()
    status = job.gens.status()
    assert (status["held"] or {}).get("reason") == held
    assert job.latest() == (1 if len(ready) >= 2 else 0)


def test_a_rollback_below_min_is_held():
    job = Job([0, 1], min_workers=2).settled([0, 1])
    job.gens.resize([0, 1, 2])
    job.ready(2)
    job.gens.tick()
    job.write(keys.verdict(2), '{"ok": false, "reason": "checksum"}')
    job.clock.advance(HB_TIMEOUT_S + 0.1)
    job.beat(0, 2)                    # worker 1 went silent during the copy
    job.gens.tick()
    assert job.latest() == 2 and job.store.check([keys.rejected(2)])
    assert job.gens.status()["held"]["reason"] == \
        "rolling back generation 2 would leave 1 worker(s), below the job's minimum of 2"


@pytest.mark.parametrize("wanted", [[0], [5]])
def test_a_resize_below_min_is_refused(wanted):
    job = Job([0, 1], min_workers=2).settled([0, 1])
    with pytest.raises(ValueError, match="below the job's minimum of 2"):
        job.gens.resize(wanted)
    assert job.gens.desired == [0, 1]
    job.write(keys.DESIRED_REQUEST, json.dumps({"members": wanted, "seq": 1}))
    job.gens.tick()
    assert job.gens.desired == [0, 1] and job.latest() == 1


@pytest.mark.parametrize("bad", [[True], [-1], [2**70], [0, 1.0]])
def test_a_resize_to_ids_that_cannot_be_workers_is_refused(bad):
    job = Job([0, 1]).settled([0, 1])
    with pytest.raises(ValueError, match="worker ids"):
        job.gens.resize(bad)
    assert job.gens.desired == [0, 1]



@pytest.mark.parametrize("bad", [[True], [-1], [10**9], [2**70], [0, 5000]])
def test_a_workers_signed_request_for_ids_not_of_this_job_is_malformed(bad):
    """A worker's control socket passes its resize on as a signed request: ids that are no
    worker of this job (nor a newcomer's next id) are refused there too, not acted on."""
    job = Job([0, 1]).settled([0, 1])
    job.write(keys.DESIRED_REQUEST, json.dumps({"members": bad, "seq": 1}))
    job.gens.tick()
    assert job.gens.desired == [0, 1] and job.latest() == 1
    assert job.gens.status()["forged"]["last"] == keys.DESIRED_REQUEST


# ---- crashes are bugs -----------------------------------------------------------------------
def test_a_crashed_member_holds_the_job_even_with_enough_survivors():
    job = Job([0, 1, 2], min_workers=1).settled([0, 1, 2])
    job.crash(2, phase="forward")
    job.write(keys.fail(1, 0), "peer closed the connection")
    job.write(keys.fail(1, 1), "peer closed the connection")
    job.clock.advance(HB_TIMEOUT_S + 0.1)
    job.beat(0, 1)
    job.gens.tick()
    status = job.gens.status()
    assert job.latest() == 1
    assert status["held"]["reason"] == "worker 2 crashed: ZeroDivisionError: division by zero"
    assert status["crashed"] == [{"wid": 2, "error": "ZeroDivisionError: division by zero",
                                  "traceback": ["Traceback (most recent call last):",
                                                '  File "train.py", line 9'],
                                  "phase": "forward"}]
    assert status["settled"] is False
    job.gens.resize([0, 1, 3])        # nothing is formed without it, whatever comes
    job.ready(3)
    job.gens.tick()
    assert job.latest() == 1


def test_a_newcomer_that_crashed_while_warming_up_holds_the_job():
    job = Job([0, 1]).settled([0, 1])
    job.gens.resize([0, 1, 2])
    job.gens.tick()
    job.crash(2, "RuntimeError: CUDA error", phase="warm-up")
    job.gens.tick()
    status = job.gens.status()
    assert status["held"]["reason"] == "worker 2 crashed: RuntimeError: CUDA error"
    assert [c["wid"] for c in status["crashed"]] == [2] and job.latest() == 1


def test_a_crash_record_is_bounded_and_printable_in_status():
    job = Job([0, 1]).settled([0, 1])
    lines = [f"line {i}\x1b[31m" for i in range(40)]
    job.crash(1, "ValueError: " + "x" * 5000 + "\x00", traceback=lines, phase=None)
    job.gens.tick()
    rec = job.gens.status()["crashed"][0]
    assert len(rec["error"]) <= 500 and rec["error"].isprintable()
    assert len(rec["traceback"]) == TRACEBACK_LINES and rec["traceback"][-1].startswith("line 39")
    assert all(line.isprintable() for line in rec["traceback"]) and rec["phase"] == "unknown"


# ---- no unbounded retry ---------------------------------------------------------------------
def bn_job() -> Job:
    job = Job([0, 1]).settled([0, 1])
    job.gens.resize([0, 1, 2])
    job.ready(2)
    job.gens.tick()
    return job


def test_the_same_rollback_three_times_in_a_row_aborts_the_job():
    job = bn_job()
    for member in (2, 1, 0):          # which member differs changes; the cause does not
        g = job.latest()
        job.write(keys.verdict(g), json.dumps(
            {"ok": False, "reason": f"tensor bn.running_mean differs on member {member}"}))
        job.beat(0, 1)
        job.gens.tick()
    status = job.gens.status()
    reason = "state check failed: tensor bn.running_mean differs on member 0 (3 times in a row: generations 2..4)"
    record = {"reason": reason, "cause": "repeated", "at": job.clock()}   # `at`: the control side orders ends by it
    assert status["abort"] == record and job.abort_record() == record
    assert job.latest() == 4 and status["held"] is None and status["settled"] is False
    for _ in range(5):                # nothing more, whatever happens
        job.clock.advance(IDLE_TICK_S)
        job.all_fail("peer died")
        job.gens.tick()
    assert job.latest() == 4
    with pytest.raises(ValueError, match="aborted"):
        job.gens.resize([0, 1, 3])


def test_a_repeated_failed_collective_without_a_lost_worker_aborts_and_says_so():
    job = Job([0, 1]).settled([0, 1])
    job.all_fail("Timed out after 10000 ms waiting for generation {g} rank {w}")
    rec = job.record(2)
    assert rec["message"] == ("re-formed after a failed collective in generation 1 (no worker lost): "
                              "Timed out after 10000 ms waiting for generation 1 rank 0")
    assert "[]" not in rec["message"]
    job.all_fail("Timed out after 10000 ms waiting for generation {g} rank {w}")
    job.all_fail("Timed out after 10000 ms waiting for generation {g} rank {w}")
    assert job.latest() == 3
    assert job.gens.status()["abort"]["reason"].endswith("(3 times in a row: generations 1..3)")


def test_alternating_causes_do_not_abort_but_the_backstop_ends_a_job_without_progress():
    job = Job([0, 1]).settled([0, 1])
    for i in range(BACKSTOP_MIN - 1):
        job.all_fail(["peer closed the connection", "formation: barrier timed out"][i % 2])
    assert job.gens.status()["abort"] is None and job.latest() == BACKSTOP_MIN
    job.all_fail("peer closed the connection")
    assert job.gens.status()["abort"]["reason"].startswith(
        f"{BACKSTOP_MIN} failed generations in a row without training progress")


def test_training_progress_between_failures_starts_the_count_again():
    job = Job([0, 1]).settled([0, 1])
    for step in range(1, 3 * BACKSTOP_MIN):
        job.all_fail("peer closed the connection")
        job.verify(job.latest(), step=10 * step)   # the new generation trained on
    assert job.gens.status()["abort"] is None and job.latest() == 3 * BACKSTOP_MIN


def test_a_forged_abort_record_is_deleted_and_counted():
    job = Job([0, 1]).settled([0, 1])
    job.store.set(keys.ABORT, json.dumps({"reason": "forged"}))
    job.store.add(keys.EVENTS, 1)
    job.gens.tick()
    status = job.gens.status()
    assert keys.ABORT not in job.store.data and status["abort"] is None
    assert status["forged"] == {"count": 1, "last": keys.ABORT}


def test_an_unsigned_crash_record_is_ignored_and_counted():
    job = Job([0, 1]).settled([0, 1])
    job.store.set(keys.crashed(1), json.dumps({"error": "forged", "traceback": [], "phase": "x"}))
    job.store.add(keys.EVENTS, 1)
    job.gens.tick()
    status = job.gens.status()
    assert status["crashed"] == [] and status["held"] is None and status["settled"] is True
    assert status["forged"] == {"count": 1, "last": keys.crashed(1)}


def test_a_membership_that_cannot_be_reached_is_reported_not_retried():
    job = Job([0, 1, 2]).settled([0, 1, 2])
    job.write(keys.fail(1, 0), "peer died")
    job.write(keys.fail(1, 1), "peer died")
    job.clock.advance(HB_TIMEOUT_S + 0.1)
    job.beat(0, 1)
    job.gens.tick()
    job.verify(2)
    job.gens.resize([0, 1, 2])        # worker 2 was lost: it cannot come back under its id
    for _ in range(50):
        job.clock.advance(IDLE_TICK_S)
        job.beat(0, 1)
        job.gens.tick()
    status = job.gens.status()
    assert job.latest() == 2 and status["generations_total"] == 2
    assert status["unreachable"] == {"desired": [0, 1, 2], "reason":
                                     "worker(s) [2] cannot join again: rejected, or left the job earlier"}
    job.gens.resize([0, 1, 3])        # a new id can
    job.ready(3)
    job.gens.tick()
    assert job.record(3)["members"] == [0, 1, 3] and job.gens.status()["unreachable"] is None


# ---- status ---------------------------------------------------------------------------------
def test_status_history_is_bounded():
    job = Job([0, 1]).settled([0, 1])
    for step in range(1, HISTORY_KEPT + 10):
        job.all_fail("peer closed the connection")
        job.verify(job.latest(), step=step)
    status = job.gens.status()
    assert status["generations_total"] == job.latest() == HISTORY_KEPT + 10
    assert len(status["history"]) == HISTORY_KEPT
    assert status["history"][-1]["generation"] == HISTORY_KEPT + 10 and status["settled"]


def test_every_new_status_key_is_present_when_there_is_nothing_to_say():
    status = Job([0, 1], min_workers=2).gens.status()
    assert {k: status[k] for k in ("abort", "held", "unreachable", "crashed", "waiting",
                                   "min_workers", "generations_total", "left_out", "stopped")} == {
        "abort": None, "held": None, "unreachable": None, "crashed": [], "waiting": [],
        "min_workers": 2, "generations_total": 0, "left_out": [], "stopped": None}


def test_members_waiting_for_busy_members_are_shown_until_they_stop_waiting():
    job = Job([0, 1, 2]).settled([0, 1, 2])
    job.write(keys.waiting(1), json.dumps({"for": [0], "since": 1234.5, "phase": "backward"}))
    job.write(keys.waiting(2), json.dumps({"for": [], "since": 1234.5, "phase": "backward"}))
    job.gens.tick()
    assert job.gens.status()["waiting"] == [{"wid": 1, "for": [0], "since": 1234.5, "phase": "backward"}]
    job.write(keys.waiting(1), json.dumps({"for": []}))
    job.gens.tick()
    assert job.gens.status()["waiting"] == [] and job.latest() == 1


def test_a_settled_jobs_idle_reads_skip_the_crash_and_waiting_records():
    job = Job([0, 1]).settled([0, 1])
    job.gens.tick()
    job.store.looked_at.clear()
    job.clock.advance(IDLE_TICK_S)
    job.beat(0, 1)
    job.gens.tick()                   # the idle full read: heartbeats, progress, own records
    idle = list(job.store.looked_at)
    assert idle and not any(k.startswith(("crashed/", "waiting/")) for k in idle)
    job.crash(1)                      # a worker's write bumps the events counter: read at once
    job.gens.tick()
    assert job.gens.status()["crashed"][0]["wid"] == 1


# ---- the pieces -----------------------------------------------------------------------------
@pytest.mark.parametrize("a,b,same", [
    ("Timed out after 10000 ms (generation 4)", "Timed out after 10000 ms (generation 5)", True),
    ("connect to 127.0.0.1:29500 failed", "connect  to 127.0.0.1:31001 failed", True),
    ("bad pointer 0x7ffe3a00", "bad pointer 0xdeadbeef", True),
    ("peer closed the connection", "formation: barrier timed out", False),
])
def test_causes_ignore_the_numbers_that_change_between_tries(a, b, same):
    assert (cause_of(a) == cause_of(b)) is same


def test_the_failure_streak_counts_one_decision_per_generation():
    streak = FailureStreak(2)
    assert streak.add(5, "x") is None
    assert streak.add(5, "x") is None   # the same generation looked at again
    assert streak.add(6, "x") == "x (2 times in a row: generations 5..6)"


@pytest.mark.parametrize("raw,expected", [
    ({"for": [0, True, "1", 2], "since": float("nan"), "phase": "boundary"},
     {"wid": 3, "for": [0, 2], "since": None, "phase": "boundary"}),
    ({"for": []}, None),
    ([1, 2], None),
    ({"for": "0"}, None),
])
def test_waiting_records_are_read_leniently(raw, expected):
    assert waiting_record(3, raw) == expected


def test_a_crash_record_that_is_not_an_object_still_says_the_worker_crashed():
    assert listed_crash(4, ["x"]) == {"wid": 4, "error": "unknown error", "traceback": [],
                                      "phase": "unknown"}


@pytest.mark.parametrize("argv", [["--min-workers", "0"], ["--max-failures", "-1"],
                                  ["--min-workers", "two"]])
def test_the_coordinator_refuses_limits_below_one(argv, capsys):
    with pytest.raises(SystemExit) as e:
        coordinator.main(["--port", "1", "--members", "0", "--control", "/nonexistent/c", *argv])
    assert e.value.code == 2 and "--m" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [{"min_workers": 0}, {"max_failures": 0}])
def test_generations_refuse_limits_below_one(kwargs):
    with pytest.raises(ValueError, match="at least 1"):
        Job([0], **kwargs)


# ---- formation deadlines (forming.py) -------------------------------------------------------
FORMATION_S = 30.0


def wait(job: Job, seconds: float, beating: tuple[int, ...] = ()) -> None:
    """Let `seconds` pass a second at a time, the `beating` workers' heartbeats running."""
    for _ in range(int(seconds)):
        job.clock.advance(1.0)
        job.beat(*beating)
        job.gens.tick()


def joined(job: Job, g: int, *wids: int) -> None:
    for w in wids:
        job.write(keys.joined(g, w))


def test_a_worker_killed_before_it_ever_beat_is_left_out_of_the_first_generation():
    job = Job([0, 1, 2], formation_timeout_s=FORMATION_S, min_workers=2)
    job.ready(1, 2)                   # worker 0 died importing torch: no heartbeat, never ready
    job.gens.tick()
    forming = job.gens.status()["forming"]
    assert forming == {"generation": 1, "since": 1000.0, "waiting_for": [0], "phase": "starting"}
    wait(job, FORMATION_S - 1, beating=(1, 2))
    assert job.latest() == 0          # it might still be importing: wait for the deadline
    wait(job, 2, beating=(1, 2))
    rec = job.record(1)
    assert (rec["members"], rec["kind"]) == ([1, 2], "initial")
    assert rec["message"] == ("formed without them: worker(s) [0] did not become ready within 30 s "
                              "while starting generation 1")
    assert job.store.check([keys.rejected(0)]) and job.gens.desired == [1, 2]
    assert job.gens.status()["forming"]["generation"] == 1 and job.gens.status()["forming"]["phase"] == "joining"


def test_a_worker_that_dies_before_the_first_generation_is_left_out_without_waiting_for_the_deadline():
    job = Job([0, 1, 2], formation_timeout_s=FORMATION_S, min_workers=2)
    job.beat(0)                       # its heartbeat ran, then it was killed
    job.ready(1, 2)
    job.gens.tick()
    wait(job, HB_TIMEOUT_S + 1, beating=(1, 2))
    rec = job.record(1)
    assert rec["members"] == [1, 2]
    assert rec["message"] == "formed without them: worker(s) [0] died (no heartbeat) while starting generation 1"


def test_a_first_generation_that_would_fall_below_min_is_held_naming_who_and_the_phase():
    job = Job([0, 1, 2], formation_timeout_s=FORMATION_S, min_workers=3)
    job.ready(1, 2)
    wait(job, FORMATION_S + 1, beating=(1, 2))
    status = job.gens.status()
    assert job.latest() == 0 and status["forming"] is None
    assert status["held"]["reason"] == ("worker(s) [0] did not become ready within 30 s while starting "
                                        "generation 1: 2 worker(s) left, below the job's minimum of 3")
    assert not job.store.check([keys.rejected(0)])


def test_an_inplace_job_none_of_whose_workers_ever_beat_ends_at_the_deadline_instead_of_holding():
    """A plain script under MIN:MAX: nothing of the runtime's ever runs, so a hold (then a
    requeue, then the same wait) would loop; the coordinator ends the job, once."""
    job = Job([0, 1], formation_timeout_s=FORMATION_S, min_workers=1)
    wait(job, FORMATION_S - 1)
    assert job.gens.status()["abort"] is None     # it may still be importing torch
    wait(job, 2)
    status = job.gens.status()
    record = {"reason": never_joined_reason(2, FORMATION_S), "cause": "never-joined", "at": job.clock()}
    assert status["abort"] == record and job.abort_record() == record   # signed: runtime workers exit too
    assert (status["held"], status["forming"], job.latest()) == (None, None, 0)
    wait(job, FORMATION_S)
    assert job.gens.status()["abort"] == record   # decided once


def test_a_first_generation_one_of_whose_workers_beat_is_held_not_ended():
    """A worker that beat runs the runtime (the other was killed while importing torch)."""
    job = Job([0, 1], formation_timeout_s=FORMATION_S, min_workers=2)
    job.beat(1)
    wait(job, FORMATION_S + 1, beating=(1,))
    status = job.gens.status()
    assert status["abort"] is None and status["held"]["reason"].startswith("worker(s) [0, 1] did not become ready")


def grown(start: tuple[int, ...] = (0, 1), min_workers: int = 1) -> Job:
    """A settled job growing by one newcomer: generation 2 published, nobody joined yet."""
    new = max(start) + 1
    job = Job(list(start), formation_timeout_s=FORMATION_S, min_workers=min_workers).settled(list(start))
    job.gens.resize([*start, new])
    job.ready(new)
    job.gens.tick()
    assert job.record(2)["members"] == [*start, new]
    return job


def test_a_newcomer_that_dies_before_joining_a_resize_is_formed_without_at_once():
    job = grown()
    joined(job, 2, 0, 1)
    job.gens.tick()
    assert job.gens.status()["forming"]["waiting_for"] == [2]
    wait(job, HB_TIMEOUT_S + 1, beating=(0, 1))   # worker 2 went silent: dead
    rec = job.record(3)
    assert (rec["members"], rec["kind"], rec["prev"]) == ([0, 1], "recover", [0, 1, 2])
    assert rec["message"] == "formed without them: worker(s) [2] died (no heartbeat) while joining generation 2"
    assert job.store.check([keys.rejected(2)]) and job.gens.desired == [0, 1]


def test_a_member_alive_but_not_joined_is_dropped_only_after_the_formation_timeout():
    job = grown()
    joined(job, 2, 0, 2)
    wait(job, FORMATION_S - 1, beating=(0, 1, 2))   # worker 1 beats but never arrives
    assert job.latest() == 2 and job.gens.status()["forming"]["waiting_for"] == [1]
    wait(job, 2, beating=(0, 1, 2))
    rec = job.record(3)
    assert rec["members"] == [0, 2]
    assert rec["message"] == "formed without them: worker(s) [1] did not join within 30 s while joining generation 2"


def test_everyone_joined_in_time_is_not_cut_short_by_the_deadline():
    job = grown()
    joined(job, 2, 0, 1, 2)
    wait(job, FORMATION_S + 5, beating=(0, 1, 2))   # a slow state copy: the process group's business
    forming = job.gens.status()["forming"]
    assert job.latest() == 2 and forming["waiting_for"] == [] and forming["phase"].startswith("forming")
    job.verify(2)
    assert job.gens.status()["forming"] is None and job.latest() == 2


def test_a_formation_below_min_is_held_with_the_worker_and_the_phase():
    job = grown((0, 1, 2), min_workers=3)
    joined(job, 2, 0, 2)
    wait(job, HB_TIMEOUT_S + 1, beating=(0, 2))
    assert job.latest() == 2
    held = job.gens.status()["held"]
    assert held["reason"] == (
        "worker(s) [1, 3] died (no heartbeat) while joining generation 2: 2 worker(s) left, below the job's "
        "minimum of 3")
    assert (held["workers"], held["phase"]) == ([1, 3], "generation 2, joining")


def test_the_formation_timeout_must_be_positive():
    with pytest.raises(ValueError, match="formation timeout"):
        Job([0], formation_timeout_s=0)


# ---- a resize's newcomers warming up (resizing.py) ------------------------------------------
def test_a_newcomer_that_dies_warming_up_is_left_out_and_the_resize_goes_on_with_the_rest():
    job = Job([0, 1], formation_timeout_s=FORMATION_S).settled([0, 1])
    job.gens.resize([0, 1, 2, 3])
    job.beat(2)                        # warming up, then killed
    job.gens.tick()
    job.ready(3)
    wait(job, HB_TIMEOUT_S + 1, beating=(0, 1, 3))
    rec = job.record(2)
    assert (rec["members"], rec["kind"]) == ([0, 1, 3], "resize")
    assert job.store.check([keys.rejected(2)]) and job.gens.desired == [0, 1, 3]
    [left] = job.gens.status()["left_out"]
    assert left == {"n": 1, "wid": 2, "phase": "warm-up", "generation": 1, "at": left["at"],
                    "reason": "stopped beating while it warmed up, before it was ready"}


def test_a_newcomer_that_never_starts_is_left_out_after_the_formation_timeout_one_that_beats_is_not():
    job = Job([0, 1], formation_timeout_s=FORMATION_S).settled([0, 1])
    job.gens.resize([0, 1, 2, 3])     # 2 never starts; 3 warms up for longer than the timeout
    job.gens.tick()
    wait(job, FORMATION_S - 1, beating=(0, 1, 3))
    assert job.gens.desired == [0, 1, 2, 3] and job.gens.status()["left_out"] == []
    wait(job, 2, beating=(0, 1, 3))
    status = job.gens.status()
    assert job.gens.desired == [0, 1, 3] and [e["wid"] for e in status["left_out"]] == [2]
    assert status["left_out"][0]["reason"] == "neither beat nor became ready within 30 s of being wanted"
    job.ready(3)
    job.gens.tick()
    assert job.record(2)["members"] == [0, 1, 3]



# ---- rank 0's progress as status shows it (progress_view.py) ---------------------------------
def test_a_failed_checkpoints_reason_outlives_the_next_successful_write():
    """Rank 0 reports a failed write, then its next write succeeds and clears the reason
    in its record: the coordinator's status keeps the last failure's reason with its count."""
    full = "checkpoint at step 40 failed: No space left on device (/ckpt/checkpoint.pt)"
    job = Job([0, 1]).settled([0, 1])

    def report(count: int, error: str | None, at: float) -> None:
        job.store.set(keys.PROGRESS, json.dumps({"wid": 0, "step": 40, "checkpoint_failures": count,
                                                 "checkpoint_error": error, "time": at}))
        job.clock.advance(IDLE_TICK_S)
        job.beat(0, 1)
        job.gens.tick()

    report(0, None, 1.0)
    assert job.gens.status()["progress"]["checkpoint_failures"] == {"count": 0, "last_error": None, "last_time": None}
    report(1, full, 2.0)
    report(1, None, 3.0)              # the next write succeeded
    kept = {"count": 1, "last_error": full, "last_time": 2.0}
    assert job.gens.status()["progress"]["checkpoint_failures"] == kept
    report(2, None, 4.0)              # a failure whose reason was cleared before a read: the last one known
    assert job.gens.status()["progress"]["checkpoint_failures"] == {**kept, "count": 2}
    job.store.set(keys.PROGRESS, json.dumps({"wid": 0, "step": "x"}))   # no count: shown as written
    job.clock.advance(IDLE_TICK_S)
    job.gens.tick()
    assert job.gens.status()["progress"] == {"wid": 0, "step": "x"}
