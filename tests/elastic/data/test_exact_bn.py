"""gpuflex.elastic.data.exact_bn: in bitwise mode the BatchNorm running statistics that
every member ends a step with are the same bits for any grouping of the units over 1, 2 or
3 members and any order they ran them in (members are threads meeting in test_exact.py's
all-reduce), equal to BatchNorm's own running update to float precision; evaluations do not
touch them; what cannot be exact is refused in one line."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from gpuflex.elastic.data import exact
from gpuflex.elastic.data.exact_bn import BatchNormUnits
from gpuflex.elastic.run.runtime import ElasticRun
from tests.elastic.data.test_exact import Members, make_run, pinned  # noqa: F401

UNIT, UNITS = 6, 8   # a global batch of 48 images in 8 units
GROUPINGS = [[list(range(UNITS))],                 # alone
             [[0, 1, 2], [3, 4, 5], [6, 7]],      # 3 members
             [[0, 1, 2, 3, 4], [5, 6, 7]],        # 2 members, split by speed
             [[7], [3, 1, 2, 0, 6, 5, 4]]]        # the units run in another order


def make_model(momentum: float | None = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.BatchNorm1d(8, momentum=momentum),
                         nn.Linear(8, 4))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = 2.0 + 3.0 * torch.randn(UNIT * UNITS, 3, 6, 6, generator=g)   # far from BatchNorm's initial statistics
    return x, torch.randint(0, 4, (UNIT * UNITS,), generator=g)


def buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for b in model.buffers()]


def members_run(grouping: list[list[int]], steps: int = 2, momentum: float | None = 0.1) -> list[torch.Tensor]:
    """`steps` steps of the units grouped so over len(grouping) members (threads, each its
    own copy of the model): every member's buffers after them, asserted equal; returned."""
    members, out, errors = Members(len(grouping)), {}, []
    initial = make_model(momentum)   # made here: the threads would race on torch's global RNG

    def member(rank: int) -> None:
        try:
            model = copy.deepcopy(initial)
            bn = BatchNormUnits(model)
            grads = exact.UnitGrads(list(model.parameters()))
            group = members.group(rank) if len(grouping) > 1 else None
            for step in range(steps):
                x, y = data(step)
                for u in grouping[rank]:
                    sl = slice(u * UNIT, (u + 1) * UNIT)
                    (nn.functional.cross_entropy(model(x[sl]), y[sl]) * (UNIT / len(x))).backward()
                    grads.take()
                    bn.take(u, (0, step))
                    assert bn.pending == {}
                stats = bn.pack(UNITS)
                summed = grads.reduce(group, UNITS, stats)
                bn.apply(summed, UNITS)
                with torch.no_grad():   # a step of the optimizer would differ nowhere: the gradients are exact
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            out[rank] = buffers(model)
        except BaseException as e:   # noqa: BLE001 - reported by the test's thread
            errors.append(e)
            members.barrier.abort()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(len(grouping))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for rank in out:
        assert all(torch.equal(a, b) for a, b in zip(out[rank], out[0])), rank
    return out[0]


def plain_batch_norm_run(steps: int = 2, momentum: float | None = 0.1) -> list[torch.Tensor]:
    """BatchNorm's own running update, the units one after the other on one process."""
    model = make_model(momentum)
    for step in range(steps):
        x, y = data(step)
        model.zero_grad()
        for u in range(UNITS):
            sl = slice(u * UNIT, (u + 1) * UNIT)
            (nn.functional.cross_entropy(model(x[sl]), y[sl]) * (UNIT / len(x))).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return buffers(model)


@pytest.mark.parametrize("momentum", [0.1, None])   # None: BatchNorm's cumulative average
def test_the_merged_running_statistics_have_the_same_bits_for_any_grouping_of_the_units(pinned, momentum):  # noqa: F811
    exact.pin_threads({})   # as bitwise mode does: one intra-op thread, deterministic kernels
    alone = members_run(GROUPINGS[0], momentum=momentum)
    for grouping in GROUPINGS[1:]:
        got = members_run(grouping, momentum=momentum)
        assert all(torch.equal(a, b) for a, b in zip(got, alone)), grouping
    plain = plain_batch_norm_run(momentum=momentum)
    for a, b in zip(alone, plain):   # BatchNorm's own update, to float precision
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6), (a, b)
    init = buffers(make_model(momentum))
    assert all(not torch.equal(a, b) for a, b in zip(alone, init))   # they moved (num_batches_tracked: 2 x 8)
    assert [int(b) for b in alone if b.dtype == torch.int64] == [2 * UNITS, 2 * UNITS]


def test_the_members_statistics_merged_by_rank_zeros_rule_would_differ(pinned):  # noqa: F811
    exact.pin_threads({})
    """What the default mode's broadcast of rank 0's buffers gives under this split: not
    the standalone's bits (so the test above is not passing by accident)."""
    model = make_model()
    x, y = data(0)
    for u in GROUPINGS[1][0]:   # rank 0's units of a 3-member split, in BatchNorm's own update
        sl = slice(u * UNIT, (u + 1) * UNIT)
        model(x[sl])
    alone = members_run(GROUPINGS[0], steps=1)
    assert not all(torch.equal(a, b) for a, b in zip(buffers(model), alone))


def test_evaluations_and_a_raising_forward_leave_the_buffers_and_momentum_as_they_were():
    model = make_model()
    bn = BatchNormUnits(model)
    before = buffers(model)
    x, _ = data(0)
    model.eval()
    model(x[:UNIT])
    assert bn.pending == {} and all(torch.equal(a, b) for a, b in zip(buffers(model), before))
    model.train()
    with torch.no_grad():   # gradients off: an evaluation too, left to BatchNorm itself
        model(x[:UNIT])
    assert bn.pending == {}
    with torch.no_grad():
        for b, saved in zip(model.buffers(), before):
            b.copy_(saved)
    model(x[:UNIT])   # a unit's training forward: recorded, BatchNorm's own update undone
    assert sorted(bn.pending) == [0, 1] and all(torch.equal(a, b) for a, b in zip(buffers(model), before))
    mean, var = bn.pending[0]
    h = model[0](x[:UNIT])
    assert torch.allclose(mean, h.mean((0, 2, 3)).double(), atol=1e-5)
    assert torch.allclose(var, h.var((0, 2, 3), unbiased=True).double(), rtol=1e-4)
    with pytest.raises(ValueError, match="BatchNorm layer 0 ran twice in one unit"):
        model(x[:UNIT])
    assert model[1].momentum == 0.1 and model[5].momentum == 0.1
    bn.drop()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        model(torch.zeros(1, 3, 6, 6))   # the second BatchNorm (1d) refuses one sample
    assert model[5].momentum == 0.1 and all(torch.equal(a, b) for a, b in zip(buffers(model), before))


@pytest.mark.parametrize("kw,msg", [
    ({"model": nn.Sequential(nn.Linear(3, 2), nn.SyncBatchNorm(2))}, "with SyncBatchNorm is not supported"),
    ({"model": nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), "unit": 1}, "units of at least 2 samples"),
    ({"model": nn.Sequential(nn.Linear(3, 2), nn.LazyBatchNorm1d())}, "lazy BatchNorm"),
])
def test_what_cannot_be_exact_with_batch_norm_is_refused_at_start_in_one_line(pinned, kw, msg):  # noqa: F811
    with pytest.raises(ValueError, match=msg) as e:
        make_run(exact="bitwise", **kw)
    assert "\n" not in str(e.value)


def test_a_standalone_bitwise_run_with_batch_norm_moves_its_statistics_once_per_unit(pinned):  # noqa: F811
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = ElasticRun(model=model, optimizer=opt, num_samples=32, global_batch_size=8, steps=2, exact="bitwise",
                     unit=2)   # 2 steps of 8 samples: 4 units each
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 3, generator=g), torch.randn(32, 1, generator=g))
    seen = []
    for x, y in run.loader(ds):
        for xb, yb in run.accumulate(x, y):
            run.backward(nn.functional.mse_loss(model(xb), yb))
            seen.append(int(model[1].num_batches_tracked))
        opt.step()
    assert seen == [0, 0, 0, 4, 4, 4, 4, 8]   # moved at the end of each step's last unit, once per unit


def test_the_rows_of_a_step_abandoned_before_its_end_are_not_carried_into_the_next():
    model = make_model()
    bn = BatchNormUnits(model)
    x, _ = data(0)
    model(x[:UNIT])
    bn.take(3, (1, 5))   # generation 1, step 5: a member's first unit, then the step was abandoned
    model(x[UNIT:2 * UNIT])
    bn.take(1, (2, 5))   # step 5 again, in generation 2
    table = bn.pack(UNITS).view(torch.float64).reshape(UNITS, bn.width)
    assert [u for u in range(UNITS) if table[u].any()] == [1]
