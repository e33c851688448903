"""The exact sum of `exact="bitwise"` (data/exact.py): the units' gradients summed over the
members with bits that depend neither on how the units are grouped over the members nor on
the order they arrive in.

Each unit's gradient is turned into int64 fixed point at a power-of-two scale 2**k that
every member agrees on (one MAX all-reduce of the members' largest |gradient|; k leaves
room for the sum of every unit of the global batch, so nothing overflows), the member's
units are added as integers, the members' sums are all-reduced as integers (in buckets,
each launched once quantized), and the one integer sum is turned back into floats the same
way on every member. Integer addition is associative, so any grouping of the units over the
members, and a member alone, gives the same integers, hence the same float bits.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gpuflex.elastic.torch_compat import foreach_copy_, foreach_scale_round_

INT_BITS = 62          # the integer sum of every unit stays below 2**62: int64 with room to spare

def scale_exponent(max_abs: float, units: int) -> int:
    """k such that round(g x 2**k) summed over `units` units, each |g| <= max_abs, stays
    below 2**INT_BITS: max_abs < 2**e, units <= 2**b, so each term is at most 2**(62-b)."""
    if max_abs == 0.0:
        return 0
    e = math.frexp(max_abs)[1]               # max_abs < 2**e
    b = max(units - 1, 0).bit_length()       # units <= 2**b
    return max(-1000, min(1000, INT_BITS - b - e))   # 2.0**k stays a finite float64


def quantize(flat: torch.Tensor, k: int) -> torch.Tensor:
    """int64 fixed point of `flat` at scale 2**k (exact scaling in float64, then one
    rounding, half to even: a function of the values and k alone)."""
    return torch.round(flat.to(torch.float64) * (2.0 ** k)).to(torch.int64)


def dequantize(total: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The float gradient of an int64 sum: the same rounding on every member."""
    return (total.to(torch.float64) * (2.0 ** -k)).to(dtype)


# Grad dtypes whose exponent range holds every g x 2**k this module makes (|g x 2**k| < 2**62)
# and 2**k itself for k in FAST_K: there the scaling is exact in the grad's own dtype, and
# round() of an exactly scaled value is the same integer float64 would give (see _quantize_into)
FAST_DTYPES = (torch.float32, torch.bfloat16)
FAST_K = range(-126, 128)


BUCKET = 1 << 21  # elements (16 MiB of int64) of the integer sum all-reduced at a time: the
# buckets' all-reduces overlap the quantization of the next and the way back of the previous
CHUNK = 1 << 17   # elements: on the CPU, a gradient larger than this is quantized, summed and
# turned back a piece at a time, so each piece's float and int64 copies stay in the CPU's cache
# (1 MiB of L2 a core here) instead of streaming model-sized temporaries through memory; same
# ops, same bits. On a GPU each gradient is one piece: there every piece is a few kernel
# launches a unit, and at 64 MB of gradients 128 pieces x 8 units of launches cost an H200
# 86 % of its steps/s (docs/benchmarks.md, "On a real GPU")


class UnitGrads:
    """One step's units of this member: each unit's gradients, kept (the tensors backward
    made, not copies) until the step's last unit; then the scale is agreed and the integer
    sum made (`reduce`). The int64 sum and its scratch are kept from step to step: at 100 MB
    of state, fresh 100 MB buffers each step cost more in page faults than the adds.

    The integer sum's layout (the same on every member, as the parameters are): the small
    gradients (at most CHUNK elements) first, quantized with one foreach call a unit, then
    the large ones, a chunk at a time; the tail (BatchNorm statistics, the vote) after them."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.units: list[list[torch.Tensor]] = []   # per unit, one gradient per parameter
        self.peaks: list[torch.Tensor] = []          # per unit, its largest |gradient| (0-dim, float64)
        self._total: torch.Tensor | None = None      # int64: the sum, then the vote at its end
        self._scratch: torch.Tensor | None = None    # int64: a unit's small gradients, or one chunk
        self.small = [i for i, p in enumerate(params) if p.numel() <= CHUNK]
        self.large = [i for i, p in enumerate(params) if p.numel() > CHUNK]
        self.small_n = sum(params[i].numel() for i in self.small)
        self.chunk = CHUNK if self._on_cpu() else max([params[i].numel() for i in self.large], default=CHUNK)
        self.offsets: list[int] = [0] * len(params)   # each parameter's place in the integer sum
        off = 0
        for i in self.small + self.large:
            self.offsets[i] = off
            off += params[i].numel()

    def take(self) -> None:
        """After one unit's backward: keep its gradients, and clear `.grad` for the next unit
        (whose backward must start from nothing, not add to this one)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p in self.params:
            p.grad = None
        # aminmax, not abs().max() or an inf-norm: one vectorized pass, no copy (~17x faster
        # at 50 MB); NaN where any gradient is NaN
        ends = [e for g in grads if g.numel() for e in torch.aminmax(g.reshape(-1))]
        if not ends:
            peak = torch.zeros((), dtype=torch.float64)
        elif len({e.dtype for e in ends}) == 1:   # |x| and max are exact in any float dtype: one
            peak = torch.stack(ends).abs().max().to(torch.float64)   # stack, abs, max and cast a unit
        else:
            peak = torch.stack([e.to(torch.float64) for e in ends]).abs().max()
        self.units.append(grads)
        self.peaks.append(peak)

    def clear(self) -> None:
        self.units, self.peaks = [], []

    def local_max(self) -> float:
        """The largest |gradient| of this member's units: NaN where one is NaN, inf where
        one is infinite (either way, not finite)."""
        return float(torch.stack(self.peaks).max()) if self.peaks else 0.0

    def size(self) -> int:
        return sum(p.numel() for p in self.params)

    def _kept(self, n: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.params[0].device if self.params else None
        if self._total is None or self._total.numel() != n + extra or self._total.device != torch.device(device or "cpu"):
            self._total = torch.empty(n + extra, dtype=torch.int64, device=device)
            self._scratch = torch.empty(max(self.small_n, min(n, self.chunk)), dtype=torch.int64, device=device)
        return self._total, self._scratch

    def _views(self, flat: torch.Tensor, which: list[int]) -> list[torch.Tensor]:
        """The parameters `which` in `flat` laid out as the integer sum is (see the class)."""
        return [flat[self.offsets[i]:self.offsets[i] + self.params[i].numel()].view(self.params[i].shape)
                for i in which]

    def _pieces(self) -> list[tuple[int, int, int]]:
        """The integer sum in pieces (start, end, parameter or -1 for the small block), in
        layout order: the small gradients as one block, then each large one's chunks."""
        pieces = [(0, self.small_n, -1)] if self.small_n else []
        for i in self.large:
            off, m = self.offsets[i], self.params[i].numel()
            pieces += [(off + a, off + min(a + self.chunk, m), i) for a in range(0, m, self.chunk)]
        return pieces

    def _quantize_piece(self, total: torch.Tensor, scratch: torch.Tensor, piece: tuple[int, int, int],
                        k: int) -> None:
        """This member's units of one piece, quantized and added as int64 into `total`."""
        lo, hi, i = piece
        if i < 0:   # the small block: one foreach call a unit
            into_total, into_scratch = self._views(total, self.small), self._views(scratch, self.small)
            for u, grads in enumerate(self.units):
                _quantize_into(into_scratch if u else into_total, [grads[j] for j in self.small], k)
                if u:
                    total[lo:hi].add_(scratch[lo:hi])
            return
        o, a = total[lo:hi], lo - self.offsets[i]
        for u, grads in enumerate(self.units):   # every unit's chunk added while it is in cache
            dst = o if u == 0 else scratch[:hi - lo]
            _quantize_chunk(dst, grads[i].reshape(-1)[a:a + hi - lo], k)
            if u:
                o.add_(dst)

    def _dequantize_piece(self, total: torch.Tensor, wide: torch.Tensor, grads: list[torch.Tensor],
                          piece: tuple[int, int, int], k: int) -> None:
        """One piece of the summed integers back into `grads`: float64 (one rounding), scaled
        by 2**-k (exact), then the grad's dtype (a second rounding), as `dequantize`."""
        lo, hi, i = piece
        if i < 0:
            wide[lo:hi].copy_(total[lo:hi]).mul_(2.0 ** -k)
            foreach_copy_([grads[j] for j in self.small], self._views(wide, self.small))
            return
        a = lo - self.offsets[i]
        grads[i].view(-1)[a:a + hi - lo].copy_(wide[:hi - lo].copy_(total[lo:hi]).mul_(2.0 ** -k))

    def _targets(self) -> list[torch.Tensor]:
        """The tensors the summed gradients go into: the first unit's where they fit."""
        reuse = self.units[0] if self.units else [None] * len(self.params)
        out = []
        for p, g in zip(self.params, reuse):
            fits = g is not None and g.dtype == p.dtype and g.shape == p.shape and g.device == p.device
            out.append(g if fits and g.is_contiguous() else torch.empty_like(p, memory_format=torch.contiguous_format))
        return out

    def _install(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g
        self.clear()

    def local_sum(self, k: int, n: int, extra: int = 0) -> torch.Tensor:
        """The int64 sum of this member's quantized units in the first n entries of the kept
        buffer (`extra` entries after them left for the vote). The units' gradients are
        overwritten on the way (they are this object's own)."""
        total, scratch = self._kept(n, extra)
        if not self.units:
            total[:n].zero_()
            return total
        for piece in self._pieces():
            self._quantize_piece(total, scratch, piece, k)
        return total

    def set_grads(self, total: torch.Tensor, k: int) -> None:
        """The summed integers back into every parameter's `.grad` (see `_dequantize_piece`)."""
        wide, grads = self._wide(total), self._targets()
        for piece in self._pieces():
            self._dequantize_piece(total, wide, grads, piece, k)
        self._install(grads)

    def _wide(self, total: torch.Tensor) -> torch.Tensor:
        """Float64 room for the small block or one chunk: the int64 scratch (the same width)."""
        need = max(self.small_n, min(self.size(), self.chunk))
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.int64, device=total.device)
        return self._scratch.view(torch.float64)

    def _pipelined(self, group, k: int, n: int, tail: torch.Tensor | None) -> torch.Tensor:
        """The integer sum over the members in buckets of about BUCKET elements: each bucket's
        all-reduce is launched once its pieces are quantized, so it runs (on the process
        group's threads) while the next bucket is quantized, and each is turned back into
        floats once it arrived while the later ones are still on the wire. The same integers
        as one all-reduce of everything: each element's sum is its own."""
        extra = tail.numel() if tail is not None else 0
        total, scratch = self._kept(n, extra)
        if tail is not None:
            total[n:].copy_(tail.reshape(-1))   # int64: the BatchNorm statistics' bits and the vote
        if not self.units:
            total[:n].zero_()
        pieces, buckets, works = self._pieces(), [], []
        for j, piece in enumerate(pieces):
            if not buckets or piece[1] - pieces[buckets[-1][0]][0] > BUCKET:
                buckets.append([j, j + 1])
            else:
                buckets[-1][1] = j + 1
        if not buckets:   # no parameter: the tail alone
            buckets.append([0, 0])
        for b, (p0, p1) in enumerate(buckets):
            if self.units:
                for piece in pieces[p0:p1]:
                    self._quantize_piece(total, scratch, piece, k)
            lo = pieces[p0][0] if p0 < p1 else 0
            hi = n + extra if b == len(buckets) - 1 else pieces[p1 - 1][1]
            works.append(group.all_reduce_async(total[lo:hi]))
        wide, grads, ok = self._wide(total), self._targets(), True
        for (p0, p1), work in zip(buckets, works):
            ok = group.call(work.wait) and ok   # every launched bucket waited for, failed or not
            if ok:
                for piece in pieces[p0:p1]:
                    self._dequantize_piece(total, wide, grads, piece, k)
        if not ok:
            raise RuntimeError("a collective of the bitwise gradient sum failed")
        self._install(grads)
        return total

    def set_nan(self) -> None:
        """A non-finite gradient somewhere: every gradient is NaN, on every member alike."""
        for p in self.params:
            p.grad = torch.full_like(p, float("nan"))
        self.clear()

    def reduce(self, group, global_units: int, tail: torch.Tensor | None) -> torch.Tensor | None:
        """Sum this step's units over the members (`group`, None alone): the MAX all-reduce
        of the largest |gradient|, the scale from it, the int64 sums all-reduced with `tail`
        at their end (int64: the units' BatchNorm statistics, data/exact_bn.py, and the
        boundary's vote). Returns the summed tail, on the CPU (None without one);
        raises RuntimeError where a collective failed (the caller drops the gradients)."""
        n = self.size()
        local = self.local_max()
        # NaN sent as inf: a MAX that meets a NaN may keep or drop it depending on the order
        # it compares in (gloo's does), and every member must see the same non-finite peak
        peak = torch.tensor([local if local == local else math.inf], dtype=torch.float64)
        if group is not None:
            peak = self._all_reduce(group, peak, dist.ReduceOp.MAX)
        peak_value = float(peak[0])
        if not math.isfinite(peak_value):
            self.set_nan()
            if tail is not None and group is not None:
                tail = self._all_reduce(group, tail, dist.ReduceOp.SUM).cpu()
            return tail
        k = scale_exponent(peak_value, global_units)
        extra = tail.numel() if tail is not None else 0
        # in buckets on gloo over host memory (measured here); nccl, and gloo staging a GPU's
        # gradients through the host, keep one all-reduce (no GPU here to measure buckets on)
        if group is not None and group.backend != "nccl" and self._on_cpu():
            total = self._pipelined(group, k, n, tail)
            return total[n:].cpu().clone() if tail is not None else None
        total = self.local_sum(k, n, extra)
        if tail is not None:
            total[n:].copy_(tail.reshape(-1))   # int64: the BatchNorm statistics' bits and the vote
        if group is not None:
            total = self._all_reduce(group, total, dist.ReduceOp.SUM)
        self.set_grads(total, k)
        return total[n:].cpu().clone() if tail is not None else None

    def _on_cpu(self) -> bool:
        return all(p.device.type == "cpu" for p in self.params)   # gloo sums host memory in place

    @staticmethod
    def _all_reduce(group, t: torch.Tensor, op) -> torch.Tensor:
        dev = t.to(group.device) if group.backend == "nccl" else t.cpu()   # gloo: on the host
        if not group.call(dist.all_reduce, dev, op=op, group=group.pg):
            raise RuntimeError("a collective of the bitwise gradient sum failed")
        return dev


def _quantize_into(out: list[torch.Tensor], grads: list[torch.Tensor], k: int) -> None:
    """`quantize` of each gradient into the int64 views `out`, the same integers. Where the
    dtype and k allow, in place in the gradient's dtype: g x 2**k is exact there (a power of
    two, the result below 2**62 and so far from overflow; a product small enough to lose
    bits is below 2**-126 and rounds to 0 either way), and round() of an exact value is the
    float64 one. Else through float64, as `quantize`."""
    fast = [i for i, g in enumerate(grads) if g.dtype in FAST_DTYPES and k in FAST_K]
    if fast:
        gs = [grads[i] for i in fast]
        foreach_scale_round_(gs, 2.0 ** k)
        foreach_copy_([out[i] for i in fast], gs)   # integer-valued floats: the cast is exact
    for i in set(range(len(grads))) - set(fast):
        out[i].copy_(quantize(grads[i].reshape(out[i].shape), k))


def _quantize_chunk(out: torch.Tensor, g: torch.Tensor, k: int) -> None:
    """`_quantize_into` of one piece of a large gradient (1-D `out` and `g`), the same integers."""
    if g.dtype in FAST_DTYPES and k in FAST_K:
        out.copy_(g.mul_(2.0 ** k).round_())
    else:
        out.copy_(quantize(g, k))
