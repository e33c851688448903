"""Runs a training script with one worker's received state copy corrupted, to prove that
the formation's checksum catches a bad copy (tests/e2e/test_elastic_jobs.py).

    python tests/fakes/runtime_corrupt_copy.py WID SCRIPT [ARGS...]

In the worker whose GPUFLEX_WORKER_ID is WID, every state tree the runtime applies (for a
newcomer: only the copy it receives while forming a generation) is applied, then the
model's first parameter is nudged by +1, as a transfer that flipped bits would leave it.
Every other worker, and the script itself, run unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

from gpuflex.elastic.protocol import env
from gpuflex.elastic.state.training import TrainingState


def corrupt_after_applying(apply_tree):
    def apply(self, tree, skip=()):
        apply_tree(self, tree, skip=skip)
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] += 1.0
    return apply


if __name__ == "__main__":
    target, script = sys.argv[1], sys.argv[2]
    if os.environ.get(env.WORKER_ID) == target:
        TrainingState.apply_tree = corrupt_after_applying(TrainingState.apply_tree)
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")
