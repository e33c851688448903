"""gpuflex.elastic.run.context (`RunContext`, what the parts of an ElasticRun share) and
gpuflex.elastic.run.boundary (`Boundary`, between two steps), on a standalone run: no
store, no processes. tests/elastic/run/test_runtime.py has them at several sizes, with processes."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from gpuflex.elastic.membership.joining import Formed
from gpuflex.elastic.membership.rendezvous import StoreLost
from gpuflex.elastic.protocol import keys
from gpuflex.elastic.run import context
from gpuflex.elastic.run.boundary import Boundary
from gpuflex.elastic.run.context import RunContext
from gpuflex.elastic.run.runtime import ElasticRun
from tests.elastic.run.test_steps import standalone


def test_a_standalone_context_is_not_distributed_and_crosses_no_barrier():
    run, _, _ = standalone()
    ctx = run.ctx
    assert isinstance(ctx, RunContext) and not ctx.distributed and ctx.barrier is None
    assert ctx.where() == {"wid": ctx.wid, "rank": 0, "gen": 0, "step": 0}
    assert ctx.cross("backward") is True and ctx.crossed == (0, 0, "backward")
    assert ctx.more()


def test_a_formation_sets_the_place_and_none_stops_the_run():
    run, _, _ = standalone()
    ctx = run.ctx
    ctx.joined(Formed(generation=4, rank=1, world_size=3, members=(0, 2, 5), kind="resize", at=12.5,
                      copied=0, timings={"copy": 0.1}))
    assert (ctx.rank, ctx.world_size, ctx.generation, ctx.formed_kind, ctx.formed_at) == (1, 3, 4, "resize", 12.5)
    assert ctx.pending_timings == {"copy": 0.1}
    ctx.joined(None)
    assert ctx.stopped and not ctx.more()


class Written:
    """A store that keeps what the worker sets (or is lost)."""

    def __init__(self, lost: bool = False) -> None:
        self.records, self.lost = {}, lost

    def set(self, key: str, value: str) -> None:
        if self.lost:
            raise StoreLost("gone")
        self.records[key] = json.loads(value)


def test_a_member_asked_to_stop_says_so_unless_it_finished_or_was_not_asked():
    run, _, _ = standalone(steps=2)
    ctx = run.ctx
    ctx.rdzv, ctx.generation = Written(), 3
    ctx.say_stopped()
    assert ctx.rdzv.records == {}   # not asked: another member's stop
    ctx.signals.request_stop("a SIGTERM")
    ctx.joined(None)   # stopped while it waited for the next generation
    assert ctx.rdzv.records == {keys.STOPPED: {"wid": ctx.wid, "by": "a SIGTERM", "step": 0,
                                               "of": ctx.sampler.total_steps}}
    ctx.rdzv, ctx.state.step = Written(), ctx.sampler.total_steps
    ctx.say_stopped()
    assert ctx.rdzv.records == {}   # the training was over
    ctx.rdzv, ctx.state.step = Written(lost=True), 0
    ctx.say_stopped()   # a lost store: the stop goes on


def test_the_status_record_names_the_place_and_the_step():
    run, model, data = standalone(steps=1)
    for x, y in run.loader(data):
        run.backward(torch.nn.functional.mse_loss(model(x), y))
    status = run.ctx.status()
    assert (status["rank"], status["world_size"], status["step"], status["waiting_for"]) == (0, 1, 1, [])
    assert status["loss"] is not None


def test_close_happens_once():
    run, _, _ = standalone()
    run.ctx.close()
    assert run.ctx.closed
    run.ctx.close()   # a second close is a no-op, not an error
    assert run.ctx.closed


def test_the_boundary_of_a_standalone_run_switches_nowhere_and_raises_a_store_lost_seen_in_the_step():
    run, _, _ = standalone()
    boundary = Boundary(run.ctx, run.strategy)
    assert boundary.switch_to() == 0
    run.ctx.store_lost = StoreLost("seen inside the step")
    with pytest.raises(StoreLost, match="seen inside the step"):
        boundary.after_step()


def test_a_split_gives_no_member_an_empty_batch_unless_the_script_says_it_takes_one():
    run, _, _ = standalone()
    assert run.ctx.split.empty_ok is False and run.ctx.split.least == 1
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    takes_empty = ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), num_samples=12,
                             global_batch_size=4, steps=1, empty_batches=True)
    assert takes_empty.ctx.split.empty_ok is True and takes_empty.ctx.split.least == 2


def test_a_steps_compute_is_timed_from_its_first_training_forward_not_from_the_batch(monkeypatch):
    """Issue 28 item 3: rank 0's evaluation between the batch and the step's forward (its
    own forwards under no_grad in eval mode, then a wait) is not the step's compute. A
    clock the test moves: 50 s of "evaluation" and one eval forward, then a training
    forward of 1 s, per step of 4 samples: the speed split's meter holds 1/4 s a sample."""
    clock = [1000.0]
    monkeypatch.setattr(context, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=time.time))
    run, model, data = standalone(steps=3)

    def one_second(module, args, out):
        clock[0] += 1.0

    model.register_forward_hook(one_second)   # every forward of the model takes 1 s on this clock
    for x, y in run.loader(data):
        model.eval()
        with torch.no_grad():
            model(x)        # rank 0's evaluation: not a training forward
        model.train()
        clock[0] += 50.0    # and the rest of it
        run.backward(torch.nn.functional.mse_loss(model(x), y))
    assert run.step == 3
    assert run.ctx.split.meter.sec == 1.0 / 4


def test_a_step_whose_forward_never_reaches_the_model_is_timed_from_its_batch(monkeypatch):
    """No training forward of the model in the step (the hook never fired): the step is
    timed from the batch handed out, as before."""
    clock = [1000.0]
    monkeypatch.setattr(context, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=time.time))
    run, model, data = standalone(steps=1)
    for x, y in run.loader(data):
        clock[0] += 8.0
        with torch.no_grad():
            pred = model(x)
        run.backward(torch.nn.functional.mse_loss(pred.requires_grad_(), y))
    assert run.ctx.split.meter.sec == 8.0 / 4
