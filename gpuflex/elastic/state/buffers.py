"""A model's buffers (BatchNorm's running statistics and step count, ...) made equal on
every member once per step, so they are state like the parameters.

Without this each rank's running statistics follow its own share of the batches: they
drift apart, and a formation's checksum (which covers the model's state_dict) can never
agree. Two rules:

- "broadcast" (the default, DDP's `broadcast_buffers=True`): rank 0's buffers are sent to
  every member. DDP does it before each forward; here it is done at the step boundary, once
  the step is agreed and before the light commit, so what is committed (and undone,
  checkpointed, copied to newcomers) is the same on every member.
- "average": floating buffers become the mean of the members' buffers, each weighted by its
  share of the step's global batch (the running statistics then follow every rank's
  samples, not rank 0's alone); integer buffers (num_batches_tracked) are rank 0's.

All buffers travel in one collective: "broadcast" packs their bytes into one uint8 buffer
(each at an 8-byte aligned offset, viewed back in its own dtype), "average" packs them as
float64 (integer buffers only from rank 0, so their sum is rank 0's exact value; float64
holds integers up to 2**53 exactly). Either way every member ends with the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpuflex.elastic import torch_compat
from gpuflex.elastic.membership.collectives import Collectives

RULES = ("broadcast", "average")


def buffer_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Where each buffer of `model` lives, (module, name), in `modules()` order: a buffer is
    read there each time (`getattr(module, name)`), since `.to()` replaces it. A tensor
    registered under two names is at both places, as the modules hold it."""
    return [(m, name) for m in model.modules()
            for name, _ in m.named_buffers(recurse=False, remove_duplicate=False)]


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"buffers must be one of {', '.join(map(repr, RULES))}, got {rule!r}")
    return rule


class BufferSync:
    """The buffers of `model` under `rule`, synchronized over `group` by `sync`."""

    def __init__(self, model: torch.nn.Module, group: Collectives, rule: str = "broadcast") -> None:
        self.model, self.group, self.rule = model, group, check_rule(rule)
        self._slots: list[tuple[torch.nn.Module, str]] | None = None
        self._packed: tuple[torch.Tensor, list[torch.Tensor]] | None = None   # (flat, views) for broadcast
        self._key: tuple | None = None

    def buffers(self) -> list[torch.Tensor]:
        """The live buffers (looked up where they live: `.to()` replaces them)."""
        if self._slots is None:
            self._slots = buffer_slots(self.model)
        return [getattr(m, name) for m, name in self._slots]

    def needed(self) -> bool:
        return self.group.world_size > 1 and bool(self.buffers())

    def sync(self, weight: float) -> bool:
        """At a step boundary: apply the rule. False if the collective failed (noted by the
        group, handled like a failed agreement)."""
        if not self.needed():
            return True
        if self.rule == "average":
            return self.group.call(self._average, weight)
        return self.group.call(self.broadcast)

    def broadcast(self) -> None:
        """Rank 0's buffers to every member, in one broadcast; raises if it fails (the
        formation's use: a failed formation is retried as a whole)."""
        bufs = self.buffers()
        if not bufs or self.group.world_size == 1:
            return
        flat, views = self._flat(bufs)
        with torch.no_grad():
            if self.group.rank == 0:
                torch_compat.foreach_copy_(views, bufs)
            dist.broadcast(flat, src=0, group=self.group.pg)
            if self.group.rank != 0:
                torch_compat.foreach_copy_(bufs, views)

    def _flat(self, bufs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One uint8 buffer with a view of each buffer's dtype and shape, made once per layout."""
        key = tuple((b.dtype, b.device, tuple(b.shape)) for b in bufs)
        if self._packed is None or self._key != key:
            offsets, off = [], 0
            for b in bufs:
                offsets.append(off)
                off += -(-b.numel() * b.element_size() // 8) * 8
            flat = torch.empty(off, dtype=torch.uint8, device=bufs[0].device)
            views = [flat[o:o + b.numel() * b.element_size()].view(b.dtype).view(b.shape)
                     for o, b in zip(offsets, bufs)]
            self._packed, self._key = (flat, views), key
        return self._packed

    def _average(self, weight: float) -> None:
        bufs = self.buffers()
        rank0 = self.group.rank == 0
        with torch.no_grad():
            parts = []
            for b in bufs:
                x = b.detach().reshape(-1).to(torch.float64)
                if b.is_floating_point():
                    parts.append(x * weight)
                else:
                    parts.append(x if rank0 else torch.zeros_like(x))
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=self.group.pg)
            off = 0
            for b in bufs:
                n = b.numel()
                b.copy_(flat[off:off + n].view(b.shape).to(b.dtype))
                off += n
