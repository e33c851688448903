"""`DataParallelSteps`: the step strategy of a data-parallel run (a whole model on every
member). `run.backward` is its `backward`: the loss weighted by the rank's share of the
global batch, the gradients summed over the members by the gradient plan (gradients.py),
whose large all-reduces start during backward once the process's first backward is done
(it may compile), after the step barrier; a warming-up newcomer's backward only compiles.

A step strategy is what the runtime asks of a kind of run besides the step loop: its
`backward`, its preparation at start-up (`prepare`), whether the boundary's vote rode the
step's own collective (`vote_rode`) or rides a barrier (`vote_rides_barrier`), what a
failed collective means (`no_undo`: here nothing, the boundary undoes the step), its
checkpoint, and `full_parameters`. The sharded one (sharded_steps.py) answers the same.
"""

from __future__ import annotations

import torch

from gpuflex.elastic.data.exact_sum import UnitGrads
from gpuflex.elastic.data.exact_bn import BatchNormUnits, has_batch_norm
from gpuflex.elastic.data.gradients import GradPlan, drop_grads
from gpuflex.elastic.data.micro import share
from gpuflex.elastic.membership.collectives import backward
from gpuflex.elastic.membership.rendezvous import StoreLost
from gpuflex.elastic.protocol import failpoints
from gpuflex.elastic.run.context import RunContext


def warm_up_backward(ctx: RunContext, loss: torch.Tensor) -> None:
    """A warming-up newcomer's backward: it compiles what the first step would; the state
    it receives on joining replaces the rest, so its gradients are dropped."""
    loss.backward()
    ctx.last_loss = loss.detach()
    drop_grads(ctx.model)


class DataParallelSteps:
    """A data-parallel run's steps over `ctx` (see the module docstring)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.grad_plan: GradPlan | None = None   # made at start-up under gpuflex, else at the first reduce
        self.overlap = False   # the process's first backward is not overlapped (it may compile)
        self.units: UnitGrads | None = None   # bitwise mode: this step's units (data/exact_sum.py)
        # bitwise mode with BatchNorm: the units' statistics, merged exactly (data/exact_bn.py)
        self.bn = BatchNormUnits(ctx.model) if ctx.unit and has_batch_norm(ctx.model) else None

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's *mean* loss over its share, weighted by the share's part
        of the global batch, then the gradients summed over the members: exactly the
        full-batch mean gradient, at any world size (as DDP's average is at a fixed one)."""
        ctx = self.ctx
        if ctx.unit:
            return self.bitwise_backward(loss)
        batch, micro = ctx.batch, ctx.micro.take()
        if ctx.micro.backward_before_last(loss):   # accumulating: the last micro-batch reduces
            return
        if ctx.warming_up:
            self.overlap = True
            return warm_up_backward(ctx, loss)
        overlap, self.overlap = self.overlap, True   # a first backward may compile: not overlapped
        world = ctx.world_size
        if world > 1:   # the large gradients' all-reduces start during backward
            if self.grad_plan is None:
                self.grad_plan = self.make_grad_plan()
            if overlap and ctx.cross("backward"):
                self.grad_plan.arm()
        if batch is not None and len(batch.indices) == 0:   # more ranks than samples this step
            for p in ctx.model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            weight = micro.weight if micro is not None else share(batch)
            backward(loss * weight if weight != 1.0 else loss, ctx.group.backend)
        if batch is not None:   # this rank's compute of the step: to the end of its backward, less barriers
            ctx.split.meter.add(ctx.compute_s(), len(batch.indices))
        ctx.last_loss = loss.detach()
        if failpoints.ARMED and world > 1: failpoints.hit("steady.collective", **ctx.where())
        if world > 1 and not overlap and ctx.cross("backward"):   # then reduce
            self.grad_plan.arm()
        if world > 1 and ctx.group.failure is not None:
            drop_grads(ctx.model)
        elif world > 1:
            try:
                self.grad_plan.reduce()
            except StoreLost as e:   # raised at the boundary, where the runtime exits cleanly
                drop_grads(ctx.model)
                ctx.store_lost = e

    def bitwise_backward(self, loss: torch.Tensor) -> None:
        """exact="bitwise" (data/exact.py): one unit's backward, its gradient kept; after the
        rank's last unit, the exact integer sum over every unit of every member, with the
        boundary's vote at its end."""
        ctx = self.ctx
        batch, micro = ctx.batch, ctx.micro.take()
        if micro is None and batch is not None and len(batch.indices) > ctx.unit:
            raise ValueError(f"exact='bitwise': run.backward got the loss of {len(batch.indices)} samples, more "
                             f"than one unit ({ctx.unit}); loop over the units: for xb, yb in "
                             "run.accumulate(x, y): run.backward(loss_fn(model(xb), yb))")
        weight, last = (share(batch), True) if micro is None else (micro.weight, micro.last)
        if ctx.warming_up:
            if self.bn is not None:
                self.bn.drop()
            return warm_up_backward(ctx, loss)
        if self.units is None:
            self.units = UnitGrads([p for p in ctx.model.parameters() if p.requires_grad])
        if batch is None or len(batch.indices) > 0:   # a member with no samples adds no unit
            (loss * weight).backward()
            self.units.take()
            if self.bn is not None:   # the unit's place in the global batch: its row of statistics
                self.bn.take(micro.unit if micro is not None else
                             batch.offset // ctx.unit if batch is not None else len(self.units.units) - 1,
                             (ctx.generation, ctx.state.step))
        if not last:
            return
        if batch is not None:
            ctx.split.meter.add(ctx.compute_s(), len(batch.indices))
        ctx.last_loss = loss.detach()
        world = ctx.world_size
        units = -(-batch.global_size // ctx.unit) if batch is not None else len(self.units.units)
        # int64 after the gradients: the units' BatchNorm statistics, then the boundary's vote
        stats = self.bn.pack(units) if self.bn is not None else torch.zeros(0, dtype=torch.int64)
        try:
            if world > 1:
                if failpoints.ARMED: failpoints.hit("steady.collective", **ctx.where())
                if not ctx.cross("backward") or ctx.group.failure is not None:
                    raise RuntimeError("the step barrier failed")
            vote = ctx.agreement.build(done_step=True) if world > 1 else torch.zeros(0, dtype=torch.int64)
            summed = self.units.reduce(ctx.group if world > 1 else None, units,
                                       torch.cat([stats, vote.to(torch.int64)]))
        except StoreLost as e:   # raised at the boundary, where the runtime exits cleanly
            self.units.clear()
            drop_grads(ctx.model)
            ctx.store_lost = e
            return
        except RuntimeError:   # noted by the group: the boundary undoes the step
            self.units.clear()
            drop_grads(ctx.model)
            return
        if self.bn is not None:   # every member folds in every unit's statistics alike
            self.bn.apply(summed[:len(stats)], units)
        if world > 1:
            ctx.agreement.summed(summed[len(stats):])

    def make_grad_plan(self) -> GradPlan:
        ctx = self.ctx
        return GradPlan(ctx.model, ctx.group, ctx.agreement, ctx.sampler.num_samples)

    def prepare(self) -> None:
        """At start-up under gpuflex: the gradient buffer (and hooks) made and touched, so a
        first step does not pay for them."""
        if not self.ctx.unit and any(p.requires_grad for p in self.ctx.model.parameters()):
            self.grad_plan = self.make_grad_plan()
            self.grad_plan.flat.zero_()

    def vote_rode(self) -> bool:
        """The boundary's vote rode this step's gradient all-reduce (its barrier was crossed
        and the plan fuses the vote into it)."""
        ctx = self.ctx
        if ctx.unit:   # bitwise: the vote rode the integer sum when it arrived with it
            return ctx.agreement.held
        return ctx.crossed == (ctx.generation, ctx.state.step, "backward") and self.grad_plan.fuse

    def vote_rides_barrier(self) -> bool:
        return False   # a data-parallel step's vote rides its all-reduce, else has one of its own

    def no_undo(self, why: str | None) -> None:
        """A failed collective: nothing here; the boundary undoes the step and recovers."""

    def checkpoint(self, agreed: bool) -> bool:
        """Rank 0 writes the checkpoint (state/checkpoints.py); False: it failed or was not due."""
        return self.ctx.state.checkpoint(self.ctx.rank, self.ctx.world_size)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, by name (a copy)."""
        return {n: p.detach().clone() for n, p in self.ctx.model.named_parameters()}
