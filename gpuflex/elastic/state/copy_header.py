"""What a state copy says about itself (formation.py's `_sync_state` and `_verify`).

- The header a sender publishes, signed, before the tensors: the state tree's skeleton
  (codec: no pickle), each tensor's dtype, device and shape, the logs, and the sending rank
  (`header_text`); `read_header` takes one apart and refuses anything else.
- Which of a newcomer's own model tensors an entry can land in, so the copy fills them in
  place (`model_targets`).
- What every member compares after a copy: the non-tensor values' checksum
  (`skeleton_crc`), and for a mismatch's message each tensor's dotted path (`tensor_paths`).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch

from gpuflex.elastic.state import codec
from gpuflex.elastic.state.tree import TensorRef

NON_TENSOR = "a non-tensor value (a registered scalar, an optimizer or scheduler setting)"


def skeleton_crc(skeleton: Any) -> int:
    """A checksum of the state's non-tensor values (registered scalars, optimizer and
    scheduler settings): they must be equal on every member too. 0 where the codec cannot
    encode them (such state cannot be copied to a newcomer either; that copy says why)."""
    try:
        return zlib.crc32(codec.encode(skeleton, TensorRef).encode())
    except codec.CodecError:
        return 0


def tensor_paths(skeleton: Any, prefix: str) -> list[str]:
    """The dotted path of each tensor of a flattened tree, by its index
    ("objects.model.bn1.running_mean", "objects.optimizer.state.0.momentum_buffer")."""
    out: dict[int, str] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, TensorRef):
            out[node.i] = path
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif isinstance(node, (list, tuple)):
            for k, v in enumerate(node):
                walk(v, f"{path}.{k}")

    walk(skeleton, prefix)
    return [out.get(i, f"{prefix}[{i}]") for i in range(len(out))]


MAX_HEADER_BYTES = 1 << 30


def header_text(src: int, skeleton: Any, tensors: list[torch.Tensor], logs: dict[str, Any]) -> str:
    """The state header as JSON: the skeleton (codec), each tensor's dtype, device and
    shape, the logs, and the sending rank."""
    layout = [[str(t.dtype).removeprefix("torch."), str(t.device), list(t.shape)] for t in tensors]
    return json.dumps({"src": src, "skeleton": codec.encode(skeleton, TensorRef), "layout": layout,
                       "logs": logs}, separators=(",", ":"))


def read_header(text: str, src: int) -> dict[str, Any]:
    """`header_text`'s header back, with the skeleton and the layout as `_sync_state` uses
    them; ValueError (CodecError) for anything else."""
    h = json.loads(text)
    if not isinstance(h, dict) or h.get("src") != src or not isinstance(h.get("layout"), list) \
            or not isinstance(h.get("logs"), dict) or not isinstance(h.get("skeleton"), str):
        raise ValueError("not a state header")
    layout = []
    for entry in h["layout"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list)
                and all(isinstance(d, int) and d >= 0 for d in entry[2])):
            raise ValueError(f"bad tensor layout {entry!r}")
        dtype = getattr(torch, str(entry[0]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {entry[0]!r}")
        layout.append((dtype, torch.device(str(entry[1])), tuple(entry[2])))
    return {"skeleton": codec.decode(h["skeleton"], TensorRef), "layout": tuple(layout), "logs": h["logs"]}


def model_refs(skeleton: Any) -> dict[str, Any]:
    refs = skeleton.get("objects", {}).get("model", {})
    return refs if isinstance(refs, dict) else {}


def model_targets(model: torch.nn.Module, skeleton: Any, layout: tuple) -> dict[int, torch.Tensor]:
    """{index in the sent tensor list: the newcomer's own tensor that entry can land in}:
    the model's parameters and buffers, where name, dtype, device and shape agree."""
    own = model.state_dict()
    out = {}
    for name, ref in model_refs(skeleton).items():
        t = own.get(name)
        if (isinstance(ref, TensorRef) and t is not None and t.is_contiguous()
                and (t.dtype, t.device, tuple(t.shape)) == tuple(layout[ref.i])):
            out[ref.i] = t
    return out
