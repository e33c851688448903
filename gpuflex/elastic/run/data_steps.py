"""What a data-parallel step does in `run.backward` (mixed into ElasticRun, whose attributes
it uses): the loss weighted by the rank's share of the global batch, the gradients summed
over the members by the gradient plan (gradients.py), whose large all-reduces start during
backward once the process's first backward is done (it may compile), after the step
barrier. A sharded run's backward is ShardedSteps'; a warming-up newcomer's only compiles.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpuflex.elastic.protocol import failpoints
from gpuflex.elastic.membership.collectives import backward
from gpuflex.elastic.data.gradients import GradPlan, drop_grads
from gpuflex.elastic.data.micro import share
from gpuflex.elastic.membership.rendezvous import StoreLost


class DataParallelSteps:
    """Mixed into ElasticRun (runtime.py)."""

    def backward(self: Any, loss: torch.Tensor) -> None:
        """Backward of this rank's *mean* loss over its share, weighted by the share's part
        of the global batch, then the gradients summed over the members: exactly the
        full-batch mean gradient, at any world size (as DDP's average is at a fixed one)."""
        batch, micro = self.batch, self.micro.take()
        if self.micro.backward_before_last(loss):   # accumulating: the last micro-batch reduces
            return
        if self.sharding is not None and not self.warming_up:   # FSDP reduce-scatters (sums) in backward
            return self._backward_sharded(loss, batch, micro)
        if self.warming_up:   # compiles what the first step would; the received state replaces the rest
            loss.backward()
            self._overlap, self._last_loss = True, loss.detach()
            return drop_grads(self.model)
        overlap, self._overlap = self._overlap, True   # a first backward may compile: not overlapped
        if self.world_size > 1:   # the large gradients' all-reduces start during backward
            if self._grad_plan is None:
                self._grad_plan = self._make_grad_plan()
            if overlap and self._cross("backward"):
                self._grad_plan.arm()
        if batch is not None and len(batch.indices) == 0:   # more ranks than samples this step
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            weight = micro.weight if micro is not None else share(batch)
            backward(loss * weight if weight != 1.0 else loss, self.backend)
        if batch is not None:   # this rank's compute of the step: to the end of its backward, less barriers
            self.split.meter.add(time.perf_counter() - self._t_step - self._waited, len(batch.indices))
        self._last_loss = loss.detach()
        if failpoints.ARMED and self.world_size > 1: failpoints.hit("steady.collective", **self._where())
        if self.world_size > 1 and not overlap and self._cross("backward"):   # then reduce
            self._grad_plan.arm()
        if self.world_size > 1 and self.group.failure is not None:
            drop_grads(self.model)
        elif self.world_size > 1:
            try:
                self._grad_plan.reduce()
            except StoreLost as e:   # raised at the boundary, where the runtime exits cleanly
                drop_grads(self.model)
                self._store_lost = e

    def _make_grad_plan(self: Any) -> GradPlan:
        return GradPlan(self.model, self.group, self.agreement, self.sampler.num_samples)
