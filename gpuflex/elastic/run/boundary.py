"""`Boundary`: what happens between two steps of an `ElasticRun`, and at the top of one.

After a step (`after_step`) the members confirm it and agree, in one small all-reduce
(riding the gradients' where it can; a sharded step's rides the step barrier), on the
samples of the step just done, on stopping, on a checkpoint and on a switch to a newer
generation (membership/agreement.py); then the state is committed in memory. A step whose
collective failed is undone (a sharded run cannot: it ends, sharded_steps.py) and the
members recover into the next generation (membership/joining.py). At the top of a step,
when due, the split of the global batch is re-planned from the members' measurements
(`plan_split`, data/split_plan.py). It works on the run's context (context.py) and asks the
run's step strategy what its kind of run does.
"""

from __future__ import annotations

import json
import time

from gpuflex.elastic.data.micro import share
from gpuflex.elastic.data.split_plan import exchange
from gpuflex.elastic.membership.rendezvous import StoreLost
from gpuflex.elastic.protocol import failpoints, keys
from gpuflex.elastic.run.context import RunContext, StepStrategy


class Boundary:
    """The step boundary over `ctx`, for a run whose step strategy is `strategy`."""

    def __init__(self, ctx: RunContext, strategy: StepStrategy) -> None:
        self.ctx, self.strategy = ctx, strategy

    def switch_to(self) -> int:
        """Rank 0's part of the agreement: a newer generation to switch to, or 0."""
        ctx = self.ctx
        g = 0 if ctx.rank != 0 or ctx.rdzv is None else ctx.rdzv.newer_generation(
            ctx.generation, ctx.signals.take_poke())
        if failpoints.ARMED and g: failpoints.hit("resize.detect", **dict(ctx.where(), new=g))
        return g

    def after_step(self) -> bool:
        """Confirm the step just done, then agree on what happens next. False: stop."""
        ctx = self.ctx
        now = time.time()
        done_step = ctx.step_started is not None
        state = ctx.state
        if ctx.store_lost is not None:
            raise ctx.store_lost
        if ctx.rdzv is not None and ctx.rdzv.lost.is_set():   # seen by the heartbeat thread
            raise StoreLost("the job store stopped answering heartbeats")
        ctx.step_started = None
        why = ctx.group.take_failure()
        if why is not None:   # this step's gradient all-reduce failed: undo it
            self.strategy.no_undo(why)
            state.undo_step()
            ctx.joined(ctx.formation.recover(ctx.generation, why))
            return ctx.more()
        agreement = ctx.agreement
        rode = self.strategy.vote_rode()   # the vote arrived with the step's own collective or barrier
        fence = ctx.buffers.needed()   # the buffers' sync is a collective after user code: a barrier first
        if rode:
            flags = agreement.agree(done_step) if not fence or ctx.cross("boundary") else None
        elif self.strategy.vote_rides_barrier():
            flags = agreement.unpack(ctx.barrier.voted) if ctx.cross("boundary", agreement.pack()) else None
        else:
            flags = agreement.agree(done_step) if ctx.cross("boundary") else None
        flags = flags if flags is None or ctx.buffers.sync(share(ctx.batch)) else None   # failed: a failed vote
        if flags is None:   # the agreement failed, after this rank completed its step
            why = ctx.group.take_failure()
            self.strategy.no_undo(why)
            if done_step:
                ids = ctx.sampler.global_batch(state.step)[2].tolist() if ctx.track_samples else None
                state.confirm_step(ids, now, ctx.world_size)
            state.commit()
            ctx.joined(ctx.formation.recover(ctx.generation, why))
            return ctx.more()
        switch_to, stop, ckpt, ids = flags
        if done_step:
            state.confirm_step(ids, now, ctx.world_size)
        state.commit()
        if ctx.formed_at is not None and done_step:
            first, ctx.formed_at = now - ctx.formed_at, None
            ctx.formation.log(f"first step of generation {ctx.generation}: {first:.3f}s")
            if ctx.pending_timings is not None:   # rank 0
                ctx.pending_timings["first_step"] = first
                ctx.rdzv.set(keys.timings(ctx.generation), json.dumps(ctx.pending_timings))
                ctx.pending_timings = None
        if stop:
            ctx.stopped = True
            if failpoints.ARMED: failpoints.hit("cancel.stop", **ctx.where())
            self.checkpoint()
            ctx.say_stopped()
            return False
        if state.step >= ctx.sampler.total_steps:
            self.checkpoint()
            if ctx.rdzv is not None and ctx.rank == 0:
                ctx.rdzv.set(keys.FINISHED, "1")
            if failpoints.ARMED: failpoints.hit("training.finished", **ctx.where())
            return False
        if ckpt or (ctx.rank == 0 and time.monotonic() - state.last_checkpoint >= ctx.checkpoint_interval_s):
            self.checkpoint(agreed=ckpt)
        if ctx.rank == 0 and ctx.rdzv is not None:
            ctx.progress.report(state.step_log, ctx.rdzv)
        if switch_to > ctx.generation:
            ctx.joined(ctx.formation.switch(switch_to, agreed_at=now, agree_s=agreement.last_s))
            return ctx.more()
        return True

    def plan_split(self) -> None:
        """At the top of a step, when due (a new generation's first step, every few steps):
        the members' measurements exchanged, and the split re-planned from them if worth it."""
        ctx = self.ctx
        sp, step = ctx.split, ctx.state.step
        if not sp.due(step, ctx.generation):
            return
        sp.exchanged_in = ctx.generation
        row = sp.row(ctx.wid, time.time())
        if ctx.world_size == 1:
            rows = [row]
        else:
            rows = exchange(ctx.group, ctx.rank, ctx.world_size, row) if ctx.cross("split") else None
        if rows is not None and sp.decide(rows, step, ctx.generation) is not None:
            if failpoints.ARMED: failpoints.hit("split.replan", **ctx.where())   # made, not yet committed

    def checkpoint(self, agreed: bool = True) -> None:
        """Rank 0 writes a checkpoint (a sharded run: every member, sharded_steps.py); one that
        failed is reported at once through the progress record (the control side turns each
        new failure into an event)."""
        ctx = self.ctx
        written = self.strategy.checkpoint(agreed)
        if not written and ctx.state.last_checkpoint_error and ctx.rdzv is not None and ctx.rank == 0:
            ctx.progress.report(ctx.state.step_log, ctx.rdzv, force=True)
