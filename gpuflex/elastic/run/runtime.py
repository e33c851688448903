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
checkpoint and on a switch to a newer generation (boundary.py); then the state is
committed in memory. A collective that fails (a dead peer) is noted and handled at the next
boundary: the survivors report it, the coordinator publishes the next generation, and the
members continue from the newest state any of them holds (membership/joining.py). Before a
step's collectives the members pass a barrier over the job store (membership/liveness.py):
a busy member is waited for, a silent one fenced. With `shard=` the model is sharded with
FSDP2 over each generation and resharded in place (sharding/, sharded_steps.py). With
`exact="bitwise"` (or GPUFLEX_EXACT=bitwise) a data-parallel run keeps the bits of a
standalone run: `run.accumulate` yields the global batch's units and the units' gradients
are summed as integers (data/exact.py, data/exact_sum.py).

`ElasticRun` is this file's step loop over parts it composes (run/__init__.py lists them):
they share one `RunContext` (context.py), and the run's public attributes are the
context's, read through it.
"""

from __future__ import annotations

import signal
import threading
import time
from operator import attrgetter
from typing import Any, Iterator

import torch
import torch.distributed as dist

from gpuflex.elastic.data.exact import bitwise_units
from gpuflex.elastic.data.loader import ElasticLoader, Prefetcher
from gpuflex.elastic.data.micro import Accumulation, has_batch_norm, warm_up_steps
from gpuflex.elastic.data.sampler import Batch, ElasticSampler
from gpuflex.elastic.data.split_plan import SplitPlan
from gpuflex.elastic.membership.agreement import Agreement
from gpuflex.elastic.membership.collectives import Collectives, pick_device
from gpuflex.elastic.membership.liveness import close_after, close_at_exit
from gpuflex.elastic.membership.worker_control import Progress
from gpuflex.elastic.protocol import failpoints
from gpuflex.elastic.protocol.env import WorkerEnv
from gpuflex.elastic.protocol.signals import BY_SIGTERM, StepSignals
from gpuflex.elastic.run.boundary import Boundary
from gpuflex.elastic.run.context import RunContext
from gpuflex.elastic.run.data_steps import DataParallelSteps
from gpuflex.elastic.run.sharded_steps import ShardedSteps, shard_model
from gpuflex.elastic.run.startup import StartUp
from gpuflex.elastic.run.user_calls import UserCalls
from gpuflex.elastic.state.buffers import BufferSync
from gpuflex.elastic.state.training import TrainingState
from gpuflex.elastic.state.tree import Registry


def _shared(name: str, doc: str | None = None) -> property:
    """A run's attribute that is its context's (read-only), read in one C-level lookup."""
    return property(attrgetter(f"ctx.{name}"), doc=doc)


class ElasticRun:
    """Drives an elastic data-parallel training loop; see the module docstring.

    Its parts, each over the one `ctx` (context.py): `strategy`, the step strategy
    (`DataParallelSteps`, or `ShardedSteps` with `shard=`): `backward`, what a failed
    collective means, checkpoints; `startup` (`StartUp`): the start under gpuflex and the
    join; `boundary` (`Boundary`): what happens between two steps; `calls` (`UserCalls`):
    all_reduce, accumulate, global_mean, register. The context's collaborators are the
    run's attributes: `signals` (stop, checkpoint and poke requests), `state` (the step, the
    logs, the registered objects, commits and checkpoints), `group` (the process group and
    its failures), `agreement` (the step-boundary vote), `split` (each member's share of a
    step, by measured speed or even; data/split_plan.py), and, under gpuflex, `rdzv` (the job
    store) and `formation` (joining generations)."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 num_samples: int, global_batch_size: int, epochs: int | None = None,
                 steps: int | None = None, seed: int = 0, scheduler: Any = None, scaler: Any = None,
                 extra: dict[str, Any] | None = None, buffers: str = "broadcast",
                 warm_up: int | None = None, track_samples: bool = False,
                 checkpoint_dir: str | None = None, checkpoint_interval_s: float | None = None,
                 split: str | None = None, shard: Any = None, empty_batches: bool = False,
                 exact: str | None = None, unit: int | None = None) -> None:
        units = bitwise_units(model, num_samples, global_batch_size, exact, unit, shard=shard, scaler=scaler,
                              buffers=buffers)   # 0: the default mode; checked before anything starts
        device = pick_device()
        sharding = None   # shard=: FSDP2 over each generation; optimizer (and scheduler) are factories
        if shard is not None:
            sharding, optimizer, scheduler = shard_model(model, optimizer, scheduler, shard, device)
        sampler = ElasticSampler(num_samples, global_batch_size, epochs=epochs, steps=steps, seed=seed)
        plan = SplitPlan(global_batch_size, split,   # "speed" | "even"; None: GPUFLEX_SPLIT, else "speed"
                         least=2 if has_batch_norm(model) else 1,   # every member gets this many samples,
                         empty_ok=empty_batches,                   # or 0 where the script takes an empty batch
                         unit=units or 1)                          # bitwise: whole units
        heavy = sharding is None   # a sharded run's model and optimizer state move as shards only
        registry = Registry.of(model=model if heavy else None, optimizer=optimizer if heavy else None,
                               scheduler=scheduler, scaler=scaler, extra=extra)
        if not heavy:
            registry.add("sharded.param_groups", sharding.param_groups)
        registry.add("split", plan)   # committed with each step, copied to newcomers, checkpointed
        passes = warm_up_steps(model, warm_up)   # a newcomer's passes before it is ready
        env = WorkerEnv.from_environ()
        checkpoint_dir = checkpoint_dir or env.checkpoint_dir
        group = Collectives(device, env.pg_timeout_s)
        buffer_sync = BufferSync(model, group, buffers)
        state = TrainingState(registry=registry, model=model, sampler=sampler, buffers=buffer_sync,
                              distributed=env.store is not None, checkpoint_dir=checkpoint_dir,
                              resume_from=env.resume_from)
        ctx = self.ctx = RunContext(
            env=env, device=device, model=model, optimizer=optimizer, scheduler=scheduler, sharding=sharding,
            sampler=sampler, split=plan, registry=registry, group=group, buffers=buffer_sync, state=state,
            signals=StepSignals(), micro=Accumulation(), checkpoint_dir=checkpoint_dir,
            checkpoint_interval_s=float(checkpoint_interval_s or env.checkpoint_interval_s),
            warm_up_steps=passes, track_samples=track_samples, unit=units)
        ctx.micro.unit, ctx.micro.seed = units, seed   # bitwise: run.accumulate yields the units
        model.register_forward_pre_hook(ctx.began_forward)   # a step's compute starts at its forward
        sampler.unit = units or 1                      # ... and the shares are cut at their boundaries
        self.strategy = ShardedSteps(ctx) if sharding is not None else DataParallelSteps(ctx)
        if sharding is not None:
            sharding.on_forward = self.strategy.forward_barrier
        self.startup, self.boundary = StartUp(ctx, self.strategy), Boundary(ctx, self.strategy)
        self.calls = UserCalls(ctx)
        ctx.agreement = Agreement(batch_size=global_batch_size, track_samples=track_samples,
                                  signals=ctx.signals, group=group, switch_to=self.boundary.switch_to)
        ctx.progress = Progress(global_batch_size, ctx.status)
        # The script's calls in a step are the parts' own bound methods on the instance, so a
        # call costs what a method of the run costs (the class's methods below document them).
        self.backward, self.accumulate = self.strategy.backward, self.calls.accumulate
        self.all_reduce, self.global_mean = self.calls.all_reduce, self.calls.global_mean
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: ctx.signals.request_stop(BY_SIGTERM))

    # ---- public attributes: the context's ------------------------------------------------------
    @property
    def is_primary(self) -> bool:
        return self.ctx.rank == 0 and not self.ctx.warming_up

    step = _shared("state.step", "Global steps done (across epochs).")
    epoch = _shared("state.epoch", "The current epoch.")
    step_log = _shared("state.step_log", "[step, time, world size] per step done.")
    samples = _shared("state.samples", "Sample ids per epoch (track_samples).")
    distributed = _shared("distributed", "Under gpuflex (GPUFLEX_STORE set).")
    backend = _shared("group.backend", "gloo or nccl.")
    pg = _shared("group.pg", "This generation's process group.")
    rank = _shared("rank", "This member's rank in the current generation.")
    world_size = _shared("world_size", "The current generation's members.")
    generation = _shared("generation", "The current generation (0 before the first).")
    batch = _shared("batch", "The step being trained now (its Batch).")
    warming_up = _shared("warming_up", "A newcomer's passes through the loop before it is ready.")
    stopped = _shared("stopped", "A stop was agreed (or came while waiting for a generation).")
    wid = _shared("wid", "This worker's id in the job.")
    store_address = _shared("env.store", "The job store's address (None alone).")
    pg_timeout_s = _shared("env.pg_timeout_s")
    env, device, sharding = _shared("env"), _shared("device"), _shared("sharding")
    model, optimizer, scheduler = _shared("model"), _shared("optimizer"), _shared("scheduler")
    sampler, split, registry = _shared("sampler"), _shared("split"), _shared("registry")
    state, group, buffers = _shared("state"), _shared("group"), _shared("buffers")
    signals, agreement, progress = _shared("signals"), _shared("agreement"), _shared("progress")
    micro, warm_up_steps, track_samples = _shared("micro"), _shared("warm_up_steps"), _shared("track_samples")
    checkpoint_dir, checkpoint_interval_s = _shared("checkpoint_dir"), _shared("checkpoint_interval_s")
    rdzv, formation, barrier = _shared("rdzv"), _shared("formation"), _shared("barrier")

    # ---- the script's calls --------------------------------------------------------------------
    # (bound on the instance from the parts in __init__; these say what they are)
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's mean loss over its share, weighted, and the gradients
        summed over the members (the step strategy's: data_steps.py, sharded_steps.py)."""
        self.strategy.backward(loss)

    def accumulate(self, *tensors: torch.Tensor, micro_batch_size: int | None = None,
                   steps: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """Micro-batches of this rank's share (UserCalls.accumulate)."""
        return self.calls.accumulate(*tensors, micro_batch_size=micro_batch_size, steps=steps)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> bool:
        """A user collective that a dead peer cannot crash; False if it failed (UserCalls)."""
        return self.calls.all_reduce(tensor, op)

    def global_mean(self, value: float | torch.Tensor) -> float:
        """The global batch's mean of this rank's mean (UserCalls.global_mean)."""
        return self.calls.global_mean(value)

    def register(self, name: str, obj: Any) -> Any:
        """More state, checkpointed and carried to newcomers; before the loop (UserCalls.register)."""
        return self.calls.register(name, obj)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name. In a sharded run it all-gathers each one: every
        member calls it, inside the loop (e.g. in the last step, for a report)."""
        return self.strategy.full_parameters()

    def status(self) -> dict[str, Any]:
        """This worker's status record (RunContext.status)."""
        return self.ctx.status()

    def destroy_process_group(self) -> None:
        """Drop this generation's group (see Collectives.close)."""
        self.ctx.group.close()

    # ---- the loop -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """Every remaining step of the run, across epochs."""
        yield from close_after(self._steps(epoch=None), self.ctx.close)

    def epochs(self) -> Iterator[int]:
        """The epochs still to run (a resumed or newly joined worker starts inside one);
        iterate `run.loader(dataset)` in each, as with a DistributedSampler."""
        ctx = self.ctx
        try:
            with ctx.guard():
                self.startup.ensure_started()
            ctx.in_epochs = True
            if ctx.warming_up:   # one pass of the user's epoch body: the loader gives the warm-up batches
                yield ctx.state.epoch
                with ctx.guard():
                    self.startup.join()
            while ctx.more():
                yield ctx.state.epoch
        except BaseException:   # left early: the crash hook reports an exception before the close
            close_at_exit(ctx.close)
            raise
        ctx.close()

    def loader(self, dataset: Any, num_workers: int = 0, pin_memory: bool = False, collate_fn: Any = None,
               prefetch_factor: int | None = None, persistent_workers: bool = True) -> ElasticLoader:
        """This rank's share of each step of the current epoch inside `run.epochs()`, else of every
        remaining step; `num_workers > 0`: read ahead by processes that live for the whole run.

        `persistent_workers` is accepted as DataLoader's is, so a converted call keeps it: the
        read-ahead DataLoader is iterated once for the whole run (data/loader.py), so its
        workers always persist; False, which asks for workers ended after each epoch, is a
        ValueError rather than silently not done."""
        if not persistent_workers:
            raise ValueError("run.loader(persistent_workers=False): the read-ahead workers live for the "
                             "whole run (across epochs and resizes) and cannot end after each epoch; "
                             "drop the argument")
        ctx, sampler = self.ctx, self.ctx.sampler
        pre = Prefetcher(dataset, sampler, num_workers, pin_memory, collate_fn, prefetch_factor) \
            if num_workers else None
        return ElasticLoader(lambda: (self._steps(ctx.state.epoch), sampler.steps_per_epoch) if ctx.in_epochs
                             else (iter(self), sampler.total_steps - ctx.state.step), dataset, collate_fn, pre)

    def _steps(self, epoch: int | None) -> Iterator[Batch]:
        ctx, startup, boundary = self.ctx, self.startup, self.boundary
        with ctx.guard():
            startup.ensure_started()
            if ctx.warming_up:
                yield from startup.warm_up_passes()
                if epoch is not None:   # epochs() joins once the user's warm-up pass is over
                    return
                startup.join()
            # Every member meets the first batch of a generation straight from its
            # formation (survivors return from the switch into the same spot), so the
            # collectives line up; the boundary comes after each step.
            state, sampler, split, agreement = ctx.state, ctx.sampler, ctx.split, ctx.agreement
            while ctx.more() and (epoch is None or state.epoch == epoch):
                boundary.plan_split()
                batch = sampler.batch(state.step, ctx.rank, ctx.world_size, split.shares_for(ctx.world_size))
                ctx.batch = batch
                agreement.begin_step(batch)
                ctx.step_started = time.time()
                ctx.begin_step()
                if failpoints.ARMED and ctx.formed_at is not None and ctx.formed_kind == "resize":
                    failpoints.hit("resize.first_step", **ctx.where())
                yield batch
                if not boundary.after_step():
                    return
