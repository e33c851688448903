"""How an `ElasticRun` starts under gpuflex: its control socket, the job store, the
formation and the step barrier; a newcomer's warm-up passes (a compiled model compiles
while the others train); joining the next generation. Mixed into ElasticRun (runtime.py)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Iterator

from gpuflex.elastic.protocol import failpoints, keys
from gpuflex.elastic.membership.joining import Formation
from gpuflex.elastic.membership.liveness import StepBarrier, install_crash_hook, report_crash
from gpuflex.elastic.protocol.logs import ensure_handler
from gpuflex.elastic.membership.rendezvous import Rendezvous
from gpuflex.elastic.data.sampler import Batch
from gpuflex.elastic.state.tree import copy_value
from gpuflex.elastic.membership.worker_control import start_control


class StartUp:
    """ElasticRun's start and join (its attributes, set in its __init__, are used here)."""

    def _start(self: Any) -> None:
        if self.distributed or not logging.getLogger().handlers:   # a worker's log, or a plain script
            ensure_handler(sys.stderr)
        if not self.distributed:
            self.state.load_disk_checkpoint()
            if self.sharding is not None:   # the same FSDP2 code path, over a group of one
                self.sharding.start_alone()
                self.sharding.restore(None, self.state.resume_dcp)
            return
        self._control = start_control(self.env.control, self.signals, self.status, self._request_members)
        self.rdzv = Rendezvous(self.store_address, self.wid, secret=self.env.job_secret,
                               timeout_s=max(60.0, self.pg_timeout_s))
        self.formation = Formation(wid=self.wid, rdzv=self.rdzv, group=self.group, state=self.state,
                                   signals=self.signals, timeout_s=self.pg_timeout_s, shards=self.sharding)
        self.barrier = StepBarrier(self.rdzv, self.wid, self.env.heartbeat_timeout_s)
        install_crash_hook(lambda rec: (report_crash(self.rdzv, self.wid, rec), self._close()),
                           lambda: f"step {self.step} of generation {self.generation} (rank {self.rank})")
        if self.sharding is not None:   # a member dying in FSDP's collectives: one line, not a crash
            self._end_on_failed_collective()
        if self.sharding is None and any(p.requires_grad for p in self.model.parameters()):
            self._grad_plan = self._make_grad_plan()   # the gradient buffer (and hooks), touched:
            self._grad_plan.flat.zero_()               # not paid for in a first step
        self.warming_up = self.warm_up_steps > 0
        if not self.warming_up:
            self._join()

    def _join(self: Any) -> None:
        """Put back the state the warm-up passes changed (buffers, a scheduler, RNG: a first
        generation takes rank 0's as it is), say it is ready, enter the next generation."""
        if self.warming_up and self._pre_warm is not None:
            self.state.apply_tree(self._pre_warm)
        self.warming_up = False
        if failpoints.ARMED: failpoints.hit("startup.before_join", wid=self.wid)
        self.rdzv.set(keys.ready(self.wid), str(time.time()))
        self._joined(self.formation.enter(after=0, was_member=False, failed_at=None))

    def _warm_up_passes(self: Any) -> Iterator[Batch]:
        """`warm_up_steps` batches through the user's loop before it is ready (a compiled model
        compiles here, while the others train), cut for the place it expects; nothing counts."""
        rank, world = self.rdzv.expected_place()
        self._pre_warm = copy_value(self.state.capture())
        for _ in range(self.warm_up_steps):
            self.batch = self.sampler.batch(0, rank, world)
            self.formation.log(f"warm-up pass as rank {rank} of {world}")
            yield self.batch

    def _request_members(self: Any, members: list[int]) -> None:
        """A control socket's resize with members: for the coordinator to validate."""
        if self.rdzv is None:
            raise ValueError("not connected to the job store yet")
        self.rdzv.request_members(members)
