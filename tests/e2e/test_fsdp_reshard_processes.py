"""FSDP2 state resharded in place (gpuflex.elastic.sharding.fsdp) across 1 -> 3 -> 2 -> 4 real gloo
processes: the final parameters equal an unsharded single-process run of the same global
batches, a newcomer receives only its own rows, and a corrupted move is refused by the
checksum instead of being trained on."""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gpuflex.elastic.sharding import pages, reshard, fsdp as sharded
from gpuflex.elastic.membership.collectives import backward
from tests import REPO as ROOT
from tests.conftest import exits_without_teardown

pytestmark = pytest.mark.e2e   # members as processes (mp.spawn)

GLOBAL_BATCH = 12
PHASES = [[0], [0, 1, 2], [0, 2], [0, 1, 2, 3]]   # members; 1 leaves at phase 2, comes back new
STEPS_PER_PHASE = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(10, 7), nn.LayerNorm(7)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 10), Block(), nn.Linear(7, 5))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def train_step(model, optimizer, step: int, pos: int, world: int) -> None:
    x, y = batch(step)
    a, b = reshard.bounds(GLOBAL_BATCH, world)[pos]
    # FSDP averages gradients over the mesh: a sum over the global batch, times world
    loss = ((model(x[a:b]) - y[a:b]) ** 2).sum() * world / GLOBAL_BATCH
    backward(loss, "gloo")   # torch 2.13's gloo exit race otherwise aborts a process now and then (collectives.py)
    optimizer.step()
    optimizer.zero_grad()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@exits_without_teardown
def _worker(rank: int, port: int, corrupt: bool, out: dict) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3 if corrupt else 4, rank == 0, timeout=dt.timedelta(seconds=60))
    model, optimizer = None, None
    phases = PHASES[:2] if corrupt else PHASES   # the corrupted move is the first one
    for k, members in enumerate(phases):
        prev = PHASES[k - 1] if k else []
        union = sorted(set(prev) | set(members))
        if rank not in union:
            continue
        held = None
        if model is not None and rank in prev:
            held = sharded.hold(model, optimizer, prev.index(rank), len(prev))
            if corrupt and rank == 0:
                held.params[0][0, 0] += 1.0      # a bit flipped on the way
            dist.destroy_process_group()
        elif model is None:
            with torch.device("meta"):
                model = build()
            optimizer = None
        dist.init_process_group("gloo", store=dist.PrefixStore(f"phase{k}", store), rank=union.index(rank),
                                world_size=len(union), timeout=dt.timedelta(seconds=60))
        mesh = DeviceMesh("cpu", [union.index(m) for m in members])
        me = union.index(rank)
        if k == 0:
            sharded.apply(model := build(), Block, mesh)
            optimizer = make_optimizer(list(model.parameters()))
        else:
            try:
                optimizer, stats = sharded.reshard_in_place(
                    model, optimizer, make_optimizer, held, old=[union.index(m) for m in prev],
                    new=[union.index(m) for m in members], rank=me, mesh=mesh, shard=Block)
            except RuntimeError as e:
                out[("error", rank)] = str(e)
                dist.destroy_process_group()
                return
            out[(k, rank)] = (stats.sent_rows, stats.received_rows, stats.held_bytes, stats.new_bytes)
        if rank not in members:   # a leaver: it sent its shards; it may come back as a newcomer
            dist.destroy_process_group()
            model = optimizer = None
            continue
        for step in range(k * STEPS_PER_PHASE, (k + 1) * STEPS_PER_PHASE):
            train_step(model, optimizer, step, members.index(rank), len(members))
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        out["params"] = full
    dist.destroy_process_group()


def _run(corrupt: bool) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), corrupt, out), nprocs=3 if corrupt else 4, join=True)
        return dict(out)


def test_resharded_in_place_1_3_2_4_the_run_equals_an_unsharded_one():
    out = _run(corrupt=False)
    ref, opt = build(), None
    opt = make_optimizer(list(ref.parameters()))
    for step in range(len(PHASES) * STEPS_PER_PHASE):
        train_step(ref, opt, step, 0, 1)
    for name, p in ref.named_parameters():
        # the only difference is the order of the gradient sum over ranks: float32 rounding
        torch.testing.assert_close(out["params"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    # rank 3 joins at the last phase: it receives its own rows and nothing else
    sent, received, held_bytes, new_bytes = out[(3, 3)]
    rows = sum(b - a for n in (p.shape[0] for p in ref.parameters())
               for a, b in [reshard.bounds(n, 4)[3]])
    assert (sent, held_bytes) == (0, 0)
    assert received == rows * 3    # the parameter and AdamW's two moments
    # a survivor kept only shards: its old ones plus its new ones, never a whole tensor
    total = sum(p.numel() * p.element_size() for p in ref.parameters()) * 3
    assert 0 < out[(1, 0)][2] + out[(1, 0)][3] < total * 1.5


def test_a_corrupted_move_fails_the_checksum_on_every_rank():
    out = _run(corrupt=True)
    errors = {k[1]: v for k, v in out.items() if isinstance(k, tuple) and k[0] == "error"}
    assert sorted(errors) == [0, 1, 2]
    assert all("does not match the old shards" in e for e in errors.values())
    assert "params" not in out


@exits_without_teardown
def _dcp_worker(rank: int, port: int, directory: str, out: dict) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=dt.timedelta(seconds=60))
    for k, world in enumerate((3, 2)):   # written by 3 processes, resumed by 2 new ones
        if rank >= world:
            return
        dist.init_process_group("gloo", store=dist.PrefixStore(f"dcp{k}", store), rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=60))
        with torch.device("meta"):
            model = build()
        sharded.apply(model, Block, DeviceMesh("cpu", list(range(world))))
        model.to_empty(device="cpu")
        if k == 0:
            for name, p in build().named_parameters():   # the initial weights, each rank its rows
                a, b = reshard.bounds(p.shape[0], world)[rank]
                sharded.local(dict(model.named_parameters())[name]).data.copy_(p.detach()[a:b])
        optimizer = make_optimizer(list(model.parameters()))
        if k == 1:
            sharded.load(model, optimizer, directory)
        for step in range(k * 3, (k + 1) * 3):
            train_step(model, optimizer, step, rank, world)
        if k == 0:
            sharded.save(model, optimizer, directory)
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        if rank == 0 and k == 1:
            out["params"] = full
        dist.destroy_process_group()


def test_a_distributed_checkpoint_written_by_3_resumes_on_2_exactly(tmp_path):
    directory = str(tmp_path / "ckpt")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_dcp_worker, args=(_free_port(), directory, out), nprocs=3, join=True)
        params = dict(out)["params"]
    ref = build()
    opt = make_optimizer(list(ref.parameters()))
    for step in range(6):
        train_step(ref, opt, step, 0, 1)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]   # no .tmp or .old left


_FAULTS = r"""
import resource, sys, torch
from gpuflex.elastic.sharding import pages
reserved = pages.reserve(int(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
shards = [torch.empty(1 << 20) for _ in range(16)]   # 64 MB of new shards, as to_empty makes them
for s in shards:
    s.fill_(1.0)                                      # the move writes every page
print(reserved, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_filling_64mb(reserve: int) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS, str(reserve)], capture_output=True, text=True,
                         check=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.split()
    return int(out[0]), int(out[1])


def test_a_newcomer_s_reserved_memory_is_filled_without_page_faults():
    """pages.reserve touches heap memory and frees it into glibc's heap: 64 MB of new shards
    then land on pages already mapped. Without it, each 4 KB page faults as it is first
    written (16,384 pages); with it, few do (~1,000 here: 1/16; ru_minflt of a fresh process)."""
    if pages._glibc() is None:
        pytest.skip("not glibc: pages.reserve does nothing here")
    none, cold = _faults_filling_64mb(0)
    reserved, warm = _faults_filling_64mb(64 << 20)
    assert none == 0 and reserved == (16 + pages.MARGIN) * pages.BLOCK
    assert cold >= 16384 * 0.9, cold            # every page of the 64 MB, first written
    assert warm <= 16384 / 8, (cold, warm)      # mapped already
