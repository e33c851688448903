"""`StartUp`: how an `ElasticRun` starts under gpuflex: its control socket, the job store,
the formation and the step barrier; a newcomer's warm-up passes (a compiled model compiles
while the others train); joining the next generation. Alone (no GPUFLEX_STORE) it only
loads the newest checkpoint on disk. It works on the run's context (context.py) and asks
the run's step strategy (data_steps.py or sharded_steps.py) to prepare."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Iterator

from gpuflex.elastic.data.sampler import Batch
from gpuflex.elastic.membership.joining import Formation
from gpuflex.elastic.membership.liveness import StepBarrier, install_crash_hook, report_crash
from gpuflex.elastic.membership.rendezvous import Rendezvous
from gpuflex.elastic.membership.worker_control import start_control
from gpuflex.elastic.protocol import failpoints, keys
from gpuflex.elastic.protocol.logs import ensure_handler
from gpuflex.elastic.run.context import RunContext, StepStrategy
from gpuflex.elastic.state.tree import copy_value


class StartUp:
    """The run's start and join, over `ctx`; `strategy` is the run's step strategy."""

    def __init__(self, ctx: RunContext, strategy: StepStrategy) -> None:
        self.ctx, self.strategy = ctx, strategy
        self.pre_warm: dict[str, Any] | None = None   # the state before the warm-up passes, put back after

    def ensure_started(self) -> None:
        """Start once, at the run's first call that needs it."""
        if not self.ctx.started:
            self.ctx.started = True
            self.start()

    def start(self) -> None:
        ctx = self.ctx
        if ctx.distributed or not logging.getLogger().handlers:   # a worker's log, or a plain script
            ensure_handler(sys.stderr)
        if not ctx.distributed:
            ctx.state.load_disk_checkpoint()
            if ctx.sharding is not None:   # the same FSDP2 code path, over a group of one
                ctx.sharding.start_alone()
                ctx.sharding.restore(None, ctx.state.resume_dcp)
            return
        env = ctx.env
        ctx.control = start_control(env.control, ctx.signals, ctx.status, self.request_members)
        ctx.rdzv = Rendezvous(env.store, ctx.wid, secret=env.job_secret, timeout_s=max(60.0, env.pg_timeout_s))
        ctx.formation = Formation(wid=ctx.wid, rdzv=ctx.rdzv, group=ctx.group, state=ctx.state,
                                  signals=ctx.signals, timeout_s=env.pg_timeout_s, shards=ctx.sharding)
        ctx.barrier = StepBarrier(ctx.rdzv, ctx.wid, env.heartbeat_timeout_s)
        install_crash_hook(lambda rec: (report_crash(ctx.rdzv, ctx.wid, rec), ctx.close()),
                           lambda: f"step {ctx.state.step} of generation {ctx.generation} (rank {ctx.rank})")
        self.strategy.prepare()   # the gradient buffer touched; a sharded run's hook for FSDP's collectives
        ctx.warming_up = ctx.warm_up_steps > 0
        if not ctx.warming_up:
            self.join()

    def join(self) -> None:
        """Put back the state the warm-up passes changed (buffers, a scheduler, RNG: a first
        generation takes rank 0's as it is), say it is ready, enter the next generation."""
        ctx = self.ctx
        if ctx.warming_up and self.pre_warm is not None:
            ctx.state.apply_tree(self.pre_warm)
        ctx.warming_up = False
        if failpoints.ARMED: failpoints.hit("startup.before_join", wid=ctx.wid)
        ctx.rdzv.set(keys.ready(ctx.wid), str(time.time()))
        ctx.joined(ctx.formation.enter(after=0, was_member=False, failed_at=None))

    def warm_up_passes(self) -> Iterator[Batch]:
        """`warm_up_steps` batches through the user's loop before it is ready (a compiled model
        compiles here, while the others train), cut for the place it expects; nothing counts."""
        ctx = self.ctx
        rank, world = ctx.rdzv.expected_place()
        self.pre_warm = copy_value(ctx.state.capture())
        for _ in range(ctx.warm_up_steps):
            ctx.batch = ctx.sampler.batch(0, rank, world)
            ctx.formation.log(f"warm-up pass as rank {rank} of {world}")
            yield ctx.batch

    def request_members(self, members: list[int]) -> None:
        """A control socket's resize with members: for the coordinator to validate."""
        if self.ctx.rdzv is None:
            raise ValueError("not connected to the job store yet")
        self.ctx.rdzv.request_members(members)
