"""gpuflex.elastic: the worker runtime (imports only torch and the standard library).

    from gpuflex.elastic import ElasticRun

    run = ElasticRun(model=..., optimizer=..., num_samples=N, global_batch_size=B, steps=S)  # or epochs=E
    for x, y in run.loader(dataset, num_workers=2):       # every remaining step
        for xb, yb in run.accumulate(x, y, micro_batch_size=M):
            run.backward(loss_fn(model(xb), yb))           # accumulates; the last one reduces
        optimizer.step(); optimizer.zero_grad()
        logged = run.global_mean(loss)                     # the global batch's mean

(run/runtime.py's docstring has the whole picture; docs/converting.md the conversion.)

The sub-packages, by what they are about:

    protocol/     torch-free: store keys and exit codes, the worker environment, signing,
                  the control socket, run-directory files (the control side imports only this)
    coordinator/  the per-job coordinator process: generations, forming, failures, resizes
    membership/   a worker in a generation: rendezvous, joining, liveness, agreement, collectives
    state/        training state: the state tree, commits, codec, checkpoints, buffers
    sharding/     FSDP2 state: a sharded run, resharding in place, shard checkpoints
    data/         samplers, loader, micro-batches, shares and split plans, gradients
    run/          ElasticRun: start-up, the script's calls, data-parallel and sharded steps

and one module beside them, torch_compat.py: every use of a private field of torch (numpy,
CPython), each wrapped in a function that fails loudly where a torch release moved it.

The names below are loaded on first use, so `protocol` can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from gpuflex.elastic.protocol.keys import ABORTED_EXIT, EVICTED_EXIT, STORE_LOST_EXIT

_LAZY = {"ElasticRun": "gpuflex.elastic.run.runtime", "Batch": "gpuflex.elastic.data.sampler",
         "ElasticSampler": "gpuflex.elastic.data.sampler", "ElasticLoader": "gpuflex.elastic.data.loader"}

__all__ = ["ABORTED_EXIT", "Batch", "ElasticLoader", "ElasticRun", "ElasticSampler", "EVICTED_EXIT",
           "STORE_LOST_EXIT"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpuflex.elastic' has no attribute {name!r}")
