"""Liveness from heartbeats (gpuflex.elastic.membership.liveness): the step barrier waits for a busy
member and fails, for every member alike, when one is silent, crashed, gone or the job was
aborted; crash records; a state mismatch named by tensor and member.

The barrier tests run members as threads of this process, each with its own store
connections and heartbeat thread, against a real TCPStore; every wait is bounded."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
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
from tests import TESTS
from tests.conftest import GpuflexCLI, cleanup_jobs, wait_for

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
    forged = b"fail: forged"
    job.store.set(outcome_key(G, 1), forged)
    assert job.signer.verify(outcome_key(G, 1), b0._decide(G, 1, 2, forged)) == "ok"
    honest = job.signer.sign(outcome_key(G, 2), "fail: worker 1 crashed")
    for w in (0, 1):
        job.store.append(arrivals_key(G, 2), f"{w} {job.signer.sign(f'{arrivals_key(G, 2)}#{w}', '0')}\n")
    job.store.set(outcome_key(G, 2), honest)
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


def test_an_exception_escaping_the_script_is_recorded_then_printed_as_before(make_job, monkeypatch):
    job = make_job([0, 1])
    rdzv = job.worker(1).rdzv
    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: printed.append(a[0]))
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


# ---- end to end on the local pool --------------------------------------------------------------
JOB = str(TESTS / "fakes" / "liveness_job.py")
E2E_DEADLINE_S = 300
JOB_ARGS = ("--hidden", "32", "--global-batch-size", "64", "--seed", "4")


@pytest.fixture
def lj(home):
    """CLI whose jobs have a 3 s process-group timeout and a 3 s heartbeat timeout."""
    cfg = home / "g.toml"
    cfg.write_text(
        f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
        "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 1\npg_timeout_s = 3\nheartbeat_timeout_s = 3\n\n"
        f'[[hosts]]\nname = "local"\ngpus = "cpu:4"\nworkdir = "{home}/work"\n')
    cli = GpuflexCLI(home, cfg)
    yield cli
    cleanup_jobs(cli, home / "g.db")


_refs: dict[tuple, dict] = {}


def reference(tmp_path_factory, epochs: int, *extra: str) -> dict:
    """The standalone run of the same script, without the busy wait or the exception."""
    key = (epochs, *extra)
    if key not in _refs:
        out = tmp_path_factory.mktemp("ref") / "ref.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
        subprocess.run([sys.executable, JOB, *JOB_ARGS, *extra, "--epochs", str(epochs), "--report", str(out)],
                       check=True, env=env, timeout=300)
        _refs[key] = json.loads(out.read_text())
    return _refs[key]


def assert_matches(report: dict, ref: dict) -> None:
    assert report["steps"] == ref["steps"]
    got, want = torch.tensor(report["params"]), torch.tensor(ref["params"])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    for epoch, ids in report["samples"].items():
        assert sorted(ids) == list(range(2048)), f"epoch {epoch} not exactly once"
    assert [s for s, _, _ in report["step_log"]] == list(range(ref["steps"]))


def poll(cli: GpuflexCLI, job_id: int, pred: Callable[[dict], Any], what: str) -> dict:
    return wait_for(cli, job_id, pred, what, E2E_DEADLINE_S, every_s=0.5)


def members_of(job: dict) -> list[dict]:
    return sorted((w for w in job["workers"] if w["rank"] is not None and w["state"] == "running"),
                  key=lambda w: w["rank"])


def test_rank_0_busy_longer_than_the_process_group_timeout_is_waited_for_without_rollback(
        lj, tmp_path_factory, home):
    report = home / "r.json"
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--epochs", "2", "--step-sleep", "0.02",
                     "--busy-at", "5", "--busy-s", "8", "--report", str(report)], "--workers", "2")
    running = poll(lj, job["id"], lambda j: len(members_of(j)) == 2, "two members")
    rank0 = members_of(running)[0]["wid"]
    seen = poll(lj, job["id"], lambda j: any(rank0 in w["for"] for w in j.get("waiting") or ()),
                "the other member to be shown waiting for rank 0")
    (w,) = [w for w in seen["waiting"] if rank0 in w["for"]]
    assert w["wid"] != rank0 and w["phase"] == "backward"
    done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    assert done["state"] == "succeeded", done
    assert done["generation"] == 1   # no recovery, no rollback: the busy member was waited for
    assert_matches(json.loads(report.read_text()), reference(tmp_path_factory, 2))
    kinds = {e["kind"] for e in lj.json("events", str(job["id"]))}
    assert not kinds & {"fault", "rollback"}, kinds


def test_a_frozen_member_is_fenced_within_the_heartbeat_timeout_and_the_others_go_on(
        lj, tmp_path_factory, home):
    report = home / "r.json"
    # 8 epochs of 32 steps, >= 50 ms each: the freeze lands long before the end, even on a busy host
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--epochs", "8", "--step-sleep", "0.05",
                     "--report", str(report)], "--workers", "2:3")
    lj.ok("scale", str(job["id"]), "3", "--wait", "--timeout", str(E2E_DEADLINE_S))
    running = poll(lj, job["id"], lambda j: len(members_of(j)) == 3 and (j.get("step") or 0) >= 3,
                   "steps at world size 3")
    assert running["step"] < 200, "the job is too close to its end for the test to mean anything"
    frozen = members_of(running)[1]
    os.kill(frozen["pid"], signal.SIGSTOP)
    try:
        after = poll(lj, job["id"], lambda j: j["generation"] > running["generation"] and j["world_size"] == 2
                     and (j.get("step") or 0) > (running.get("step") or 0) + 5, "the others to go on without it")
        assert frozen["wid"] not in [w["wid"] for w in members_of(after)]
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    assert done["state"] == "succeeded", done
    assert_matches(json.loads(report.read_text()), reference(tmp_path_factory, 8))


def test_a_worker_that_raises_writes_its_crash_record_and_the_survivor_never_trains_alone(lj, home):
    report = home / "r.json"
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--epochs", "2", "--step-sleep", "0.05",
                     "--raise-at", "12", "--raise-wid", "1", "--report", str(report)], "--workers", "2")
    done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    assert done["state"] == "failed", done
    text = json.dumps(done)
    assert "ZeroDivisionError: division by zero" in text, text[:2000]
    crashed = {w["wid"]: w for w in done["workers"]}[1]
    assert crashed["exit_code"] == 1
    survivor = {w["wid"]: w for w in done["workers"]}[0]
    assert survivor["exit_code"] == 0   # it waited, then the control side stopped it
    assert done["generation"] == 1      # no generation without the crashed worker: never alone
    r = json.loads(report.read_text())  # the stopped survivor's report: step 12 undone, none alone
    assert r["steps"] == 12 and {ws for _, _, ws in r["step_log"]} == {2}


def test_compiled_workers_warm_up_through_the_loop_before_they_are_ready_and_leave_no_trace(
        lj, tmp_path_factory, home):
    """A torch.compile'd model: every worker, the first two and a newcomer, makes one pass
    through the user's own loop (it compiles there) before it says it is ready, cut for the
    place it expects, not primary, its gradients dropped; the state before the pass is put
    back (rank 0's is the first generation's) or replaced by the copy, so the job still ends
    equal to a standalone run."""
    report, warm, hold = home / "r.json", home / "warm", home / "hold"
    hold.touch()   # the pace is held until both resizes are done (a loaded machine's compiles are slow)
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--compile", "--epochs", "6", "--step-sleep", "0.5",
                     "--sleep-while", str(hold), "--warm-log", str(warm), "--report", str(report)],
                    "--workers", "1:2")
    poll(lj, job["id"], lambda j: (j.get("step") or 0) >= 3 and j["world_size"] == 2, "steps at world size 2")
    lj.ok("scale", str(job["id"]), "1", "--wait", "--timeout", str(E2E_DEADLINE_S))
    lj.ok("scale", str(job["id"]), "2", "--wait", "--timeout", str(E2E_DEADLINE_S))
    hold.unlink()
    done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    assert done["state"] == "succeeded", done
    places = {}
    for w in done["workers"]:
        passes = [json.loads(line) for line in Path(f"{warm}.w{w['wid']}").read_text().splitlines()]
        places[w["wid"]] = [(p["is_primary"], p["rank"], p["world_size"], p["step"]) for p in passes]
    newcomer = max(places)
    assert newcomer >= 2 and len(places) == 3, places
    assert places == {0: [(False, 0, 2, 0)], 1: [(False, 1, 2, 0)], newcomer: [(False, 1, 2, 0)]}
    log = lj("logs", str(job["id"]), "--worker", str(newcomer)).stdout
    assert log.index("warm-up pass as rank 1 of 2") < log.index("rank 1 of 2 at step"), log[-3000:]
    assert_matches(json.loads(report.read_text()), reference(tmp_path_factory, 6, "--compile"))


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


def _store_of_job_with(marker: str) -> str:
    """GPUFLEX_STORE of a running worker whose command line holds `marker` (as an attacker
    finds the port with `ss -ltn`; root reads the environment)."""
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            env = dict(v.split(b"=", 1) for v in (d / "environ").read_bytes().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        if any(marker.encode() in a for a in argv) and b"GPUFLEX_STORE" in env:
            return env[b"GPUFLEX_STORE"].decode()
    return ""


FORGED_TEXT = "text-of-the-forger-7f3a"


def test_a_job_under_a_forger_at_its_store_port_succeeds_exact(lj, tmp_path_factory, home):
    """Issue 28's attack and its kin on a real job: outcomes forged ahead with "fail: ..."
    for every coming barrier, arrival lines with the forger's votes, counts pushed to
    "everyone arrived". The job ends succeeded, equal to the standalone run, and no text
    of the forger's reaches its events or its reason."""
    report = home / "r.json"
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--epochs", "3", "--step-sleep", "0.02",
                     "--report", str(report)], "--workers", "3")
    poll(lj, job["id"], lambda j: len(members_of(j)) == 3, "three members")
    address = wait_for_value(lambda: _store_of_job_with(str(report)), "the job's store address")
    host, _, port = address.rpartition(":")
    forger = TCPStore(host, int(port), is_master=False, timeout=dt.timedelta(seconds=BOUND_S))
    stop = threading.Event()

    def attack() -> None:
        rounds = 0
        while not stop.is_set() and rounds < 400:   # bounded: at most 400 rounds of writes
            rounds += 1
            try:
                for g in range(1, 4):
                    for n in range(1, 200):
                        forger.set(outcome_key(g, n), f"fail: {FORGED_TEXT}")
                    forger.add(counter_key(g), 3)
                    forger.append(arrivals_key(g, rounds % 150 + 1), "0 1073741824\n1 5\n")
            except Exception:   # the job ended and its store with it
                return
            stop.wait(0.2)

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    try:
        done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    finally:
        stop.set()
        t.join(BOUND_S)
    assert done["state"] == "succeeded", done
    events = lj("events", str(job["id"])).stdout
    assert FORGED_TEXT not in events and FORGED_TEXT not in json.dumps(done)
    assert_matches(json.loads(report.read_text()), reference(tmp_path_factory, 3))


def wait_for_value(fn: Callable[[], Any], what: str) -> Any:
    return wait_until(fn, what)
