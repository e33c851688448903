"""The gradient all-reduce of `ElasticRun.backward`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gpuflex.elastic import agreement

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun


def reduce_gradients(run: "ElasticRun") -> None:
    """One flat all-reduce of every gradient; the step-boundary agreement rides along at
    its end when the gradients are float32/float64 (its integers stay exact there), so a
    step costs one collective, as under DDP."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    n = sum(g.numel() for g in grads)
    fuse = grads[0].dtype in (torch.float32, torch.float64) and run.sampler.num_samples < 2 ** 24
    vote = agreement.build(run, done_step=True) if fuse else None
    total = n + (len(vote) if fuse else 0)
    if run._grad_flat is None or run._grad_flat.numel() != total or run._grad_flat.dtype != grads[0].dtype:
        run._grad_flat = torch.empty(total, dtype=grads[0].dtype, device=grads[0].device)
    views, off = [], 0
    for g in grads:
        views.append(run._grad_flat[off:off + g.numel()].view_as(g))
        off += g.numel()
    torch._foreach_copy_(views, grads)
    if fuse:
        run._grad_flat[n:].copy_(vote)
    if not run._collective(dist.all_reduce, run._grad_flat):
        run._drop_grads()
        return
    if fuse:
        run._vote = agreement.parse(run, run._grad_flat[n:].round().long().cpu())
        run._last_agree_s = 0.0
    for p, v in zip(params, views):
        if p.grad is None:
            p.grad = v.clone()
        else:
            p.grad.copy_(v)
