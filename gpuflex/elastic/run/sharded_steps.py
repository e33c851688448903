"""`ShardedSteps`: the step strategy of a sharded run (`ElasticRun(shard=...)`, sharding/),
what it does differently from a data-parallel one (data_steps.py) inside a step. FSDP2
(sharding/) is imported only by a run that shards.

- The optimizer (and a scheduler given as a function of it) is built by the runtime on the
  model's parameters before they are sharded, and kept: the script uses `run.optimizer`.
- Backward weights the loss by the rank's share of the global batch; FSDP's reduce-scatter,
  made a plain sum, adds the shares up: the exact weighted-mean gradient.
- The step barrier is crossed before the step's first forward, ahead of FSDP's all-gathers
  (the data-parallel path crosses it before backward's all-reduce), carrying the step's
  vote when it packs; the boundary then crosses none, and its collectives (a distributed
  checkpoint) are fenced by one of their own (`fence`).
- A failed collective or a dead member ends the run (`ShardsLost`, SHARDS_LOST_EXIT):
  without a copy of the shards a step cannot be undone nor a lost shard restored here; the
  job restarts from its last distributed checkpoint. Where FSDP's own collective fails
  inside the script (a member died mid-step), the same line ends the worker instead of a
  crash record and a traceback.
- A checkpoint is every member's act (each writes its own shards, shard_checkpoints.py):
  one the job's interval makes due is asked for by rank 0 in the next step's vote, so all
  members write it at the same boundary.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from gpuflex.elastic.protocol import keys
from gpuflex.elastic.sharding import checkpoints as shard_checkpoints
from gpuflex.elastic.membership.collectives import backward
from gpuflex.elastic.membership.joining import ShardsLost
from gpuflex.elastic.data.micro import share
from gpuflex.elastic.protocol.logs import describe
from gpuflex.elastic.membership.rendezvous import StoreLost
from gpuflex.elastic.run.context import RunContext
from gpuflex.elastic.run.data_steps import warm_up_backward


def shard_model(model: torch.nn.Module, optimizer: Any, scheduler: Any, shard: Any,
                device: torch.device) -> tuple[Any, Any, Any]:
    """Take the model to shard: its Sharding, and the optimizer and scheduler (built here
    when factories)."""
    from gpuflex.elastic.sharding.sharded_run import Sharding
    sharding = Sharding(model, optimizer, shard, device)
    optimizer = sharding.optimizer
    if callable(scheduler) and not hasattr(scheduler, "state_dict"):
        scheduler = scheduler(optimizer)
    return sharding, optimizer, scheduler


class ShardedSteps:
    """A sharded run's steps over `ctx` (see the module docstring; the strategy's calls are
    DataParallelSteps' too). Its `forward_barrier` becomes the Sharding's `on_forward`."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def backward(self, loss: torch.Tensor) -> None:
        """The loss weighted by this rank's share (FSDP sums the gradients). A rank with an
        empty share (weight 0) still takes part in the collectives."""
        ctx = self.ctx
        batch, micro = ctx.batch, ctx.micro.take()
        if ctx.micro.backward_before_last(loss):   # a micro-batch before the rank's last one
            return
        if ctx.warming_up:
            return warm_up_backward(ctx, loss)
        weight = micro.weight if micro is not None else share(batch)
        backward(loss * weight, ctx.group.backend)
        if batch is not None:
            ctx.split.meter.add(ctx.compute_s(), len(batch.indices))
        ctx.last_loss = loss.detach()

    def prepare(self) -> None:
        """At start-up under gpuflex: a member dying in FSDP's collectives ends this worker
        with one line, not a crash record (`end_on_failed_collective`)."""
        self.end_on_failed_collective()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name: it all-gathers each one, so every member calls it,
        inside the loop (e.g. in the last step, for a report)."""
        return self.ctx.sharding.full_parameters()

    def checkpoint(self, agreed: bool) -> bool:
        """At an agreed boundary, every member: its shards into dcp/step-N, then rank 0 the
        light state naming them, then the DCP directories no light file names removed. Rank
        0 alone with the interval due: asked for in the next step's vote. False: it failed
        (or, off rank 0, nothing to write)."""
        ctx = self.ctx
        state = ctx.state
        if not ctx.checkpoint_dir:
            return False
        if not agreed:
            ctx.signals.request_checkpoint()
            return True
        self.fence()
        name = shard_checkpoints.step_name(state.step)
        from gpuflex.elastic.sharding import fsdp as sharded
        try:
            sharded.write(ctx.model, ctx.optimizer, shard_checkpoints.path_of(ctx.checkpoint_dir, name))
        except (OSError, RuntimeError) as e:   # DCP's CheckpointException is a RuntimeError
            state.checkpoint_failed(f"distributed checkpoint at step {state.step} failed: "
                                    f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
            return False
        if not state.checkpoint(ctx.rank, ctx.world_size, dcp=name):
            return False
        state.dcp_names = [*state.dcp_names[-1:], name]
        shard_checkpoints.prune(ctx.checkpoint_dir, set(state.dcp_names))
        return True

    def vote_rode(self) -> bool:
        """The boundary's vote rode the barrier before this step's first forward."""
        ctx = self.ctx
        return ctx.crossed == (ctx.generation, ctx.state.step, "forward") and ctx.agreement.held

    def vote_rides_barrier(self) -> bool:
        """A sharded step has no gradient all-reduce of ours to carry the boundary's vote:
        unless it carries sample ids, it rides a step barrier (agreement.pack): the one
        before the step's first forward, else the boundary's."""
        ctx = self.ctx
        return ctx.agreement.packs and ctx.barrier is not None and ctx.world_size > 1

    def forward_barrier(self) -> None:
        """Before a sharded step's first forward: the step barrier (a dead member: the end),
        carrying the step's vote, so the boundary needs no barrier of its own (one store
        barrier a step; `fence` guards the collectives a boundary may make)."""
        ctx = self.ctx
        at = (ctx.generation, ctx.state.step, "forward")
        if ctx.warming_up or ctx.batch is None or ctx.crossed == at:
            return
        vote = ctx.agreement.pack() if self.vote_rides_barrier() else None
        if ctx.cross("forward", vote):
            if vote is not None:
                ctx.agreement.carried(ctx.barrier.voted)
            return
        with ctx.guard():
            self.no_undo(ctx.group.take_failure())

    def fence(self) -> None:
        """Before a boundary's collectives (a distributed checkpoint): the step barrier, unless
        the boundary crossed one already. A member still busy after its step (an evaluation
        on rank 0 before the loop comes back) is waited for while it is alive; a dead one
        ends the run."""
        ctx = self.ctx
        if ctx.crossed[-1:] == ("boundary",) or ctx.cross("checkpoint"):
            return
        self.no_undo(ctx.group.take_failure())

    def no_undo(self, why: str | None) -> None:
        """A sharded run cannot undo a step or restore a dead member's shards: it ends (as
        a lost store when that is why: see `store_gone`)."""
        gone = self.store_gone()
        if gone is not None:
            raise gone
        from gpuflex.elastic.sharding.sharded_run import ENDS
        raise ShardsLost(f"a collective of generation {self.ctx.generation} failed ({why}); {ENDS}")

    def store_gone(self) -> StoreLost | None:
        """Whether the job store is gone, asked once (bounded by the store timeout) after a
        collective failed: a member that saw the store die first has exited, which fails the
        others' collectives. Those then end as a lost store too, and the job's record says what
        happened to it (both restart from the last distributed checkpoint)."""
        rdzv = self.ctx.rdzv
        if rdzv is None:
            return None
        try:
            rdzv.has(keys.RUN)
        except StoreLost as e:
            return e
        return None

    def end_on_failed_collective(self) -> None:
        """Chain `sys.excepthook` (outside the crash hook): an exception escaping the script
        from a collective (FSDP's all-gather or reduce-scatter: a member died) ends the
        worker as ShardsLost does, with one line and SHARDS_LOST_EXIT; anything else goes on to the
        crash hook (a bug in the script is reported as a crash)."""
        previous = sys.excepthook

        def hook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
            if not _from_a_collective(value, tb):
                return previous(etype, value, tb)
            with self.ctx.guard():   # exits as ShardsLost (or a lost store) does anywhere else
                self.no_undo(f"in the script: {describe(value)}")

        sys.excepthook = hook


def _from_a_collective(value: BaseException, tb: Any) -> bool:
    """The exception came out of torch.distributed (its innermost Python frame is there)."""
    if isinstance(value, dist.DistError):
        return True
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/") if tb is not None else ""
    return isinstance(value, RuntimeError) and "/torch/distributed/" in name
