"""`ElasticRun`: the training loop driver a torch user adopts in a few lines (the usage,
step by step, and what stays exact: docs/converting.md).

    run = ElasticRun(model=model, optimizer=opt, num_samples=len(ds), global_batch_size=256, steps=S)
    for x, y in run.loader(ds, num_workers=2):   # this rank's share of each global batch
        for xb, yb in run.accumulate(x, y, micro_batch_size=32):
            run.backward(loss_fn(model(xb), yb))   # weighted; the last one all-reduces
        opt.step(); opt.zero_grad()

Under gpuflex (GPUFLEX_STORE set) the run joins the job's current generation and follows
resizes and faults in place; without it the same script runs alone. At each step boundary
the members agree, in one small all-reduce (riding the gradients' where it can; a sharded
step's rides the step barrier), on the samples of the step just done, on stopping, on a
checkpoint and on a switch to a newer generation (agreement.py); then the state is
committed in memory. A collective that fails (a dead peer) is noted and handled at the next
boundary: the survivors report it, the coordinator publishes the next generation, and the
members continue from the newest state any of them holds (formation.py). Before a step's
collectives the members pass a barrier over the job store (liveness.py): a busy member is
waited for, a silent one fenced. With `shard=` the model is sharded with FSDP2 over each
generation and resharded in place (sharding.py, sharded_steps.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

import torch

from gpuflex.elastic.protocol import failpoints, keys
from gpuflex.elastic.membership.agreement import Agreement
from gpuflex.elastic.state.buffers import BufferSync
from gpuflex.elastic.membership.collectives import Collectives, pick_device
from gpuflex.elastic.state.training import TrainingState
from gpuflex.elastic.run.data_steps import DataParallelSteps
from gpuflex.elastic.protocol.env import WorkerEnv
from gpuflex.elastic.membership.joining import Formation, Formed, ShardsLost
from gpuflex.elastic.data.gradients import GradPlan
from gpuflex.elastic.protocol.keys import ABORTED_EXIT, EVICTED_EXIT, SHARDS_LOST_EXIT, STORE_LOST_EXIT
from gpuflex.elastic.membership.liveness import StepBarrier, close_after, close_at_exit
from gpuflex.elastic.data.loader import ElasticLoader, Prefetcher
from gpuflex.elastic.data.micro import Accumulation, has_batch_norm, share, warm_up_steps
from gpuflex.elastic.membership.rendezvous import Aborted, Evicted, Leaving, Rendezvous, StoreLost
from gpuflex.elastic.data.sampler import Batch, ElasticSampler
from gpuflex.elastic.run.sharded_steps import ShardedSteps
from gpuflex.elastic.protocol.signals import StepSignals
from gpuflex.elastic.data.split_plan import SplitPlan, exchange
from gpuflex.elastic.run.startup import StartUp
from gpuflex.elastic.state.tree import Registry
from gpuflex.elastic.run.user_calls import UserCalls
from gpuflex.elastic.membership.worker_control import Progress

log = logging.getLogger(__name__)


class ElasticRun(StartUp, UserCalls, DataParallelSteps, ShardedSteps):
    """Drives an elastic data-parallel training loop; see the module docstring.

    Its parts: `signals` (stop, checkpoint and poke requests), `state` (the step, the logs,
    the registered objects, commits and checkpoints), `group` (the process group and its
    failures), `agreement` (the step-boundary vote), the gradient plan, and, under gpuflex,
    `rdzv` (the job store) and `formation` (joining generations), and `split` (the split
    plan: each member's share of a step, by measured speed or even; split_plan.py). The calls
    a script makes inside a step (all_reduce, accumulate, global_mean, register) come from
    UserCalls; the start and join from StartUp; `backward` from DataParallelSteps; a sharded
    run's steps from ShardedSteps."""

    barrier: StepBarrier | None = None   # under gpuflex: the step barrier (liveness.py)
    warming_up = False   # a worker's passes through the loop before it says it is ready (no state yet)
    _pre_warm: dict[str, Any] | None = None   # the state before them, put back after
    _overlap, _crossed = False, ()       # the process's first backward is not overlapped; the last barrier

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 num_samples: int, global_batch_size: int, epochs: int | None = None,
                 steps: int | None = None, seed: int = 0, scheduler: Any = None, scaler: Any = None,
                 extra: dict[str, Any] | None = None, buffers: str = "broadcast",
                 warm_up: int | None = None, track_samples: bool = False,
                 checkpoint_dir: str | None = None, checkpoint_interval_s: float | None = None,
                 split: str | None = None, shard: Any = None) -> None:
        self.device = pick_device()
        self.sharding = None   # shard=: FSDP2 over each generation; optimizer (and scheduler) are factories
        if shard is not None:
            optimizer, scheduler = self._shard(model, optimizer, scheduler, shard)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.sampler = ElasticSampler(num_samples, global_batch_size, epochs=epochs, steps=steps, seed=seed)
        self.split = SplitPlan(global_batch_size, split,   # "speed" | "even"; None: GPUFLEX_SPLIT, else "speed"
                               least=2 if has_batch_norm(model) else 1)
        heavy = self.sharding is None   # a sharded run's model and optimizer state move as shards only
        self.registry = Registry.of(model=model if heavy else None, optimizer=optimizer if heavy else None,
                                    scheduler=scheduler, scaler=scaler, extra=extra)
        if not heavy:
            self.registry.add("sharded.param_groups", self.sharding.param_groups)
        self.registry.add("split", self.split)   # committed with each step, copied to newcomers, checkpointed
        self.warm_up_steps = warm_up_steps(model, warm_up)   # a newcomer's passes before it is ready
        self.track_samples, self.stopped = track_samples, False
        env = self.env = WorkerEnv.from_environ()
        self.wid, self.store_address, self.pg_timeout_s = env.worker_id, env.store, env.pg_timeout_s
        self.checkpoint_dir = checkpoint_dir or env.checkpoint_dir
        self.checkpoint_interval_s = float(checkpoint_interval_s or env.checkpoint_interval_s)
        self.rank, self.world_size, self.generation = 0, 1, 0
        self.group = Collectives(self.device, self.pg_timeout_s)
        self.buffers = BufferSync(model, self.group, buffers)
        self.state = TrainingState(registry=self.registry, model=model, sampler=self.sampler, buffers=self.buffers,
                                   distributed=self.distributed, checkpoint_dir=self.checkpoint_dir,
                                   resume_from=env.resume_from)
        self.signals = StepSignals()
        self.agreement = Agreement(batch_size=global_batch_size, track_samples=track_samples,
                                   signals=self.signals, group=self.group, switch_to=self._switch_to)
        self.progress = Progress(global_batch_size, self.status)
        self.micro = Accumulation()
        self.rdzv: Rendezvous | None = None
        self.formation: Formation | None = None
        self.batch: Batch | None = None       # the step being trained now
        self._last_loss: torch.Tensor | None = None
        self._step_started: float | None = None
        self._t_step = self._waited = 0.0   # this step's start (perf_counter) and time at its barriers
        self._started = self._in_epochs = False
        self._store_lost: StoreLost | None = None
        self._grad_plan: GradPlan | None = None
        self._pending_timings: dict[str, Any] | None = None
        self._formed_at: float | None = None   # the end of the last formation, until its first step
        self._formed_kind = ""
        self._control = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.signals.request_stop())

    # ---- public properties ---------------------------------------------------------------
    @property
    def is_primary(self) -> bool:
        return self.rank == 0 and not self.warming_up

    # the training state's counters and logs, read through the run
    step = property(lambda self: self.state.step, doc="Global steps done (across epochs).")
    epoch = property(lambda self: self.state.epoch, doc="The current epoch.")
    step_log = property(lambda self: self.state.step_log, doc="[step, time, world size] per step done.")
    samples = property(lambda self: self.state.samples, doc="Sample ids per epoch (track_samples).")

    distributed = property(lambda self: self.store_address is not None, doc="Under gpuflex (GPUFLEX_STORE set).")
    backend = property(lambda self: self.group.backend, doc="gloo or nccl.")
    pg = property(lambda self: self.group.pg, doc="This generation's process group.")

    # ---- the loop -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """Every remaining step of the run, across epochs."""
        yield from close_after(self._steps(epoch=None), self._close)

    def epochs(self) -> Iterator[int]:
        """The epochs still to run (a resumed or newly joined worker starts inside one);
        iterate `run.loader(dataset)` in each, as with a DistributedSampler."""
        try:
            with self._guard():
                self._ensure_started()
            self._in_epochs = True
            if self.warming_up:   # one pass of the user's epoch body: the loader gives the warm-up batches
                yield self.epoch
                with self._guard():
                    self._join()
            while self._more():
                yield self.epoch
        except BaseException:   # left early: the crash hook reports an exception before the close
            close_at_exit(self._close)
            raise
        self._close()

    def loader(self, dataset: Any, num_workers: int = 0, pin_memory: bool = False, collate_fn: Any = None,
               prefetch_factor: int | None = None, persistent_workers: bool = True) -> ElasticLoader:
        """This rank's share of each step of the current epoch inside `run.epochs()`, else of every
        remaining step; `num_workers > 0`: read ahead by processes that live for the whole run."""
        pre = Prefetcher(dataset, self.sampler, num_workers, pin_memory, collate_fn, prefetch_factor) if num_workers else None
        return ElasticLoader(lambda: (self._steps(self.epoch), self.sampler.steps_per_epoch) if self._in_epochs
                             else (iter(self), self.sampler.total_steps - self.step), dataset, collate_fn, pre)

    def _steps(self, epoch: int | None) -> Iterator[Batch]:
        with self._guard():
            self._ensure_started()
            if self.warming_up:
                yield from self._warm_up_passes()
                if epoch is not None:   # epochs() joins once the user's warm-up pass is over
                    return
                self._join()
            # Every member meets the first batch of a generation straight from its
            # formation (survivors return from the switch into the same spot), so the
            # collectives line up; the boundary comes after each step.
            while self._more() and (epoch is None or self.epoch == epoch):
                self._plan_split()
                batch = self.sampler.batch(self.state.step, self.rank, self.world_size,
                                           self.split.shares_for(self.world_size))
                self.batch = batch
                self.agreement.begin_step(batch)
                self._step_started = time.time()
                self._t_step, self._waited = time.perf_counter(), 0.0
                if failpoints.ARMED and self._formed_at is not None and self._formed_kind == "resize":
                    failpoints.hit("resize.first_step", **self._where())
                yield batch
                if not self._boundary():
                    return

    def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            self._start()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """The runtime's own ways out become exit codes, with the store and sockets closed."""
        try:
            yield
        except StoreLost as e:
            log.info("gpuflex: %s; exiting with %d so the job restarts from its last checkpoint",
                     e, STORE_LOST_EXIT)
            self._close()
            os._exit(STORE_LOST_EXIT)
        except (Evicted, Aborted) as e:
            log.info("gpuflex: worker %d %s; exiting", self.wid, f"aborted: {e}" if isinstance(e, Aborted) else e)
            self._close()
            sys.exit(ABORTED_EXIT if isinstance(e, Aborted) else EVICTED_EXIT)
        except Leaving:
            self._close()
            sys.exit(0)
        except ShardsLost as e:   # the job restarts from its distributed checkpoint (sharding.py)
            log.error("gpuflex: worker %d: %s", self.wid, e)
            self._close(done=False)   # not done: the control side sees the exit code and restarts the job
            logging.shutdown()
            os._exit(SHARDS_LOST_EXIT)

    # ---- start, boundary, switch ---------------------------------------------------------------
    def _switch_to(self) -> int:
        """Rank 0's part of the agreement: a newer generation to switch to, or 0."""
        g = 0 if self.rank != 0 or self.rdzv is None else self.rdzv.newer_generation(
            self.generation, self.signals.take_poke())
        if failpoints.ARMED and g: failpoints.hit("resize.detect", **dict(self._where(), new=g))
        return g

    def _joined(self, formed: Formed | None) -> None:
        """A formation ended: in a new generation, or (None) stopped while waiting for one."""
        if formed is None:
            self.stopped = True
            return
        self.rank, self.world_size, self.generation = formed.rank, formed.world_size, formed.generation
        self._formed_at, self._formed_kind = formed.at, formed.kind
        self._pending_timings = formed.timings

    def _boundary(self) -> bool:
        """Confirm the step just done, then agree on what happens next. False: stop."""
        now = time.time()
        done_step = self._step_started is not None
        state = self.state
        if self._store_lost is not None:
            raise self._store_lost
        if self.rdzv is not None and self.rdzv.lost.is_set():   # seen by the heartbeat thread
            raise StoreLost("the job store stopped answering heartbeats")
        self._step_started = None
        why = self.group.take_failure()
        if why is not None:   # this step's gradient all-reduce failed: undo it
            self._no_undo(why)
            state.undo_step()
            self._joined(self.formation.recover(self.generation, why))
            return self._more()
        rode = self._crossed == (self.generation, state.step, "backward") and self._grad_plan.fuse   # the vote
        rode = rode or self._crossed == (self.generation, state.step, "forward") and self.agreement.held
        fence = self.buffers.needed()   # the buffers' sync is a collective after user code: a barrier first
        if rode:
            flags = self.agreement.agree(done_step) if not fence or self._cross("boundary") else None
        elif self._vote_rides_barrier():
            flags = self.agreement.unpack(self.barrier.voted) if self._cross("boundary", self.agreement.pack()) \
                else None
        else:
            flags = self.agreement.agree(done_step) if self._cross("boundary") else None
        flags = flags if flags is None or self.buffers.sync(share(self.batch)) else None   # failed: a failed vote
        if flags is None:   # the agreement failed, after this rank completed its step
            why = self.group.take_failure()
            self._no_undo(why)
            if done_step:
                ids = self.sampler.global_batch(state.step)[2].tolist() if self.track_samples else None
                state.confirm_step(ids, now, self.world_size)
            state.commit()
            self._joined(self.formation.recover(self.generation, why))
            return self._more()
        switch_to, stop, ckpt, ids = flags
        if done_step:
            state.confirm_step(ids, now, self.world_size)
        state.commit()
        if self._formed_at is not None and done_step:
            first, self._formed_at = now - self._formed_at, None
            self.formation.log(f"first step of generation {self.generation}: {first:.3f}s")
            if self._pending_timings is not None:   # rank 0
                self._pending_timings["first_step"] = first
                self.rdzv.set(keys.timings(self.generation), json.dumps(self._pending_timings))
                self._pending_timings = None
        if stop:
            self.stopped = True
            if failpoints.ARMED: failpoints.hit("cancel.stop", **self._where())
            self._checkpoint()
            return False
        if state.step >= self.sampler.total_steps:
            self._checkpoint()
            if self.rdzv is not None and self.rank == 0:
                self.rdzv.set(keys.FINISHED, "1")
            return False
        if ckpt or (self.rank == 0 and time.monotonic() - state.last_checkpoint >= self.checkpoint_interval_s):
            self._checkpoint(agreed=ckpt)
        if self.rank == 0 and self.rdzv is not None:
            self.progress.report(state.step_log, self.rdzv)
        if switch_to > self.generation:
            self._joined(self.formation.switch(switch_to, agreed_at=now, agree_s=self.agreement.last_s))
            return self._more()
        return True

    def _cross(self, phase: str, vote: int | None = None) -> bool:
        """The step barrier before this step's collectives: False (noted as a failed collective)
        when a member it waits for is dead, crashed or gone (see liveness.py). `vote`: a
        voting barrier (the boundary's agreement riding it)."""
        self._crossed = (self.generation, self.state.step, phase)
        t = time.perf_counter()
        ok = self.barrier is None or self.barrier.cross_noted(self.group, self.generation, self.world_size, phase,
                                                              vote)
        self._waited += time.perf_counter() - t
        return ok

    def _plan_split(self) -> None:
        """At the top of a step, when due (a new generation's first step, every few steps):
        the members' measurements exchanged, and the split re-planned from them if worth it."""
        sp, step = self.split, self.state.step
        if not sp.due(step, self.generation):
            return
        sp.exchanged_in = self.generation
        row = sp.row(self.wid, time.time())
        if self.world_size == 1:
            rows = [row]
        else:
            rows = exchange(self.group, self.rank, self.world_size, row) if self._cross("split") else None
        if rows is not None and sp.decide(rows, step, self.generation) is not None:
            if failpoints.ARMED: failpoints.hit("split.replan", **self._where())   # made, not yet committed

    def _checkpoint(self, agreed: bool = True) -> None:
        """Rank 0 writes a checkpoint (a sharded run: every member, ShardedSteps); one that
        failed is reported at once through the progress record (the control side turns each
        new failure into an event)."""
        written = self._checkpoint_shards(agreed) if self.sharding is not None \
            else self.state.checkpoint(self.rank, self.world_size)
        if not written and self.state.last_checkpoint_error and self.rdzv is not None and self.rank == 0:
            self.progress.report(self.state.step_log, self.rdzv, force=True)

    def _where(self) -> dict[str, int]:
        """This worker's place, for a failpoint's filters."""
        return {"wid": self.wid, "rank": self.rank, "gen": self.generation, "step": self.step}

    def _more(self) -> bool:
        return self.state.step < self.sampler.total_steps and not self.stopped

    def status(self) -> dict[str, Any]:
        loss = self._last_loss
        return {"wid": self.wid, "rank": self.rank, "world_size": self.world_size, "generation": self.generation,
                "step": self.step, "epoch": self.epoch, "samples_per_s": round(self.progress.rate, 2),
                "loss": None if loss is None else float(loss), "checkpoint_failures": self.state.checkpoint_failures,
                "checkpoint_error": self.state.last_checkpoint_error,
                "waiting_for": list(self.barrier.waiting_for) if self.barrier else [], "time": time.time(),
                **self.split.record()}

    def _close(self, done: bool = True) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.rdzv is not None:
            with contextlib.suppress(StoreLost):
                if done:
                    self.rdzv.set(keys.done(self.wid), "1")
            self.rdzv.close()
        if self._control is not None:
            self._control.close()
        self.destroy_process_group()

    def destroy_process_group(self) -> None:
        """Drop this generation's group (see Collectives.close)."""
        self.group.close()
