"""Forming a generation: barrier, process group, state copy, verification.

Used by `ElasticRun` at three moments: the first join, an agreed switch at a step
boundary (resize), and recovery after a failed collective (fault). In every case the
members end with the same commit: the newest step that every member with state still
holds (a survivor may be one step ahead of its peers after a fault, so each keeps two).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gpuflex.elastic import keys
from gpuflex.elastic.rendezvous import Evicted, Leaving, Superseded
from gpuflex.elastic.state import FlatState, Snapshot, checksum_tensors, flatten, materialize

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun


class StateMismatch(Exception):
    pass


class Formation:
    def __init__(self, run: "ElasticRun") -> None:
        self.run = run
        self.rdzv = run.rdzv

    def log(self, msg: str) -> None:
        print(f"gpuflex[w{self.run.wid}]: {msg}", file=sys.stderr, flush=True)

    # ---- the three entries ------------------------------------------------------------------
    def recover(self, why: str) -> None:
        g = self.run.generation
        self.log(f"collective failed in generation {g}: {why}")
        failed_at = time.time()
        self.rdzv.report_fail(g, why)
        self._destroy()
        self.enter(after=g, was_member=True, failed_at=failed_at, clean=False)

    def switch(self, g: int, agreed_at: float) -> None:
        info = self.rdzv.generation(g)
        if self.run.wid not in info["members"]:
            self._leave(g)
            return
        try:
            self._form(info, clean=True, detect_from=info["created"], agreed_at=agreed_at)
        except Superseded:
            self.enter(after=g, was_member=True, failed_at=None, clean=True)
        except StateMismatch:
            self.enter(after=g, was_member=True, failed_at=None, clean=False)
        except (RuntimeError, TimeoutError, ValueError) as e:
            self._formation_failed(g, e)
            self.enter(after=g, was_member=True, failed_at=time.time(), clean=False)

    def enter(self, after: int, was_member: bool, failed_at: float | None, clean: bool) -> None:
        """Wait for the next generation that includes this worker and form it."""
        while True:
            info = self.rdzv.wait_for_generation(after, was_member, self.run._stop_requested.is_set)
            if info is None:
                self.run.stopped = True
                return
            g = info["generation"]
            try:
                self._form(info, clean=clean, detect_from=failed_at, agreed_at=None)
                return
            except Superseded:
                after = g
            except StateMismatch:
                if self.run.snapshots.latest() is None:
                    raise Evicted(f"state copied in generation {g} did not verify") from None
                after, clean = g, False
            except (RuntimeError, TimeoutError, ValueError) as e:
                self._formation_failed(g, e)
                after, clean, failed_at = g, False, time.time()
            was_member = was_member or self.run.snapshots.latest() is not None

    # ---- pieces -------------------------------------------------------------------------------
    def _destroy(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):
                pass

    def _formation_failed(self, g: int, e: Exception) -> None:
        self.log(f"forming generation {g} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        self.rdzv.report_fail(g, f"formation: {e}")
        self._destroy()

    def _leave(self, g: int) -> None:
        self._destroy()
        ok = self.rdzv.wait_verdict(g, lambda: False)
        if ok:
            self.rdzv.set(keys.left(self.run.wid), "1")
            raise Leaving(g)
        self.log(f"generation {g} was rolled back; rejoining")
        self.enter(after=g, was_member=True, failed_at=None, clean=True)

    def _form(self, info: dict[str, Any], *, clean: bool, detect_from: float | None,
              agreed_at: float | None) -> None:
        run = self.run
        g, members = info["generation"], info["members"]
        rank, world = members.index(run.wid), len(members)
        t0 = time.time()
        self.rdzv.barrier(g, members, timeout_s=2 * run.pg_timeout_s)
        run.init_process_group(g, rank, world)
        t1 = time.time()
        copied = self._sync_state(rank, world, clean)
        t2 = time.time()
        self._verify(g, rank)
        t3 = time.time()
        run.rank, run.world_size, run.generation = rank, world, g
        run._grad_flat = None
        if rank == 0:
            self.rdzv.set(keys.verdict(g), '{"ok": true}')
            start = agreed_at if agreed_at is not None else t0
            run._pending_timings = {
                "generation": g, "kind": info["kind"], "world_size": world,
                "detect": max(0.0, (agreed_at or t0) - detect_from) if detect_from else 0.0,
                "agree": run._last_agree_s if agreed_at is not None else 0.0,
                "rebuild": t1 - t0, "copy": t2 - t1, "verify": t3 - t2,
                "pause": t3 - start, "bytes": copied, "step": run.step, "_formed_at": t3,
            }
        self.log(f"generation {g}: rank {rank} of {world} at step {run.step} "
                 f"(rebuild {t1 - t0:.3f}s, copy {t2 - t1:.3f}s, {copied} bytes)")

    def _sync_state(self, rank: int, world: int, clean: bool) -> int:
        """Bring every member to the same commit; returns the bytes broadcast (0: no copy)."""
        run = self.run
        latest, prev = run.snapshots.steps()
        vec = torch.zeros(2 * world, dtype=torch.int64)
        vec[2 * rank], vec[2 * rank + 1] = latest, prev
        vec = self._all_reduce(vec)
        haves = [(int(vec[2 * r]), int(vec[2 * r + 1])) for r in range(world)]
        if all(lt < 0 for lt, _ in haves):            # nobody has state: a fresh (re)start
            if rank == 0:
                run.load_disk_checkpoint()
                run._commit_now()
            has_target = [r == 0 for r in range(world)]
        else:
            target = min(lt for lt, _ in haves if lt >= 0)
            has_target = [target in h for h in haves]
            if has_target[rank]:
                run.restore(target, live_is_current=clean and latest == target)
        if all(has_target):
            return 0
        src = has_target.index(True)
        mine = run.snapshots.latest() if has_target[rank] else None
        header = [None]
        if rank == src:
            header = [{"step": mine.step, "skeleton": mine.skeleton, "layout": mine.flat.layout,
                       "lens": mine.lens, "logs": run.logs_payload()}]
        dist.broadcast_object_list(header, src=src, device=run.device if run.backend == "nccl" else None)
        h = header[0]
        flat = mine.flat if mine is not None else FlatState(h["layout"])
        for buf in flat.buffers.values():
            self._broadcast(buf, src)
        if mine is not None:
            return flat.nbytes()   # sent (or received again, unchanged)
        snap = Snapshot(h["step"], h["skeleton"], flat, h["lens"])
        run.snapshots.adopt(snap)
        run.apply_tree(materialize(snap))
        run.load_logs(h["logs"])
        if os.environ.get("GPUFLEX_TEST_CORRUPT_STATE") == str(run.wid):   # test hook: the check works
            with torch.no_grad():
                next(run.model.parameters()).view(-1)[0] += 1.0
        return flat.nbytes()

    def _verify(self, g: int, rank: int) -> None:
        """All members compare a checksum of their live state, step and data position."""
        _, tensors = flatten(self.run.capture()["objects"])
        crc = checksum_tensors(tensors)
        pos = self.run.step * self.run.sampler.global_batch_size
        vec = torch.tensor([crc, self.run.step, pos, -crc, -self.run.step, -pos], dtype=torch.int64)
        vec = self._all_reduce(vec, dist.ReduceOp.MAX)
        if vec[:3].tolist() != (-vec[3:]).tolist():
            if rank == 0:
                self.rdzv.set(keys.verdict(g), '{"ok": false, "reason": "state checksum mismatch"}')
            self.log(f"generation {g}: state checksums differ across members; rolling back")
            self._destroy()
            raise StateMismatch(g)

    def _all_reduce(self, vec: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.run.backend == "nccl":
            dev = vec.to(self.run.device)
            dist.all_reduce(dev, op=op)
            return dev.cpu()
        dist.all_reduce(vec, op=op)
        return vec

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        if self.run.backend == "nccl" and buf.device.type == "cpu":
            tmp = buf.to(self.run.device)
            dist.broadcast(tmp, src=src)
            buf.copy_(tmp.cpu())
        else:
            dist.broadcast(buf, src=src)
