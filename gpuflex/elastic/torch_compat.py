"""torch's private names, behind one door: every use gpuflex makes of an internal of torch.

A few things the runtime does have no public API at a cost it can pay, or none at all
(undoing `fully_shard` for a resize). Each is one function here that says what it is for
and on which torch it was checked, and that fails loudly where a torch release has moved
the field: a RuntimeError naming the field and the torch version, at first use, never a
silent fallback. Nothing else in gpuflex names a private field of torch (tests/test_structure.py
holds the rest of the package to that; tests/elastic/test_torch_compat.py checks each wrapper on this
torch, and its failure with the field taken away).

Checked on torch 2.13.0 (CPU, the Makefile's pin: every wrapper) and 2.11.0+cu130 (a GPU
machine: the nccl and FSDP2 ones); pyproject.toml bounds torch to these releases. Upgrading
torch: run tests/elastic/test_torch_compat.py first, then the FSDP and fault tests.

The imports of torch.distributed's internals are made inside the functions that need them,
so that a data-parallel run never loads FSDP's.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Sequence

import torch

CHECKED_ON = "2.11 and 2.13"


def _missing(field: str, purpose: str) -> RuntimeError:
    return RuntimeError(f"gpuflex needs {field} ({purpose}), which torch {torch.__version__} does not "
                        f"have: gpuflex was checked on torch {CHECKED_ON} (gpuflex/elastic/torch_compat.py)")


def _field(obj: Any, name: str, field: str, purpose: str) -> Any:
    """`obj.<name>`, or the loud failure naming `field`."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(field, purpose) from None


# ---- data parallel: gradients, buffers, backward ------------------------------------------------

def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """`dst[i].copy_(src[i])` for every i in one call: `torch._foreach_copy_`. The packed
    small gradients and the buffers' broadcast copy lists of many small tensors each step,
    where a Python loop of `copy_` costs a few microseconds a tensor. Checked on torch 2.11, 2.13."""
    _field(torch, "_foreach_copy_", "torch._foreach_copy_", "copying many small tensors at once")(dst, src)


def foreach_scale_round_(tensors: Sequence[torch.Tensor], factor: float) -> None:
    """`t.mul_(factor).round_()` for every t in two calls: `torch._foreach_mul_` and
    `torch._foreach_round_`. Bitwise mode quantizes each unit's gradients this way
    (data/exact_sum.py), one list per unit, where a loop over a model's parameters costs a few
    microseconds a tensor and op. Checked on torch 2.13."""
    _field(torch, "_foreach_mul_", "torch._foreach_mul_", "scaling many tensors at once")(tensors, factor)
    _field(torch, "_foreach_round_", "torch._foreach_round_", "rounding many tensors at once")(tensors)


def run_backward_without_context(loss: torch.Tensor) -> None:
    """`loss.backward()` for a scalar loss with a graph, straight into the autograd engine:
    `torch.autograd.Variable._execution_engine.run_backward`, as `torch.autograd.backward`
    calls it, less the contextvars copy torch stashes in the thread-local state around it
    (gpuflex.elastic.membership.collectives.backward says why gloo needs that). The public
    `torch.autograd.backward` stashes it, so it cannot do this job. Checked on torch 2.11, 2.13."""
    engine = _field(torch.autograd.Variable, "_execution_engine", "torch.autograd.Variable._execution_engine",
                    "a backward pass without the context stash")
    run = _field(engine, "run_backward", "torch.autograd.Variable._execution_engine.run_backward",
                 "a backward pass without the context stash")
    run((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True)


def reset_group_counter() -> None:
    """Name the next process group "0", as after `destroy_process_group`: torch names groups
    from a per-process counter, `distributed_c10d._world.group_count`, which a failed
    `init_process_group` leaves advanced (gpuflex.elastic.membership.collectives says why that
    matters). Only while no world group exists. Checked on torch 2.11, 2.13."""
    import torch.distributed as dist

    world = _field(dist.distributed_c10d, "_world", "torch.distributed.distributed_c10d._world",
                   "naming every member's next process group alike")
    _field(world, "group_count", "torch.distributed.distributed_c10d._world.group_count",
           "naming every member's next process group alike")
    if not dist.is_initialized():
        world.group_count = 0


def is_batch_norm(module: torch.nn.Module) -> bool:
    """Whether `module` is a BatchNorm of any dimension (lazy ones and SyncBatchNorm
    included): their common base, `torch.nn.modules.batchnorm._BatchNorm`, which a user's own
    BatchNorm subclass may also derive from. Checked on torch 2.11, 2.13."""
    base = _field(torch.nn.modules.batchnorm, "_BatchNorm", "torch.nn.modules.batchnorm._BatchNorm",
                  "recognising a BatchNorm layer")
    return isinstance(module, base)


# ---- torch.compile ------------------------------------------------------------------------------

def is_compiled_module(model: Any) -> bool:
    """Whether `model` is what `torch.compile(module)` returns (its first pass compiles, so a
    newcomer warms up): `torch._dynamo.eval_frame.OptimizedModule`. torch._dynamo is not
    imported for this: no module is compiled in a process that has not loaded it. Checked on
    torch 2.11, 2.13."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    frames = _field(dynamo, "eval_frame", "torch._dynamo.eval_frame", "recognising a torch.compile'd module")
    return isinstance(model, _field(frames, "OptimizedModule", "torch._dynamo.eval_frame.OptimizedModule",
                                    "recognising a torch.compile'd module"))


def preload_dynamo() -> None:
    """Import torch._dynamo now: `fully_shard`'s first call imports it (0.4 s), which a sharded
    run pays at start-up instead of inside its first resize. Checked on torch 2.11, 2.13."""
    try:
        import torch._dynamo  # noqa: F401
    except ImportError as e:
        raise _missing("torch._dynamo", "importing it ahead of a resize") from e


# ---- the DataLoader -----------------------------------------------------------------------------

def loader_shutdown(it: Any) -> Callable[[], None]:
    """How to end the worker processes of a multi-process DataLoader iterator now, without
    waiting for it to be garbage-collected: its `_shutdown_workers` (what its `__del__`
    calls). Asked for when the iterator is made, so a torch without it fails before any
    step. Checked on torch 2.11, 2.13."""
    return _field(it, "_shutdown_workers", "DataLoader iterator's _shutdown_workers",
                  "ending the loader's worker processes")


# ---- FSDP2: undoing fully_shard for a resize ----------------------------------------------------

_FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def undo_fully_shard(model: torch.nn.Module) -> None:
    """Undo `fully_shard` on every module of `model`, so that it can be sharded again over
    another mesh (gpuflex.elastic.sharding.fsdp: a resize in place). Each sharded parameter
    becomes a full-shape parameter on the meta device (no memory) in every module that shares
    it; the FSDP class, the forward hooks and the module's registration with the composable
    API are removed. FSDP2 has no public way back: this reads its state (`_fsdp_param_group`,
    each parameter's `_module_info` and `_orig_size`, the hook handles), the composable
    registry's keys and `_composable_state._module_state_mapping`, and writes the modules'
    `_parameters`. Checked on torch 2.11 (nccl, a GPU) and 2.13 (gloo)."""
    from torch.distributed import _composable_state
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # the module, not the function of the same name its package exports
    contract = importlib.import_module("torch.distributed._composable.contract")

    purpose = "undoing fully_shard for a resize"
    keys = [_field(contract, k, f"torch.distributed._composable.contract.{k}", purpose)
            for k in ("REGISTRY_KEY", "STATE_KEY")]
    mapping = _field(_composable_state, "_module_state_mapping",
                     "torch.distributed._composable_state._module_state_mapping", purpose)
    # every field is read before anything changes: a torch that lacks one leaves the model as it was
    plans = []
    for m in list(model.modules()):
        if not isinstance(m, FSDPModule):
            continue
        state = fully_shard.state(m)
        handles = [_field(state, h, f"FSDPState.{h}", purpose)
                   for h in ("_pre_forward_hook_handle", "_post_forward_hook_handle")]
        group = _field(state, "_fsdp_param_group", "FSDPState._fsdp_param_group", purpose)
        params = [(fp, _field(fp, "_module_info", "FSDPParam._module_info", purpose),
                   _field(fp, "_orig_size", "FSDPParam._orig_size", purpose))
                  for fp in (group.fsdp_params if group is not None else ())]
        plans.append((m, handles, params))
    for m, handles, params in plans:
        for h in {id(h): h for h in handles if h is not None}.values():
            h.remove()
        for fp, info, size in params:
            meta = torch.nn.Parameter(torch.empty(size, device="meta", dtype=fp.sharded_param.dtype),
                                      requires_grad=fp.sharded_param.requires_grad)
            for mod, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                mod._parameters[name] = meta
        m.__class__ = next(c for c in type(m).__bases__ if c is not FSDPModule)
        for k in keys:
            m.__dict__.pop(k, None)
        mapping.pop(m, None)
    for m in model.modules():
        for flag in _FSDP_FLAGS:
            m.__dict__.pop(flag, None)
