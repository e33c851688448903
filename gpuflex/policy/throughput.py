"""A job's throughput against its world size: measured points and a small fitted model (issue 32). Pure.

Each point is one (world size, host count) a job ran at with the mean of the samples/s
its coordinator reported there (gpuflex.control.throughput keeps them). With a fixed
global batch, the time per sample is modelled as

    T(n, h) = a / n + b * (n - 1) + c * (h - 1)         (a, b, c >= 0)

a: the compute, divided over n workers; b: what each more worker adds to the all-reduce
(latency, stragglers); c: what crossing one more host adds (a lab's 10 GbE between hosts
is far slower than NVLink or PCIe within one). Throughput is 1 / T. Pollux fits a
similar compute-plus-sync model; three linear terms are enough to tell a compute-bound
job (b, c near 0: near-linear) from a communication-bound one (adding workers adds
nothing, or loses). The fit is least squares on T (linear in a, b, c: the normal
equations, at most 3 x 3, solved here, no numpy); a term that comes out negative is
dropped and the rest refitted, so T never decreases faster than 1/n. The compute term a
is always kept (without it two points fit as well, and predict nothing), and a set of
terms the points cannot tell apart (2 sizes, each on its own host count, for 3 terms)
is singular: skipped, not solved through rounding.

Too few points: without two distinct world sizes nothing about scaling is known, and
`fit` returns None with `why_not` saying so; without two host counts c is not fitted (0).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Sequence

MIN_SIZES = 2     # distinct world sizes needed before the model says anything
SINGULAR = 1e-9   # a pivot this small against the normal matrix's largest entry: no unique fit


@dataclasses.dataclass(frozen=True)
class Point:
    """Measured: `samples_per_s` at `world` workers on `hosts` hosts (mean of `readings`)."""

    world: int
    hosts: int
    samples_per_s: float
    readings: int = 1


@dataclasses.dataclass(frozen=True)
class Model:
    """T(n, h) = a/n + b(n-1) + c(h-1) seconds per sample; see the module docstring."""

    a: float
    b: float
    c: float = 0.0

    def throughput(self, n: int, hosts: int = 1) -> float:
        """Predicted samples/s at n workers on `hosts` hosts."""
        t = self.a / n + self.b * (n - 1) + self.c * (max(hosts, 1) - 1)
        return 1.0 / t if t > 0 else math.inf

    def speedup(self, n: int, base: int, hosts: int = 1, base_hosts: int = 1) -> float:
        """Throughput at n relative to that at `base` (the job's MIN: 1.0 there)."""
        return self.throughput(n, hosts) / self.throughput(base, base_hosts)

    def gain(self, n: int, to: int, hosts: int = 1, to_hosts: int | None = None) -> float:
        """Relative change of throughput from n to `to` workers: 0.04 = 4% more."""
        return self.throughput(to, hosts if to_hosts is None else to_hosts) / self.throughput(n, hosts) - 1.0

    def efficiency(self, n: int, to: int, hosts: int = 1, to_hosts: int | None = None) -> float:
        """Throughput added (or lost) per worker added (or removed) going from n to `to`,
        over the mean throughput per worker at n: 1.0 is linear scaling, 0 adds nothing."""
        if to == n:
            return 1.0
        x = self.throughput(n, hosts)
        y = self.throughput(to, hosts if to_hosts is None else to_hosts)
        return (y - x) / (to - n) / (x / n)


def hosts_at(n: int, hosts_now: int, world_now: int) -> int:
    """The host count assumed at n workers: the job's hosts now, fewer when n is below it."""
    return max(1, min(hosts_now, n)) if n <= world_now else max(1, hosts_now)


def merge(points: Iterable[Point]) -> list[Point]:
    """One point per (world, hosts): readings-weighted means."""
    acc: dict[tuple[int, int], list[float]] = {}
    for p in points:
        s = acc.setdefault((p.world, p.hosts), [0.0, 0])
        s[0] += p.samples_per_s * p.readings
        s[1] += p.readings
    return [Point(w, h, s / n, int(n)) for (w, h), (s, n) in sorted(acc.items()) if n > 0]


def why_not(points: Sequence[Point]) -> str | None:
    """Why no model can be fitted to `points` (None: one can)."""
    usable = [p for p in points if p.samples_per_s > 0 and p.world >= 1]
    sizes = sorted({p.world for p in usable})
    if len(sizes) < MIN_SIZES:
        at = f" (measured at {', '.join(map(str, sizes))} worker(s) only)" if sizes else " (none measured yet)"
        return f"too few measurements: {MIN_SIZES} world sizes needed{at}"
    return None


def fit(points: Sequence[Point]) -> Model | None:
    """Least squares fit of T = 1/samples_per_s (each point weighted by its readings);
    None with too few points (see why_not)."""
    if why_not(points) is not None:
        return None
    usable = [p for p in points if p.samples_per_s > 0 and p.world >= 1]
    terms = [0, 1] + ([2] if len({p.hosts for p in usable}) >= 2 else [])
    rows = [((1.0 / p.world, float(p.world - 1), float(p.hosts - 1)), 1.0 / p.samples_per_s, float(p.readings))
            for p in usable]
    # the largest subset of terms, the compute term always in it, whose least-squares
    # solution is all >= 0 with compute > 0 (at most 4 tries): a subset without it fits
    # two points as well but predicts nothing (a job that speeds up by losing workers)
    for k in range(len(terms), 0, -1):
        best = None
        for subset in itertools.combinations(terms, k):
            coef = _solve(rows, subset)
            if 0 not in subset or coef is None or coef[0] <= 0 or any(v < 0 for v in coef.values()):
                continue
            err = sum(w * (sum(coef[i] * x[i] for i in subset) - y) ** 2 for x, y, w in rows)
            if best is None or err < best[0]:
                best = (err, coef)
        if best is not None:
            c = best[1]
            return Model(c.get(0, 0.0), c.get(1, 0.0), c.get(2, 0.0))
    return None


def _solve(rows, subset: Sequence[int]) -> dict[int, float] | None:
    """Weighted least squares on the `subset` columns: the normal equations by Gauss-Jordan."""
    k = len(subset)
    m = [[sum(w * x[i] * x[j] for x, _, w in rows) for j in subset] + [sum(w * x[i] * y for x, y, w in rows)]
         for i in subset]
    # singular (more terms than the points tell apart: 2 sizes on 2 host counts, 3 terms)
    # when a pivot is only rounding left over; relative to the matrix, since readings weight it
    tiny = SINGULAR * max((abs(v) for r in m for v in r[:k]), default=0.0)
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= tiny:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return {subset[i]: m[i][k] / m[i][i] for i in range(k)}


def summary(points: Sequence[Point], min_workers: int, max_workers: int, world: int, hosts: int) -> dict:
    """What `status JOB --json` shows under "scaling": the points, and (when a model fits)
    its prediction for MIN..MAX and the efficiency of one more / one fewer worker."""
    pts = merge(points)
    out: dict = {"points": [dataclasses.asdict(p) for p in pts], "model": None, "predicted": [],
                 "one_more": None, "one_fewer": None, "why_not": why_not(pts)}
    model = fit(pts)
    if model is None:
        return out
    out["model"] = {"a": model.a, "b": model.b, "c": model.c}
    out["predicted"] = [{"world": n, "hosts": hosts_at(n, hosts, world),
                         "samples_per_s": round(model.throughput(n, hosts_at(n, hosts, world)), 3)}
                        for n in range(min_workers, max_workers + 1)]
    h = hosts_at(world, hosts, world)
    if world >= 1 and world < max_workers:
        out["one_more"] = {"gain": round(model.gain(world, world + 1, h), 4),
                           "efficiency": round(model.efficiency(world, world + 1, h), 4)}
    if world > min_workers:
        out["one_fewer"] = {"gain": round(model.gain(world, world - 1, h, hosts_at(world - 1, hosts, world)), 4),
                            "efficiency": round(model.efficiency(world, world - 1, h,
                                                                 hosts_at(world - 1, hosts, world)), 4)}
    return out
