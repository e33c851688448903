"""gpuflex.elastic: the worker runtime (imports only torch and the standard library).

    from gpuflex.elastic import ElasticRun

The names below are loaded on first use, so the torch-free modules of this package
(`keys`, the store protocol, and `env`, the worker environment contract) can be imported
by the control side without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from gpuflex.elastic.keys import EVICTED_EXIT, STORE_LOST_EXIT

_LAZY = {"ElasticRun": "gpuflex.elastic.runtime", "Batch": "gpuflex.elastic.sampler",
         "ElasticSampler": "gpuflex.elastic.sampler"}

__all__ = ["Batch", "ElasticRun", "ElasticSampler", "EVICTED_EXIT", "STORE_LOST_EXIT"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpuflex.elastic' has no attribute {name!r}")
