"""gpuflex.elastic.run's parts of ElasticRun, each on a standalone run (world size 1, no
store, no processes): `startup` (the start of a plain script), `user_calls` (the script's
own collectives, micro-batches, registration) and `data_steps` (the data-parallel
backward). tests/elastic/run/test_runtime.py covers them at several sizes, with processes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from gpuflex.elastic.run.data_steps import DataParallelSteps
from gpuflex.elastic.run.runtime import ElasticRun
from gpuflex.elastic.run.startup import StartUp
from gpuflex.elastic.run.user_calls import UserCalls


def standalone(steps: int = 2) -> tuple[ElasticRun, torch.nn.Module, TensorDataset]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(12, 3, generator=g), torch.randn(12, 1, generator=g))
    run = ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), num_samples=12,
                     global_batch_size=4, steps=steps, seed=3)
    return run, model, data


def test_each_part_holds_the_calls_it_is_named_for():
    assert {"all_reduce", "accumulate", "global_mean", "register"} <= set(vars(UserCalls))
    assert "backward" in vars(DataParallelSteps)
    assert any(name.lstrip("_") == "request_members" for name in vars(StartUp))


def test_a_standalone_backward_is_the_plain_backward_of_the_whole_batch():
    run, model, data = standalone()
    twin = torch.nn.Linear(3, 1)
    twin.load_state_dict(model.state_dict())
    for x, y in run.loader(data):
        model.zero_grad()
        run.backward(torch.nn.functional.mse_loss(model(x), y))
        twin.zero_grad()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        for mine, plain in zip(model.parameters(), twin.parameters()):
            assert torch.allclose(mine.grad, plain.grad)
        assert len(x) == 4
    assert run.step == 2


def test_user_collectives_alone_return_this_ranks_values():
    run, model, data = standalone(steps=1)
    for x, y in run.loader(data):
        t = torch.tensor([1.0, 2.0])
        assert run.all_reduce(t) is True and t.tolist() == [1.0, 2.0]
        assert run.global_mean(torch.tensor(0.25)) == pytest.approx(0.25)
        halves = list(run.accumulate(x, y, micro_batch_size=2))
        assert [len(a) for a, _ in halves] == [2, 2]
        assert torch.equal(torch.cat([a for a, _ in halves]), x)
        for xb, yb in halves:
            run.backward(torch.nn.functional.mse_loss(model(xb), yb))


def test_registered_state_is_the_scripts_own_object():
    run, _, _ = standalone()
    best = {"val_loss": 1.5}
    assert run.register("best", best) is best
    with pytest.raises(ValueError, match="already registered"):
        run.register("best", {})
