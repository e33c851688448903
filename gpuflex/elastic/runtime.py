"""`ElasticRun`: the training loop driver a torch user adopts in a few lines.

    run = ElasticRun(model=model, optimizer=opt, scheduler=sched,
                     num_samples=len(dataset), global_batch_size=256, epochs=10, seed=0)
    loader = run.loader(dataset)           # replaces DistributedSampler + DataLoader
    for epoch in run.epochs():             # a resumed or joining worker starts mid-epoch
        for x, y in loader:                # this rank's share of one global batch
            loss = loss_fn(model(x), y)    # this rank's mean, as under DDP
            optimizer.zero_grad()
            run.backward(loss)             # weighted backward + exact gradient all-reduce
            optimizer.step(); scheduler.step()

`for batch in run:` is the same loop over `Batch` objects (sample ids) across epochs.
Under gpuflex (GPUFLEX_STORE set) the run joins the job's current generation and
follows resizes and faults in place; without it the same script runs alone.

At each step boundary the members agree, with one small all-reduce, on the ids of the
samples processed in the step just done, on stopping, on a checkpoint and on a switch to
a newer generation; then the state is committed in memory. A collective that fails (a
dead peer) is noted and handled at the next boundary: the survivors report it, the
coordinator publishes the next generation, and the members continue from the newest
state any of them holds (see formation.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from gpuflex.elastic import agreement, keys
from gpuflex.elastic.env import WorkerEnv
from gpuflex.elastic.gradients import GradPlan, reduce_gradients
from gpuflex.elastic.formation import Formation
from gpuflex.elastic.keys import EVICTED_EXIT, STORE_LOST_EXIT
from gpuflex.elastic.logs import ensure_handler
from gpuflex.elastic.rendezvous import Evicted, Leaving, Rendezvous, StoreLost
from gpuflex.elastic.sampler import Batch, ElasticSampler
from gpuflex.elastic.state import Registry
from gpuflex.elastic.commits import StateMixin
from gpuflex.elastic.worker_control import report_progress, start_control

if TYPE_CHECKING:
    from gpuflex.elastic.loader import ElasticLoader
    from gpuflex.elastic.state import LightCommit

log = logging.getLogger(__name__)


class ElasticRun(StateMixin):
    """Drives an elastic data-parallel training loop; see the module docstring."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 num_samples: int, global_batch_size: int, epochs: int, seed: int = 0,
                 scheduler: Any = None, scaler: Any = None, extra: dict[str, Any] | None = None,
                 track_samples: bool = False, checkpoint_dir: str | None = None,
                 checkpoint_interval_s: float | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.sampler = ElasticSampler(num_samples, global_batch_size, epochs=epochs, seed=seed)
        self.registry = Registry()
        self.registry.add("model", model)
        self.registry.add("optimizer", optimizer)
        self.registry.add("scheduler", scheduler)
        self.registry.add("scaler", scaler)
        for name, obj in (extra or {}).items():
            self.registry.add(f"extra.{name}", obj)
        self.track_samples = track_samples
        self.samples: dict[int, list[int]] = {}
        self.step_log: list[list[float]] = []
        self.step = 0
        self.stopped = False
        env = self.env = WorkerEnv.from_environ()
        self.wid = env.worker_id
        self.store_address = env.store
        self.checkpoint_dir = checkpoint_dir or env.checkpoint_dir
        self.checkpoint_interval_s = float(checkpoint_interval_s or env.checkpoint_interval_s)
        self.pg_timeout_s = env.pg_timeout_s
        self.rank, self.world_size, self.generation = 0, 1, 0
        self.device = self._pick_device()
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.has_state = not self.distributed   # a newcomer gets it at its first formation
        self._light: LightCommit | None = None
        self.rdzv: Rendezvous | None = None
        self.formation: Formation | None = None
        self._broken: str | None = None       # a collective failed during this step
        self._stop_requested = threading.Event()
        self._checkpoint_requested = threading.Event()
        self._poke = threading.Event()         # look at the store's latest generation now
        self._last_ckpt = time.monotonic()
        self._last_progress = 0.0
        self._last_loss: torch.Tensor | None = None
        self._step_ids: torch.Tensor | None = None
        self._step_started: float | None = None
        self._started = False
        self.batch: Batch | None = None       # the step being trained now
        self._last_agree_s = 0.0
        self._vote: tuple | None = None      # the agreement, when it rode on the gradients
        self._store_lost: StoreLost | None = None
        self._buffer_slots: list[tuple[torch.nn.Module, str]] | None = None
        self._grad_plan: GradPlan | None = None   # gradients.reduce_gradients' buffer and views
        self.pg: dist.ProcessGroup | None = None   # this generation's, from init_process_group
        self._rate = 0.0
        self._pending_timings: dict[str, Any] | None = None
        self._formed_at: float | None = None   # the end of the last formation, until its first step
        self._control = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self._stop_requested.set())

    # ---- public properties ---------------------------------------------------------------
    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def epoch(self) -> int:
        return min(self.step // self.sampler.steps_per_epoch, self.sampler.epochs)

    @property
    def distributed(self) -> bool:
        return self.store_address is not None

    def _pick_device(self) -> torch.device:
        if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "") not in ("", "-1"):
            torch.cuda.set_device(0)
            return torch.device("cuda", 0)
        return torch.device("cpu")

    # ---- the loop -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """Every remaining step of the run, across epochs."""
        try:
            yield from self._steps(epoch=None)
        finally:
            self._close()

    def epochs(self) -> Iterator[int]:
        """The epochs still to run (a resumed or newly joined worker starts inside one);
        iterate `run.loader(dataset)` in each, as with a DistributedSampler."""
        try:
            with self._guard():
                self._ensure_started()
            while self._more():
                yield self.epoch
        finally:
            self._close()

    def loader(self, dataset: Any, collate_fn: Any = None) -> "ElasticLoader":
        """Batches of `dataset` for this rank's share of each step of the current epoch."""
        from gpuflex.elastic.loader import ElasticLoader

        return ElasticLoader(self, dataset, collate_fn)

    def _steps(self, epoch: int | None) -> Iterator[Batch]:
        with self._guard():
            self._ensure_started()
            # Every member meets the first batch of a generation straight from its
            # formation (survivors return from the switch into the same spot), so the
            # collectives line up; the boundary comes after each step.
            while self._more() and (epoch is None or self.epoch == epoch):
                batch = self.sampler.batch(self.step, self.rank, self.world_size)
                self.batch = batch
                self._step_ids = batch.indices if self.track_samples else None
                self._step_started = time.time()
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
        except Evicted as e:
            log.info("gpuflex: worker %d %s; exiting", self.wid, e)
            self._close()
            sys.exit(EVICTED_EXIT)
        except Leaving:
            self._close()
            sys.exit(0)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's *mean* loss over its share, weighted by the share's part
        of the global batch, then the gradients summed over the members: exactly the
        full-batch mean gradient, at any world size (as DDP's average is at a fixed one)."""
        batch = self.batch
        if self.world_size > 1:   # the large gradients' all-reduces start during backward
            if self._grad_plan is None:
                self._grad_plan = GradPlan(self)
            self._grad_plan.arm()
        if batch is not None and len(batch.indices) == 0:   # more ranks than samples this step
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            weight = batch.weight if batch is not None else 1.0
            (loss * weight if weight != 1.0 else loss).backward()
        self._last_loss = loss.detach()
        if self.world_size > 1 and self._broken is not None:
            self._drop_grads()
        elif self.world_size > 1:
            try:
                reduce_gradients(self)
            except StoreLost as e:   # raised at the boundary, where the runtime exits cleanly
                self._drop_grads()
                self._store_lost = e

    def _drop_grads(self) -> None:
        """After a failed all-reduce: with no gradient, optimizer.step() leaves every
        parameter (and its optimizer state) as it was; the light state is undone at the
        boundary, so the failed step leaves no trace."""
        for p in self.model.parameters():
            p.grad = None

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> bool:
        """A user collective that a dead peer cannot crash; False if it failed."""
        if self.world_size == 1:
            return True
        return self._collective(dist.all_reduce, tensor, op=op) if self._broken is None else False

    def _collective(self, fn, *args, **kwargs) -> bool:
        try:
            fn(*args, **kwargs)
            return True
        except (RuntimeError, ValueError) as e:   # DistBackendError is a RuntimeError
            self._broken = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return False

    # ---- start, boundary, switch ---------------------------------------------------------------
    def _start(self) -> None:
        if self.distributed or not logging.getLogger().handlers:   # a worker's log, or a plain script
            ensure_handler(sys.stderr)
        if not self.distributed:
            self.load_disk_checkpoint()
            return
        self._control = start_control(self, self.env.control)
        self.rdzv = Rendezvous(self.store_address, self.wid, timeout_s=max(60.0, self.pg_timeout_s))
        self.formation = Formation(self)
        self._warm_up()
        self.rdzv.set(keys.ready(self.wid), str(time.time()))
        self.formation.enter(after=0, was_member=False, failed_at=None)

    def _warm_up(self) -> None:
        """Before a newcomer says it is ready: its gradient buffer, allocated and touched, so
        its first step in the job does not pay for it while the others wait."""
        if any(p.requires_grad for p in self.model.parameters()):
            self._grad_plan = GradPlan(self)   # and its hooks
            self._grad_plan.flat.zero_()

    def _boundary(self) -> bool:
        """Confirm the step just done, then agree on what happens next. False: stop."""
        now = time.time()
        done_step = self._step_started is not None
        if self._store_lost is not None:
            raise self._store_lost
        if self.rdzv is not None and self.rdzv.lost.is_set():   # seen by the heartbeat thread
            raise StoreLost("the job store stopped answering heartbeats")
        self._step_started = None
        if self._broken is not None:   # this step's gradient all-reduce failed: undo it
            why, self._broken = self._broken, None
            self._undo_step()
            self.formation.recover(why)
            return self._more()
        flags, self._vote = self._vote or agreement.agree(self, done_step), None
        if flags is None:   # the agreement failed, after this rank completed its step
            why, self._broken = self._broken, None
            if done_step:
                ids = self.sampler.global_batch(self.step)[2].tolist() if self.track_samples else None
                self._confirm_step(ids, now)
            self._commit()
            self.formation.recover(why)
            return self._more()
        switch_to, stop, ckpt, ids = flags
        if done_step:
            self._confirm_step(ids, now)
        self._commit()
        if self._formed_at is not None and done_step:
            first, self._formed_at = now - self._formed_at, None
            self.formation.log(f"first step of generation {self.generation}: {first:.3f}s")
            if self._pending_timings is not None:   # rank 0
                self._pending_timings["first_step"] = first
                self.rdzv.set(keys.timings(self.generation), _json(self._pending_timings))
                self._pending_timings = None
        if stop:
            self.stopped = True
            self._checkpoint()
            return False
        if self.step >= self.sampler.total_steps:
            self._checkpoint()
            if self.rdzv is not None and self.rank == 0:
                self.rdzv.set(keys.FINISHED, "1")
            return False
        if self.rank == 0 and (ckpt or time.monotonic() - self._last_ckpt >= self.checkpoint_interval_s):
            self._checkpoint()
        report_progress(self)
        if switch_to > self.generation:
            self.formation.switch(switch_to, agreed_at=now)
            return self._more()
        return True

    def _more(self) -> bool:
        return self.step < self.sampler.total_steps and not self.stopped

    def _confirm_step(self, ids: list[int] | None, now: float) -> None:
        if ids is not None:
            self.samples.setdefault(self.epoch, []).extend(ids)
        self.step_log.append([self.step, now, self.world_size])
        self.step += 1

    def status(self) -> dict[str, Any]:
        loss = self._last_loss
        return {"wid": self.wid, "rank": self.rank, "world_size": self.world_size,
                "generation": self.generation, "step": self.step, "epoch": self.epoch,
                "samples_per_s": round(self._rate, 2),
                "loss": None if loss is None else float(loss),
                "time": time.time()}

    # ---- shutdown ------------------------------------------------------------------------------
    def _close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.rdzv is not None:
            try:
                self.rdzv.set(keys.done(self.wid), "1")
            except StoreLost:
                pass
            self.rdzv.close()
        if self._control is not None:
            self._control.close()
        self.destroy_process_group()

    def destroy_process_group(self) -> None:
        """Drop this generation's group, the runtime's reference included: with none left,
        gloo joins its threads here. A group that outlives this (referenced at exit) keeps
        threads that may free a finished work while the interpreter finalizes, and torch
        2.13 then aborts the process (see tests/test_examples.py)."""
        self.pg = None
        if self._grad_plan is not None:
            self._grad_plan.works = []   # finished; they would keep gloo's context alive
        if dist.is_initialized():
            dist.destroy_process_group()

    def init_process_group(self, g: int, rank: int, world: int) -> None:
        self.destroy_process_group()
        store = dist.PrefixStore(keys.pg_prefix(g), self.rdzv.store)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=self.pg_timeout_s))
        self.pg = dist.group.WORLD


def _json(data: Any) -> str:
    import json

    return json.dumps(data)

