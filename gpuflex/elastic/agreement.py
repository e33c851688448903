"""The step-boundary agreement: a small sum over the members, once per step.

It rides at the end of the gradient all-reduce (gradients.reduce_gradients) when it can,
else it is a collective of its own.

The vector is [switch-to generation (from rank 0), stop, checkpoint, ids+1 of the
samples each rank processed in the step just done (at their offsets in the global batch),
a count per offset]. Summed over the members it confirms the step, carries the decisions
and proves no sample of the step was processed twice.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gpuflex.elastic.sampler import split

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun



def size(run: "ElasticRun") -> int:
    return 3 + 2 * (run.sampler.global_batch_size if run.track_samples else 0)


def build(run: "ElasticRun", done_step: bool) -> torch.Tensor:
    """This rank's contribution: [switch generation (rank 0), stop, checkpoint, ids+1..., counts...]."""
    stop = run._stop_requested.is_set()
    ckpt = run._checkpoint_requested.is_set()
    run._checkpoint_requested.clear()
    switch = 0
    if run.rank == 0 and run.rdzv is not None and (run._poke.is_set() or run.rdzv.newer.is_set()):
        run._poke.clear()
        run.rdzv.newer.clear()   # the watch looks again if this one is not newer after all
        latest = run.rdzv.latest()
        switch = latest if latest > run.generation else 0
    b = run.sampler.global_batch_size if run.track_samples else 0
    if not b:
        return torch.tensor([switch, int(stop), int(ckpt)], dtype=torch.int64)
    vec = torch.zeros(3 + 2 * b, dtype=torch.int64)
    vec[0], vec[1], vec[2] = switch, int(stop), int(ckpt)
    batch_ids = run._step_ids
    if b and done_step and batch_ids is not None:
        off = last_offset(run)
        vec[3 + off:3 + off + len(batch_ids)] = batch_ids + 1
        vec[3 + b + off:3 + b + off + len(batch_ids)] = 1
    return vec


def parse(run: "ElasticRun", vec: torch.Tensor) -> tuple[int, bool, bool, list[int] | None]:
    """(switch-to generation, stop, checkpoint, ids of the samples of the step) from the sum
    (integers, or floats holding integers when it rode on the gradients)."""
    b = run.sampler.global_batch_size if run.track_samples else 0
    if not b:
        switch, stop, ckpt = (round(x) for x in vec.tolist())
        return switch, stop > 0, ckpt > 0, None
    vec = vec.round().long().cpu()
    counts = vec[3 + b:]
    if int(counts.max()) > 1:
        raise RuntimeError("a sample was processed twice in one step (runtime bug)")
    ids = (vec[3:3 + b][counts == 1] - 1).tolist()
    return int(vec[0]), bool(vec[1]), bool(vec[2]), ids


def agree(run: "ElasticRun", done_step: bool):
    """The agreement as a collective of its own (a step without run.backward, world 1)."""
    t0 = time.perf_counter()
    vec = build(run, done_step)
    if run.world_size > 1:
        dev = vec.to(run.device) if run.backend == "nccl" else vec
        if not run._collective(dist.all_reduce, dev):
            return None
        vec = dev.cpu()
    run._last_agree_s = time.perf_counter() - t0
    return parse(run, vec)


def last_offset(run: "ElasticRun") -> int:
    """Where this rank's share of the step just done starts in its global batch."""
    _, _, ids = run.sampler.global_batch(run.step)
    return split(len(ids), run.world_size, run.rank)[0]
