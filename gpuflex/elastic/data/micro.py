"""Micro-batches of a rank's share (gradient accumulation), global-batch means, warm-up.

A step's global batch is split over the ranks; a rank's share may be too large for one
forward, so `run.accumulate` cuts it into micro-batches. The gradient of the global batch's
mean loss is the sum over every micro-batch m of every rank of mean_loss(m) x |m| / |global|:
each micro-batch's backward is weighted so, the gradients accumulate in `.grad`, and only
after the last micro-batch of the rank are they summed over the ranks (the gradient plan is
armed for that backward alone, so its hooks fire once). The split and the weights depend
on neither the world size nor the micro-batch size, so the result is the full-batch mean
gradient up to float summation order.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from gpuflex.elastic import torch_compat
from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.data.exact import unit_seed
from gpuflex.elastic.data.exact_bn import has_batch_norm  # noqa: F401 (micro's importers)
from gpuflex.elastic.data.sampler import Batch, split as even_split, split_by

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Micro:
    """The micro-batch being trained now: its weight in the global batch, and whether it is
    the rank's last one of the step (its backward reduces)."""

    weight: float
    last: bool
    unit: int = 0   # bitwise mode: the unit's place in the step's global batch


def micro_bounds(n: int, micro_batch_size: int | None, steps: int | None) -> list[tuple[int, int]]:
    """[start, end) of each micro-batch of n rows: of `micro_batch_size` rows (the last may
    be smaller), or `steps` parts that differ by at most one row (empty parts left out).
    At least one, possibly empty, so every rank reaches the step's reduce."""
    if (micro_batch_size is None) == (steps is None):
        raise ValueError("give exactly one of micro_batch_size=M or steps=K to run.accumulate, "
                         f"got micro_batch_size={micro_batch_size!r}, steps={steps!r}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if n == 0:
        return [(0, 0)]
    if micro_batch_size is not None:
        return [(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]
    base, extra = divmod(n, steps)
    bounds, start = [], 0
    for k in range(steps):
        end = start + base + (1 if k < extra else 0)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


def lockstep_bounds(batch: Batch, micro_batch_size: int | None, steps: int | None) -> list[tuple[int, int]]:
    """A sharded run's micro-batches: as many on every rank (each forward all-gathers and
    each backward reduce-scatters, collectives every member must join), the count the
    largest share needs; each share cut into that many parts differing by at most one row
    (empty ones kept where a share is smaller than the count). Exact as any cut is."""
    world, total = batch.world_size, batch.global_size
    lengths = [split_by(batch.shares, total, r, world, sum(batch.shares))[1] if batch.shares
               else even_split(total, world, r)[1] for r in range(world)]
    count = max(len(micro_bounds(m, micro_batch_size, steps)) for m in lengths)
    base, extra = divmod(len(batch.indices), count)
    ends = [(k + 1) * base + min(k + 1, extra) for k in range(count)]
    return list(zip([0, *ends[:-1]], ends))


class Accumulation:
    """`run.accumulate`'s state: the micro-batch now being trained, or None outside one."""

    def __init__(self) -> None:
        self.current: Micro | None = None
        self.unit = 0   # bitwise mode (data/exact.py): the micro-batches are units of this many samples
        self.seed = 0   # bitwise mode: the run's seed, of each unit's own RNG stream

    def split(self, tensors: Sequence[torch.Tensor], batch: Batch | None, *,
              micro_batch_size: int | None, steps: int | None,
              lockstep: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
        if not tensors:
            raise ValueError("run.accumulate needs at least one tensor (this rank's share of the batch)")
        n = len(tensors[0])
        if any(len(t) != n for t in tensors):
            raise ValueError(f"run.accumulate: the tensors differ in length along dim 0: "
                             f"{[len(t) for t in tensors]}")
        if batch is not None and n != len(batch.indices):
            raise ValueError(f"run.accumulate: got {n} rows, but this rank's share of step {batch.step} "
                             f"has {len(batch.indices)} samples (pass the batch the loader gave)")
        total = batch.global_size if batch is not None else n
        if self.unit:
            yield from self.units(tensors, batch, micro_batch_size)
            return
        if micro_batch_size is None and steps is None:   # one micro-batch: the whole share
            bounds = [(0, n)]
        elif lockstep and batch is not None and batch.world_size > 1:
            bounds = lockstep_bounds(batch, micro_batch_size, steps)
        else:
            bounds = micro_bounds(n, micro_batch_size, steps)
        try:
            for k, (a, b) in enumerate(bounds):
                self.current = Micro(weight=(b - a) / total if total else 0.0, last=k == len(bounds) - 1)
                yield tuple(t[a:b] for t in tensors)
        finally:
            self.current = None

    def units(self, tensors: Sequence[torch.Tensor], batch: Batch | None,
              micro_batch_size: int | None) -> Iterator[tuple[torch.Tensor, ...]]:
        """Bitwise mode: the share's units, each its own micro-batch (the same shapes on any
        member), each under its own RNG stream seeded by (step, the unit's place in the
        global batch); the RNG outside the units is left as it was."""
        u, n = self.unit, len(tensors[0])
        if micro_batch_size is not None and micro_batch_size < u:
            raise ValueError(f"run.accumulate(micro_batch_size={micro_batch_size}) is below the bitwise unit of "
                             f"{u} samples: pass unit= at most {micro_batch_size} to ElasticRun")
        total = batch.global_size if batch is not None else n
        offset, step = (batch.offset, batch.step) if batch is not None else (0, 0)
        bounds = [(a, min(a + u, n)) for a in range(0, n, u)] or [(0, 0)]   # an epoch's last unit may be short
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            for k, (a, b) in enumerate(bounds):
                self.current = Micro(weight=(b - a) / total if total else 0.0, last=k == len(bounds) - 1,
                                     unit=(offset + a) // u)
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(unit_seed(self.seed, step, (offset + a) // u))
                    yield tuple(t[a:b] for t in tensors)
        finally:
            self.current = None

    def take(self) -> Micro | None:
        """The micro-batch whose backward is being taken (None: a whole share)."""
        return self.current

    def backward_before_last(self, loss: torch.Tensor) -> bool:
        """The backward of a micro-batch before the rank's last one: weighted and only
        accumulated (the gradient plan is not armed, so no hook launches anything). False
        when the caller's backward is to reduce (the last micro-batch, or none)."""
        micro = self.current
        if micro is None or micro.last:
            return False
        (loss * micro.weight).backward()
        return True


def share(batch: Batch | None) -> float:
    """This rank's part of the step's global batch (1 outside a step)."""
    return batch.weight if batch is not None else 1.0


def warm_up_steps(model: torch.nn.Module, warm_up: int | None) -> int:
    """The forward/backward passes a newcomer runs before it says it is ready: as given, else
    1 for a torch.compile'd module (its first pass compiles, which may take a minute), else 0."""
    if warm_up is not None:
        if warm_up < 0:
            raise ValueError(f"warm_up must be >= 0, got {warm_up}")
        return warm_up
    return 1 if torch_compat.is_compiled_module(model) else 0


def global_mean(group: Collectives, value: float | torch.Tensor, weight: float, local_only: bool = False) -> float:
    """The global-batch mean of a per-rank mean `value` whose share is `weight` of the global
    batch: the weighted sum over the members (a rank with no samples, whose mean is nan,
    adds 0). A failed collective (a dead peer) is not this
    helper's to handle, nor does it undo the step (the gradients may already be applied):
    the local value comes back, and the step's own collectives meet the failure."""
    local = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
    if local_only or group.world_size == 1 or group.failure is not None or group.pg is None:
        return local
    vec = torch.tensor([local * weight if weight else 0.0], dtype=torch.float64)   # no samples: nan x 0
    dev = vec.to(group.device) if group.backend == "nccl" else vec
    try:
        dist.all_reduce(dev, group=group.pg)
    except (RuntimeError, ValueError) as e:
        log.warning("gpuflex: global_mean: %s; returning this rank's value", str(e).splitlines()[0][:200])
        return local
    return float(dev.cpu()[0])
