"""What a sharded run (`ElasticRun(shard=...)`, sharding.py) does differently inside a step.
Mixed into ElasticRun, whose attributes it uses; sharding.py (FSDP2) is imported only by a
run that shards.

- The optimizer (and a scheduler given as a function of it) is built by the runtime on the
  model's parameters before they are sharded, and kept: the script uses `run.optimizer`.
- Backward weights the loss by the rank's share of the global batch; FSDP's reduce-scatter,
  made a plain sum, adds the shares up: the exact weighted-mean gradient.
- The step barrier is crossed before the step's first forward, ahead of FSDP's all-gathers
  (the data-parallel path crosses it before backward's all-reduce), carrying the step's
  vote when it packs; the boundary then crosses none, and its collectives (a distributed
  checkpoint) are fenced by one of their own (`_fence`).
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

import logging
import os
import sys
import time
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

log = logging.getLogger(__name__)


class ShardedSteps:
    """Mixed into ElasticRun (runtime.py)."""

    def _shard(self: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any, shard: Any) -> tuple[Any, Any]:
        """Take the model to shard; the optimizer and scheduler (built here when factories)."""
        from gpuflex.elastic.sharding.sharded_run import Sharding
        self.sharding = Sharding(model, optimizer, shard, self.device)
        self.sharding.on_forward = self._forward_barrier
        optimizer = self.sharding.optimizer
        if callable(scheduler) and not hasattr(scheduler, "state_dict"):
            scheduler = scheduler(optimizer)
        return optimizer, scheduler

    def full_parameters(self: Any) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name. In a sharded run it all-gathers each one: every
        member calls it, inside the loop (e.g. in the last step, for a report)."""
        if self.sharding is None:
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}
        return self.sharding.full_parameters()

    def _backward_sharded(self: Any, loss: torch.Tensor, batch: Any, micro: Any) -> None:
        """A sharded run's backward: the loss weighted by its share (FSDP sums the gradients).
        A rank with an empty share (weight 0) still takes part in the collectives."""
        weight = micro.weight if micro is not None else share(batch)
        backward(loss * weight, self.backend)
        if batch is not None:
            self.split.meter.add(time.perf_counter() - self._t_step - self._waited, len(batch.indices))
        self._last_loss = loss.detach()

    def _checkpoint_shards(self: Any, agreed: bool) -> bool:
        """At an agreed boundary, every member: its shards into dcp/step-N, then rank 0 the
        light state naming them, then the DCP directories no light file names removed. Rank
        0 alone with the interval due: asked for in the next step's vote. False: it failed
        (or, off rank 0, nothing to write)."""
        state = self.state
        if not self.checkpoint_dir:
            return False
        if not agreed:
            self.signals.request_checkpoint()
            return True
        self._fence()
        name = shard_checkpoints.step_name(state.step)
        from gpuflex.elastic.sharding import fsdp as sharded
        try:
            sharded.write(self.model, self.optimizer, shard_checkpoints.path_of(self.checkpoint_dir, name))
        except (OSError, RuntimeError) as e:   # DCP's CheckpointException is a RuntimeError
            state.checkpoint_failed(f"distributed checkpoint at step {state.step} failed: "
                                    f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
            return False
        if not state.checkpoint(self.rank, self.world_size, dcp=name):
            return False
        state.dcp_names = [*state.dcp_names[-1:], name]
        shard_checkpoints.prune(self.checkpoint_dir, set(state.dcp_names))
        return True

    def _vote_rides_barrier(self: Any) -> bool:
        """A sharded step has no gradient all-reduce of ours to carry the boundary's vote:
        unless it carries sample ids, it rides a step barrier (agreement.pack): the one
        before the step's first forward, else the boundary's."""
        return self.sharding is not None and self.agreement.packs and self.barrier is not None \
            and self.world_size > 1

    def _forward_barrier(self: Any) -> None:
        """Before a sharded step's first forward: the step barrier (a dead member: the end),
        carrying the step's vote, so the boundary needs no barrier of its own (one store
        barrier a step; `_fence` guards the collectives a boundary may make)."""
        at = (self.generation, self.state.step, "forward")
        if self.warming_up or self.batch is None or self._crossed == at:
            return
        vote = self.agreement.pack() if self._vote_rides_barrier() else None
        if self._cross("forward", vote):
            if vote is not None:
                self.agreement.carried(self.barrier.voted)
            return
        with self._guard():
            self._no_undo(self.group.take_failure())

    def _fence(self: Any) -> None:
        """Before a boundary's collectives (a distributed checkpoint): the step barrier, unless
        the boundary crossed one already. A member still busy after its step (an evaluation
        on rank 0 before the loop comes back) is waited for while it is alive; a dead one
        ends the run."""
        if self._crossed[-1:] == ("boundary",) or self._cross("checkpoint"):
            return
        self._no_undo(self.group.take_failure())

    def _no_undo(self: Any, why: str | None) -> None:
        """A sharded run cannot undo a step or restore a dead member's shards: it ends (as
        a lost store when that is why: see `_store_gone`)."""
        if self.sharding is not None:
            gone = self._store_gone()
            if gone is not None:
                raise gone
            from gpuflex.elastic.sharding.sharded_run import ENDS
            raise ShardsLost(f"a collective of generation {self.generation} failed ({why}); {ENDS}")

    def _store_gone(self: Any) -> StoreLost | None:
        """Whether the job store is gone, asked once (bounded by the store timeout) after a
        collective failed: a member that saw the store die first has exited, which fails the
        others' collectives. Those then end as a lost store too, and the job's record says what
        happened to it (both restart from the last distributed checkpoint)."""
        if self.rdzv is None:
            return None
        try:
            self.rdzv.has(keys.RUN)
        except StoreLost as e:
            return e
        return None

    def _end_on_failed_collective(self: Any) -> None:
        """Chain `sys.excepthook` (outside the crash hook): an exception escaping the script
        from a collective (FSDP's all-gather or reduce-scatter: a member died) ends the
        worker as ShardsLost does, with one line and SHARDS_LOST_EXIT; anything else goes on to the
        crash hook (a bug in the script is reported as a crash)."""
        previous = sys.excepthook

        def hook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
            if not _from_a_collective(value, tb):
                return previous(etype, value, tb)
            with self._guard():   # exits as ShardsLost (or a lost store) does anywhere else
                self._no_undo(f"in the script: {describe(value)}")

        sys.excepthook = hook


def _from_a_collective(value: BaseException, tb: Any) -> bool:
    """The exception came out of torch.distributed (its innermost Python frame is there)."""
    if isinstance(value, dist.DistError):
        return True
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/") if tb is not None else ""
    return isinstance(value, RuntimeError) and "/torch/distributed/" in name
