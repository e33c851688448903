"""The gradient all-reduce of `ElasticRun.backward`."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from gpuflex.elastic import agreement

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun


class GradPlan(NamedTuple):
    """The flat buffer and its per-parameter views, made once per generation."""

    params: list[torch.Tensor]
    flat: torch.Tensor
    views: list[torch.Tensor]
    n: int          # gradient elements; the agreement vector follows them when `fuse`
    fuse: bool


def plan_for(run: "ElasticRun") -> GradPlan:
    params = [p for p in run.model.parameters() if p.requires_grad]
    dtype = params[0].dtype
    n = sum(p.numel() for p in params)
    fuse = dtype in (torch.float32, torch.float64) and run.sampler.num_samples < 2 ** 24
    total = n + (agreement.size(run) if fuse else 0)
    flat = torch.empty(total, dtype=dtype, device=params[0].device)
    views, off = [], 0
    for p in params:
        views.append(flat[off:off + p.numel()].view_as(p))
        off += p.numel()
    return GradPlan(params, flat, views, n, fuse)


def reduce_gradients(run: "ElasticRun") -> None:
    """One flat all-reduce of every gradient; the step-boundary agreement rides along at
    its end when the gradients are float32/float64 (its integers stay exact there), so a
    step costs one collective, as under DDP. The plan (which parameters are trained, the
    buffer) is made once and kept across generations: like DDP, which fixes its buckets
    at construction, the set of parameters that require grad is fixed for the run."""
    plan = run._grad_plan
    if plan is None:
        plan = run._grad_plan = plan_for(run)
    params, flat, views, n, fuse = plan
    grads = [p.grad for p in params]
    for i, g in enumerate(grads):
        if g is None:   # a parameter the loss did not reach: its gradient is zero
            grads[i] = params[i].grad = torch.zeros_like(params[i])
    torch._foreach_copy_(views, grads)
    if fuse:
        flat[n:].copy_(agreement.build(run, done_step=True))
    if not run._collective(dist.all_reduce, flat):
        run._drop_grads()
        return
    if fuse:
        run._vote = agreement.parse(run, flat[n:])
        run._last_agree_s = 0.0
    torch._foreach_copy_(grads, views)
