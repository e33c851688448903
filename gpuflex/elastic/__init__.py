"""gpuflex.elastic: the worker runtime (imports only torch and the standard library).

    from gpuflex.elastic import ElasticRun

    run = ElasticRun(model=..., optimizer=..., num_samples=N, global_batch_size=B, steps=S)  # or epochs=E
    for x, y in run.loader(dataset, num_workers=2):       # every remaining step
        for xb, yb in run.accumulate(x, y, micro_batch_size=M):
            run.backward(loss_fn(model(xb), yb))           # accumulates; the last one reduces
        optimizer.step(); optimizer.zero_grad()
        logged = run.global_mean(loss)                     # the global batch's mean

(runtime.py's docstring has the whole picture; docs/converting.md the conversion.)

The names below are loaded on first use, so the torch-free modules of this package
(`keys`, the store protocol, and `env`, the worker environment contract) can be imported
by the control side without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from gpuflex.elastic.keys import ABORTED_EXIT, EVICTED_EXIT, STORE_LOST_EXIT

_LAZY = {"ElasticRun": "gpuflex.elastic.runtime", "Batch": "gpuflex.elastic.sampler",
         "ElasticSampler": "gpuflex.elastic.sampler", "ElasticLoader": "gpuflex.elastic.loader"}

__all__ = ["ABORTED_EXIT", "Batch", "ElasticLoader", "ElasticRun", "ElasticSampler", "EVICTED_EXIT",
           "STORE_LOST_EXIT"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpuflex.elastic' has no attribute {name!r}")
