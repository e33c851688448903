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


@dataclasses.dataclass
class Piece:
    """One tensor to move: this rank's old shard of it (None when it held none), its row
    count n, `like` (the rows' shape and dtype, for a rank without an old shard) and `out`
    (the new shard's storage to receive into, e.g. FSDP's own local tensor; else one is
    allocated)."""

    shard: torch.Tensor | None
    n: int
    like: torch.Tensor | None = None
    out: torch.Tensor | None = None


ROUND = 256   # transfers (counted over the whole plan) posted at once: bounds the requests in flight


def move(shard: torch.Tensor | None, n: int, old: Sequence[int | None], new: Sequence[int], *,
         rank: int, group: dist.ProcessGroup | None = None, like: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor | None:
    """This rank's new shard of one tensor (None when it owns none): `move_all` of one piece."""
    return move_all([Piece(shard, n, like, out)], old, new, rank=rank, group=group)[0]


def move_all(pieces: Sequence[Piece], old: Sequence[int | None], new: Sequence[int], *,
             rank: int, group: dist.ProcessGroup | None = None) -> list[torch.Tensor | None]:
    """Each piece's new shard on this rank (None where it owns none), from the old shards
    held by `old` and the new owners `new`. Every rank of the group calls it with the same
    pieces' n, old and new. The transfers of all pieces are posted together (in rounds of
    ROUND), so the links stay busy while one tensor's rows are still on the way; each
    transfer's tag is its place in the whole plan, the same on both ends."""
    targets: list[torch.Tensor | None] = []
    ops: list[dist.P2POp] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    landed: list[tuple[torch.Tensor, torch.Tensor]] = []   # (target rows, their CPU stage) after the wait
    staged = _stages_through_cpu(group)
    tag = 0
    for piece in pieces:
        shard, n = piece.shard, piece.n
        ref = shard if shard is not None else piece.like
        if ref is None:
            raise ValueError("a rank without an old shard must pass `like` (the rows' shape and dtype)")
        old_start = bounds(n, len(old))[old.index(rank)][0] if rank in old else 0
        mine = [i for i, r in enumerate(new) if r == rank]
        target, new_start = None, 0
        if mine:
            new_start, b = bounds(n, len(new))[mine[0]]
            target = piece.out if piece.out is not None else torch.empty(
                (b - new_start, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
        for t in plan(n, old, new):
            if t.src == rank and t.dst == rank:
                copies.append((target[t.start - new_start:t.stop - new_start],
                               shard[t.start - old_start:t.stop - old_start]))
            elif t.src == rank:
                rows = shard[t.start - old_start:t.stop - old_start]
                ops.append(dist.P2POp(dist.isend, rows.cpu() if staged and rows.is_cuda else rows.contiguous(),
                                      t.dst, group=group, tag=tag))
            elif t.dst == rank:
                rows = target[t.start - new_start:t.stop - new_start]
                if staged and rows.is_cuda:
                    landed.append((rows, torch.empty(rows.shape, dtype=rows.dtype)))
                    rows = landed[-1][1]
                ops.append(dist.P2POp(dist.irecv, rows, t.src, group=group, tag=tag))
            tag += 1
            if tag % ROUND == 0:
                _post(ops, copies, landed)
        targets.append(target)
    _post(ops, copies, landed)
    return targets


def _stages_through_cpu(group: dist.ProcessGroup | None) -> bool:
    """gloo's point-to-point takes CPU tensors only: GPU rows travel through CPU memory
    (several workers sharing one GPU run gloo: GPUFLEX_BACKEND, collectives.pick_backend)."""
    return dist.is_initialized() and dist.get_backend(group) == "gloo"


def _post(ops: list[dist.P2POp], copies: list[tuple[torch.Tensor, torch.Tensor]],
          landed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Post the ops, make the local copies while they are on the way, wait for them all,
    move the rows that landed in CPU stages to their place, and empty the lists."""
    works = dist.batch_isend_irecv(ops) if ops else []
    for dst, src in copies:
        dst.copy_(src)
    for work in works:
        work.wait()
    for dst, stage in landed:
        dst.copy_(stage)
    ops.clear()
    copies.clear()
    landed.clear()


def checksum(rows: torch.Tensor, start: int) -> int:
    """Σ over the rows of (row sum mod P) x (global row index mod P + 1), mod P, for the rows
    of a tensor that start at row `start`: equal sums over any cut of the same rows. A row's
    sum adds its bytes up as 64-bit words (wrapping: exact in any order, and one vectorised
    pass, ~40 GB/s on one CPU core), so any changed bit changes it; the row weights catch a
    row in the wrong place. Rows whose size is not a multiple of 8 bytes add up their
    elements' bits instead (slower, same guarantee)."""
    if rows.numel() == 0:
        return 0
    n = rows.shape[0] if rows.dim() else 1
    flat = rows.detach().contiguous().view(n, -1)
    try:
        per_row = flat.view(torch.int64).sum(dim=1)
    except RuntimeError:   # rows of a size or at an offset that 64-bit words do not fit
        per_row = flat.view(_int_of(flat.dtype)).to(torch.int64).sum(dim=1)
    index = torch.arange(start, start + n, dtype=torch.int64, device=per_row.device)   # a GPU shard's too
    return int(((per_row % PRIME) * (index % PRIME + 1) % PRIME).sum() % PRIME)


def _int_of(dtype: torch.dtype) -> torch.dtype:
    size = torch.empty((), dtype=dtype).element_size()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
