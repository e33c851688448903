"""gpuflex.elastic.sharding.fsdp without a process group: which modules `shard=` names, in
the order FSDP2 must wrap them, and what a survivor holds of its old shards (the reshard
across real processes: tests/e2e/test_fsdp_reshard_processes.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpuflex.elastic.sharding import fsdp, reshard


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.lin(x))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(4, 2))


def test_targets_are_children_before_parents_and_the_root_last():
    m = model()
    by_type = fsdp.targets(m, Block)
    assert by_type == [m[1], m[0], m]
    assert fsdp.targets(m, (Block, nn.Linear))[-1] is m
    assert set(map(id, fsdp.targets(m, (Block, nn.Linear))[:-1])) == \
        {id(x) for x in (m[0], m[1], m[0].lin, m[1].lin, m[2])}
    assert fsdp.targets(m, lambda root: [root[2], root]) == [m[2], m]
    assert fsdp.targets(m, None) == [m]


def test_a_shard_spec_naming_a_foreign_module_is_refused():
    with pytest.raises(ValueError, match="not part of the model: Linear"):
        fsdp.targets(model(), lambda root: [nn.Linear(1, 1)])


def test_a_survivor_holds_its_shards_state_and_buffers_with_their_checksum():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(8, 4)).sum().backward()
    opt.step()
    held = fsdp.hold(m, opt, old_rank=0, old_world=1)
    params = list(m.parameters())
    assert held.rows == [p.shape[0] for p in params]
    assert all(torch.equal(a, b) for a, b in zip(held.params, params))
    assert [sorted(s) for s in held.states] == [["momentum_buffer"]] * len(params)
    assert held.nbytes == 2 * sum(p.numel() * p.element_size() for p in params)
    assert set(held.buffers) == {n for n, _ in m.named_buffers()}
    assert 0 <= held.checksum < reshard.PRIME
    m[0].lin.weight.data[0, 0] += 1   # the checksum covers the values
    assert fsdp.hold(m, opt, 0, 1).checksum != held.checksum


def test_param_slots_say_where_each_parameter_sits_in_the_optimizer():
    m = model()
    params = list(m.parameters())
    opt = torch.optim.SGD([{"params": params[4:]}, {"params": params[:4]}], lr=0.1)
    assert fsdp.param_slots(m, opt)[:5] == [(1, 0), (1, 1), (1, 2), (1, 3), (0, 0)]


def test_the_peak_is_the_old_and_the_new_shards_together():
    assert fsdp.Stats(held_bytes=100, new_bytes=60, sent_rows=2, received_rows=3).peak_extra_bytes == 160
