"""The calls a training script makes on its run inside a step, besides `backward`: its own
collectives, micro-batches of this rank's share, and registering more state.

They are `ElasticRun`'s public methods (mixed in from here): what a user's step may do
between the runtime's own collectives. A user collective passes the step barrier first
(liveness.py), so a dead peer makes it return False (or this rank's own value) instead of
hanging or crashing the script; the failure is handled at the next boundary like any other.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.membership.liveness import StepBarrier
from gpuflex.elastic.data.micro import Accumulation, global_mean, share
from gpuflex.elastic.data.sampler import Batch
from gpuflex.elastic.state.tree import Registry


class UserCalls:
    """Mixed into ElasticRun, whose attributes below they use."""

    world_size: int
    generation: int
    group: Collectives
    batch: Batch | None
    micro: Accumulation
    registry: Registry
    barrier: StepBarrier | None
    _started: bool
    sharding: Any   # a sharded run's (sharding.py): every rank takes as many micro-batches

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> bool:
        """A user collective that a dead peer cannot crash; False if it failed."""
        if self.world_size == 1:
            return True
        return self._cross_user() and self.group.call(dist.all_reduce, tensor, op=op)

    def accumulate(self, *tensors: torch.Tensor, micro_batch_size: int | None = None,
                   steps: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """Micro-batches (tuples of slices along dim 0) of this rank's share (see micro.py)."""
        return self.micro.split(tensors, self.batch, micro_batch_size=micro_batch_size, steps=steps,
                                lockstep=self.sharding is not None)

    def global_mean(self, value: float | torch.Tensor) -> float:
        """The global batch's mean of this rank's mean (a dead peer: this rank's value)."""
        if not self._cross_user():
            return global_mean(self.group, value, share(self.batch), local_only=True)
        return global_mean(self.group, value, share(self.batch))

    def register(self, name: str, obj: Any) -> Any:
        """`obj` (a dict of the script's scalars, or anything with state_dict/load_state_dict) becomes
        state: checkpointed, carried to newcomers, undone with a failed step. Call before the loop."""
        self.registry.add(f"extra.{name}", obj, new=True, sealed=self._started)
        return obj

    def _cross_user(self) -> bool:
        """The step barrier before a user collective (StepBarrier.cross_user)."""
        return self.barrier is None or self.barrier.cross_user(self.group, self.generation, self.world_size)
