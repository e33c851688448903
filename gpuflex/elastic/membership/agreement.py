"""The step-boundary agreement: a small sum over the members, once per step.

It rides at the end of the gradient all-reduce (gradients.GradPlan.reduce) when it can.
A sharded step has no gradient all-reduce of ours (FSDP reduce-scatters): there, unless
samples are tracked, the vote rides the step barrier before the step's first forward as
one integer (`pack`, `carried`, liveness.StepBarrier.cross(vote=)), or the boundary's
when that barrier was not crossed; else it is a collective of its own.

The vector is [switch-to generation (from rank 0), stop, checkpoint, ids+1 of the
samples each rank processed in the step just done (at their offsets in the global batch),
a count per offset]. Summed over the members it confirms the step, carries the decisions
and proves no sample of the step was processed twice.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.data.sampler import Batch
from gpuflex.elastic.protocol.signals import StepSignals

Vote = tuple[int, bool, bool, "list[int] | None"]   # (switch-to generation, stop, checkpoint, sample ids)
_COUNT_BITS = 20   # a packed vote: stop and checkpoint counts below 2**20 members each


class Agreement:
    """Builds this rank's vector, reads the summed one, and keeps the vote until the
    boundary takes it. `switch_to()` is rank 0's look at the store: the generation to
    switch to, or 0 (the other ranks' returns 0)."""

    def __init__(self, *, batch_size: int, track_samples: bool, signals: StepSignals,
                 group: Collectives, switch_to: Callable[[], int]) -> None:
        self.b = batch_size if track_samples else 0
        self.size = 3 + 2 * self.b
        self.signals, self.group, self.switch_to = signals, group, switch_to
        self.last_s = 0.0             # how long the last agreement of its own took
        self._vote: Vote | None = None   # the agreement, when it rode on the gradients
        self._ids: torch.Tensor | None = None
        self._offset = 0

    def begin_step(self, batch: Batch) -> None:
        """The samples this rank processes in the step now starting (voted on at its end)."""
        self._ids = batch.indices if self.b else None
        self._offset = batch.offset
        self._vote = None   # one the last step's boundary did not take (it failed before) is void

    def build(self, done_step: bool) -> torch.Tensor:
        """This rank's contribution: [switch generation (rank 0), stop, checkpoint, ids+1..., counts...]."""
        switch, stop, ckpt = self._decisions()
        b = self.b
        if not b:
            return torch.tensor([switch, int(stop), int(ckpt)], dtype=torch.int64)
        vec = torch.zeros(3 + 2 * b, dtype=torch.int64)
        vec[0], vec[1], vec[2] = switch, int(stop), int(ckpt)
        batch_ids = self._ids
        if done_step and batch_ids is not None:
            off = self._offset
            vec[3 + off:3 + off + len(batch_ids)] = batch_ids + 1
            vec[3 + b + off:3 + b + off + len(batch_ids)] = 1
        return vec

    @property
    def packs(self) -> bool:
        """The vote fits one integer: no sample ids to carry."""
        return not self.b

    def pack(self) -> int:
        """This rank's vote as one non-negative integer, to be summed over the members
        (`unpack`): stop and checkpoint as counts, rank 0's switch-to generation above them."""
        assert not self.b, "sample ids do not fit a packed vote"
        switch, stop, ckpt = self._decisions()
        return int(stop) + (int(ckpt) << _COUNT_BITS) + (switch << 2 * _COUNT_BITS)

    def _decisions(self) -> tuple[int, bool, bool]:
        """What this rank votes for: (switch-to generation, stop, checkpoint); a checkpoint
        request is taken (cleared) by the vote that carries it."""
        return self.switch_to(), self.signals.stop_requested(), self.signals.take_checkpoint()

    def unpack(self, total: int) -> Vote:
        mask = (1 << _COUNT_BITS) - 1
        self.last_s = 0.0
        return total >> 2 * _COUNT_BITS, bool(total & mask), bool((total >> _COUNT_BITS) & mask), None

    def parse(self, vec: torch.Tensor) -> Vote:
        """(switch-to generation, stop, checkpoint, ids of the samples of the step) from the sum
        (integers, or floats holding integers when it rode on the gradients)."""
        b = self.b
        if not b:
            switch, stop, ckpt = (round(x) for x in vec.tolist())
            return switch, stop > 0, ckpt > 0, None
        vec = vec.round().long().cpu()
        counts = vec[3 + b:]
        if int(counts.max()) > 1:
            raise RuntimeError("a sample was processed twice in one step (runtime bug)")
        ids = (vec[3:3 + b][counts == 1] - 1).tolist()
        return int(vec[0]), bool(vec[1]), bool(vec[2]), ids

    @property
    def held(self) -> bool:
        """A vote of this step arrived before the boundary (on the gradients or a barrier)."""
        return self._vote is not None

    def carried(self, total: int) -> None:
        """The packed sum arrived with a step barrier before the boundary: keep its vote."""
        self._vote = self.unpack(total)

    def summed(self, vec: torch.Tensor) -> None:
        """The sum arrived with the gradients: keep its vote for the boundary."""
        self._vote = self.parse(vec)
        self.last_s = 0.0

    def agree(self, done_step: bool) -> Vote | None:
        """The vote: the one that rode on the gradients or a barrier, else one collective of
        its own (a step without run.backward, world 1). None if that collective failed."""
        vote, self._vote = self._vote, None
        if vote is not None:
            return vote
        t0 = time.perf_counter()
        vec = self.build(done_step)
        group = self.group
        if group.world_size > 1:
            dev = vec.to(group.device) if group.backend == "nccl" else vec
            if not group.call(dist.all_reduce, dev):
                return None
            vec = dev.cpu()
        self.last_s = time.perf_counter() - t0
        return self.parse(vec)
