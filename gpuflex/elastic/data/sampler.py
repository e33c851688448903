"""The elastic sampler: a fixed global batch split over whatever workers there are now.

Global batch k of epoch e is `perm_e[k*B:(k+1)*B]` where `perm_e` is a permutation drawn
from `seed + e` alone, so which samples form a step never depends on the world size;
only the split over ranks does: even, or by the shares of the split plan (split_plan.py:
contiguous, in rank order; an epoch's shorter last batch is split in proportion to them). The last batch of an epoch may be smaller: nothing is
dropped and nothing is padded, so every sample of an epoch is processed exactly once.
"""

from __future__ import annotations

import dataclasses

import torch

from gpuflex.elastic.data.shares import rescale


@dataclasses.dataclass(frozen=True)
class Batch:
    """One rank's share of one global batch.

    `indices`: the sample ids this rank processes. `global_size`: samples in the whole
    global batch. Weight a per-sample *sum* by 1/global_size (or a local mean by
    `weight`) and sum the gradients over ranks: the result is exactly the full-batch mean.
    """

    epoch: int
    step: int            # global step, counted across epochs
    step_in_epoch: int
    indices: torch.Tensor
    global_size: int
    offset: int          # where this rank's share starts inside the global batch
    rank: int
    world_size: int
    shares: tuple[int, ...] | None = None   # the plan's shares of a full global batch (None: even)

    @property
    def weight(self) -> float:
        return len(self.indices) / self.global_size if self.global_size else 0.0

    @property
    def slice(self) -> slice:
        """This rank's part of a tensor built for the whole global batch."""
        return slice(self.offset, self.offset + len(self.indices))


def split(total: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, length) of rank's contiguous share; shares differ by at most one."""
    base, extra = divmod(total, world)
    length = base + (1 if rank < extra else 0)
    offset = rank * base + min(rank, extra)
    return offset, length


def split_by(shares: tuple[int, ...], total: int, rank: int, world: int, full: int) -> tuple[int, int]:
    """(offset, length) of rank's share of a global batch of `total` samples under a plan's
    `shares` of a full one (`full` samples)."""
    if len(shares) != world or sum(shares) != full or min(shares) < 0:
        raise ValueError(f"shares {shares} do not split {full} samples over {world} ranks")
    cut = rescale(shares, total)
    return sum(cut[:rank]), cut[rank]


def split_units(shares: tuple[int, ...], total: int, rank: int, world: int, unit: int) -> tuple[int, int]:
    """(offset, length) of rank's share of a global batch of `total` samples cut into units of
    `unit` (the last one short where `unit` does not divide `total`), under a plan's `shares`
    (whole units of a full batch): the plan's units rescaled to this batch's, in units."""
    if len(shares) != world or min(shares) < 0 or any(n % unit for n in shares):
        raise ValueError(f"shares {shares} are not whole units of {unit} over {world} ranks")
    cut = rescale([n // unit for n in shares], -(-total // unit))
    start = sum(cut[:rank]) * unit
    return min(start, total), max(0, min(start + cut[rank] * unit, total) - start)


class ElasticSampler:
    """Global batches of `num_samples` samples, for `epochs` epochs or, in step mode, for
    `steps` global steps (exactly one of the two): a step count crosses epochs as needed,
    the last one partial."""

    def __init__(self, num_samples: int, global_batch_size: int, *, epochs: int | None = None,
                 steps: int | None = None, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs=E (whole epochs) or steps=S (global steps), "
                             f"got epochs={epochs!r}, steps={steps!r}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        spe = -(-num_samples // global_batch_size)
        self.total_steps = spe * epochs if epochs is not None else steps
        self.epochs = -(-self.total_steps // spe)   # the epochs begun, the last one maybe partial
        self.seed = seed
        self.unit = 1   # bitwise mode (data/exact.py): shares are cut at unit boundaries
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch_size)

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, step: int) -> tuple[int, int, torch.Tensor]:
        """(epoch, step_in_epoch, sample ids) of global step `step`."""
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = self.permutation(epoch)
        return epoch, k, perm[k * self.global_batch_size:(k + 1) * self.global_batch_size]

    def batch(self, step: int, rank: int, world: int, shares: tuple[int, ...] | None = None) -> Batch:
        """Rank's share of step `step`: even, or by `shares` (one per rank, summing to the
        global batch size)."""
        epoch, k, ids = self.global_batch(step)
        if shares is None:
            offset, length = split(len(ids), world, rank)
        elif self.unit > 1:   # bitwise mode: whole units; an epoch's last batch may end in a short one
            offset, length = split_units(shares, len(ids), rank, world, self.unit)
        else:
            offset, length = split_by(shares, len(ids), rank, world, self.global_batch_size)
        return Batch(epoch=epoch, step=step, step_in_epoch=k, indices=ids[offset:offset + length],
                     global_size=len(ids), offset=offset, rank=rank, world_size=world, shares=shares)
