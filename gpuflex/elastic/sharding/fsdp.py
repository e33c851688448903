"""FSDP2 state resharded in place when the world size changes (issue 13's mechanism).

`fully_shard` can be applied to a module once, over one mesh; a job that changes size
needs its modules sharded over a new mesh while the processes, the module objects the
script holds, and the optimizer object stay the same. So a resize here:

1. `hold`: before the old group is closed, each survivor keeps references to its old local
   shards (parameters, and the optimizer's state tensors shaped like them), their row
   counts, its replicated buffers, and an exact checksum of each (gpuflex.elastic.sharding.reshard).
2. `reshard` over the new group (survivors and newcomers; a shrink's leavers too, to send):
   `strip` undoes fully_shard on every module (full-shape meta parameters back in place, the
   FSDP class, hooks and state registrations removed), `apply` shards again over the new
   mesh, `to_empty` allocates the new local shards, and gpuflex.elastic.sharding.reshard.move_all fills
   them point to point from their old holders, straight into FSDP's own storage. The
   optimizer keeps its identity: its param_groups take the new parameters and its state is
   moved the same way; scalar state (Adam's `step`) and the buffers come from a holder.
3. The checksums of the old and of the new shards are summed over the group; a mismatch
   raises (the caller rolls back to its checkpoint), so a bad move is never trained on.

No rank gathers a full tensor: a rank's extra memory is its old shards (held until the move
ends) plus its new ones; `Stats` says how much that was. Stripping reaches into FSDP2's
state and module registration, which has no public way back: that is
gpuflex.elastic.torch_compat.undo_fully_shard, which fails loudly if a torch release changes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Iterable, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from gpuflex.elastic import torch_compat
from gpuflex.elastic.sharding import reshard
from gpuflex.elastic.sharding.checkpoints import SafeReader, alone, write_rank

# which submodules get their own fully_shard (the root always gets one): a module class or
# classes, or a function of the root returning the modules
ShardSpec = Union[type, tuple, Callable[[nn.Module], Iterable[nn.Module]], None]

torch_compat.preload_dynamo()   # fully_shard's first call imports it: 0.4 s, paid here, ahead of a resize


def targets(model: nn.Module, shard: ShardSpec) -> list[nn.Module]:
    """The modules to shard, children before their parents, the root last."""
    if shard is None:
        chosen: list[nn.Module] = []
    elif isinstance(shard, (type, tuple)):
        chosen = [m for m in model.modules() if isinstance(m, shard) and m is not model]
    else:
        chosen = [m for m in shard(model) if m is not model]
    order = {id(m): i for i, m in enumerate(model.modules())}
    unknown = [type(m).__name__ for m in chosen if id(m) not in order]
    if unknown:
        raise ValueError(f"shard= named modules that are not part of the model: {', '.join(unknown)}")
    return sorted(chosen, key=lambda m: -order[id(m)]) + [model]


def apply(model: nn.Module, shard: ShardSpec, mesh: DeviceMesh) -> None:
    for m in targets(model, shard):
        fully_shard(m, mesh=mesh)


def strip(model: nn.Module) -> None:
    """Undo fully_shard on every module of `model`: each sharded parameter becomes a
    full-shape parameter on the meta device again (no memory), so `apply` can shard anew."""
    torch_compat.undo_fully_shard(model)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclasses.dataclass
class Held:
    """A survivor's old shards, kept until they have been moved to their new owners."""

    rows: list[int]                               # each parameter's dim-0 size, in parameters() order
    params: list[torch.Tensor]                    # the local shards
    states: list[dict[str, torch.Tensor]]         # each parameter's optimizer state shards
    scalars: list[dict[str, list]]                # each parameter's scalar optimizer state: [value, is a tensor]
    buffers: dict[str, torch.Tensor]
    checksum: int                                 # over this rank's old shards

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> Iterable[torch.Tensor]:
        yield from self.params
        for s in self.states:
            yield from s.values()


@dataclasses.dataclass(frozen=True)
class Stats:
    held_bytes: int     # this rank's old shards, kept through the move
    new_bytes: int      # its new shards
    sent_rows: int
    received_rows: int

    @property
    def peak_extra_bytes(self) -> int:
        return self.held_bytes + self.new_bytes


def _is_sharded_state(v: Any, p: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0


def hold(model: nn.Module, optimizer: torch.optim.Optimizer, old_rank: int, old_world: int) -> Held:
    params = list(model.parameters())
    rows = [p.shape[0] for p in params]
    shards = [local(p).detach() for p in params]
    states, scalars = [], []
    for p in params:
        st = optimizer.state.get(p, {})
        states.append({k: local(v).detach() for k, v in st.items() if _is_sharded_state(v, p)})
        scalars.append({k: [float(v), isinstance(v, torch.Tensor)] for k, v in st.items() if not _is_sharded_state(v, p)})
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    total = 0
    for i, (n, p) in enumerate(zip(rows, params)):
        start = reshard.bounds(n, old_world)[old_rank][0]
        for j, t in enumerate([shards[i], *(states[i][k] for k in sorted(states[i]))]):
            total += _weigh(reshard.checksum(t, start), i, j)
    return Held(rows, shards, states, scalars, buffers, total % reshard.PRIME)


class ChecksumMismatch(RuntimeError):
    """The resharded state does not sum to the old shards' checksum (raised on every rank)."""


def _weigh(c: int, i: int, j: int) -> int:
    return c * ((i * 64 + j) % reshard.PRIME + 1) % reshard.PRIME


def reshard_in_place(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
                     held: Held | None, *, old: Sequence[int | None], new: Sequence[int], rank: int,
                     mesh: DeviceMesh | None, shard: ShardSpec,
                     group: dist.ProcessGroup | None = None,
                     slots: list[tuple[int, int]] | None = None) -> tuple[torch.optim.Optimizer | None, Stats]:
    """Shard `model` over `mesh` (this rank's new shard; None for a leaver) from the old
    shards `held` by the ranks `old` (group rank of each old shard's holder), for the new
    owners `new`. Every rank of `group` calls it. A newcomer (held None) passes its model
    as built (ideally on the meta device) and either optimizer None (`make_optimizer`
    builds it) or an optimizer built on the model as built, which keeps its identity.
    `slots` (each parameter's place in the optimizer's param_groups, in parameters()
    order) is read from the optimizer when not given; a retry after a failed move must
    pass it (the optimizer still names the parameters of before). Returns the optimizer
    (the same object where one was given) and the move's stats; raises ChecksumMismatch
    when the checksums of the old and the new shards differ."""
    source = min(r for r in old if r is not None)
    info = _broadcast_json(_describe(held) if rank == source else None, source, group)
    stays = rank in new
    if slots is None and optimizer is not None:
        slots = param_slots(model, optimizer)
    if isinstance(model, FSDPModule):
        strip(model)
    if stays:
        apply(model, shard, mesh)
        model.to_empty(device=mesh.device_type)
    params = list(model.parameters()) if stays else [None] * len(info["rows"])
    sent = received = 0
    new_states: list[dict[str, torch.Tensor]] = []
    pieces: list[reshard.Piece] = []
    for i, n in enumerate(info["rows"]):
        p = params[i]
        like = torch.empty((0, *info["shapes"][i][1:]), dtype=getattr(torch, info["dtypes"][i]))
        pieces.append(reshard.Piece(held.params[i] if held else None, n, like, local(p).data if p is not None else None))
        states: dict[str, torch.Tensor] = {}
        for k in info["state_keys"][i]:
            if p is not None:   # every row is filled by the move (the checksum says so)
                states[k] = torch.empty_like(p)
            pieces.append(reshard.Piece(held.states[i][k] if held else None, n, like,
                                        local(states[k]) if p is not None else None))
        new_states.append(states)
        tensors = 1 + len(info["state_keys"][i])
        sent += tensors * _rows_moved(n, old, new, rank, sending=True)
        received += tensors * _rows_moved(n, old, new, rank, sending=False)
    reshard.move_all(pieces, old, new, rank=rank, group=group)
    _check(info, held, params, new_states, old, new, rank, group)
    _load_buffers(model, held, source, group, stays)
    if not stays:
        return optimizer, Stats(held.nbytes if held else 0, 0, sent, received)
    optimizer = _rebind(optimizer, make_optimizer, slots, params)
    for i, p in enumerate(params):
        st = optimizer.state[p]
        st.update(new_states[i])
        for k, (v, is_tensor) in info["scalars"][i].items():
            st[k] = torch.tensor(v, dtype=torch.float32) if is_tensor else v
    new_bytes = sum(local(t).numel() * local(t).element_size()
                    for p, s in zip(params, new_states) for t in (p, *s.values()))
    return optimizer, Stats(held.nbytes if held else 0, new_bytes, sent, received)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """A distributed checkpoint (torch.distributed.checkpoint) of the model and optimizer
    in `directory`, resumable at any world size: each rank writes its own shards into
    `directory`.tmp, and the group's lowest rank renames it into place once all are written
    (a crash midway leaves the previous checkpoint whole). Every rank of the mesh calls it."""
    write(model, optimizer, directory)
    dist.barrier()


def write(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """`save` without its closing barrier: every rank writes its own shards (no pickle on the
    wire: shard_checkpoints), an all-reduce tells every rank whether all wrote (else each
    raises), and rank 0 makes the files private and renames the directory into place."""
    partial = directory.rstrip("/") + ".tmp"
    failure: BaseException | None = None
    try:
        os.makedirs(partial, mode=0o700, exist_ok=True)
        write_rank(_state(model, optimizer), partial, dist.get_rank())
    except (OSError, RuntimeError) as e:
        failure = e
    wrote = torch.tensor([0 if failure else 1])
    dist.all_reduce(wrote, op=dist.ReduceOp.MIN)
    if failure is not None:
        raise failure
    if not int(wrote[0]):
        raise RuntimeError("another member could not write its shards")
    if dist.get_rank() == 0:
        for root, dirs, files in os.walk(partial):   # read back only if nobody else can write them
            os.chmod(root, 0o700)
            for name in files:
                os.chmod(os.path.join(root, name), 0o600)
        old = directory.rstrip("/") + ".old"
        if os.path.isdir(directory):
            os.replace(directory, old)
        os.replace(partial, directory)
        shutil.rmtree(old, ignore_errors=True)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """The state `save` wrote (at any world size) into this rank's shards of a sharded
    model and its optimizer. DCP's metadata is a pickle: it is read only from a directory
    and file of this user's that nobody else may write, by an unpickler that builds DCP's
    metadata classes alone (shard_checkpoints.SafeReader; UnsafeCheckpoint otherwise)."""
    state = _state(model, optimizer)
    with alone():
        dcp.load(state, storage_reader=SafeReader(directory), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state dicts, as DCP saves and loads them in place. DCP
    loads only the keys given, and get_state_dict initialises an optimizer's state (a step
    at lr 0) only when it holds none: the empty entries that looking a parameter up in its
    state (a defaultdict) leaves behind are dropped first, or a fresh optimizer would load
    no state at all."""
    for p in [p for p, s in optimizer.state.items() if not s]:
        del optimizer.state[p]
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def _describe(held: Held | None) -> dict[str, Any]:
    assert held is not None
    return {"rows": held.rows, "shapes": [[n, *t.shape[1:]] for n, t in zip(held.rows, held.params)],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in held.params],
            "state_keys": [sorted(s) for s in held.states], "scalars": held.scalars}


def _broadcast_json(value: Any, src: int, group: dist.ProcessGroup | None) -> Any:
    """A small JSON value from group rank `src` to every rank (never pickled)."""
    data = json.dumps(value).encode() if value is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return json.loads(bytes(buf.tolist()).decode())


def param_slots(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[int, int]]:
    """Where each parameter (in parameters() order) sits in the optimizer's param_groups."""
    where = {id(p): (g, j) for g, grp in enumerate(optimizer.param_groups) for j, p in enumerate(grp["params"])}
    return [where[id(p)] for p in model.parameters()]


def _rebind(optimizer: torch.optim.Optimizer | None, make: Callable | None, slots: list[tuple[int, int]] | None,
            params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if optimizer is None or slots is None:
        if make is None:
            raise ValueError("a rank without an optimizer needs make_optimizer")
        return make(params)
    optimizer.state.clear()
    for (g, j), p in zip(slots, params):
        optimizer.param_groups[g]["params"][j] = p
    return optimizer


def _load_buffers(model: nn.Module, held: Held | None, source: int, group: dist.ProcessGroup | None,
                  stays: bool) -> None:
    """The replicated buffers (FSDP does not shard them; to_empty emptied them): a
    survivor's own, then the source's to everyone (a leaver takes part with its copy)."""
    buffers = dict(model.named_buffers()) if stays else held.buffers
    for name in sorted(buffers):
        b = buffers[name]
        if held is not None and stays:
            b.data.copy_(held.buffers[name])
        dist.broadcast(b.data, source, group=group)


def _rows_moved(n: int, old: Sequence[int | None], new: Sequence[int], rank: int, *, sending: bool) -> int:
    return sum(t.stop - t.start for t in reshard.plan(n, old, new)
               if (t.src if sending else t.dst) == rank and t.src != t.dst)


def _check(info: dict[str, Any], held: Held | None, params: list, states: list[dict[str, torch.Tensor]],
           old: Sequence[int | None], new: Sequence[int], rank: int, group: dist.ProcessGroup | None) -> None:
    mine = 0
    if rank in new:
        r = list(new).index(rank)
        for i, n in enumerate(info["rows"]):
            start = reshard.bounds(n, len(new))[r][0]
            tensors = [local(params[i]), *(local(states[i][k]) for k in sorted(states[i]))]
            for j, t in enumerate(tensors):
                mine += _weigh(reshard.checksum(t, start), i, j)
    sums = torch.tensor([held.checksum if held else 0, mine % reshard.PRIME], dtype=torch.int64)
    dist.all_reduce(sums, group=group)
    before, after = (int(x) % reshard.PRIME for x in sums)
    if before != after:
        raise ChecksumMismatch(f"resharded state does not match the old shards (checksum {after} != {before})")
