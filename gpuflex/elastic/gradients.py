"""The gradient all-reduce of `ElasticRun.backward`."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from gpuflex.elastic import agreement

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun

DIRECT_BYTES = 8 << 20   # gradients this large are all-reduced where they are, not packed
# (below it a copy costs less than one more collective: gloo over TCP pays ~0.3 ms per call)


class GradPlan(NamedTuple):
    """Which gradients are reduced in place and which are packed, made once for the run."""

    params: list[torch.Tensor]
    direct: list[int]        # indices into params: all-reduced in place, no copy
    packed: list[int]        # indices into params: copied into `flat`
    flat: torch.Tensor       # packed gradients, then the agreement vector when `fuse`
    views: list[torch.Tensor]
    n: int                   # packed gradient elements
    fuse: bool


def plan_for(run: "ElasticRun") -> GradPlan:
    params = [p for p in run.model.parameters() if p.requires_grad]
    dtype = params[0].dtype
    direct = [i for i, p in enumerate(params)
              if p.numel() * p.element_size() >= DIRECT_BYTES and p.dtype == dtype]
    packed = [i for i in range(len(params)) if i not in direct]
    n = sum(params[i].numel() for i in packed)
    fuse = dtype in (torch.float32, torch.float64) and run.sampler.num_samples < 2 ** 24
    flat = torch.empty(n + (agreement.size(run) if fuse else 0), dtype=dtype, device=params[0].device)
    views, off = [], 0
    for i in packed:
        views.append(flat[off:off + params[i].numel()].view_as(params[i]))
        off += params[i].numel()
    return GradPlan(params, direct, packed, flat, views, n, fuse)


def reduce_gradients(run: "ElasticRun") -> None:
    """Sum every gradient over the members: large ones all-reduced in place (no copy),
    the small ones packed into one buffer with the step-boundary agreement at its end
    (its integers stay exact in float32/float64), all launched at once and then waited
    for. The plan is made once and kept across generations: like DDP, which fixes its
    buckets at construction, the set of parameters that require grad is fixed for the run."""
    plan = run._grad_plan
    if plan is None:
        plan = run._grad_plan = plan_for(run)
    params, direct, packed, flat, views, n, fuse = plan
    grads = [p.grad for p in params]
    for i, g in enumerate(grads):
        if g is None:   # a parameter the loss did not reach: its gradient is zero
            grads[i] = params[i].grad = torch.zeros_like(params[i])
    small = [grads[i] for i in packed]
    if small:
        torch._foreach_copy_(views, small)
    if fuse:
        flat[n:].copy_(agreement.build(run, done_step=True))
    works = []
    if not run._collective(lambda: works.extend(
            [dist.all_reduce(grads[i], async_op=True) for i in direct]
            + ([dist.all_reduce(flat, async_op=True)] if flat.numel() else []))):
        run._drop_grads()
        return
    if not run._collective(lambda: [w.wait() for w in works]):
        run._drop_grads()
        return
    if fuse:
        run._vote = agreement.parse(run, flat[n:])
        run._last_agree_s = 0.0
    if small:
        torch._foreach_copy_(small, views)
