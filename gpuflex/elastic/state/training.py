"""The training state a run owns: the registered objects, the step and the logs, with the
per-step light commit and its undo, the state tree a newcomer receives, and the on-disk
checkpoint (see runtime.py and state.py)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from gpuflex.elastic.state.buffers import BufferSync, buffer_slots
from gpuflex.elastic.state.checkpoints import CheckpointError, load_newest_good, save_checkpoint
from gpuflex.elastic.sharding.checkpoints import UnsafeCheckpoint, path_of
from gpuflex.elastic.data.sampler import ElasticSampler
from gpuflex.elastic.state.tree import LightCommit, Registry, copy_value, rng_state, set_rng_state

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
NO_CHECKPOINT_EXIT = 1   # every checkpoint of the job is unusable: the worker ends, the job fails


class TrainingState:
    """The step, the logs (step log, sample ids per epoch) and the registered objects, and
    what is done with them at step boundaries and formations."""

    def __init__(self, *, registry: Registry, model: torch.nn.Module, sampler: ElasticSampler,
                 distributed: bool, checkpoint_dir: str | None, buffers: BufferSync | None = None,
                 resume_from: str | None = None) -> None:
        self.registry, self.model, self.sampler = registry, model, sampler
        self.buffers = buffers
        self.distributed = distributed
        self.checkpoint_dir = checkpoint_dir
        self.samples: dict[int, list[int]] = {}
        self.step_log: list[list[float]] = []
        self.step = 0
        self.has_state = not distributed   # a newcomer gets it at its first formation
        self.last_checkpoint = time.monotonic()
        self.last_checkpoint_error: str | None = None   # the last failed write's reason, until one succeeds
        self.checkpoint_failures = 0                    # writes that failed, in this process
        self.resume_from = resume_from   # `submit --resume-from`: another job's checkpoint directory
        self.resume_dcp: str | None = None   # a sharded run's shards to restore (the loaded checkpoint names them)
        self.dcp_names: list[str] = []       # the DCP directories the light files name (rank 0)
        self._light: LightCommit | None = None
        self._buffer_slots: list[tuple[torch.nn.Module, str]] | None = None

    @property
    def epoch(self) -> int:
        return min(self.step // self.sampler.steps_per_epoch, self.sampler.epochs)

    @property
    def position(self) -> int:
        """Samples consumed so far: where the sampler stands."""
        return self.step * self.sampler.global_batch_size

    def confirm_step(self, ids: list[int] | None, now: float, world_size: int) -> None:
        """The step just done is agreed: log it (and its samples) and count it."""
        if ids is not None:
            self.samples.setdefault(self.epoch, []).extend(ids)
        self.step_log.append([self.step, now, world_size])
        self.step += 1

    def capture(self) -> dict[str, Any]:
        return {"objects": self.registry.capture(), "rng": rng_state(), "step": self.step}

    def _lens(self) -> dict[str, int]:
        """Where the logs end now. Only the current epoch's sample list can grow in the next
        step (or a later epoch's appear), so that one length suffices: a cost per step that
        does not grow with the number of epochs run."""
        return {"step_log": len(self.step_log), "epoch": self.epoch,
                "samples": len(self.samples.get(self.epoch, ()))}

    def commit(self) -> None:
        """The light commit of every step boundary (parameters and optimizer state need none)."""
        if self.distributed:
            if self._buffer_slots is None:   # where the buffers live (`.to()` replaces them)
                self._buffer_slots = buffer_slots(self.model)
            self._light = LightCommit(self.step, rng_state(), self.registry.capture_light(),
                                      [getattr(m, n).detach().clone() for m, n in self._buffer_slots],
                                      self._lens())

    def undo_step(self) -> None:
        """Back to the last light commit: the step whose collective failed leaves no trace."""
        c = self._light
        if c is None:
            return
        self.registry.load(copy_value(c.objects), light_only=True)
        set_rng_state(c.rng)
        with torch.no_grad():
            for (m, name), saved in zip(self._buffer_slots or [], c.buffers):
                getattr(m, name).copy_(saved)
        self.step = c.step
        del self.step_log[c.lens["step_log"]:]
        epoch = c.lens["epoch"]
        for e in [e for e in self.samples if e > epoch]:
            del self.samples[e]
        if epoch in self.samples:
            del self.samples[epoch][c.lens["samples"]:]
            if not self.samples[epoch]:
                del self.samples[epoch]

    def align_buffers(self) -> None:
        """In a formation, after the state copy and before the checksum: rank 0's buffers to
        every member. A step boundary that failed after the members' forwards (a failed
        agreement or buffer sync) leaves each member's own running statistics in a confirmed
        step; this makes them equal again (the broadcast rule's truth is rank 0). Raises if
        the broadcast fails, as the formation's collectives do."""
        if self.buffers is not None:
            self.buffers.broadcast()

    def apply_tree(self, tree: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
        if "split" not in tree["objects"]:   # a checkpoint from before the split plan: planned afresh
            skip = (*skip, "split")
        self.registry.load(tree["objects"], skip=skip)
        set_rng_state(tree["rng"])
        self.step = int(tree["step"])

    def logs_payload(self) -> dict[str, Any]:
        return {"step_log": [list(x) for x in self.step_log],
                "samples": {e: list(v) for e, v in self.samples.items()}}

    def load_logs(self, logs: dict[str, Any]) -> None:
        self.step_log = [list(x) for x in logs["step_log"]]
        self.samples = {int(e): list(v) for e, v in logs["samples"].items()}

    def checkpoint(self, rank: int, world_size: int, dcp: str | None = None) -> bool:
        """Rank 0 writes the live (just committed) state to disk, atomically (a sharded run:
        its light state, naming the distributed checkpoint `dcp` of its shards). A write that
        fails (a full disk, a read-only or vanished directory) is a failed checkpoint, not
        a failed job: training goes on with the earlier checkpoints intact, the reason is
        logged and kept in `last_checkpoint_error`, and the next try comes an interval
        later. Returns whether a checkpoint was written."""
        if not (self.checkpoint_dir and rank == 0):
            return False
        path = os.path.join(self.checkpoint_dir, CHECKPOINT_FILE)
        payload = {"state": self.capture(), "logs": self.logs_payload(), "time": time.time(),
                   "world_size": world_size}
        try:
            save_checkpoint(path, dict(payload, dcp=dcp) if dcp else payload)
        except OSError as e:
            self.checkpoint_failed(f"checkpoint at step {self.step} failed: {e.strerror or e} ({path})")
            return False
        self.last_checkpoint = time.monotonic()
        self.last_checkpoint_error = None
        return True

    def checkpoint_failed(self, reason: str) -> None:
        """A checkpoint that could not be written: logged, kept, retried an interval later."""
        self.checkpoint_failures += 1
        self.last_checkpoint_error = reason
        self.last_checkpoint = time.monotonic()
        log.warning("gpuflex: %s; training goes on, the earlier checkpoints are kept", reason)

    def load_disk_checkpoint(self) -> bool:
        """Resume from the newest checkpoint that verifies (see checkpoints.py). Where the
        job has checkpoints and none is usable, the worker ends (NO_CHECKPOINT_EXIT) with
        one line naming each file and its problem: the job fails rather than start over
        from step 0 and end `succeeded`."""
        if not self.checkpoint_dir and not self.resume_from:
            return False
        try:
            found = load_newest_good(os.path.join(self.checkpoint_dir, CHECKPOINT_FILE)) \
                if self.checkpoint_dir else None
            if found is None and self.resume_from:   # the job's own come first: a restart goes on from there
                found = load_newest_good(os.path.join(self.resume_from, CHECKPOINT_FILE))
                if found is None:
                    raise CheckpointError(f"--resume-from {self.resume_from}: no {CHECKPOINT_FILE} there")
            if found is not None and found.payload.get("dcp"):
                self.resume_dcp = path_of(os.path.dirname(found.path), str(found.payload["dcp"]))
                self.dcp_names = [str(found.payload["dcp"])]
        except (CheckpointError, UnsafeCheckpoint) as e:
            log.error("gpuflex: %s; the job cannot resume and does not start over", e)
            raise SystemExit(NO_CHECKPOINT_EXIT) from None
        if found is None:
            return False
        self.apply_tree(found.payload["state"])
        self.load_logs(found.payload["logs"])
        if found.refused:
            log.warning("gpuflex: %s; resuming from the previous one (%s) at step %d",
                        "; ".join(found.refused), found.path, self.step)
        log.info("gpuflex: resumed from checkpoint at step %d", self.step)
        return True
