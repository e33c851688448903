"""The gradient all-reduce of `ElasticRun.backward`.

Large gradients are all-reduced where they are, each launched from its parameter's
post-accumulate-grad hook while backward is still computing the layers below it (as DDP
launches its buckets), in one fixed order on every rank. The small ones are packed into one
buffer with the step-boundary agreement at its end and summed when backward is done: on
gloo, when the buffer is small, by an exchange (each rank sends it to every other and adds
the copies in rank order) rather than gloo's all-reduce, whose rounds cost ~0.7 ms on a
busy host where the exchange takes ~0.3 ms.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from gpuflex.elastic import torch_compat
from gpuflex.elastic.protocol import env
from gpuflex.elastic.membership.agreement import Agreement
from gpuflex.elastic.membership.collectives import Collectives

DIRECT_BYTES = 1 << 20   # gradients this large are all-reduced in place, launched during backward
# (below it a copy into the packed buffer costs less than one more collective: gloo over
# TCP pays ~0.3 ms per call; DDP's first bucket is 1 MiB for the same reason).
# GPUFLEX_DIRECT_BYTES in a worker's environment overrides it.

EXCHANGE_BYTES = 512 << 10   # the packed buffer is exchanged when its size x (world - 1) is at most this
# (gloo only; benchmarks/gloo_sum.py, 2 ranks: 8 KiB 0.28 vs 0.67 ms all-reduce, 256 KiB
# 0.30 vs 0.65 ms, 4 MiB 3.98 vs 3.12 ms). GPUFLEX_EXCHANGE_BYTES overrides it (0: never).
EXCHANGE_TAG = 0x6766   # the exchange's point-to-point tag (the state copy uses 0)


def direct_bytes() -> int:
    return env.env_bytes(env.DIRECT_BYTES, DIRECT_BYTES)


def exchange(pg: dist.ProcessGroup, rank: int, buf: torch.Tensor, rows: torch.Tensor) -> list[dist.Work]:
    """Send `buf` to every other rank and receive each one's into its row of `rows`
    (one row per rank): the launches of the exchange, to be waited for."""
    works = []
    for peer in range(rows.shape[0]):
        if peer != rank:
            works.append(pg.send([buf], peer, EXCHANGE_TAG))
            works.append(pg.recv([rows[peer]], peer, EXCHANGE_TAG))
    return works


def sum_exchanged(buf: torch.Tensor, rows: torch.Tensor, rank: int) -> None:
    """After the exchange: `buf` becomes the sum of every rank's copy, added in rank order
    on every rank: elementwise IEEE additions in one order, so each rank gets the same bits."""
    rows[rank].copy_(buf)
    torch.add(rows[0], rows[1], out=buf)
    for r in range(2, rows.shape[0]):
        buf.add_(rows[r])


def drop_grads(model: torch.nn.Module) -> None:
    """After a failed all-reduce: with no gradient, optimizer.step() leaves every
    parameter (and its optimizer state) as it was; the light state is undone at the
    boundary, so the failed step leaves no trace."""
    for p in model.parameters():
        p.grad = None


class GradPlan:
    """Which gradients are reduced in place and which are packed, made once for the run
    (like DDP's buckets, fixed at construction: the set of parameters that require grad
    is fixed for the run), and the in-place all-reduces launched so far in this step."""

    def __init__(self, model: torch.nn.Module, group: Collectives, agreement: Agreement,
                 num_samples: int) -> None:
        self.model, self.group, self.agreement = model, group, agreement
        self.params = params = [p for p in model.parameters() if p.requires_grad]
        dtype = params[0].dtype
        limit = direct_bytes()
        big = {i for i, p in enumerate(params) if p.numel() * p.element_size() >= limit and p.dtype == dtype}
        # the launch order, the same on every rank: backward reaches the last layers first
        self.direct = sorted(big, reverse=True)
        self.packed = [i for i in range(len(params)) if i not in big]
        self.n = sum(params[i].numel() for i in self.packed)
        self.fuse = dtype in (torch.float32, torch.float64) and num_samples < 2 ** 24
        self.flat = torch.empty(self.n + (agreement.size if self.fuse else 0), dtype=dtype,
                                device=params[0].device)
        self.views, off = [], 0
        for i in self.packed:
            self.views.append(self.flat[off:off + params[i].numel()].view_as(params[i]))
            off += params[i].numel()
        self.exchange_bytes = env.env_bytes(env.EXCHANGE_BYTES, EXCHANGE_BYTES)
        self.rows: torch.Tensor | None = None   # the exchange's copies, one row per rank
        # this step's launches: the in-place all-reduces in `direct` order (their count says
        # which is next), then the packed buffer's all-reduce or exchange
        self.works: list[dist.Work] = []
        self._ready: set[int] = set()
        self._armed = False
        for i in self.direct:
            params[i].register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))
        group.on_close(self.forget_works)

    def forget_works(self) -> None:
        """The group is going: its finished works would keep gloo's context alive."""
        self.works = []

    def arm(self) -> None:
        """Called just before the step's backward: launch from the hooks during it."""
        self.works, self._ready = [], set()
        self._armed = self.group.world_size > 1 and self.group.failure is None

    def _accumulated(self, i: int, _param: torch.Tensor) -> None:
        if self._armed:
            self._ready.add(i)
            self._launch(lambda j: j in self._ready)

    def _launch(self, ready: Callable[[int], bool]) -> bool:
        """Launch the next in-place all-reduces of the fixed order while `ready` says so;
        False if a launch failed (a dead peer: noted by the group)."""
        while len(self.works) < len(self.direct) and ready(self.direct[len(self.works)]):
            grad = self.params[self.direct[len(self.works)]].grad
            if not self.group.call(lambda: self.works.append(self.group.all_reduce_async(grad))):
                self._armed = False
                return False
        return True

    def exchanges(self) -> bool:
        """Whether the packed buffer is summed by the exchange this step (gloo, small)."""
        flat = self.flat
        return (flat.device.type == "cpu" and flat.numel() > 0
                and flat.numel() * flat.element_size() * (self.group.world_size - 1) <= self.exchange_bytes)

    def launch_exchange(self) -> None:
        """The packed buffer's exchange, its rows made for this world size."""
        group, flat = self.group, self.flat
        if self.rows is None or self.rows.shape[0] != group.world_size:
            self.rows = torch.empty(group.world_size, flat.numel(), dtype=flat.dtype)
        self.works += exchange(group.pg, group.rank, flat, self.rows)

    def launch_all_reduce(self) -> None:
        """The packed buffer's all-reduce."""
        self.works.append(self.group.all_reduce_async(self.flat))

    def launch_rest(self) -> bool:
        """After backward: the hooks stop, and the in-place all-reduces not yet launched
        (a gradient that came late, or not at all) follow in the fixed order."""
        self._armed = False
        return self._launch(lambda j: True)

    def reduce(self) -> None:
        """Sum every gradient over the members: the in-place all-reduces not launched during
        backward (a gradient that came late, or not at all) follow in the fixed order, then
        the packed small ones with the agreement (its integers stay exact in
        float32/float64), by all-reduce or by the exchange; then all are waited for. The
        caller has armed the plan before backward. A failure leaves every gradient unset."""
        params, group = self.params, self.group
        for p in params:
            if p.grad is None:   # a parameter the loss did not reach: its gradient is zero
                p.grad = torch.zeros_like(p)
        small = [params[i].grad for i in self.packed]
        if small:
            torch_compat.foreach_copy_(self.views, small)
        if self.fuse:
            self.flat[self.n:].copy_(self.agreement.build(done_step=True))
        if not self.launch_rest():
            drop_grads(self.model)
            return
        exchanged = self.exchanges()
        launch = self.launch_exchange if exchanged else self.launch_all_reduce
        if self.flat.numel() and not group.call(launch):
            drop_grads(self.model)
            return
        if not group.call(lambda: [w.wait() for w in self.works]):
            drop_grads(self.model)
            return
        if exchanged:
            sum_exchanged(self.flat, self.rows, group.rank)
        if self.fuse:
            self.agreement.summed(self.flat[self.n:])
        if small:
            torch_compat.foreach_copy_(small, self.views)
