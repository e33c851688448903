"""This generation's process group, and the note of a collective that failed on it.

A collective that fails (a dead peer) must not crash the training loop: `call` turns the
error into a note, `failure`, that the runtime handles at the next step boundary (the
survivors report it and wait for the coordinator's next generation). The formation's own
collectives (state sync, verification) raise instead: a formation that breaks is retried
as a whole.
"""

from __future__ import annotations

import atexit
import datetime as dt
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from gpuflex.elastic import torch_compat
from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.env import BACKEND
from gpuflex.elastic.protocol.logs import describe

GLOO_DRAIN_S = 0.05   # ten of the interpreter's 5 ms switch intervals
_SUM = dist.AllreduceOptions()   # read, never changed: the process group copies it into each work
_SUM.reduceOp = dist.ReduceOp.SUM


BACKENDS = ("gloo", "nccl")


def pick_backend(device: torch.device) -> str:
    """The process group's backend: GPUFLEX_BACKEND where set (gloo lets several workers
    share one GPU, which nccl refuses: one GPU per rank), else nccl on a GPU, gloo on CPU.
    gloo moves CUDA tensors in its all-reduce; the rest (broadcast, send and receive of
    the state copy) is staged through CPU memory (`Collectives._staged`)."""
    raw = os.environ.get(BACKEND, "").strip().lower()
    if raw:
        if raw not in BACKENDS:
            raise ValueError(f"{BACKEND}={raw!r}: expected one of {', '.join(BACKENDS)}")
        if raw == "nccl" and device.type != "cuda":
            raise ValueError(f"{BACKEND}=nccl needs a GPU, and this worker has none (CUDA_VISIBLE_DEVICES)")
        return raw
    return "nccl" if device.type == "cuda" else "gloo"


def group_backend(backend: str) -> str:
    """What init_process_group is given: on nccl, gloo beside it for CPU tensors. The
    runtime's own collectives carry CPU tensors (the sharded formation's checksums and
    counts, DCP's coordination), which nccl alone refuses."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def pick_device() -> torch.device:
    """This worker's device: its GPU where gpuflex gave it one, else CPU. A gang's worker sees
    all of the job's GPUs on its host (torchrun's convention): GPUFLEX_CUDA_DEVICE says which
    visible index is its own (0 for in-place jobs, which see only their own)."""
    if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "") not in ("", "-1"):
        raw = os.environ.get("GPUFLEX_CUDA_DEVICE", "0")
        index = int(raw) if raw.isdigit() and int(raw) < torch.cuda.device_count() else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def backward(loss: torch.Tensor, backend: str) -> None:
    """`loss.backward()`; on gloo, without the Python object torch keeps in the thread-local
    state for the backward's duration (`_engine_run_backward` stashes a contextvars copy for
    compiled autograd's device threads). Every gloo collective launched inside backward (the
    gradient all-reduces, FSDP's reduce-scatters) snapshots that state; when gloo's worker
    thread frees the last one while the interpreter finalizes, it cannot take the GIL and
    the process aborts ("terminate called without an active exception", SIGABRT: 2 of 25
    plain FSDP2 runs under torchrun here, none of 25 without the object). CPU autograd runs
    in the calling thread, where nothing reads it; NCCL keeps torch's own path."""
    if backend != "gloo" or loss.grad_fn is None or loss.numel() != 1:   # torch's own errors, too
        loss.backward()
        return
    torch_compat.run_backward_without_context(loss)   # what backward() calls, less the stash


def _let_gloo_threads_finish() -> None:
    """At exit, before the interpreter finalizes (atexit runs while other threads may still
    take the GIL): give gloo's worker threads the GIL to free the works they finished. A
    work that holds a Python object in its thread-local state (the backward's stash, see
    `backward`; DCP-restored workers had others) needs the GIL to be freed; a thread that
    asks for it once finalizing has begun is ended inside a C++ destructor and the process
    aborts (SIGABRT, "terminate called without an active exception": a worker that had
    finished its run would end 'failed'). The thread waits at most one switch interval
    (5 ms) for a main thread that holds the GIL; a script that exits within that of its last
    collective lost the race: 2 of 30 plain FSDP2 runs here, 0 of 40 with this pause."""
    time.sleep(GLOO_DRAIN_S)


_drain_at_exit = False


class Collectives:
    """The process group of the generation being formed or run, with its rank and size."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.backend = pick_backend(device)
        self.timeout_s = timeout_s
        self.pg: dist.ProcessGroup | None = None
        self.rank, self.world_size = 0, 1
        self.failure: str | None = None   # a collective failed during this step
        self._on_close: list[Callable[[], None]] = []

    # ---- the group's life ---------------------------------------------------------------
    def on_close(self, fn: Callable[[], None]) -> None:
        """Call `fn` whenever the group is destroyed, first: it drops references to the
        group's works (finished works keep gloo's context alive)."""
        self._on_close.append(fn)

    def open(self, store: dist.Store, g: int, rank: int, world: int) -> None:
        """Generation g's group, over the job store under g's own prefix."""
        global _drain_at_exit
        self.close()
        if self.backend == "gloo" and not _drain_at_exit:
            atexit.register(_let_gloo_threads_finish)
            _drain_at_exit = True
        _name_world_group_alike()
        dist.init_process_group(group_backend(self.backend), store=dist.PrefixStore(keys.pg_prefix(g), store),
                                rank=rank, world_size=world, timeout=dt.timedelta(seconds=self.timeout_s))
        self.pg = dist.group.WORLD
        self.rank, self.world_size = rank, world

    def close(self) -> None:
        """Drop the group, the runtime's references included: with none left, gloo joins its
        threads here. A group that outlives this (referenced at exit) keeps threads that may
        free a finished work while the interpreter finalizes, and torch 2.13 then aborts the
        process (see tests/e2e/test_examples.py)."""
        self.pg = None
        for fn in self._on_close:
            fn()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives during steps: a failure is noted, not raised ------------------------
    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Run a collective (or launches of some); False, with the failure noted, if it failed."""
        try:
            fn(*args, **kwargs)
            return True
        except (RuntimeError, ValueError) as e:   # DistBackendError is a RuntimeError
            self.failure = describe(e)
            return False

    def take_failure(self) -> str | None:
        """The failure noted in this step, if any, cleared for the next."""
        why, self.failure = self.failure, None
        return why

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work:
        """`dist.all_reduce(tensor, async_op=True)` straight on the process group, as DDP's
        reducer calls it from C++: the Python wrapper's checks and logging cost ~50 us a call
        on 2 CPU cores, a few percent of a small model's step."""
        return self.pg.allreduce([tensor], _SUM)

    # ---- the formation's collectives: errors propagate -------------------------------------
    def all_reduce(self, vec: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """The reduced copy of a CPU tensor (through the GPU on nccl)."""
        if self.backend == "nccl":
            dev = vec.to(self.device)
            dist.all_reduce(dev, op=op)
            return dev.cpu()
        dist.all_reduce(vec, op=op)
        return vec

    def broadcast_bytes(self, data: bytes | None, src: int, limit: int) -> bytes:
        """`data` (given on rank `src`) on every rank: its length, then the bytes as a uint8
        tensor (never a pickle). A length over `limit` raises ValueError before anything
        is allocated for it. The tensor is a view of a bytearray, which holds the bytes once
        the broadcast is done: read back without numpy (`.numpy()` needs it, and a GPU host
        has only torch)."""
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._broadcast(n, src)
        size = int(n[0])
        if not 0 <= size <= limit:
            raise ValueError(f"a broadcast of {size} bytes (limit {limit})")
        if not size:
            return b""
        held = bytearray(data) if data is not None else bytearray(size)
        self._broadcast(torch.frombuffer(held, dtype=torch.uint8), src)
        return bytes(held)

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        staged = self._staged(buf)
        dist.broadcast(staged, src=src)
        if staged is not buf:
            buf.copy_(staged.cpu())

    def send(self, bufs: list[torch.Tensor], peers: list[int]) -> None:
        staged = [self._staged(b) for b in bufs]
        for work in [dist.isend(b, dst=r) for b in staged for r in peers]:
            work.wait()

    def recv(self, bufs: list[torch.Tensor], src: int) -> None:
        staged = [self._staged(b) for b in bufs]
        for work in [dist.irecv(b, src=src) for b in staged]:   # all posted at once, in send order
            work.wait()
        for buf, st in zip(bufs, staged):
            if st is not buf:
                buf.copy_(st.cpu())

    def _staged(self, buf: torch.Tensor) -> torch.Tensor:
        """nccl moves only GPU tensors: CPU parts of the state (RNG) travel through the GPU;
        gloo's broadcast and point-to-point take CPU tensors: GPU parts travel through CPU."""
        if self.backend == "nccl" and buf.device.type == "cpu":
            return buf.to(self.device)
        if self.backend == "gloo" and buf.device.type != "cpu":
            return buf.cpu()
        return buf


def _name_world_group_alike() -> None:
    """torch names a process group from a per-process counter (its store keys are under that
    name) and resets the counter when the world group is destroyed, not when creating one
    failed. A member whose last formation failed inside init_process_group (a peer gone
    during gloo's connect) would name its next group "1" while the others name theirs "0":
    their connects wait for each other's keys until every formation fails (seen in
    tests/e2e/test_fault_matrix_phases.py). No world group exists here, so the next one is
    named "0" on every member, as after a destroy. A torch without the counter fails here,
    loudly: skipping the reset would leave such formations failing as above."""
    torch_compat.reset_group_counter()
