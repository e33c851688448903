"""A safe encoding of state skeletons: JSON with tagged types, never pickle.

What a worker receives from a peer (the state header) or reads from a checkpoint file
must not be able to run code, so the skeleton of a state tree (`state.flatten`: the tree
with each tensor replaced by a `TensorRef`) is written as JSON text. JSON has no tuples,
no non-string keys, no bytes and no arrays, so those are tagged:

    TensorRef(i)            {"$t": i}
    tuple                   {"$tuple": [...]}
    dict with a non-str key {"$dict": [[key, value], ...]}   (a dict whose keys are all
                            str, none starting with "$", stays a plain JSON object)
    bytes                   {"$bytes": base64}
    numpy array             {"$ndarray": base64, "dtype": "<u4", "shape": [...]}
    numpy scalar            the Python number
    torch.dtype             {"$dtype": "float32"}

Floats keep their exact value (Python's json writes the shortest repr that round-trips;
NaN and infinities are written as NaN/Infinity, which `decode` reads back). Anything else
is refused with a `CodecError` naming its type and where it sits in the tree: register
objects with a `state_dict()` instead.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch


class CodecError(ValueError):
    """A value the safe encoding does not carry, or a text that is not one of ours."""


def _numpy():
    import sys

    return sys.modules.get("numpy")   # never imported here: only where the script has it


def _encode(v: Any, path: str, ref_type: type) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, ref_type):
        return {"$t": v.i}
    if isinstance(v, tuple) and not hasattr(v, "_fields"):
        return {"$tuple": [_encode(x, f"{path}[{i}]", ref_type) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [_encode(x, f"{path}[{i}]", ref_type) for i, x in enumerate(v)]
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {k: _encode(x, f"{path}.{k}", ref_type) for k, x in v.items()}
        return {"$dict": [[_encode(k, f"{path}<key>", ref_type), _encode(x, f"{path}[{k!r}]", ref_type)]
                          for k, x in v.items()]}
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, torch.dtype):
        return {"$dtype": str(v).removeprefix("torch.")}
    np = _numpy()
    if np is not None:
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            if a.dtype.hasobject:
                raise CodecError(f"{path or 'the state'}: a numpy array of Python objects cannot be carried safely")
            return {"$ndarray": base64.b64encode(a.tobytes()).decode("ascii"), "dtype": a.dtype.str,
                    "shape": list(a.shape)}
        if isinstance(v, np.generic):
            return v.item()
    raise CodecError(f"{path or 'the state'}: a {type(v).__module__}.{type(v).__qualname__} cannot be carried "
                     "safely (state holds tensors, numbers, strings, bytes and containers of them; register an "
                     "object with a state_dict() instead)")


def _decode(v: Any, ref_factory: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x, ref_factory) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) == 1 and "$t" in v:
        if not isinstance(v["$t"], int) or isinstance(v["$t"], bool) or v["$t"] < 0:
            raise CodecError(f"bad tensor reference {v['$t']!r}")
        return ref_factory(v["$t"])
    if len(v) == 1 and "$tuple" in v:
        return tuple(_decode(x, ref_factory) for x in _list(v["$tuple"]))
    if len(v) == 1 and "$dict" in v:
        out = {}
        for pair in _list(v["$dict"]):
            if not isinstance(pair, list) or len(pair) != 2:
                raise CodecError("bad $dict entry")
            key = _decode(pair[0], ref_factory)
            try:
                out[key] = _decode(pair[1], ref_factory)
            except TypeError:
                raise CodecError(f"unhashable key {key!r}") from None
        return out
    if len(v) == 1 and "$bytes" in v:
        return _b64(v["$bytes"])
    if len(v) == 1 and "$dtype" in v:
        dtype = getattr(torch, str(v["$dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CodecError(f"unknown dtype {v['$dtype']!r}")
        return dtype
    if "$ndarray" in v:
        np = _numpy()
        if np is None:
            import numpy as np   # a state that holds arrays was written where numpy runs
        dtype = np.dtype(str(v.get("dtype")))
        if dtype.hasobject:
            raise CodecError("a numpy array of Python objects is refused")
        shape = tuple(int(x) for x in _list(v.get("shape")))
        return np.frombuffer(_b64(v["$ndarray"]), dtype=dtype).reshape(shape).copy()
    if any(k.startswith("$") for k in v):
        raise CodecError(f"unknown tag in {sorted(v)!r}")
    return {k: _decode(x, ref_factory) for k, x in v.items()}


def _list(v: Any) -> list:
    if not isinstance(v, list):
        raise CodecError(f"expected a list, got {type(v).__name__}")
    return v


def _b64(v: Any) -> bytes:
    if not isinstance(v, str):
        raise CodecError("expected base64 text")
    try:
        return base64.b64decode(v.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise CodecError("bad base64") from None


def encode(tree: Any, ref_type: type) -> str:
    """The skeleton `tree` as JSON text; instances of `ref_type` (with an int `.i`) stand
    for tensors. Raises CodecError for a value it does not carry."""
    try:
        return json.dumps(_encode(tree, "", ref_type), separators=(",", ":"))
    except RecursionError:
        raise CodecError("the state is nested too deeply") from None


def decode(text: str | bytes, ref_factory: Any) -> Any:
    """The skeleton back from `encode`'s text; `ref_factory(i)` makes each tensor
    reference. Raises CodecError for text that is not a skeleton of ours."""
    try:
        return _decode(json.loads(text), ref_factory)
    except (ValueError, RecursionError) as e:
        if isinstance(e, CodecError):
            raise
        raise CodecError(f"not a state skeleton: {e}") from None
