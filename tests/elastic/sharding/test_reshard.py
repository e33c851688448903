"""Dim-0 shards moved from one world size to another point to point (gpuflex.elastic.sharding.reshard):
the cut matches torch.chunk (FSDP2's), the plan covers every row once, and real gloo
processes end with exactly the rows a fresh cut at the new size gives, without anyone
holding the whole tensor."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpuflex.elastic.sharding import reshard
from tests.conftest import exits_without_teardown


@pytest.mark.parametrize("n,world", [(7, 3), (3, 3), (2, 4), (0, 2), (10, 1), (9, 4), (1, 5)])
def test_bounds_cut_as_torch_chunk_does(n, world):
    chunks = torch.arange(n).chunk(world) if n else ()
    got = [(a, b) for a, b in reshard.bounds(n, world) if b > a]
    assert got == [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
    assert len(reshard.bounds(n, world)) == world


@pytest.mark.parametrize("n,old,new", [
    (7, [0, 1, 2], [0, 1]),            # shrink 3 -> 2: rank 2 sends before it leaves
    (7, [0, 1], [0, 1, 2, 3]),         # grow 2 -> 4
    (10, [2, 0, 1], [1, 2, 0]),        # same size, ranks reordered
    (5, [0], [0, 1, 2]),               # 1 -> 3
    (3, [0, 1, 2, 3], [3]),            # 4 -> 1, more shards than rows
])
def test_the_plan_gives_every_row_of_every_new_shard_exactly_once(n, old, new):
    moves = reshard.plan(n, old, new)
    old_cut, new_cut = reshard.bounds(n, len(old)), reshard.bounds(n, len(new))
    for r, dst in enumerate(new):
        rows = sorted(i for t in moves if t.dst == dst for i in range(t.start, t.stop))
        assert rows == list(range(*new_cut[r]))
    for t in moves:   # each from the one shard that held those rows
        r = old.index(t.src)
        assert old_cut[r][0] <= t.start < t.stop <= old_cut[r][1]


def test_a_row_nobody_holds_is_named_not_invented():
    with pytest.raises(ValueError, match=r"rows 3\.\.4 of 9 are lost \(old shard 1"):
        reshard.plan(9, [0, None, 2], [0, 1])


@pytest.mark.parametrize("shape", [(11, 3), (11, 4), (11,), (11, 2, 2)],
                         ids=["12-byte rows", "64-bit words", "1-d", "3-d"])
def test_the_checksum_does_not_depend_on_the_cut(shape):
    t = torch.randn(*shape)
    whole = reshard.checksum(t, 0)
    for world in (2, 3, 5):
        parts = sum(reshard.checksum(t[a:b], a) for a, b in reshard.bounds(11, world))
        assert parts % reshard.PRIME == whole
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert reshard.checksum(swapped, 0) != whole    # the rows' places count
    flipped = t.clone()
    flipped.view(-1).view(torch.int32)[7] ^= 1 << 9
    assert reshard.checksum(flipped, 0) != whole    # any changed bit counts
    shifted = torch.cat([torch.zeros(1, *shape[1:]), t])[1:]   # the same rows at an odd offset
    assert reshard.checksum(shifted, 0) == whole


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@exits_without_teardown
def _worker(rank: int, world: int, port: int, cases: list, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, (n, cols, old, new) in cases:
            full = torch.arange(n * cols, dtype=torch.float32).reshape(n, cols) * 0.5 - 3
            shard = None
            if rank in old:
                a, b = reshard.bounds(n, len(old))[old.index(rank)]
                shard = full[a:b].clone()
            del full   # from here on this rank has only its old shard
            got = reshard.move(shard, n, old, new, rank=rank, like=torch.empty(0, cols))
            out[(name, rank)] = None if got is None else got.clone()
    finally:
        dist.destroy_process_group()


def test_real_processes_end_with_a_fresh_cut_at_the_new_size():
    cases = [("grow 2->4", (13, 3, [0, 1], [0, 1, 2, 3])),
             ("shrink 4->3", (13, 3, [0, 1, 2, 3], [1, 2, 3])),
             ("reorder", (9, 2, [3, 2, 1, 0], [0, 1, 2, 3])),
             ("more ranks than rows", (2, 5, [0, 1], [0, 1, 2, 3]))]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(4, _free_port(), cases, out), nprocs=4, join=True)
        results = dict(out)
    for name, (n, cols, old, new) in cases:
        full = torch.arange(n * cols, dtype=torch.float32).reshape(n, cols) * 0.5 - 3
        cut = reshard.bounds(n, len(new))
        for rank in range(4):
            got = results[(name, rank)]
            if rank not in new:
                assert got is None, (name, rank)
                continue
            a, b = cut[new.index(rank)]
            assert torch.equal(got, full[a:b]), (name, rank)


@exits_without_teardown
def _gatherer(rank: int, world: int, port: int, cases: list, out: dict) -> None:
    from gpuflex.elastic.sharding.sharded_run import gather_rows_through_cpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, shape in cases:
            full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) / 7
            a, b = reshard.bounds(shape[0], world)[rank]
            out[(name, rank)] = gather_rows_through_cpu(full[a:b], dist.group.WORLD, shape)
        try:   # a shape the shards do not make is an error, not a wrong tensor
            gather_rows_through_cpu(torch.zeros(2, 3), dist.group.WORLD, (9, 3))
            out[("wrong shape", rank)] = "no error"
        except RuntimeError as e:
            out[("wrong shape", rank)] = str(e)
    finally:
        dist.destroy_process_group()


def test_a_sharded_parameter_gathered_through_cpu_is_whole_in_rank_order():
    """The gather a sharded run's `full_parameters` uses on CUDA over gloo, where the
    DTensor's own all-gather crashed the worker (an H200, torch 2.11): uneven shards,
    empty ones (more ranks than rows) and 1-D parameters, each whole on every rank."""
    cases = [("uneven", (13, 3)), ("empty shards", (2, 5)), ("bias", (5,)), ("one row each", (4, 2))]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gatherer, args=(4, _free_port(), cases, out), nprocs=4, join=True)
        results = dict(out)
    for name, shape in cases:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) / 7
        for rank in range(4):
            assert torch.equal(results[(name, rank)], full), (name, rank)
    assert all("gathered (8, 3) for a tensor of shape (9, 3)" in results[("wrong shape", r)] for r in range(4))
