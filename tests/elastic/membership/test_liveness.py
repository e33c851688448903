"""Liveness from heartbeats (gpuflex.elastic.membership.liveness): the step barrier waits for a busy
member and fails, for every member alike, when one is silent, crashed, gone or the job was
aborted; crash records; a state mismatch named by tensor and member.

The barrier tests run members as threads of this process, each with its own store
connections and heartbeat thread, against a real TCPStore; every wait is bounded. The same on
real jobs: tests/e2e/test_liveness_jobs.py."""

from __future__ import annotations

import datetime as dt
import json
import signal
import sys
import threading
import time
from typing import Any, Callable

import pytest
import torch
from torch.distributed import TCPStore

from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.auth import Signer
from gpuflex.elastic.membership.joining import Formation
from gpuflex.elastic.state.copy_header import tensor_paths
from gpuflex.elastic.protocol.keys import arrivals_key, counter_key
from gpuflex.elastic.membership.liveness import (StepBarrier, bounded, crash_record, install_crash_hook, outcome_key,
                                      report_crash)
from gpuflex.elastic.membership.rendezvous import Aborted, Rendezvous
from gpuflex.elastic.state.tree import flatten

SECRET = "liveness-test-secret"
G = 1
BOUND_S = 30


class Job:
    """A job store with a signed generation G of `members`, and workers joined to it."""

    def __init__(self, members: list[int], hb_timeout_s: float) -> None:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=dt.timedelta(seconds=BOUND_S))
        self.signer = Signer(SECRET).for_run("run-1")
        self.store.set(keys.RUN, Signer(SECRET).sign(keys.RUN, "run-1"))
        self.write(keys.members(G), json.dumps({"generation": G, "kind": "initial", "members": members,
                                                "prev": [], "created": 0}))
        self.members, self.hb_timeout_s = members, hb_timeout_s
        self.rdzvs: list[Rendezvous] = []

    def write(self, key: str, value: str) -> None:
        self.store.set(key, self.signer.sign(key, value))

    def read(self, key: str) -> Any:
        return json.loads(self.signer.verify(key, self.store.get(key))) if self.store.check([key]) else None

    def worker(self, wid: int) -> StepBarrier:
        rdzv = Rendezvous(f"127.0.0.1:{self.store.port}", wid, secret=SECRET, timeout_s=BOUND_S,
                          heartbeat_s=0.05)
        self.rdzvs.append(rdzv)
        return StepBarrier(rdzv, wid, self.hb_timeout_s)

    def close(self) -> None:
        for r in self.rdzvs:
            r.close()


@pytest.fixture
def make_job():
    jobs: list[Job] = []

    def make(members: list[int], hb_timeout_s: float = 1.0) -> Job:
        jobs.append(Job(members, hb_timeout_s))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


def cross_in_thread(barrier: StepBarrier, world: int, phase: str = "backward", times: int = 1,
                    before: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Cross `times` barriers in a thread; the results land in the returned dict."""
    out: dict[str, Any] = {"results": []}

    def run() -> None:
        before()
        for _ in range(times):
            out["results"].append(barrier.cross(G, world, phase))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def join(*runs: dict[str, Any]) -> list[list[str | None]]:
    for r in runs:
        r["thread"].join(BOUND_S)
        assert not r["thread"].is_alive(), "a barrier did not return (bounded wait)"
    return [r["results"] for r in runs]


def wait_until(pred: Callable[[], Any], what: str) -> Any:
    end = time.monotonic() + BOUND_S
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"gave up waiting for {what}")


def test_every_member_passes_each_barrier_and_spent_outcomes_are_deleted(make_job):
    job = make_job([0, 1, 2])
    barriers = [job.worker(w) for w in (0, 1, 2)]
    runs = [cross_in_thread(b, 3, times=5) for b in barriers]
    assert join(*runs) == [[None] * 5] * 3
    assert all(b.crossed == 5 for b in barriers)
    assert job.signer.verify(outcome_key(G, 5), job.store.get(outcome_key(G, 5))) == "ok"
    wait_until(lambda: not any(job.store.check([outcome_key(G, n)]) for n in range(1, 5)),
               "the outcomes nobody reads any more to be deleted")


def test_a_voting_barrier_gives_every_member_the_sum_of_the_votes_and_cleans_up(make_job):
    """The sharded path's boundary: the agreement rides the barrier. Each member reads the
    same sum, a barrier where nobody votes sums to 0, and spent vote sums are deleted."""
    job = make_job([0, 1, 2])
    barriers = [job.worker(w) for w in (0, 1, 2)]
    votes = {0: [5 << 40, 0, 0], 1: [1, 0, 0], 2: [1 << 20, 0, 7]}   # per worker, per barrier
    sums: dict[int, list[int]] = {w: [] for w in votes}

    def run(w: int) -> None:
        for v in votes[w]:
            assert barriers[w].cross(G, 3, "boundary", vote=v) is None
            sums[w].append(barriers[w].voted)

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in votes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
        assert not t.is_alive(), "a barrier did not return (bounded wait)"
    expected = [(5 << 40) + 1 + (1 << 20), 0, 7]
    assert sums == {0: expected, 1: expected, 2: expected}
    wait_until(lambda: not any(job.store.check([arrivals_key(G, n)]) for n in (1, 2)), "the spent arrivals to be deleted")


# ---- a forger at the store's port (issue 28): it can delay a barrier, never decide it --------------
class Forger:
    """Another local user at the job store's port: no secret, any key written."""

    def __init__(self, job: "Job") -> None:
        self.store = TCPStore("127.0.0.1", job.store.port, is_master=False, timeout=dt.timedelta(seconds=BOUND_S))

    def fail_ahead(self, barriers: range) -> None:
        """The attack first seen: "fail: ..." written ahead into the coming barriers' outcomes."""
        for n in barriers:
            self.store.set(outcome_key(G, n), "fail: attacker text\x1b[31m")

    def arrivals(self, barriers: range, world: int, vote: int) -> None:
        """Arrival lines for every member with a vote of its choosing, unsigned and signed with
        a guessed secret, and the counter pushed to "everyone arrived"."""
        for n in barriers:
            for w in range(world):
                self.store.append(arrivals_key(G, n), f"{w} {vote}\n{w} {Signer('guess').for_run('run-1').sign(f'{arrivals_key(G, n)}#{w}', str(vote))}\n")
        self.store.add(counter_key(G), world * len(barriers))


def cross_all(barriers: list[StepBarrier], world: int, votes: dict[int, list[int]] | None = None,
              times: int = 3) -> tuple[dict[int, list], dict[int, list[int]]]:
    results: dict[int, list] = {w: [] for w in range(len(barriers))}
    sums: dict[int, list[int]] = {w: [] for w in range(len(barriers))}

    def run(w: int) -> None:
        for i in range(times):
            results[w].append(barriers[w].cross(G, world, "boundary", vote=votes[w][i] if votes else None))
            sums[w].append(barriers[w].voted)

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(len(barriers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
        assert not t.is_alive(), "a barrier did not return (bounded wait)"
    return results, sums


def test_outcomes_forged_ahead_of_the_barriers_are_ignored_and_every_member_passes(make_job):
    job = make_job([0, 1, 2])
    Forger(job).fail_ahead(range(1, 6))
    barriers = [job.worker(w) for w in (0, 1, 2)]
    results, _ = cross_all(barriers, 3, times=5)
    assert results == {0: [None] * 5, 1: [None] * 5, 2: [None] * 5}
    assert sum(r.forged.count for r in job.rdzvs) >= 1   # seen, logged, not acted on
    assert job.signer.verify(outcome_key(G, 5), job.store.get(outcome_key(G, 5))) == "ok"


def test_forged_arrivals_and_counts_change_no_vote_and_let_nobody_through_early(make_job):
    """The counter says "everyone arrived" before anyone did and the arrivals hold the forger's
    votes: the sums are still exactly the members' own."""
    job = make_job([0, 1, 2])
    Forger(job).arrivals(range(1, 4), 3, vote=1 << 30)
    barriers = [job.worker(w) for w in (0, 1, 2)]
    votes = {0: [5, 0, 0], 1: [1, 0, 0], 2: [0, 0, 7]}
    results, sums = cross_all(barriers, 3, votes)
    assert results == {0: [None] * 3, 1: [None] * 3, 2: [None] * 3}
    assert sums == {w: [6, 0, 7] for w in (0, 1, 2)}


def test_a_forged_count_does_not_pass_a_voting_barrier_a_member_has_not_reached(make_job):
    """A voting barrier's outcome carries a decision: a count pushed to "both arrived" makes
    worker 0 check the arrivals, find worker 1's missing and wait for it."""
    job = make_job([0, 1])
    Forger(job).arrivals(range(1, 2), 2, vote=0)   # count at 2: "both arrived"
    b0, b1 = job.worker(0), job.worker(1)
    results: dict[int, str | None] = {}

    def cross(w: int, b: StepBarrier) -> None:
        results[w] = b.cross(G, 2, "boundary", vote=w + 1)

    first = threading.Thread(target=cross, args=(0, b0), daemon=True)
    first.start()
    time.sleep(0.5)
    assert first.is_alive() and b0.crossed == 0   # it waits for worker 1 all the same
    second = threading.Thread(target=cross, args=(1, b1), daemon=True)
    second.start()
    for t in (first, second):
        t.join(BOUND_S)
        assert not t.is_alive(), "a barrier did not return (bounded wait)"
    assert results == {0: None, 1: None} and b0.voted == b1.voted == 3


def test_a_forged_outcome_is_replaced_exactly_and_an_honest_one_is_never_overwritten(make_job):
    """A member that read a forged outcome re-decides from the verified arrivals and swaps
    exactly the bytes it read: a forged value is replaced, an honest one written meanwhile
    (another member's "fail") stays, so every member still reads one outcome."""
    job = make_job([0, 1])
    b0 = job.worker(0)
    for w in (0, 1):   # both arrived, as their own lines say
        job.store.append(arrivals_key(G, 1), f"{w} {job.signer.sign(f'{arrivals_key(G, 1)}#{w}', '0')}\n")
    # the store answers no append: a round trip on the same connection makes sure both were
    # applied before b0, on its own connection, reads them (a member's add does the same)
    job.store.get(arrivals_key(G, 1))
    forged = b"fail: forged"
    job.store.set(outcome_key(G, 1), forged)
    assert job.signer.verify(outcome_key(G, 1), b0._decide(G, 1, 2, forged)) == "ok"
    honest = job.signer.sign(outcome_key(G, 2), "fail: worker 1 crashed")
    for w in (0, 1):
        job.store.append(arrivals_key(G, 2), f"{w} {job.signer.sign(f'{arrivals_key(G, 2)}#{w}', '0')}\n")
    job.store.set(outcome_key(G, 2), honest)
    job.store.get(outcome_key(G, 2))   # the round trip, as above
    assert b0._decide(G, 2, 2, forged) == honest.encode()
    assert b0._decide(G, 3, 2, forged) is None   # no arrivals yet: nothing to decide


def test_a_reason_read_from_the_store_is_escaped_and_bounded():
    assert bounded("worker 3 crashed\x1b[31m\n") == "worker 3 crashed\\x1b[31m\\n"
    assert len(bounded("x" * 10_000)) == 300


def test_a_busy_member_is_waited_for_without_failing_and_shown_as_waited_for(make_job):
    job = make_job([0, 1, 2], hb_timeout_s=0.5)   # the busy one is silent at no barrier, yet alive
    b0, b1, b2 = (job.worker(w) for w in (0, 1, 2))
    runs = [cross_in_thread(b0, 3), cross_in_thread(b1, 3)]
    rec = wait_until(lambda: (job.read(keys.waiting(0)) or {}).get("for"), "worker 0's waiting record")
    assert rec == [2] and job.read(keys.waiting(0))["phase"] == "backward"
    assert b0.waiting_for == [2] and b1.waiting_for == [2]
    time.sleep(1.5)   # three heartbeat timeouts: still waited for, since it beats
    assert all(r["thread"].is_alive() for r in runs)
    late = cross_in_thread(b2, 3)
    assert join(*runs, late) == [[None], [None], [None]]
    assert b0.waiting_for == []
    wait_until(lambda: job.read(keys.waiting(0)) == {"for": [], "since": job.read(keys.waiting(0))["since"],
                                                      "phase": ""}, "worker 0's waiting record cleared")


def test_a_silent_member_fails_the_barrier_for_everyone_naming_it_and_a_late_one_reads_it(make_job):
    job = make_job([0, 1, 2], hb_timeout_s=0.5)
    b0, b1, b2 = (job.worker(w) for w in (0, 1, 2))
    b2.rdzv.close()   # frozen: its heartbeat stops
    (r0,), (r1,) = join(cross_in_thread(b0, 3, phase="boundary"), cross_in_thread(b1, 3, phase="boundary"))
    assert r0 == r1 == "worker 2 sent no heartbeat for 0.5s (at the boundary barrier)"
    resumed = job.worker(2)   # the frozen one, resumed: it arrives last and reads the same outcome
    assert resumed.cross(G, 3, "boundary") == r0


@pytest.mark.parametrize("record,expect", [(keys.crashed(2), "worker 2 crashed"),
                                           (keys.fail(G, 2), "worker 2 left generation 1"),
                                           (keys.ABORT, "the job was aborted")])
def test_a_crashed_departed_or_aborted_job_fails_the_barrier_before_any_heartbeat_timeout(
        make_job, record, expect):
    job = make_job([0, 1, 2], hb_timeout_s=600)
    b0, b1, _ = (job.worker(w) for w in (0, 1, 2))
    runs = [cross_in_thread(b0, 3), cross_in_thread(b1, 3)]
    wait_until(lambda: b0.waiting_for == [2], "worker 0 to see who is missing")
    job.write(record, json.dumps({"reason": "same failure 3 times", "error": "x"}))
    (r0,), (r1,) = join(*runs)
    assert r0 == r1 and expect in r0


def test_a_forged_crash_record_does_not_fail_the_barrier(make_job):
    job = make_job([0, 1], hb_timeout_s=600)
    b0, b1 = job.worker(0), job.worker(1)
    run = cross_in_thread(b0, 2)
    job.store.set(keys.crashed(1), json.dumps({"error": "forged"}))   # unsigned
    wait_until(lambda: b0.rdzv.forged.count >= 1, "the forged record to be noticed")
    assert run["thread"].is_alive()
    assert join(run, cross_in_thread(b1, 2)) == [[None], [None]]


def test_an_abort_ends_the_wait_for_a_generation(make_job):
    job = make_job([0])
    rdzv = job.worker(5).rdzv
    job.write(keys.ABORT, json.dumps({"reason": "rolled back 3 times in a row"}))
    polls = iter(range(1000))
    with pytest.raises(Aborted, match="rolled back 3 times"):
        rdzv.wait_for_generation(G, False, lambda: next(polls, None) is None)


def test_an_exception_escaping_the_script_is_recorded_then_printed_as_before(make_job, monkeypatch, request):
    job = make_job([0, 1])
    rdzv = job.worker(1).rdzv
    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: printed.append(a[0]))
    before = signal.getsignal(signal.SIGTERM)
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, before))
    install_crash_hook(lambda rec: report_crash(rdzv, 1, rec), lambda: "step 7 of generation 1 (rank 1)")
    try:
        1 / 0
    except ZeroDivisionError:
        sys.excepthook(*sys.exc_info())
    assert printed == [ZeroDivisionError]    # the previous hook still ran
    rec = job.read(keys.crashed(1))
    assert rec["error"] == "ZeroDivisionError: division by zero"
    assert rec["phase"] == "step 7 of generation 1 (rank 1)"
    assert rec["traceback"][-1] == "ZeroDivisionError: division by zero" and len(rec["traceback"]) <= 15
    assert any("1 / 0" in line for line in rec["traceback"])
    assert rdzv.closed   # the heartbeat stopped: the worker is seen gone at once
    # the job's stop, which the record brings at once, cannot turn its exit 1 into -15
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_a_crash_record_keeps_only_the_last_lines_of_a_deep_traceback():
    def deep(n: int) -> None:   # deep and deeper alternate: no frame repeats to be collapsed
        if n == 0:
            raise ValueError("bad batch\nsecond line")
        deeper(n - 1)

    def deeper(n: int) -> None:
        deep(n)

    try:
        deep(30)
    except ValueError as e:
        rec = crash_record(type(e), e, e.__traceback__, "warm-up")
    assert len(rec["traceback"]) == 15 and rec["traceback"][-1] == "second line"
    assert not rec["traceback"][0].startswith("Traceback")   # the first lines were left out
    assert rec["error"].startswith("ValueError: bad batch")


# ---- a state mismatch named by tensor and member ---------------------------------------------------
class TwoRanks:
    """The collectives of rank 0 of two, the other rank's contributions given in order."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        self.others = others

    def all_reduce(self, vec: torch.Tensor, op: Any = torch.distributed.ReduceOp.SUM) -> torch.Tensor:
        other = self.others.pop(0)
        return torch.maximum(vec, other) if op == torch.distributed.ReduceOp.MAX else vec + other


class FakeState:
    def __init__(self, objects: dict[str, Any], step: int = 4, position: int = 256) -> None:
        self.objects, self.step, self.position = objects, step, position

    def capture(self) -> dict[str, Any]:
        return {"objects": self.objects}


def model_state(bn_mean: float) -> dict[str, Any]:
    bn = torch.nn.BatchNorm1d(3)
    bn.running_mean.fill_(bn_mean)
    return {"model": {"bn1." + k: v for k, v in bn.state_dict().items()},
            "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3)}}}}


def contributions(state: FakeState, rank: int, world: int, differing: int = 2) -> list[torch.Tensor]:
    """What `state` held on `rank` adds to each of the verify's collectives (the first
    tensor of each is recomputed by the formation for rank 0 itself); `differing`: the
    index of the part that differs (2: bn1.running_mean, after weight and bias)."""
    from gpuflex.elastic.state.copy_header import skeleton_crc
    from gpuflex.elastic.state.tree import checksum_tensors
    skeleton, tensors = flatten(state.capture()["objects"])
    crc = checksum_tensors(tensors) ^ skeleton_crc(skeleton)
    first = torch.tensor([crc, state.step, state.position, -crc, -state.step, -state.position])
    own = [checksum_tensors([t]) for t in tensors] + [skeleton_crc(skeleton), state.step, state.position]
    second = torch.tensor(own + [-v for v in own])
    each = torch.zeros(world, dtype=torch.int64)
    each[rank] = own[differing]
    return [first, second, each]


def test_a_registered_scalar_that_differs_is_a_mismatch_named_as_such():
    """Registered state must be equal on every member: a scalar only rank 0 updated (a
    best_val_loss) is caught by the checksum, not carried silently."""
    from gpuflex.elastic.state.copy_header import NON_TENSOR
    mine, theirs = model_state(0.0), model_state(0.0)
    mine["extra.best"], theirs["extra.best"] = {"val_loss": 1.5}, {"val_loss": 1e9}
    verdicts: dict[str, str] = {}

    class Rdzv:
        def set(self, key: str, value: str) -> None:
            verdicts[key] = value

    n_tensors = len(flatten(theirs)[1])
    f = Formation(wid=10, rdzv=Rdzv(), group=TwoRanks(contributions(FakeState(theirs), 1, 2, n_tensors)),
                  state=FakeState(mine), signals=None, timeout_s=1)
    f._destroy = lambda: None
    with pytest.raises(Exception) as raised:
        f._verify(3, 0, received=False, kind="resize", members=[10, 11])
    assert type(raised.value).__name__ == "StateMismatch"
    reason = json.loads(verdicts[keys.verdict(3)])["reason"]
    assert reason == f"state checksum mismatch in resize: {NON_TENSOR} differs on worker 11 (rank 1)"


def test_a_state_mismatch_names_the_tensor_and_the_member_in_the_verdict():
    mine, theirs = FakeState(model_state(0.0)), FakeState(model_state(0.5))
    verdicts: dict[str, str] = {}

    class Rdzv:
        def set(self, key: str, value: str) -> None:
            verdicts[key] = value

    f = Formation(wid=10, rdzv=Rdzv(), group=TwoRanks(contributions(theirs, 1, 2)), state=mine,
                  signals=None, timeout_s=1)
    f._destroy = lambda: None
    with pytest.raises(Exception) as raised:
        f._verify(3, 0, received=False, kind="resize", members=[10, 11])
    assert type(raised.value).__name__ == "StateMismatch"
    reason = json.loads(verdicts[keys.verdict(3)])["reason"]
    # two members, two values: the tie goes to rank 0's, so rank 1 is named
    assert reason == "state checksum mismatch in resize: objects.model.bn1.running_mean differs on worker 11 (rank 1)"


def test_tensor_paths_follow_the_state_tree():
    skeleton, _ = flatten({"model": {"w": torch.zeros(1), "bn.running_var": torch.ones(1)},
                           "optimizer": {"state": {0: {"exp_avg": torch.zeros(1)}}, "lr": [0.1]}})
    assert tensor_paths(skeleton, "objects") == [
        "objects.model.w", "objects.model.bn.running_var", "objects.optimizer.state.0.exp_avg"]



def test_a_failed_collective_of_a_sharded_run_ends_it_as_a_lost_store_once_the_store_is_gone(make_job):
    """A sharded run cannot undo a step whose collective failed: ShardsLost while the job
    store answers; StoreLost once the store is gone (a member that saw it die first has
    exited, which is what failed the others' collective), so every member of a job whose
    store was killed exits STORE_LOST_EXIT and the job's record says so."""
    from types import SimpleNamespace

    from gpuflex.elastic.membership.joining import ShardsLost
    from gpuflex.elastic.membership.rendezvous import StoreLost
    from gpuflex.elastic.run.sharded_steps import ShardedSteps

    job = make_job([0])
    job.worker(0)
    steps = ShardedSteps(SimpleNamespace(generation=G, rdzv=job.rdzvs[0]))   # what no_undo reads of a context
    with pytest.raises(ShardsLost, match="a collective of generation 1 failed \\(peer gone\\)"):
        steps.no_undo("peer gone")
    job.store = None   # the job store's server goes with its last reference
    with pytest.raises(StoreLost):
        steps.no_undo("peer gone")
