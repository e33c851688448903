"""`ElasticRun`'s state handling: the per-step light commit and its undo, the state tree a
newcomer receives, and the on-disk checkpoint (see runtime.py and state.py)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from gpuflex.elastic.state import (LightCommit, copy_value, load_checkpoint, rng_state,
                                   save_checkpoint, set_rng_state)

log = logging.getLogger(__name__)


class StateMixin:
    """Methods of ElasticRun that read or write its training state."""

    def capture(self) -> dict[str, Any]:
        return {"objects": self.registry.capture(), "rng": rng_state(), "step": self.step}

    def _lens(self) -> dict[str, int]:
        """Where the logs end now. Only the current epoch's sample list can grow in the next
        step (or a later epoch's appear), so that one length suffices: a cost per step that
        does not grow with the number of epochs run."""
        return {"step_log": len(self.step_log), "epoch": self.epoch,
                "samples": len(self.samples.get(self.epoch, ()))}

    def _commit(self) -> None:
        """The light commit of every step boundary (parameters and optimizer state need none)."""
        if self.distributed:
            if self._buffer_slots is None:   # where the buffers live (`.to()` replaces them)
                self._buffer_slots = [(m, name) for m in self.model.modules() for name in m._buffers
                                      if m._buffers[name] is not None]
            self._light = LightCommit(self.step, rng_state(), self.registry.capture_light(),
                                      [m._buffers[n].detach().clone() for m, n in self._buffer_slots],
                                      self._lens())

    def _undo_step(self) -> None:
        c = self._light
        if c is None:
            return
        self.registry.load(copy_value(c.objects), light_only=True)
        set_rng_state(c.rng)
        with torch.no_grad():
            for (m, name), saved in zip(self._buffer_slots or [], c.buffers):
                m._buffers[name].copy_(saved)
        self.step = c.step
        del self.step_log[c.lens["step_log"]:]
        epoch = c.lens["epoch"]
        for e in [e for e in self.samples if e > epoch]:
            del self.samples[e]
        if epoch in self.samples:
            del self.samples[epoch][c.lens["samples"]:]
            if not self.samples[epoch]:
                del self.samples[epoch]

    def apply_tree(self, tree: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
        self.registry.load(tree["objects"], skip=skip)
        set_rng_state(tree["rng"])
        self.step = int(tree["step"])

    def logs_payload(self) -> dict[str, Any]:
        return {"step_log": [list(x) for x in self.step_log],
                "samples": {e: list(v) for e, v in self.samples.items()}}

    def load_logs(self, logs: dict[str, Any]) -> None:
        self.step_log = [list(x) for x in logs["step_log"]]
        self.samples = {int(e): list(v) for e, v in logs["samples"].items()}

    def _checkpoint(self) -> None:
        """Rank 0 writes the live (just committed) state to disk, atomically."""
        if self.checkpoint_dir and self.rank == 0:
            save_checkpoint(os.path.join(self.checkpoint_dir, "checkpoint.pt"),
                            {"state": self.capture(), "logs": self.logs_payload(),
                             "time": time.time(), "world_size": self.world_size})
            self._last_ckpt = time.monotonic()

    def load_disk_checkpoint(self) -> bool:
        ck = load_checkpoint(os.path.join(self.checkpoint_dir, "checkpoint.pt")) if self.checkpoint_dir else None
        if ck is not None:
            self.apply_tree(ck["state"])
            self.load_logs(ck["logs"])
            log.info("gpuflex: resumed from checkpoint at step %d", self.step)
        return ck is not None

