"""gpuflex.elastic.torch_compat, the one module that names torch's private fields: each
wrapper does its job on this torch, and fails loudly (a RuntimeError naming the field and the
torch version) where the field is taken away, as a torch release that moved it would."""

from __future__ import annotations

import importlib
import multiprocessing
import re
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from gpuflex.elastic import torch_compat


def loud(field: str):
    """pytest.raises for the loud failure naming `field` and this torch's version."""
    return pytest.raises(RuntimeError, match=rf"(?s){re.escape(field)}.*torch {re.escape(torch.__version__)}")


def test_foreach_copy_copies_each_tensor_and_fails_loudly_without_the_field(monkeypatch):
    src = [torch.arange(3.0), torch.tensor([7, 8], dtype=torch.int64)]
    dst = [torch.zeros(3), torch.zeros(2, dtype=torch.int64)]
    torch_compat.foreach_copy_(dst, src)
    assert [d.tolist() for d in dst] == [[0.0, 1.0, 2.0], [7, 8]]
    monkeypatch.delattr(torch, "_foreach_copy_")
    with loud("torch._foreach_copy_"):
        torch_compat.foreach_copy_(dst, src)


def test_foreach_scale_round_scales_and_rounds_each_tensor_and_fails_loudly_without_the_fields(monkeypatch):
    ts = [torch.tensor([0.25, -1.25, 3.0]), torch.tensor([[0.75]], dtype=torch.bfloat16)]
    torch_compat.foreach_scale_round_(ts, 2.0)
    assert [t.tolist() for t in ts] == [[0.0, -2.0, 6.0], [[2.0]]]   # halves to even
    for field in ("_foreach_round_", "_foreach_mul_"):
        monkeypatch.delattr(torch, field)
        with loud(f"torch.{field}"):
            torch_compat.foreach_scale_round_(ts, 2.0)


def _net_and_loss() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    return net, net(torch.randn(5, 4)).square().mean()


def test_run_backward_without_context_gives_backwards_gradients_and_fails_loudly_without_the_engine(monkeypatch):
    ref, loss = _net_and_loss()
    loss.backward()
    net, loss = _net_and_loss()
    torch_compat.run_backward_without_context(loss)
    assert [p.grad.tolist() for p in net.parameters()] == [p.grad.tolist() for p in ref.parameters()]
    monkeypatch.delattr(torch.autograd.Variable, "_execution_engine")
    _, loss = _net_and_loss()
    with loud("torch.autograd.Variable._execution_engine"):
        torch_compat.run_backward_without_context(loss)


def test_reset_group_counter_names_the_next_group_0_and_fails_loudly_without_the_counter(monkeypatch):
    world = dist.distributed_c10d._world
    monkeypatch.setattr(world, "group_count", 3)
    torch_compat.reset_group_counter()
    assert world.group_count == 0
    monkeypatch.delattr(dist.distributed_c10d, "_world")
    with loud("torch.distributed.distributed_c10d._world"):
        torch_compat.reset_group_counter()


def test_is_batch_norm_knows_every_batch_norm_and_fails_loudly_without_their_base(monkeypatch):
    norms = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm1d()]
    assert all(torch_compat.is_batch_norm(m) for m in norms)
    assert not any(torch_compat.is_batch_norm(m) for m in (nn.Linear(2, 2), nn.LayerNorm(2), nn.GroupNorm(1, 2)))
    monkeypatch.delattr(torch.nn.modules.batchnorm, "_BatchNorm")
    with loud("torch.nn.modules.batchnorm._BatchNorm"):
        torch_compat.is_batch_norm(nn.BatchNorm1d(2))


def test_is_compiled_module_knows_torch_compile_s_module_and_fails_loudly_without_its_class(monkeypatch):
    torch_compat.preload_dynamo()
    assert "torch._dynamo" in sys.modules
    plain = nn.Linear(2, 2)
    assert torch_compat.is_compiled_module(torch.compile(plain))   # nothing is compiled before a call
    assert not torch_compat.is_compiled_module(plain)
    monkeypatch.delattr(sys.modules["torch._dynamo"].eval_frame, "OptimizedModule")
    with loud("torch._dynamo.eval_frame.OptimizedModule"):
        torch_compat.is_compiled_module(plain)
    monkeypatch.delitem(sys.modules, "torch._dynamo")   # a process that never loaded it compiled nothing
    assert not torch_compat.is_compiled_module(plain)


def test_preload_dynamo_fails_loudly_where_torch_has_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch._dynamo", None)   # `import` then raises ImportError
    with loud("torch._dynamo"):
        torch_compat.preload_dynamo()


@pytest.mark.e2e   # DataLoader worker processes
def test_loader_shutdown_ends_the_workers_and_fails_loudly_on_an_iterator_without_it():
    before = set(multiprocessing.active_children())
    it = iter(DataLoader(list(range(64)), batch_size=4, num_workers=1))
    assert next(it).tolist() == [0, 1, 2, 3]
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 1
    torch_compat.loader_shutdown(it)()
    assert not [p for p in workers if p.is_alive()]
    with loud("DataLoader iterator's _shutdown_workers"):
        torch_compat.loader_shutdown(iter(range(3)))


@pytest.fixture
def one_rank():
    """A one-rank gloo group and its mesh, in this process."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    model(torch.randn(3, 4)).sum().backward()
    return model


def test_undo_fully_shard_leaves_full_shape_meta_parameters_that_shard_again(one_rank):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = _sharded(one_rank)
    torch_compat.undo_fully_shard(model)
    assert not [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert {n: (tuple(p.shape), p.device.type) for n, p in model.named_parameters()} == {
        "0.weight": ((6, 4), "meta"), "0.bias": ((6,), "meta"), "2.weight": ((2, 6), "meta"), "2.bias": ((2,), "meta")}
    for m in (model[0], model[2], model):   # fully_shard again, as a resize does
        fully_shard(m, mesh=one_rank)
    model.to_empty(device="cpu")
    assert model(torch.randn(3, 4)).shape == (3, 2)


@pytest.mark.parametrize("owner, field, named", [
    ("torch.distributed._composable_state", "_module_state_mapping",
     "torch.distributed._composable_state._module_state_mapping"),
    ("torch.distributed._composable.contract", "STATE_KEY", "torch.distributed._composable.contract.STATE_KEY"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState", "_fsdp_param_group", "FSDPState._fsdp_param_group"),
])
def test_undo_fully_shard_fails_loudly_without_a_field_and_leaves_the_model_sharded(one_rank, monkeypatch,
                                                                                  owner, field, named):
    from torch.distributed.fsdp import FSDPModule

    model = _sharded(one_rank)
    module, _, cls = owner.partition(":")   # by import: contract's package exports a function of its name
    where = importlib.import_module(module)
    monkeypatch.delattr(getattr(where, cls) if cls else where, field)
    with loud(named):
        torch_compat.undo_fully_shard(model)
    assert all(isinstance(m, FSDPModule) for m in (model[0], model[2], model))
    assert all(p.device.type == "cpu" for p in model.parameters())
