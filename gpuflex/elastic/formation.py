"""Forming a generation: barrier, process group, state copy, verification.

Used by `ElasticRun` at three moments: the first join, an agreed switch at a step
boundary (resize), and recovery after a failed collective (fault). In every case the
members end with the same state: the newest one any of them holds. After a fault a
member is either at step k (its gradient all-reduce failed, so the step was skipped and
undone) or at k+1 (the all-reduce completed — every rank's share was in it — and only
the agreement after it failed); a member that is ahead sends its state to the others.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gpuflex.elastic import keys
from gpuflex.elastic.rendezvous import Evicted, Leaving, Superseded
from gpuflex.elastic.state import FlatState, TensorRef, checksum_tensors, flatten, layout_of, unflatten

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun

log = logging.getLogger(__name__)

class StateMismatch(Exception):
    pass


class Formation:
    def __init__(self, run: "ElasticRun") -> None:
        self.run = run
        self.rdzv = run.rdzv
        self.marks: list[tuple[str, float]] = []   # when each part of the last state copy ended
        self.checksum_s = 0.0

    def log(self, msg: str) -> None:
        log.info("gpuflex[w%d]: %s", self.run.wid, msg)

    # ---- the three entries ------------------------------------------------------------------
    def recover(self, why: str) -> None:
        g = self.run.generation
        self.log(f"collective failed in generation {g}: {why}")
        failed_at = time.time()
        self.rdzv.report_fail(g, why)
        self._destroy()
        self.enter(after=g, was_member=True, failed_at=failed_at)

    def switch(self, g: int, agreed_at: float) -> None:
        info = self.rdzv.generation(g)
        if self.run.wid not in info["members"]:
            self._leave(g)
            return
        try:
            self._form(info, detect_from=info["created"], agreed_at=agreed_at)
        except (Superseded, StateMismatch):
            self.enter(after=g, was_member=True, failed_at=None)
        except (RuntimeError, TimeoutError, ValueError) as e:
            self._formation_failed(g, e)
            self.enter(after=g, was_member=True, failed_at=time.time())

    def enter(self, after: int, was_member: bool, failed_at: float | None) -> None:
        """Wait for the next generation that includes this worker and form it."""
        while True:
            info = self.rdzv.wait_for_generation(after, was_member, self.run._stop_requested.is_set)
            if info is None:
                self.run.stopped = True
                return
            g = info["generation"]
            try:
                self._form(info, detect_from=failed_at, agreed_at=None)
                return
            except Superseded:
                after = g
            except StateMismatch as e:
                if e.args[1]:   # this worker's copy is the one that did not verify
                    raise Evicted(f"state copied in generation {g} did not verify") from None
                after = g
            except (RuntimeError, TimeoutError, ValueError) as e:
                self._formation_failed(g, e)
                after, failed_at = g, time.time()
            was_member = was_member or self.run.has_state

    # ---- pieces -------------------------------------------------------------------------------
    def _destroy(self) -> None:
        try:
            self.run.destroy_process_group()
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
        self.enter(after=g, was_member=True, failed_at=None)

    def _form(self, info: dict[str, Any], *, detect_from: float | None, agreed_at: float | None) -> None:
        run = self.run
        g, members = info["generation"], info["members"]
        rank, world = members.index(run.wid), len(members)
        t0 = time.time()
        self.rdzv.barrier(g, members, timeout_s=2 * run.pg_timeout_s)
        tb = time.time()
        run.init_process_group(g, rank, world)
        t1 = time.time()
        self.marks = []
        had_state = run.has_state
        copied = self._sync_state(rank, world)
        t2 = time.time()
        self._verify(g, rank, received=copied > 0 and not had_state)
        t3 = time.time()
        run.rank, run.world_size, run.generation = rank, world, g
        self.rdzv.watch_after(g)
        run._formed_at = t3
        if rank == 0:
            self.rdzv.set(keys.verdict(g), '{"ok": true}')
            start = agreed_at if agreed_at is not None else t0
            run._pending_timings = {
                "generation": g, "kind": info["kind"], "world_size": world,
                "detect": max(0.0, (agreed_at or t0) - detect_from) if detect_from else 0.0,
                "agree": run._last_agree_s if agreed_at is not None else 0.0,
                "rebuild": t1 - t0, "copy": t2 - t1, "verify": t3 - t2,
                "pause": t3 - start, "bytes": copied, "step": run.step,
            }
        marks = " ".join(f"{k} {v - t1:.3f}" for k, v in self.marks)
        self.log(f"generation {g}: rank {rank} of {world} at step {run.step} "
                 f"(barrier {tb - t0:.3f}s, process group {t1 - tb:.3f}s, copy {t2 - t1:.3f}s [{marks}], "
                 f"verify {t3 - t2:.3f}s [checksum {self.checksum_s:.3f}s], {copied} bytes)")

    def _sync_state(self, rank: int, world: int) -> int:
        """Bring every member to the newest state any holds: the lowest rank holding it sends
        it to the members without it. Returns the bytes this rank sent or received."""
        run = self.run
        vec = torch.zeros(world, dtype=torch.int64)
        vec[rank] = run.step + 1 if run.has_state else 0
        steps = [int(x) - 1 for x in self._all_reduce(vec)]
        if all(s < 0 for s in steps):             # nobody has state: a fresh (re)start
            if rank == 0:
                run.load_disk_checkpoint()
                run.has_state = True
            have = [r == 0 for r in range(world)]
        else:
            have = [s == max(steps) for s in steps]
        if all(have):
            return 0
        src = have.index(True)
        header: list[Any] = [None]
        if rank == src:   # the live tensors go out as they are: no packing copy
            skeleton, tensors = flatten(run.capture())
            tensors = [t.detach().contiguous() for t in tensors]
            header = [{"skeleton": skeleton, "layout": layout_of(tensors), "logs": run.logs_payload()}]
        self.marks.append(("have", time.time()))
        dist.broadcast_object_list(header, src=src, device=run.device if run.backend == "nccl" else None)
        self.marks.append(("header", time.time()))
        h = header[0]
        receivers = [r for r in range(world) if not have[r]]
        if rank == src:   # point to point: members that already hold the state do nothing
            self._send([t for t in tensors if t.numel()], receivers)
            return sum(t.numel() * t.element_size() for t in tensors)
        if have[rank]:
            return 0
        # A newcomer receives the model's tensors straight into its own parameters and
        # buffers (already allocated, so no page faults and no copy after); the rest (the
        # optimizer state, RNG) into one fresh buffer per dtype. A member that holds an
        # older state keeps it intact until the transfer is complete.
        layout = h["layout"]
        in_place = {} if run.has_state else _model_targets(run, h["skeleton"], layout)
        rest = [i for i in range(len(layout)) if i not in in_place]
        flat = FlatState(tuple(layout[i] for i in rest))
        views: list[torch.Tensor] = [torch.empty(0)] * len(layout)
        for i, v in zip(rest, flat.views):
            views[i] = v
        for i, t in in_place.items():
            views[i] = t
        self.marks.append(("alloc", time.time()))
        self._recv([v for v in views if v.numel()], src)
        self.marks.append(("recv", time.time()))
        model_done = bool(in_place) and len(in_place) == len(_model_refs(h["skeleton"]))
        run.apply_tree(unflatten(h["skeleton"], views), skip=("model",) if model_done else ())
        self.marks.append(("apply", time.time()))
        run.load_logs(h["logs"])
        run.has_state = True
        run._commit()
        return sum(v.numel() * v.element_size() for v in views)

    def _verify(self, g: int, rank: int, received: bool) -> None:
        """All members compare a checksum of their live state, step and data position."""
        _, tensors = flatten(self.run.capture()["objects"])
        tv = time.time()
        crc = checksum_tensors(tensors)
        self.checksum_s = time.time() - tv
        pos = self.run.step * self.run.sampler.global_batch_size
        vec = torch.tensor([crc, self.run.step, pos, -crc, -self.run.step, -pos], dtype=torch.int64)
        vec = self._all_reduce(vec, dist.ReduceOp.MAX)
        if vec[:3].tolist() != (-vec[3:]).tolist():
            if rank == 0:
                self.rdzv.set(keys.verdict(g), '{"ok": false, "reason": "state checksum mismatch"}')
            self.log(f"generation {g}: state checksums differ across members; rolling back")
            self._destroy()
            raise StateMismatch(g, received)

    def _all_reduce(self, vec: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.run.backend == "nccl":
            dev = vec.to(self.run.device)
            dist.all_reduce(dev, op=op)
            return dev.cpu()
        dist.all_reduce(vec, op=op)
        return vec

    def _send(self, bufs: list[torch.Tensor], peers: list[int]) -> None:
        staged = [self._staged(b) for b in bufs]
        for work in [dist.isend(b, dst=r) for b in staged for r in peers]:
            work.wait()

    def _recv(self, bufs: list[torch.Tensor], src: int) -> None:
        staged = [self._staged(b) for b in bufs]
        for work in [dist.irecv(b, src=src) for b in staged]:   # all posted at once, in send order
            work.wait()
        for buf, st in zip(bufs, staged):
            if st is not buf:
                buf.copy_(st.cpu())

    def _staged(self, buf: torch.Tensor) -> torch.Tensor:
        """nccl moves only GPU tensors: CPU parts of the state (RNG) travel through the GPU."""
        if self.run.backend == "nccl" and buf.device.type == "cpu":
            return buf.to(self.run.device)
        return buf


def _model_refs(skeleton: Any) -> dict[str, Any]:
    refs = skeleton.get("objects", {}).get("model", {})
    return refs if isinstance(refs, dict) else {}


def _model_targets(run: "ElasticRun", skeleton: Any, layout: tuple) -> dict[int, torch.Tensor]:
    """{index in the sent tensor list: the newcomer's own tensor that entry can land in}:
    the model's parameters and buffers, where name, dtype, device and shape agree."""
    own = run.model.state_dict()
    out = {}
    for name, ref in _model_refs(skeleton).items():
        t = own.get(name)
        if (isinstance(ref, TensorRef) and t is not None and t.is_contiguous()
                and (t.dtype, t.device, tuple(t.shape)) == tuple(layout[ref.i])):
            out[ref.i] = t
    return out
