"""Moving dim-0 shards from one world size to another, point to point (issue 13's base).

FSDP2 (`fully_shard`) cuts each parameter, and with it each optimizer state tensor, on
dim 0 the way `torch.chunk` does: shard r of W holds rows [r*c, min((r+1)*c, n)) with
c = ceil(n / W); the last shards may hold fewer rows or none. When a job changes size in
place, every survivor keeps its process and its old shard, and each new owner needs a row
range that overlaps a few old shards. `plan` lists those overlaps; `move` carries them out
with point-to-point sends over a group that holds both the old holders and the new owners
(a shrink's leavers send before they go), receiving straight into the new shard. No rank
ever holds more than its old shard and its new one: nobody gathers a full tensor, and a
newcomer receives only its own rows.

`checksum` is a position-weighted integer hash of a tensor's rows that does not depend on
how the rows are cut or in which order the pieces are added: the sum over the holders of
the old shards must equal the sum over the owners of the new ones, exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

PRIME = (1 << 31) - 1   # a prime: every product of two residues fits in int64


def bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Each of `world` shards' rows [start, stop) of an n-row tensor, as torch.chunk cuts
    them (and FSDP2 with it): ceil(n/world) rows each, the last ones shorter or empty."""
    if world < 1 or n < 0:
        raise ValueError(f"cannot cut {n} rows into {world} shards")
    size = -(-n // world) if n else 0
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Rows [start, stop) (of the whole tensor) go from group rank `src` to `dst`."""

    src: int
    dst: int
    start: int
    stop: int


def plan(n: int, old: Sequence[int | None], new: Sequence[int]) -> list[Transfer]:
    """The transfers that turn the shards held by `old` (old shard r is held by group rank
    old[r]; None: nobody has it any more) into the shards owned by `new` (new shard r goes
    to group rank new[r]). ValueError when a row that someone needs is held by nobody:
    the caller recovers it another way (a buddy copy, a checkpoint)."""
    moves = []
    for (a, b), dst in zip(bounds(n, len(new)), new):
        for r, ((s, e), src) in enumerate(zip(bounds(n, len(old)), old)):
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue
            if src is None:
                raise ValueError(f"rows {lo}..{hi - 1} of {n} are lost (old shard {r} has no holder)")
            moves.append(Transfer(src, dst, lo, hi))
    return moves


def move(shard: torch.Tensor | None, n: int, old: Sequence[int | None], new: Sequence[int], *,
         rank: int, group: dist.ProcessGroup | None = None, like: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor | None:
    """This rank's new shard (None when it owns none), from its old `shard` (None when it
    held none) and its peers'. `like` gives the rows' shape and dtype to a rank without an
    old shard (e.g. the meta parameter); `out` may be the new shard's storage to receive
    into (FSDP's own local tensor), else one is allocated. Every rank of the group calls
    this with the same n, old and new."""
    ref = shard if shard is not None else like
    if ref is None:
        raise ValueError("a rank without an old shard must pass `like` (the rows' shape and dtype)")
    old_start = bounds(n, len(old))[old.index(rank)][0] if rank in old else 0
    mine = [i for i, r in enumerate(new) if r == rank]
    if not mine:
        target = None
    else:
        a, b = bounds(n, len(new))[mine[0]]
        target = out if out is not None else torch.empty((b - a, *ref.shape[1:]), dtype=ref.dtype,
                                                         device=ref.device)
        new_start = a
    ops = []
    for t in plan(n, old, new):
        if t.src == rank and t.dst == rank:
            target[t.start - new_start:t.stop - new_start].copy_(shard[t.start - old_start:t.stop - old_start])
        elif t.src == rank:
            ops.append(dist.P2POp(dist.isend, shard[t.start - old_start:t.stop - old_start].contiguous(), t.dst,
                                  group=group, tag=t.start))
        elif t.dst == rank:
            ops.append(dist.P2POp(dist.irecv, target[t.start - new_start:t.stop - new_start], t.src,
                                  group=group, tag=t.start))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return target


def checksum(rows: torch.Tensor, start: int) -> int:
    """Σ over the elements of (bits mod P) x (global element index mod P + 1), mod P, for the
    rows of a tensor that start at row `start`: equal sums over any cut of the same rows."""
    if rows.numel() == 0:
        return 0
    flat = rows.detach().contiguous().view(-1)
    bits = flat.view(_int_of(flat.dtype)).to(torch.int64) % PRIME
    per_row = flat.numel() // rows.shape[0] if rows.dim() else 1
    index = torch.arange(flat.numel(), dtype=torch.int64) + start * per_row
    return int(((bits * (index % PRIME + 1)) % PRIME).sum() % PRIME)


def _int_of(dtype: torch.dtype) -> torch.dtype:
    size = torch.empty((), dtype=dtype).element_size()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
