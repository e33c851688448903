"""The calls a training script makes on its run inside a step, besides `backward`: its own
collectives, micro-batches of this rank's share, and registering more state.

`ElasticRun`'s methods of these names are a `UserCalls`' over the run's context
(context.py): what a user's step may do between the runtime's own collectives. A user
collective passes the step barrier first (membership/liveness.py), so a dead peer makes it
return False (or this rank's own value) instead of hanging or crashing the script; the
failure is handled at the next boundary like any other.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

from gpuflex.elastic.data.micro import global_mean, share
from gpuflex.elastic.run.context import RunContext


class UserCalls:
    """The script's calls inside a step, over `ctx`; ElasticRun's methods of the same names."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> bool:
        """A user collective that a dead peer cannot crash; False if it failed."""
        ctx = self.ctx
        if ctx.world_size == 1:
            return True
        return self.cross_user() and ctx.group.call(dist.all_reduce, tensor, op=op)

    def accumulate(self, *tensors: torch.Tensor, micro_batch_size: int | None = None,
                   steps: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """Micro-batches (tuples of slices along dim 0) of this rank's share (see micro.py).
        In a sharded run every rank takes as many micro-batches (FSDP's collectives)."""
        ctx = self.ctx
        return ctx.micro.split(tensors, ctx.batch, micro_batch_size=micro_batch_size, steps=steps,
                               lockstep=ctx.sharding is not None)

    def global_mean(self, value: float | torch.Tensor) -> float:
        """The global batch's mean of this rank's mean (a dead peer: this rank's value)."""
        ctx = self.ctx
        if not self.cross_user():
            return global_mean(ctx.group, value, share(ctx.batch), local_only=True)
        return global_mean(ctx.group, value, share(ctx.batch))

    def register(self, name: str, obj: Any) -> Any:
        """`obj` (a dict of the script's scalars, or anything with state_dict/load_state_dict) becomes
        state: checkpointed, carried to newcomers, undone with a failed step. Call before the loop."""
        self.ctx.registry.add(f"extra.{name}", obj, new=True, sealed=self.ctx.started)
        return obj

    def cross_user(self) -> bool:
        """The step barrier before a user collective (StepBarrier.cross_user)."""
        ctx = self.ctx
        return ctx.barrier is None or ctx.barrier.cross_user(ctx.group, ctx.generation, ctx.world_size)
