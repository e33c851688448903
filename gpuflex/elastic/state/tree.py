"""Training state: capture, per-step light commits, checksums (checkpoints: checkpoints.py).

The registered objects (model, optimizer, scheduler, scaler, user counters) plus the
runtime's own counters and RNG states form one tree. `flatten` splits it into a skeleton
(everything but tensors) and a tensor list; a `FlatState` lays out fresh tensors for a
received copy in one 64-byte-aligned buffer per (dtype, device).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
import zlib
from typing import Any

import torch

try:  # numpy's RNG is part of the state only where numpy is installed
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Placeholder for the i-th tensor of a flattened tree."""

    i: int


def flatten(tree: Any, out: list[torch.Tensor] | None = None) -> tuple[Any, list[torch.Tensor]]:
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        out.append(tree)
        return TensorRef(len(out) - 1), out
    if isinstance(tree, dict):
        return type(tree)((k, flatten(v, out)[0]) for k, v in tree.items()), out
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(flatten(v, out)[0] for v in tree), out
    return tree, out


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, TensorRef):
        return tensors[skeleton.i]
    if isinstance(skeleton, dict):
        return type(skeleton)((k, unflatten(v, tensors)) for k, v in skeleton.items())
    if isinstance(skeleton, (list, tuple)) and not hasattr(skeleton, "_fields"):
        return type(skeleton)(unflatten(v, tensors) for v in skeleton)
    return skeleton


def rng_state() -> dict[str, Any]:
    """Every global RNG's state, through the public getters: `random.getstate()` and
    `np.random.get_state()` take ~8 and ~30 us, invisible in benchmarks/steady_overhead.py."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    # numpy's global RNG exists once numpy.random is imported (numpy 2 imports it lazily;
    # torch imports it when torch._dynamo loads, e.g. at an optimizer's first step).
    if _np is not None and "numpy.random" in sys.modules:
        state["numpy"] = _np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if "numpy" in state and _np is not None:
        _np.random.set_state(state["numpy"])


_ATOMS = (int, float, bool, str, bytes, type(None))


def copy_value(v: Any) -> Any:
    """A deep copy, fast for what state dicts hold (containers of numbers, strings and
    tensors: a few microseconds where copy.deepcopy takes tens); anything else goes to
    copy.deepcopy."""
    if isinstance(v, _ATOMS):
        return v
    if type(v) is dict:
        return {k: copy_value(x) for k, x in v.items()}
    if type(v) in (list, tuple):
        return type(v)(copy_value(x) for x in v)
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return copy.deepcopy(v)


HEAVY = ("model", "optimizer")   # changed only by optimizer.step(); everything else is light
GROUPS = "optimizer.param_groups"


class Registry:
    """The objects whose state the runtime owns, by name."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}

    @classmethod
    def of(cls, *, model: Any, optimizer: Any, scheduler: Any = None, scaler: Any = None,
           extra: dict[str, Any] | None = None) -> "Registry":
        """The run's objects: a user's `extra` objects are named `extra.<name>`."""
        reg = cls()
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
            reg.add(name, obj)
        for name, obj in (extra or {}).items():
            reg.add(f"extra.{name}", obj)
        return reg

    def add(self, name: str, obj: Any, new: bool = False, sealed: bool = False) -> None:
        """Register `obj` under `name`; `new`: a name already taken is a ValueError; `sealed`:
        the run has started (a newcomer's state tree must hold the same names)."""
        if sealed:
            raise RuntimeError(f"{name}: registered after the run started; register before the loop")
        if new and name in self.objects:
            raise ValueError(f"{name!r} is already registered; pick another name")
        if obj is None:
            return
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")) and not isinstance(obj, dict):
            raise TypeError(f"{name}: expected an object with state_dict()/load_state_dict() or a dict, "
                            f"got {type(obj).__name__}")
        self.objects[name] = obj

    def capture(self) -> dict[str, Any]:
        return {name: (dict(obj) if isinstance(obj, dict) else obj.state_dict())
                for name, obj in self.objects.items()}

    def capture_light(self) -> dict[str, Any]:
        """Deep copies of the light objects' state, plus the optimizer's hyperparameters
        (a scheduler writes the learning rate into the optimizer's param groups)."""
        out = {name: copy_value(dict(obj) if isinstance(obj, dict) else obj.state_dict())
               for name, obj in self.objects.items() if name not in HEAVY}
        opt = self.objects.get("optimizer")
        if opt is not None:
            out[GROUPS] = [{k: copy_value(v) for k, v in g.items() if k != "params"}
                           for g in opt.param_groups]
        return out

    def load(self, tree: dict[str, Any], *, light_only: bool = False, skip: tuple[str, ...] = ()) -> None:
        """Load `tree` into the objects; `skip`: names whose state is already in place."""
        if light_only and GROUPS in tree:
            for group, saved in zip(self.objects["optimizer"].param_groups, tree[GROUPS]):
                group.update(saved)
        for name, obj in self.objects.items():
            if (light_only and name in HEAVY) or name in skip:
                continue
            if name not in tree:
                raise KeyError(f"state has no {name!r}")
            if isinstance(obj, dict):
                obj.clear()
                obj.update(tree[name])
            else:
                obj.load_state_dict(tree[name])


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class FlatState:
    """Views of the given (dtype, device, shape) layout, packed into one buffer per
    (dtype, device), each view starting on a 64-byte boundary."""

    def __init__(self, layout: tuple) -> None:
        self.layout = layout
        sizes: dict[tuple, int] = {}
        places = []
        for dtype, device, shape in layout:
            n = 1
            for s in shape:
                n *= s
            key = (dtype, device)
            align = max(1, 64 // _elem_size(dtype))   # each view starts on a 64-byte boundary
            off = -(-sizes.get(key, 0) // align) * align
            places.append((key, off, n, shape))
            sizes[key] = off + n
        self.buffers = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
        self.views = [self.buffers[key][off:off + n].view(shape) for key, off, n, shape in places]



def checksum_tensors(tensors: list[torch.Tensor]) -> int:
    """A checksum of the tensors' raw bytes, in order, that is cheap at any size: each
    tensor's bytes summed as 64-bit words (wrapping; a vectorised sum, ~30 GB/s on one CPU
    core and computed where the tensor lives, so GPU state never crosses to the host), then a
    CRC32 over the per-tensor (size, sum) pairs. Any single changed bit changes its tensor's
    sum; state in a wrong slot or of a wrong size changes the pairs."""
    sums, sizes = [], []
    for t in tensors:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        n8 = b.numel() // 8 * 8
        head = b[:n8] if b.storage_offset() % 8 == 0 else b[:n8].clone()
        s = head.view(torch.int64).sum() if n8 else torch.zeros((), dtype=torch.int64, device=b.device)
        if n8 < b.numel():   # the last few bytes, weighted by position
            w = torch.arange(1, b.numel() - n8 + 1, dtype=torch.int64, device=b.device)
            s = s + (b[n8:].to(torch.int64) * w).sum()
        sums.append(s)
        sizes.append(b.numel())
    values = torch.stack(sums).cpu().tolist() if sums else []
    packed = b"".join((n.to_bytes(8, "little") + (v & (2 ** 64 - 1)).to_bytes(8, "little"))
                      for n, v in zip(sizes, values))
    return zlib.crc32(packed)


@dataclasses.dataclass
class LightCommit:
    """What a step changes besides parameters and optimizer state: RNG, scheduler, scaler,
    user counters, model buffers, the step, and the lengths of the append-only logs.

    Parameters and optimizer state need no per-step copy: a step whose gradient
    all-reduce failed leaves every gradient unset, so `optimizer.step()` skips every
    parameter, and a member that did finish the step is simply ahead (see formation).
    """

    step: int
    rng: dict[str, Any]
    objects: dict[str, Any]
    buffers: list[torch.Tensor]
    lens: dict[str, int]
