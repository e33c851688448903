"""The runtime's collaborators on their own, without processes: the step signals, the
step-boundary agreement, the collectives' failure note and rank 0's progress report."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpuflex.elastic.membership.agreement import Agreement
from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.data.sampler import ElasticSampler
from gpuflex.elastic.protocol.signals import StepSignals
from gpuflex.elastic.membership.worker_control import Progress
from tests.conftest import exits_without_teardown
from tests.elastic.run.test_runtime import free_port


def test_signals_checkpoint_and_poke_are_taken_once_and_stop_stays():
    s = StepSignals()
    assert (s.stop_requested(), s.take_checkpoint(), s.take_poke()) == (False, False, False)
    s.request_checkpoint()
    s.poke()
    s.request_stop("a SIGTERM")
    assert s.take_checkpoint() is True and s.take_checkpoint() is False
    assert s.take_poke() is True and s.take_poke() is False
    assert s.stop_requested() and s.stop_requested()


def agreement(track: bool, batch: int = 8, switch: int = 0) -> tuple[Agreement, StepSignals, Collectives]:
    signals, group = StepSignals(), Collectives(torch.device("cpu"), timeout_s=1)
    return Agreement(batch_size=batch, track_samples=track, signals=signals, group=group,
                     switch_to=lambda: switch), signals, group


@pytest.mark.parametrize("track", [False, True])
def test_a_lone_rank_agrees_on_its_signals_and_samples(track):
    agree, signals, _ = agreement(track, switch=4)
    sampler = ElasticSampler(20, 8, epochs=1, seed=1)
    batch = sampler.batch(0, 0, 1)
    agree.begin_step(batch)
    signals.request_checkpoint()
    switch, stop, ckpt, ids = agree.agree(done_step=True)
    assert (switch, stop, ckpt) == (4, False, True)
    assert ids == (batch.indices.tolist() if track else None)
    assert agree.agree(done_step=True)[2] is False   # the checkpoint request was taken


def test_the_summed_vectors_of_two_ranks_give_the_whole_global_batch():
    sampler = ElasticSampler(20, 8, epochs=1, seed=1)
    vecs = []
    for rank in (0, 1):
        agree, signals, _ = agreement(True, switch=3 if rank == 0 else 0)
        if rank == 1:
            signals.request_stop("a SIGTERM")
        agree.begin_step(sampler.batch(2, rank, 2))
        vecs.append(agree.build(done_step=True))
    switch, stop, ckpt, ids = agree.parse(vecs[0] + vecs[1])
    assert (switch, stop, ckpt) == (3, True, False)
    assert ids == sampler.global_batch(2)[2].tolist()


def test_a_sample_processed_twice_in_a_step_is_caught():
    sampler = ElasticSampler(20, 8, epochs=1, seed=1)
    agree, _, _ = agreement(True)
    agree.begin_step(sampler.batch(0, 0, 2))
    vec = agree.build(done_step=True)
    with pytest.raises(RuntimeError, match="twice"):
        agree.parse(vec + vec)


def test_a_vote_that_rode_on_the_gradients_is_used_once_without_a_collective_of_its_own():
    agree, signals, group = agreement(False)
    agree.summed(torch.tensor([5.0, 1.0, 0.0], dtype=torch.float64))
    group.world_size = 2   # a collective of its own would need a process group: none here
    assert agree.agree(done_step=True) == (5, True, False, None)
    # the next vote is a collective again: with no process group it fails, and is noted
    assert agree.agree(done_step=True) is None
    assert "process group" in group.take_failure()


def test_a_failed_collective_is_noted_once_and_a_good_one_leaves_no_note():
    group = Collectives(torch.device("cpu"), timeout_s=1)

    def dead_peer():
        raise RuntimeError("Connection closed by peer\nmore detail")

    assert group.call(lambda: None) is True and group.take_failure() is None
    assert group.call(dead_peer) is False
    assert group.failure == "RuntimeError: Connection closed by peer"
    assert group.take_failure() == "RuntimeError: Connection closed by peer"
    assert group.take_failure() is None


def test_progress_posts_rank_0s_status_with_its_rate_about_once_a_second():
    class Store:
        posted: list[str] = []

        def post_progress(self, status: str) -> None:
            self.posted.append(status)

    progress = Progress(batch_size=64, status=lambda: {"rate": progress.rate})
    store = Store()
    log = [[s, 10.0 + 0.5 * s, 2] for s in range(5)]   # a step every 0.5 s
    progress.report(log, store)
    progress.report(log, store)                          # within the interval: nothing
    assert progress.rate == pytest.approx(128.0)
    assert [json.loads(p) for p in store.posted] == [{"rate": 128.0}]
    # after a resize to 3: only the steps at 3 count, none before it nor its pause
    log += [[5, 14.0, 3]]
    progress.report(log, store, force=True)
    assert progress.rate == 0.0                          # one step at 3: no rate yet
    log += [[6, 14.25, 3], [7, 14.5, 3]]
    progress.report(log, store, force=True)
    assert progress.rate == pytest.approx(256.0)


@exits_without_teardown
def _failed_then_formed(rank: int, port: int, out: dict) -> None:
    """Generation 1: rank 0 alone of 2 (its peer never comes), so creating the group fails.
    Generation 2: both, whose group must form on each."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=dt.timedelta(seconds=30))
    group = Collectives(torch.device("cpu"), timeout_s=2)
    if rank == 0:
        try:
            group.open(store, 1, 0, 2)
        except (RuntimeError, ValueError) as e:   # gloo's connect or the store's wait timed out
            out["failed"] = type(e).__name__
        store.set("rank0-failed", "1")
    else:
        store.wait(["rank0-failed"])
    try:
        group.open(store, 2, rank, 2)
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        out[rank] = float(total)
    except (RuntimeError, ValueError) as e:
        out[rank] = str(e).splitlines()[0]
    group.close()


def test_a_member_whose_group_failed_to_form_forms_the_next_one_with_the_others():
    """A failed init_process_group leaves torch's group-name counter raised (only a destroy
    resets it): the next generation's group would never meet the others' (a fault-matrix
    cell aborted on it). Collectives.open names every member's world group alike."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_failed_then_formed, args=(free_port(), out), nprocs=2, join=True)
        out = dict(out)
    assert "failed" in out, out
    assert out[0] == out[1] == 3.0, out
