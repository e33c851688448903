"""`exact="bitwise"`: gradients whose bits do not depend on the world size, the split or
the order the members' parts arrive in.

The global batch is cut into units of `unit` samples; every member's share is a whole
number of units, and each unit's forward and backward is its own (`run.accumulate` yields
the units), so a unit's gradient has the same bits whichever member computes it. The sum
over the units is then made exact: each unit's gradient is turned into int64 fixed point
at a power-of-two scale 2**k that every member agrees on (one MAX all-reduce of the
members' largest |gradient|; k leaves room for the sum of every unit of the global batch,
so nothing overflows), the member's units are added as integers, the members' sums are
all-reduced as integers, and the one integer sum is turned back into floats the same way
on every member. Integer addition is associative, so any grouping of the units over the
members, and a member alone, gives the same integers, hence the same float bits.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

import torch
import torch.distributed as dist

from gpuflex.elastic.data import exact_bn
from gpuflex.elastic.protocol.env import EXACT, EXACT_THREADS, UNIT
from gpuflex.elastic.torch_compat import foreach_copy_, foreach_scale_round_

MODES = ("allclose", "bitwise")
DEFAULT_UNITS = 8      # unit= defaults to the global batch / 8 (so up to 8 members get work)
INT_BITS = 62          # the integer sum of every unit stays below 2**62: int64 with room to spare
DEFAULT_THREADS = 1    # intra-op threads in bitwise mode (GPUFLEX_EXACT_THREADS): a reduction
# split over threads adds in an order that depends on their count, so it is fixed per run


def exact_mode(exact: str | None, environ: Mapping[str, str] | None = None) -> str:
    """`ElasticRun(exact=...)`: as given, else GPUFLEX_EXACT, else "allclose"."""
    env = os.environ if environ is None else environ
    mode = exact if exact is not None else (env.get(EXACT) or "allclose")
    if mode not in MODES:
        where = "exact" if exact is not None else EXACT
        raise ValueError(f"{where} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def unit_size(global_batch_size: int, num_samples: int, unit: int | None,
              environ: Mapping[str, str] | None = None) -> int:
    """The samples of one unit in bitwise mode: `unit=`, else GPUFLEX_UNIT, else the global
    batch / DEFAULT_UNITS. Refused (ValueError, one line) where the global batch does not
    divide into units."""
    env = os.environ if environ is None else environ
    if unit is None and env.get(UNIT):
        try:
            unit = int(env[UNIT])
        except ValueError:
            raise ValueError(f"{UNIT} must be a whole number of samples, got {env[UNIT]!r}") from None
    if unit is None:
        if global_batch_size % DEFAULT_UNITS:
            raise ValueError(f"exact='bitwise': global_batch_size {global_batch_size} is not a multiple of "
                             f"{DEFAULT_UNITS}; give unit= (samples per unit) dividing it")
        unit = global_batch_size // DEFAULT_UNITS
    if unit < 1 or global_batch_size % unit:
        raise ValueError(f"exact='bitwise': global_batch_size {global_batch_size} does not divide into units "
                         f"of {unit} samples")
    return unit   # an epoch's last, partial batch ends in a short unit where `unit` does not divide it


def refuse(*, shard: object, scaler: object, buffers: str) -> None:
    """What bitwise mode does not cover yet, refused at construction with one line."""
    if shard is not None:
        raise ValueError("exact='bitwise' with shard= is not supported: FSDP's reduce-scatter sums in "
                         "floats in an order set by the world size")
    if scaler is not None:
        raise ValueError("exact='bitwise' with a loss scaler (scaler=) is not supported: drop the scaler "
                         "(float32 or bfloat16 autocast need none)")
    if buffers != "broadcast":
        raise ValueError(f"exact='bitwise' with buffers={buffers!r} is not supported: averaged buffers "
                         "depend on the split; use buffers='broadcast'")


def bitwise_units(model: torch.nn.Module, num_samples: int, global_batch_size: int, exact: str | None,
                  unit: int | None, *, shard: object, scaler: object, buffers: str) -> int:
    """ElasticRun's exact= and unit=: 0 in the default mode; in bitwise mode the unit's
    samples, once what it does not cover is refused and the threads are pinned (a model
    with BatchNorm: its running statistics are merged exactly, data/exact_bn.py)."""
    if exact_mode(exact) != "bitwise":
        if unit is not None:
            raise ValueError("unit= is for exact='bitwise' (the default mode has no units)")
        return 0
    refuse(shard=shard, scaler=scaler, buffers=buffers)
    units = unit_size(global_batch_size, num_samples, unit)
    if exact_bn.has_batch_norm(model):
        exact_bn.refuse(model, units, num_samples, global_batch_size)
    pin_threads()
    return units


def pin_threads(environ: Mapping[str, str] | None = None) -> int:
    """Fix the intra-op threads for the run (a float reduction's order depends on their
    count) and ask torch for deterministic kernels; returns the thread count."""
    env = os.environ if environ is None else environ
    raw = env.get(EXACT_THREADS)
    try:
        threads = int(raw) if raw else DEFAULT_THREADS
    except ValueError:
        raise ValueError(f"{EXACT_THREADS} must be a whole number of threads, got {raw!r}") from None
    if threads < 1:
        raise ValueError(f"{EXACT_THREADS} must be at least 1, got {threads}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # cuBLAS' deterministic mode
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    return threads


def unit_seed(seed: int, step: int, unit: int) -> int:
    """The seed of a unit's own RNG stream (dropout and the like): a function of the step
    and the unit's place in the global batch only, never of the member that runs it."""
    return (seed * 1_000_003 + step) * 65_537 + unit


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


CHUNK = 1 << 17   # elements: a gradient larger than this is quantized, summed and turned back a
# piece at a time, so each piece's float and int64 copies stay in the CPU's cache (1 MiB of L2
# a core here) instead of streaming model-sized temporaries through memory; same ops, same bits


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
        ends = [torch.aminmax(g.reshape(-1)) for g in grads if g.numel()]
        peak = (torch.stack([e.to(torch.float64).abs() for mm in ends for e in mm]).max() if ends
                else torch.zeros((), dtype=torch.float64))
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
            self._scratch = torch.empty(max(self.small_n, min(n, CHUNK)), dtype=torch.int64, device=device)
        return self._total, self._scratch

    def _views(self, flat: torch.Tensor, which: list[int]) -> list[torch.Tensor]:
        """The parameters `which` in `flat` laid out as the integer sum is (see the class)."""
        return [flat[self.offsets[i]:self.offsets[i] + self.params[i].numel()].view(self.params[i].shape)
                for i in which]

    def local_sum(self, k: int, n: int, extra: int = 0) -> torch.Tensor:
        """The int64 sum of this member's quantized units in the first n entries of the kept
        buffer (`extra` entries after them left for the vote). The units' gradients are
        overwritten on the way (they are this object's own)."""
        total, scratch = self._kept(n, extra)
        if not self.units:
            total[:n].zero_()
            return total
        sn = self.small_n   # the small gradients lie first, at the same offsets in total and scratch
        into_total, into_scratch = self._views(total, self.small), self._views(scratch, self.small)
        for u, grads in enumerate(self.units):   # one foreach call a unit
            _quantize_into(into_scratch if u else into_total, [grads[i] for i in self.small], k)
            if u:
                total[:sn].add_(scratch[:sn])
        for i in self.large:   # the large ones a chunk at a time, every unit's chunk added in cache
            out = total[self.offsets[i]:self.offsets[i] + self.params[i].numel()]
            flats = [grads[i].reshape(-1) for grads in self.units]
            for a in range(0, out.numel(), CHUNK):
                o = out[a:a + CHUNK]
                for u, g in enumerate(flats):
                    dst = o if u == 0 else scratch[:o.numel()]
                    _quantize_chunk(dst, g[a:a + CHUNK], k)
                    if u:
                        o.add_(dst)
        return total
    def set_grads(self, total: torch.Tensor, k: int) -> None:
        """The summed integers back into every parameter's `.grad`: float64 (one rounding),
        scaled by 2**-k (exact), then the grad's dtype (a second rounding), as `dequantize`;
        the large gradients a chunk at a time. The first unit's tensors become the gradients
        where they fit."""
        n, sn = self.size(), self.small_n
        need = max(sn, min(n, CHUNK))
        scratch = self._scratch if self._scratch is not None and self._scratch.numel() >= need \
            else torch.empty(need, dtype=torch.int64, device=total.device)
        wide = scratch.view(torch.float64)   # the int64 scratch reused as float64 (same width)
        reuse = self.units[0] if self.units else [None] * len(self.params)
        grads = []
        for p, g in zip(self.params, reuse):
            fits = g is not None and g.dtype == p.dtype and g.shape == p.shape and g.device == p.device
            grads.append(g if fits and g.is_contiguous() else torch.empty_like(p, memory_format=torch.contiguous_format))
        if sn:
            wide[:sn].copy_(total[:sn]).mul_(2.0 ** -k)
            foreach_copy_([grads[i] for i in self.small], self._views(wide, self.small))
        for i in self.large:
            src = total[self.offsets[i]:self.offsets[i] + self.params[i].numel()]
            dst = grads[i].view(-1)
            for a in range(0, src.numel(), CHUNK):
                w = wide[:min(CHUNK, src.numel() - a)]
                dst[a:a + CHUNK].copy_(w.copy_(src[a:a + CHUNK]).mul_(2.0 ** -k))
        for p, g in zip(self.params, grads):
            p.grad = g
        self.clear()

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
        total = self.local_sum(k, n, extra)
        if tail is not None:
            total[n:].copy_(tail.reshape(-1))   # int64: the BatchNorm statistics' bits and the vote
        if group is not None:
            total = self._all_reduce(group, total, dist.ReduceOp.SUM)
        self.set_grads(total, k)
        return total[n:].cpu().clone() if tail is not None else None

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
