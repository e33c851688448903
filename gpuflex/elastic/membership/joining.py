"""Forming a generation: barrier, process group, state copy, verification.

Used by `ElasticRun` at three moments: the first join, an agreed switch at a step
boundary (resize), and recovery after a failed collective (fault). In every case the
members end with the same state: the newest one any of them holds. After a fault a
member is either at step k (its gradient all-reduce failed, so the step was skipped and
undone) or at k+1 (the all-reduce completed — every rank's share was in it — and only
the agreement after it failed); a member that is ahead sends its state to the others.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from gpuflex.elastic.state import codec
from gpuflex.elastic.protocol import failpoints, keys
from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.state.training import TrainingState
from gpuflex.elastic.membership.rendezvous import Evicted, Leaving, Rendezvous, Superseded
from gpuflex.elastic.protocol.signals import StepSignals
from gpuflex.elastic.state.tree import FlatState, checksum_tensors, flatten, unflatten
from gpuflex.elastic.state.copy_header import (MAX_HEADER_BYTES, NON_TENSOR, header_text, model_refs, model_targets,
                                        read_header, skeleton_crc, tensor_paths)
from gpuflex.elastic.protocol.logs import describe

log = logging.getLogger(__name__)


class StateMismatch(Exception):
    pass


class ShardsLost(Exception):
    """A sharded run (ElasticRun(shard=...)) cannot go on: a shard's only copy is gone, or a
    step cannot be undone without one. Not a RuntimeError: a formation does not retry it."""


class Shards(Protocol):
    """A sharded run's model state (gpuflex.elastic.sharding.sharded_run.Sharding), moved by the formation."""

    def before_switch(self, members: list[int], wid: int, rank: int, world: int) -> None: ...

    def form(self, rank: int, world: int) -> int: ...

    def prepare(self, world: int, total: Callable[[], int | None]) -> None: ...


@dataclasses.dataclass(frozen=True)
class Formed:
    """A generation this worker formed: its place in it, and what forming it took."""

    generation: int
    rank: int
    world_size: int
    members: tuple[int, ...]
    kind: str
    at: float                        # when the formation ended (time.time())
    copied: int                      # bytes of state this rank sent or received
    timings: dict[str, Any] | None   # rank 0's per-phase timings, published after the first step


class Formation:
    """Joins this worker to generations: `enter`, `switch` and `recover` each return the
    generation formed (None: a stop was requested while waiting for one) or raise
    Leaving or Evicted."""

    def __init__(self, *, wid: int, rdzv: Rendezvous, group: Collectives, state: TrainingState,
                 signals: StepSignals, timeout_s: float, shards: Shards | None = None) -> None:
        self.wid, self.rdzv, self.group, self.state = wid, rdzv, group, state
        self.shards = shards   # a sharded run's: moved after the state copy, before the checksum
        self.fresh = False     # the formation being made is a (re)start: nobody had state
        self.signals, self.timeout_s = signals, timeout_s
        self.marks: list[tuple[str, float]] = []   # when each part of the last state copy ended
        self.checksum_s = 0.0
        self._shard_total: int | None = None   # keys.SHARD_BYTES as this worker last wrote it (rank 0)

    def log(self, msg: str) -> None:
        log.info("gpuflex[w%d]: %s", self.wid, msg)

    # ---- the three entries ------------------------------------------------------------------
    def recover(self, g: int, why: str) -> Formed | None:
        """A collective of generation g failed: report it and join the next generation."""
        self.log(f"collective failed in generation {g}: {why}")
        failed_at = time.time()
        self.rdzv.report_fail(g, why)
        self._destroy()
        return self.enter(after=g, was_member=True, failed_at=failed_at)

    def switch(self, g: int, agreed_at: float, agree_s: float) -> Formed | None:
        """The members agreed (in `agree_s`) to switch to generation g."""
        if failpoints.ARMED: failpoints.hit("resize.agree", wid=self.wid, rank=self.group.rank, gen=g,
                                            step=self.state.step)
        info = self.rdzv.record(g, self.signals.stop_requested)
        if info is None:
            return None
        if self.shards is not None:   # over the old group: a leaver's shards go to the survivors
            self.shards.before_switch(info["members"], self.wid, self.group.rank, self.group.world_size)
        if self.wid not in info["members"]:
            return self._leave(g)
        try:
            return self._form(info, detect_from=info["created"], agreed_at=agreed_at, agree_s=agree_s)
        except (Superseded, StateMismatch):
            return self.enter(after=g, was_member=True, failed_at=None)
        except (RuntimeError, TimeoutError, ValueError) as e:
            self._formation_failed(g, e)
            return self.enter(after=g, was_member=True, failed_at=time.time())

    def enter(self, after: int, was_member: bool, failed_at: float | None) -> Formed | None:
        """Wait for the next generation that includes this worker and form it."""
        while True:
            info = self.rdzv.wait_for_generation(after, was_member, self.signals.stop_requested)
            if info is None:
                return None
            g = info["generation"]
            try:
                return self._form(info, detect_from=failed_at, agreed_at=None, agree_s=0.0)
            except Superseded:
                after = g
            except StateMismatch as e:
                if e.args[1]:   # this worker's copy is the one that did not verify
                    raise Evicted(f"state copied in generation {g} did not verify") from None
                after = g
            except (RuntimeError, TimeoutError, ValueError) as e:
                self._formation_failed(g, e)
                after, failed_at = g, time.time()
            # g listed this worker: a newer generation that leaves it out dropped it (Evicted).
            # Waiting to be included instead kept a stateless one (frozen in its first
            # formation, then woken) alive, holding its device, until the job finished.
            was_member = True

    # ---- pieces -------------------------------------------------------------------------------
    def _destroy(self) -> None:
        try:
            self.group.close()
        except (RuntimeError, ValueError):
            pass

    def _formation_failed(self, g: int, e: Exception) -> None:
        self.log(f"forming generation {g} failed: {describe(e)}")
        self.rdzv.report_fail(g, f"formation: {e}")
        self._destroy()

    def _leave(self, g: int) -> Formed | None:
        self._destroy()
        ok = self.rdzv.wait_verdict(g, lambda: False)
        if ok:
            self.rdzv.set(keys.left(self.wid), "1")
            raise Leaving(g)
        self.log(f"generation {g} was rolled back; rejoining")
        return self.enter(after=g, was_member=True, failed_at=None)

    def _form(self, info: dict[str, Any], *, detect_from: float | None, agreed_at: float | None,
              agree_s: float) -> Formed:
        state = self.state
        g, members = info["generation"], info["members"]
        rank, world = members.index(self.wid), len(members)
        t0 = time.time()
        if self.shards is not None and info["kind"] == "resize":   # before the others stop to meet it
            self.shards.prepare(world, self._shard_bytes)
        self.rdzv.barrier(g, members, timeout_s=2 * self.timeout_s)
        tb = time.time()
        points = RESIZE_POINTS if info["kind"] == "resize" else FORMATION_POINTS
        where = {"wid": self.wid, "rank": rank, "gen": g, "step": state.step, "kind": info["kind"]}
        if failpoints.ARMED: failpoints.hit(points[0], **where)
        self.group.open(self.rdzv.store, g, rank, world)
        t1 = time.time()
        self.marks = []
        had_state = state.has_state
        if failpoints.ARMED: failpoints.hit(points[1], **where)
        copied = self._sync_state(g, rank, world)
        state.align_buffers()   # a boundary that failed after the forwards left each member's own
        sharded = None
        if self.shards is not None:
            try:
                sharded = self._reshard(g, rank, world, info["kind"])
                copied += sharded
                if self.fresh:   # a (re)start: the shards of the checkpoint rank 0 resumed from
                    self.shards.restore(self.group, state.resume_dcp)
            except BaseException:   # not restored: the next formation is a (re)start again
                state.has_state = state.has_state and not self.fresh
                raise
        t2 = time.time()
        if failpoints.ARMED: failpoints.hit(points[2], **dict(where, step=state.step))
        self._verify(g, rank, received=copied > 0 and not had_state, kind=info["kind"], members=members)
        # the verified state is every member's undo point: one that never finished a step had
        # none, and its first step's failure left that step's changes (a re-plan) in place
        state.commit()
        t3 = time.time()
        self.rdzv.watch_after(g)
        timings = None
        if rank == 0:
            self.rdzv.set(keys.verdict(g), '{"ok": true}')
            if sharded is not None and sharded * world != self._shard_total:   # for a later newcomer
                self._shard_total = sharded * world
                self.rdzv.set(keys.SHARD_BYTES, json.dumps(self._shard_total))
            start = agreed_at if agreed_at is not None else t0
            timings = {
                "generation": g, "kind": info["kind"], "world_size": world,
                "detect": max(0.0, (agreed_at or t0) - detect_from) if detect_from else 0.0,
                "agree": agree_s if agreed_at is not None else 0.0,
                "rebuild": t1 - t0, "copy": t2 - t1, "verify": t3 - t2,
                "pause": t3 - start, "bytes": copied, "step": state.step,
            }
        marks = " ".join(f"{k} {v - t1:.3f}" for k, v in self.marks)
        self.log(f"generation {g}: rank {rank} of {world} at step {state.step} "
                 f"(barrier {tb - t0:.3f}s, process group {t1 - tb:.3f}s, copy {t2 - t1:.3f}s [{marks}], "
                 f"verify {t3 - t2:.3f}s [checksum {self.checksum_s:.3f}s], {copied} bytes)")
        return Formed(generation=g, rank=rank, world_size=world, members=tuple(members), kind=info["kind"],
                      at=t3, copied=copied, timings=timings)

    def _sync_state(self, g: int, rank: int, world: int) -> int:
        """Bring every member to the newest state any holds: the lowest rank holding it sends
        it to the members without it, a signed JSON header (header_text) and then the
        tensors. Returns the bytes this rank sent or received."""
        state, group = self.state, self.group
        vec = torch.zeros(world, dtype=torch.int64)
        vec[rank] = state.step + 1 if state.has_state else 0
        steps = [int(x) - 1 for x in group.all_reduce(vec)]
        self.fresh = all(s < 0 for s in steps)
        if self.fresh:                            # nobody has state: a fresh (re)start
            if rank == 0:
                state.load_disk_checkpoint()
                state.has_state = True
            have = [r == 0 for r in range(world)]
        else:
            have = [s == max(steps) for s in steps]
        if all(have):
            return 0
        src = have.index(True)
        signer = self.rdzv.signer
        text = None
        if rank == src:   # the live tensors go out as they are: no packing copy
            skeleton, tensors = flatten(state.capture())
            tensors = [t.detach().contiguous() for t in tensors]
            try:
                text = signer.sign(keys.state(g), header_text(src, skeleton, tensors, state.logs_payload()))
            except codec.CodecError:   # an empty header tells the others at once
                group.broadcast_bytes(b"", src, MAX_HEADER_BYTES)
                raise
        self.marks.append(("have", time.time()))
        text = group.broadcast_bytes(None if text is None else text.encode(), src, MAX_HEADER_BYTES).decode()
        self.marks.append(("header", time.time()))
        if not text:
            raise ValueError(f"rank {src} could not send its state (see its log)")
        h = read_header(signer.verify(keys.state(g), text), src)   # Forged, a ValueError: a failed formation
        receivers = [r for r in range(world) if not have[r]]
        if rank == src:   # point to point: members that already hold the state do nothing
            group.send([t for t in tensors if t.numel()], receivers)
            return sum(t.numel() * t.element_size() for t in tensors)
        if have[rank]:
            return 0
        # A newcomer receives the model's tensors straight into its own parameters and
        # buffers (already allocated, so no page faults and no copy after); the rest (the
        # optimizer state, RNG) into one fresh buffer per dtype. A member that holds an
        # older state keeps it intact until the transfer is complete.
        layout = h["layout"]
        in_place = {} if state.has_state else model_targets(state.model, h["skeleton"], layout)
        rest = [i for i in range(len(layout)) if i not in in_place]
        flat = FlatState(tuple(layout[i] for i in rest))
        views: list[torch.Tensor] = [torch.empty(0)] * len(layout)
        for i, v in zip(rest, flat.views):
            views[i] = v
        for i, t in in_place.items():
            views[i] = t
        self.marks.append(("alloc", time.time()))
        group.recv([v for v in views if v.numel()], src)
        self.marks.append(("recv", time.time()))
        model_done = bool(in_place) and len(in_place) == len(model_refs(h["skeleton"]))
        state.apply_tree(unflatten(h["skeleton"], views), skip=("model",) if model_done else ())
        self.marks.append(("apply", time.time()))
        state.load_logs(h["logs"])
        state.has_state = True
        state.commit()
        return sum(v.numel() * v.element_size() for v in views)

    def _reshard(self, g: int, rank: int, world: int, kind: str) -> int:
        """A sharded run's shards moved to this generation's members (the bytes of this rank's
        new shards). Their checksums disagreeing is a state mismatch: rolled back as one (the
        old holders keep their old shards for the rollback generation)."""
        try:
            return self.shards.form(rank, world)
        except StateMismatch as e:
            reason = f"sharded state checksum mismatch in {kind}: {e.args[2]}"
            if rank == 0:
                self.rdzv.set(keys.verdict(g), json.dumps({"ok": False, "reason": reason}))
            self.log(f"generation {g}: {reason}; rolling back")
            self._destroy()
            raise

    def _shard_bytes(self) -> int | None:
        """The sharded state's size rank 0 wrote at its last formation (None: none yet)."""
        n = self.rdzv.get_json(keys.SHARD_BYTES)
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def _verify(self, g: int, rank: int, received: bool, kind: str, members: list[int]) -> None:
        """All members compare a checksum of their live state, step and data position; on a
        mismatch, which part differs and on which member is named in the verdict."""
        state = self.state
        skeleton, tensors = flatten(state.capture()["objects"])
        tv = time.time()
        crc = checksum_tensors(tensors) ^ skeleton_crc(skeleton)
        self.checksum_s = time.time() - tv
        pos = state.position
        vec = torch.tensor([crc, state.step, pos, -crc, -state.step, -pos], dtype=torch.int64)
        vec = self.group.all_reduce(vec, dist.ReduceOp.MAX)
        if vec[:3].tolist() != (-vec[3:]).tolist():
            try:
                what, r = self._differing(tensor_paths(skeleton, "objects"), tensors, skeleton, rank, len(members))
                reason = f"state checksum mismatch in {kind}: {what} differs on worker {members[r]} (rank {r})"
            except (RuntimeError, ValueError) as e:   # the group broke while looking: name nothing
                reason = f"state checksum mismatch in {kind} ({type(e).__name__} while locating it)"
            if rank == 0:
                self.rdzv.set(keys.verdict(g), json.dumps({"ok": False, "reason": reason}))
            self.log(f"generation {g}: {reason}; rolling back")
            self._destroy()
            raise StateMismatch(g, received)

    def _differing(self, paths: list[str], tensors: list[torch.Tensor], skeleton: Any, rank: int,
                   world: int) -> tuple[str, int]:
        """The first part of the state (a tensor's path, the step or the data position)
        whose checksum differs across the members, and the rank holding a value other than
        the majority's (rank 0's on a tie): two more small all-reduces, run on a mismatch only."""
        state = self.state
        own = [checksum_tensors([t]) for t in tensors] + [skeleton_crc(skeleton), state.step, state.position]
        names = paths + [NON_TENSOR, "step", "data position"]
        vec = torch.tensor(own + [-v for v in own], dtype=torch.int64)
        vec = self.group.all_reduce(vec, dist.ReduceOp.MAX)
        n = len(own)
        i = next((i for i in range(n) if int(vec[i]) != -int(vec[n + i])), n - 1)
        each = torch.zeros(world, dtype=torch.int64)
        each[rank] = own[i]
        values = self.group.all_reduce(each).tolist()
        counts = {v: values.count(v) for v in values}
        majority = max(counts.values())
        ref = values[0] if counts[values[0]] == majority else max(counts, key=counts.get)
        return names[i], next((r for r, v in enumerate(values) if v != ref), 0)


# The failpoints of a formation's phases (before the group is built, before the state
# copy, before the checksum): a resize's, or those of every other formation (the first, a
# recovery's, a rollback's).
RESIZE_POINTS = ("resize.rebuild", "resize.copy", "resize.verify")
FORMATION_POINTS = ("formation.join", "formation.group", "formation.verify")
