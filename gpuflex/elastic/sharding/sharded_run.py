"""A sharded run: `ElasticRun(model=..., optimizer=lambda params: ..., shard=...)` (issue 13).

The runtime owns FSDP2 for the script: `fully_shard` over each generation's process group
(the submodules `shard` names, then the root), the optimizer built once on the model's
parameters and kept (its param_groups take the sharded ones), and the gradient sum made a
plain sum (`set_gradient_divide_factor(1)` with sum-only collectives), so that each rank's
loss weighted by its share of the global batch gives the exact weighted-mean gradient, as
the data-parallel path's all-reduce does.

Who holds what: each process holds shard `index` of `count` of every parameter and of the
optimizer state shaped like it, or nothing. A process that has never been sharded holds the
whole model as the script built it (shard 0 of 1). At every formation (`form`) the members
sum who holds which shard and move them, point to point, to the new members
(gpuflex.elastic.sharding.fsdp.reshard_in_place): the first generation takes rank 0's model, a
resize moves only the rows each new owner lacks, and newcomers receive only their own. A
shrink's leavers hand their shards to the survivors before they go (`before_switch`, over
the old group), since they are no members of the next group.

The per-step commit holds no model or optimizer state (it would mean a full gather): a
step whose collectives failed cannot be undone, and a member killed takes the only copy of
its shards. Both end the run with `ShardsLost` (one line, SHARDS_LOST_EXIT): the job
restarts from its last distributed checkpoint (shard_checkpoints.py; `restore` at the
first formation of the restart) and replays the steps since. A checksum mismatch of a move is
rolled back like the data-parallel state copy's: the old holders keep their old shards
(`held`) and the rollback generation takes them from there.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from gpuflex.elastic.sharding import pages, fsdp as sharded
from gpuflex.elastic.membership.collectives import group_backend, pick_backend
from gpuflex.elastic.state.training import NO_CHECKPOINT_EXIT
from gpuflex.elastic.sharding.checkpoints import UnsafeCheckpoint
from gpuflex.elastic.membership.joining import ShardsLost, StateMismatch
from gpuflex.elastic.protocol.logs import describe

log = logging.getLogger(__name__)

ENDS = ("a sharded job keeps one copy of each shard and no per-step copy to roll back to: it restarts "
        "from its last distributed checkpoint and replays the steps since")


class ParamGroups:
    """The optimizer's hyperparameters (lr, betas, weight decay: what a scheduler or the
    script writes into param_groups) as light state: committed each step, copied to
    newcomers. The parameters and the per-parameter state move with the shards."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def load_state_dict(self, groups: list[dict[str, Any]]) -> None:
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update(saved)


def check_factory(optimizer: Any) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise TypeError("with shard=, optimizer must be a function of the parameters that builds the optimizer "
                        "(e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)), not "
                        f"{type(optimizer).__name__}: sharding replaces the parameters")
    return optimizer


class Sharding:
    """A run's sharded model and its optimizer (see the module docstring). `on_forward`,
    when set, is called before each forward, ahead of FSDP's all-gathers (the runtime's
    step barrier)."""

    def __init__(self, model: nn.Module, make_optimizer: Any, shard: sharded.ShardSpec,
                 device: torch.device) -> None:
        make = check_factory(make_optimizer)
        if isinstance(model, FSDPModule):
            raise ValueError("with shard=, pass the model unsharded: the runtime applies fully_shard "
                             "over each generation's process group")
        sharded.targets(model, shard)   # a bad shard= is a ValueError now, not at the first formation
        self.model, self.shard, self.device = model, shard, device
        self.optimizer = make(list(model.parameters()))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer(params) returned {type(self.optimizer).__name__}, not a torch optimizer")
        self.param_groups = ParamGroups(self.optimizer)
        try:   # each parameter's place in the param_groups, kept across reshards
            self.slots = sharded.param_slots(model, self.optimizer)
        except KeyError:
            raise ValueError("with shard=, the optimizer must hold every parameter of the model") from None
        self.index: int | None = 0   # the shard this process holds, of `count` (a fresh one: all of it)
        self.count = 1
        self.started = False        # sharded once: its plain model is no longer the job's
        self.held: sharded.Held | None = None   # old shards kept after a failed move
        self.stats: sharded.Stats | None = None
        self.on_forward: Callable[[], None] | None = None
        self._hook: Any = None
        self._reserved = False

    # ---- formations -------------------------------------------------------------------
    def start_alone(self) -> None:
        """A standalone run: a one-process group of its own, then the usual formation."""
        dist.init_process_group(group_backend(pick_backend(self.device)), store=dist.HashStore(), rank=0, world_size=1)
        self.form(0, 1)

    def form(self, rank: int, world: int) -> int:
        """Shard the model over the current group (every member calls it): from the old
        holders to ranks 0..world-1. Returns the bytes of this rank's new shards; raises
        StateMismatch on a checksum mismatch, ShardsLost when a shard has no holder."""
        old = self._holders(rank, world)
        held = None
        if rank in old:
            held = self.held if self.held is not None else sharded.hold(self.model, self.optimizer, self.index,
                                                                        self.count)
        mesh = DeviceMesh(self.device.type, list(range(world)))
        try:
            optimizer, stats = sharded.reshard_in_place(
                self.model, self.optimizer, None, held, old=old, new=list(range(world)), rank=rank, mesh=mesh,
                shard=self.shard, slots=self.slots)
        except RuntimeError as e:
            self.held = held                  # a holder keeps its old shards for a retry or rollback
            if held is None:
                self.index = None
            if isinstance(e, sharded.ChecksumMismatch):
                raise StateMismatch(None, False, str(e)) from None
            raise
        assert optimizer is self.optimizer
        if self._reserved:   # used by the move: frees hand memory back again
            pages.settle()
            self._reserved = False
        self.index, self.count, self.held, self.started, self.stats = rank, world, None, True, stats
        _log_move(f"{len(old)} -> {world} shards", stats)
        self._configure()
        return stats.new_bytes

    def prepare(self, world: int, total: Callable[[], int | None]) -> None:
        """A newcomer told it joins a resize of `world` members, before it meets them (the
        others finish their step meanwhile): the memory its shards will fill is touched now
        (pages.reserve), not page by page inside the survivors' stall. `total()`: the sharded
        state's bytes rank 0 counted (keys.SHARD_BYTES; None: unknown), capped by 4x this
        process's own model; asked only here. A member that holds shards, or a GPU's,
        reserves nothing."""
        if self.started or self.device.type != "cpu":
            return
        size = total()
        if not size:
            return
        own = sum(p.numel() * p.element_size() for p in self.model.parameters())
        share = min(size, 4 * own) // world
        t = time.perf_counter()
        got = pages.reserve(share)
        self._reserved = got > 0
        log.info("gpuflex: this newcomer's share of the sharded state is %d bytes; %d bytes reserved (%.3fs)",
                 share, got, time.perf_counter() - t)

    def before_switch(self, members: list[int], wid: int, rank: int, world: int) -> None:
        """At an agreed switch, over the old group (every old member calls it): when some
        members leave, their shards move to the staying ones, who then hold shards
        0..k-1 in the order of their new ranks; a leaver holds nothing after."""
        vec = torch.zeros(world, dtype=torch.int64)
        vec[rank] = members.index(wid) + 1 if wid in members else 0
        try:
            dist.all_reduce(vec)
        except RuntimeError as e:
            raise ShardsLost(f"the switch's shard count failed ({describe(e)}); {ENDS}") from None
        if all(int(v) for v in vec):
            return
        survivors = [r for _, r in sorted((int(v), r) for r, v in enumerate(vec) if int(v))]
        if not survivors:
            raise ShardsLost(f"every member of the sharded job leaves at once, with the shards; {ENDS}")
        if (self.index, self.count) != (rank, world):
            raise ShardsLost(f"rank {rank} of {world} holds shard {self.index} of {self.count}; {ENDS}")
        held = sharded.hold(self.model, self.optimizer, rank, world)
        mesh = DeviceMesh(self.device.type, survivors)
        try:
            _, stats = sharded.reshard_in_place(self.model, self.optimizer, None, held, old=list(range(world)),
                                                new=survivors, rank=rank, mesh=mesh, shard=self.shard, slots=self.slots)
        except RuntimeError as e:
            raise ShardsLost(f"the leaving members' shards could not be moved ({describe(e)}); {ENDS}") from None
        self.index = survivors.index(rank) if rank in survivors else None
        self.count = len(survivors)
        _log_move(f"{world} -> {len(survivors)} shards, before {world - len(survivors)} leave", stats)

    def _holders(self, rank: int, world: int) -> list[int]:
        """The rank holding each old shard. Where a member was ever sharded only those
        count; otherwise every member holds the whole model as built and rank 0's is used."""
        vec = torch.zeros(3 * world, dtype=torch.int64)
        if self.index is not None:
            vec[rank], vec[world + rank] = self.index + 1, self.count
        vec[2 * world + rank] = int(self.started)
        dist.all_reduce(vec)
        started = [bool(int(vec[2 * world + r])) for r in range(world)]
        eligible = [r for r in range(world) if int(vec[r]) and (started[r] or not any(started))]
        if not eligible:
            raise ShardsLost(f"no member of this generation holds the sharded state; {ENDS}")
        counts = {int(vec[world + r]) for r in eligible}
        if len(counts) != 1:
            raise ShardsLost(f"the members hold shards of different cuts {sorted(counts)}; {ENDS}")
        old: list[int | None] = [None] * counts.pop()
        for r in eligible:
            k = int(vec[r]) - 1
            if old[k] is None:
                old[k] = r
        lost = [k for k, r in enumerate(old) if r is None]
        if lost:
            raise ShardsLost(f"shard(s) {lost} of {len(old)} were held only by members that are gone; {ENDS}")
        return old

    def _configure(self) -> None:
        """After fully_shard: gradients summed, not averaged (each loss carries its share's
        weight), and the runtime's hook ahead of FSDP's pre-forward all-gathers."""
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)   # gloo has no PREMUL_SUM: a SUM, divided by 1
        if self._hook is not None:
            self._hook.remove()
        self._hook = self.model.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self, *_: Any) -> None:
        if self.on_forward is not None:
            self.on_forward()

    def restore(self, group: Any, path: str | None) -> None:
        """After the first formation of a (re)start, every member calls it: the shards from the
        distributed checkpoint at `path` (rank 0's, from the light checkpoint it loaded; sent
        to the others over `group`, None when alone), resharded to this generation."""
        if group is not None:
            path = group.broadcast_bytes((path or "").encode() if group.rank == 0 else None, 0, 4096).decode() or None
        if path is None:
            return
        try:
            sharded.load(self.model, self.optimizer, path)
        except (UnsafeCheckpoint, OSError, RuntimeError) as e:   # DCP raises on every rank when one failed
            log.error("gpuflex: the distributed checkpoint %s cannot be read (%s); the job cannot resume and "
                      "does not start over", path, describe(e))
            raise SystemExit(NO_CHECKPOINT_EXIT) from None
        log.info("gpuflex: shards restored from %s at %d shard(s)", path, self.count)

    # ---- what the script reads -----------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name: an all-gather of each (every member calls it)."""
        return {n: _full(p).detach().clone() for n, p in self.model.named_parameters()}


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole. A DTensor's `full_tensor` all-gathers on its device; on CUDA over
    gloo (several workers sharing one GPU, GPUFLEX_BACKEND=gloo) that crashed the worker
    (SIGSEGV, seen on an H200 with torch 2.11), so there the dim-0 shards travel through
    CPU memory, as a resharding's rows do (reshard._stages_through_cpu)."""
    if not hasattr(p, "full_tensor"):
        return p
    placements = getattr(p, "placements", ())
    group = p.device_mesh.get_group() if p.device_mesh.ndim == 1 else None
    if not (p.is_cuda and p.dim() > 0 and group is not None and dist.get_backend(group) == "gloo"
            and len(placements) == 1 and placements[0].is_shard(0)):
        return p.full_tensor()
    return gather_rows_through_cpu(p.to_local(), group, tuple(p.shape)).to(p.device)


def gather_rows_through_cpu(local: torch.Tensor, group: dist.ProcessGroup,
                            shape: tuple[int, ...]) -> torch.Tensor:
    """The whole tensor of `shape` from each member's dim-0 shard (rank order, shards of any
    length, none included), gathered as CPU tensors over `group`."""
    shard = local.detach().cpu().contiguous()
    world = dist.get_world_size(group)
    rows = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, torch.tensor([shard.shape[0]], dtype=torch.int64), group=group)
    most = max(int(r) for r in rows)
    padded = torch.zeros((most, *shard.shape[1:]), dtype=shard.dtype)
    padded[:shard.shape[0]] = shard
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    whole = torch.cat([part[:int(r)] for part, r in zip(parts, rows)])
    if tuple(whole.shape) != tuple(shape):
        raise RuntimeError(f"gathered {tuple(whole.shape)} for a tensor of shape {tuple(shape)}")
    return whole


def _log_move(what: str, stats: sharded.Stats) -> None:
    log.info("gpuflex: resharded %s: rows sent %d, received %d; old shards %d bytes + new %d = peak extra %d",
             what, stats.sent_rows, stats.received_rows, stats.held_bytes, stats.new_bytes, stats.peak_extra_bytes)

