"""`RunContext`: what the parts of an `ElasticRun` share, in one object they all hold.

The parts (startup.py, user_calls.py, boundary.py, data_steps.py, sharded_steps.py) read and
write the run through this object's public attributes and methods only: its collaborators
(fixed at construction), what joining the job store adds (`rdzv`, `formation`, `barrier`),
the current generation (`rank`, `world_size`, `generation`), the step being trained and its
timings, and the run's flags. Its methods are the few acts every part needs: crossing the
step barrier (`cross`), taking a formation's result (`joined`), the status record, and the
run's ways out (`guard`, `close`).

A field is read with one attribute lookup (slots, no properties on the hot path), so a
step costs what it cost when the parts were one class.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch

from gpuflex.elastic.data.micro import Accumulation
from gpuflex.elastic.data.sampler import Batch, ElasticSampler
from gpuflex.elastic.data.split_plan import SplitPlan
from gpuflex.elastic.membership.agreement import Agreement
from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.membership.joining import Formation, Formed, ShardsLost
from gpuflex.elastic.membership.liveness import StepBarrier
from gpuflex.elastic.membership.rendezvous import Aborted, Evicted, Leaving, Rendezvous, StoreLost
from gpuflex.elastic.membership.worker_control import Progress
from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.env import WorkerEnv
from gpuflex.elastic.protocol.keys import ABORTED_EXIT, EVICTED_EXIT, SHARDS_LOST_EXIT, STORE_LOST_EXIT
from gpuflex.elastic.protocol.signals import StepSignals
from gpuflex.elastic.state.buffers import BufferSync
from gpuflex.elastic.state.training import TrainingState
from gpuflex.elastic.state.tree import Registry

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class RunContext:
    """The run's shared state (see the module docstring). Built by ElasticRun.__init__;
    `agreement` and `progress` are set right after, as they call back into the parts."""

    # ---- fixed at construction
    env: WorkerEnv
    device: torch.device
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    sharding: Any   # a sharded run's Sharding (sharding/sharded_run.py), else None
    sampler: ElasticSampler
    split: SplitPlan
    registry: Registry
    group: Collectives
    buffers: BufferSync
    state: TrainingState
    signals: StepSignals
    micro: Accumulation
    checkpoint_dir: str | None
    checkpoint_interval_s: float
    warm_up_steps: int
    track_samples: bool
    unit: int = 0   # exact="bitwise": samples per unit (data/exact.py); 0: the default mode
    agreement: Agreement = field(init=False)
    progress: Progress = field(init=False)

    # ---- under gpuflex, once started (None alone)
    rdzv: Rendezvous | None = None
    formation: Formation | None = None
    barrier: StepBarrier | None = None   # the step barrier (liveness.py)
    control: Any = None                  # the control socket's server

    # ---- the current generation
    rank: int = 0
    world_size: int = 1
    generation: int = 0
    formed_at: float | None = None   # the end of the last formation, until its first step
    formed_kind: str = ""
    pending_timings: dict[str, Any] | None = None   # rank 0: the formation's timings, until its first step

    # ---- the step being trained
    batch: Batch | None = None
    step_started: float | None = None   # time.time() at its start; None once its boundary began
    t_step: float = 0.0    # its start (perf_counter): the batch handed out, then its first training forward
    waited: float = 0.0    # its time at the step barriers since then
    computing: bool = False   # its first training forward has begun
    crossed: tuple[Any, ...] = ()   # (generation, step, phase) of the last barrier crossed
    last_loss: torch.Tensor | None = None
    store_lost: StoreLost | None = None   # seen inside a step, raised at its boundary

    # ---- flags
    started: bool = False
    in_epochs: bool = False    # inside run.epochs(): the loader gives one epoch per iteration
    warming_up: bool = False   # a newcomer's passes through the loop before it says it is ready
    stopped: bool = False
    closed: bool = False

    @property
    def wid(self) -> int:
        return self.env.worker_id

    @property
    def distributed(self) -> bool:
        """Under gpuflex (GPUFLEX_STORE set)."""
        return self.env.store is not None

    def more(self) -> bool:
        """Steps are left and no stop was agreed."""
        return self.state.step < self.sampler.total_steps and not self.stopped

    def where(self) -> dict[str, int]:
        """This worker's place, for a failpoint's filters."""
        return {"wid": self.wid, "rank": self.rank, "gen": self.generation, "step": self.state.step}

    def cross(self, phase: str, vote: int | None = None) -> bool:
        """The step barrier before this step's collectives: False (noted as a failed collective)
        when a member it waits for is dead, crashed or gone (see liveness.py). `vote`: a
        voting barrier (the boundary's agreement riding it)."""
        self.crossed = (self.generation, self.state.step, phase)
        t = time.perf_counter()
        ok = self.barrier is None or self.barrier.cross_noted(self.group, self.generation, self.world_size, phase,
                                                              vote)
        self.waited += time.perf_counter() - t
        return ok

    def begin_step(self) -> None:
        """A step's batch handed to the script: its compute is timed from here until its
        first training forward says otherwise (`began_forward`)."""
        self.t_step, self.waited, self.computing = time.perf_counter(), 0.0, False

    def began_forward(self, module: torch.nn.Module, args: Any) -> None:
        """The model's forward pre-hook. The step's first forward with gradients on and the
        model in training mode restarts the step's clock: what the script does between the
        batch and that forward (rank 0's evaluation under no_grad, a metric's all-reduce)
        is not this rank's compute of the step, and counted as such it made rank 0 look
        slow and the speed split starve it (issue 28 item 3). A script whose forward never
        reaches this module (no hook fired) is timed from the batch, as before, and so is
        a forward torch.compile traces through this hook: it returns at once there, so a
        fullgraph compile does not break on it."""
        if torch.compiler.is_compiling():
            return
        if not self.computing and module.training and torch.is_grad_enabled():
            self.t_step, self.waited, self.computing = time.perf_counter(), 0.0, True

    def compute_s(self) -> float:
        """This rank's compute of the step so far: from `t_step`, less the barriers."""
        return time.perf_counter() - self.t_step - self.waited

    def joined(self, formed: Formed | None) -> None:
        """A formation ended: in a new generation, or (None) stopped while waiting for one."""
        if formed is None:
            self.stopped = True
            if self.generation > 0:   # a member's stop while it waited for the next generation
                self.say_stopped()
            return
        self.rank, self.world_size, self.generation = formed.rank, formed.world_size, formed.generation
        self.formed_at, self.formed_kind = formed.at, formed.kind
        self.pending_timings = formed.timings

    def say_stopped(self) -> None:
        """A stop agreed (or, waiting for a generation, asked) before the end of training: the
        worker that was asked to stop says so in the store (keys.STOPPED), so that the control
        side, when no cancel or time limit of its own ended the run, restarts the job instead
        of calling a run whose workers exited 0 early a success. A lost store changes nothing
        here: the stop goes on."""
        by = self.signals.stop_by
        if by is None or self.rdzv is None or self.state.step >= self.sampler.total_steps:
            return
        record = {"wid": self.wid, "by": by, "step": self.state.step, "of": self.sampler.total_steps}
        with contextlib.suppress(StoreLost):
            self.rdzv.set(keys.STOPPED, json.dumps(record))

    def status(self) -> dict[str, Any]:
        """The worker's status record (its control socket's answer, rank 0's progress record)."""
        loss = self.last_loss
        return {"wid": self.wid, "rank": self.rank, "world_size": self.world_size, "generation": self.generation,
                "step": self.state.step, "epoch": self.state.epoch, "samples_per_s": round(self.progress.rate, 2),
                "loss": None if loss is None else float(loss), "checkpoint_failures": self.state.checkpoint_failures,
                "checkpoint_error": self.state.last_checkpoint_error,
                "waiting_for": list(self.barrier.waiting_for) if self.barrier else [], "time": time.time(),
                **self.split.record()}

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """The runtime's own ways out become exit codes, with the store and sockets closed."""
        try:
            yield
        except StoreLost as e:
            log.info("gpuflex: %s; exiting with %d so the job restarts from its last checkpoint",
                     e, STORE_LOST_EXIT)
            self.close()
            os._exit(STORE_LOST_EXIT)
        except (Evicted, Aborted) as e:
            log.info("gpuflex: worker %d %s; exiting", self.wid, f"aborted: {e}" if isinstance(e, Aborted) else e)
            self.close()
            sys.exit(ABORTED_EXIT if isinstance(e, Aborted) else EVICTED_EXIT)
        except Leaving:
            self.close()
            sys.exit(0)
        except ShardsLost as e:   # the job restarts from its distributed checkpoint (sharding/)
            log.error("gpuflex: worker %d: %s", self.wid, e)
            self.close(done=False)   # not done: the control side sees the exit code and restarts the job
            logging.shutdown()
            os._exit(SHARDS_LOST_EXIT)

    def close(self, done: bool = True) -> None:
        """Say this worker is done (unless not `done`), close the store, the control socket
        and the process group; once."""
        if self.closed:
            return
        self.closed = True
        if self.rdzv is not None:
            with contextlib.suppress(StoreLost):
                if done:
                    self.rdzv.set(keys.done(self.wid), "1")
            self.rdzv.close()
        if self.control is not None:
            self.control.close()
        self.group.close()


class StepStrategy(Protocol):
    """What the runtime asks of a kind of run (data_steps.DataParallelSteps,
    sharded_steps.ShardedSteps), each over the run's context."""

    def backward(self, loss: torch.Tensor) -> None:
        """`run.backward`."""

    def prepare(self) -> None:
        """At start-up under gpuflex, before the first formation."""

    def vote_rode(self) -> bool:
        """At a boundary: the step's vote rode its own collective (or barrier)."""

    def vote_rides_barrier(self) -> bool:
        """At a boundary: the vote is to ride the boundary's step barrier."""

    def no_undo(self, why: str | None) -> None:
        """A collective failed: raise if this kind of run cannot undo the step."""

    def checkpoint(self, agreed: bool) -> bool:
        """Write this member's part of a checkpoint; False: failed or nothing to write."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """`run.full_parameters`."""
