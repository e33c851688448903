"""Replay a seeded day-long trace of elastic jobs through the real harvest plan, three ways:
static sizes, `[harvest] policy = "fair"` and `policy = "throughput"`; print job
completion times, makespan, GPU utilisation and each user's share, side by side (issue 32).

    .venv/bin/python benchmarks/allocation_trace.py [--hours 24] [--seed 1 | --seeds N] [--hosts 4] [--gpus 4]

Everything that decides is the real code: gpuflex.policy.harvest.plan (yields and
requeues for owners, places, grows; under "throughput" gpuflex.policy.allocation with
the model of gpuflex.policy.throughput fitted on the points the jobs reported). What is
simulated is the world around it, on a simulated clock (a tick a minute, no sleeping):

- Pool: --hosts hosts of --gpus GPUs, each host owned by someone (so harvest may grow
  onto it); half the hosts have GPUs of speed 1.0, half 0.5 (mixed GPUs: a job's
  workers split its batch by speed, so its compute goes with the sum of their speeds).
- Jobs: Poisson arrivals, one every ARRIVAL_MIN minutes on average, over the first
  --hours less LAST_ARRIVAL_H; user uniform among USERS; MIN 1 (60%) or 2; MAX = MIN x
  2 or x 4 (at most 8); the size a user asks for (static) uniform in MIN..MAX; 1 GPU
  per worker; priority 1 for 10% of them, else 0. Length: the work a job does in
  LENGTH_H[0]..LENGTH_H[1] hours (log-uniform) at MIN workers on speed-1 GPUs.
- Scaling: time per sample T = a / (sum of speeds) + b (n - 1) + c (hosts - 1), a = 1;
  compute-bound (40%): b = 0.002, c = 0.01; communication-bound (30%): b = 0.12,
  c = 0.25; mixed (30%): b = 0.03, c = 0.08. Each running job reports its throughput at
  its size every tick with +-3% noise (what gpuflex.control.throughput keeps).
- Owners: each host's owner comes back about every OWNER_EVERY_H hours (exponential)
  for 20..90 minutes on 1..2 of its GPUs; harvest yields them (or requeues a job that
  would fall below MIN). Costs: a start STARTUP_S, an in-place resize RESIZE_S, a
  requeue REQUEUE_S of the job's time (its progress is kept: a checkpoint).
- Static: each job at the size it asked for (MIN = MAX = that), started in order of
  priority then arrival, never grown; an owner's return requeues it.

Printed per policy: average and p90 job completion time (arrival to end), makespan
(first arrival to last end), utilisation (GPU-time held by jobs over the GPU-time owners
left free, up to the makespan) and each user's share: the GPU-time they held over the
max-min fair share of the GPUs owners left free, given what they could use (sum of
their jobs' MAX), summed over the ticks they had work (a job running or queued). Then
the same ratio over only the ticks a job of theirs was queued ("while waiting": the
issue's rule is "no user below its share while it has work waiting"; the first figure
also counts ticks when all their jobs ran, below their MAX only because the policy saw
no gain in growing them). Then the ratios against static and fair.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuflex.config import HarvestSettings  # noqa: E402
from gpuflex.policy.fairshare import decayed_hours  # noqa: E402
from gpuflex.policy.harvest import (Grow, GpuView, JobView, Place, Requeue, Share, Shrink, WorkerView,  # noqa: E402
                                    Yield, plan)
from gpuflex.policy.shares import fair_shares  # noqa: E402
from gpuflex.policy.throughput import Point  # noqa: E402
from gpuflex.states import JobState  # noqa: E402

TICK_S = 60.0
USERS = ("ann", "bob", "cho", "dev")
ARRIVAL_MIN = 12.0
LAST_ARRIVAL_H = 6.0
LENGTH_H = (0.25, 4.0)
OWNER_EVERY_H = 4.0
STARTUP_S, RESIZE_S, REQUEUE_S = 30.0, 5.0, 60.0
KINDS = {"compute": (0.4, 0.002, 0.01), "communication": (0.3, 0.12, 0.25), "mixed": (0.3, 0.03, 0.08)}
HALF_LIFE_H = 24.0


@dataclasses.dataclass(frozen=True)
class Spec:
    id: int
    user: str
    arrival: float
    lo: int
    hi: int
    asked: int
    priority: int
    kind: str
    work: float        # samples


@dataclasses.dataclass
class Run:
    spec: Spec
    workers: list = dataclasses.field(default_factory=list)   # (wid, host, gpu)
    done: float = 0.0
    stall: float = 0.0
    ended: float | None = None
    next_wid: int = 0
    points: dict = dataclasses.field(default_factory=dict)    # (world, hosts) -> [sum, n]
    resized_at: float | None = None


def make_jobs(rng: random.Random, hours: float) -> list[Spec]:
    jobs, t, until = [], 0.0, max(hours - LAST_ARRIVAL_H, 1.0) * 3600
    while True:
        t += rng.expovariate(1 / (ARRIVAL_MIN * 60))
        if t > until:
            return jobs
        lo = 1 if rng.random() < 0.6 else 2
        hi = min(8, lo * rng.choice((2, 4)))
        r, kind = rng.random(), "mixed"
        if r < KINDS["compute"][0]:
            kind = "compute"
        elif r < KINDS["compute"][0] + KINDS["communication"][0]:
            kind = "communication"
        hours_at_min = math.exp(rng.uniform(math.log(LENGTH_H[0]), math.log(LENGTH_H[1])))
        spec = Spec(len(jobs) + 1, rng.choice(USERS), t, lo, hi, rng.randint(lo, hi),
                    1 if rng.random() < 0.1 else 0, kind, 0.0)
        jobs.append(dataclasses.replace(spec, work=hours_at_min * 3600 * rate(spec, [1.0] * lo, 1)))


def make_owners(rng: random.Random, hosts: list[str], gpus: int, hours: float) -> list[tuple[float, float, str, int]]:
    out = []
    for h in hosts:
        t = rng.expovariate(1 / (OWNER_EVERY_H * 3600))
        while t < hours * 3600:
            length = rng.uniform(20, 90) * 60
            for d in rng.sample(range(gpus), rng.choice((1, 2))):
                out.append((t, t + length, h, d))
            t += length + rng.expovariate(1 / (OWNER_EVERY_H * 3600))
    return out


def rate(spec: Spec, speeds: list[float], hosts: int) -> float:
    """Samples/s of the job on workers of these speeds over `hosts` hosts."""
    _, b, c = KINDS[spec.kind]
    return 1.0 / (1.0 / sum(speeds) + b * (len(speeds) - 1) + c * (hosts - 1))


def simulate(policy: str, specs: list[Spec], owners, hosts: list[str], gpus: int, speed: dict[str, float],
             seed: int, hours: float) -> dict:
    rng = random.Random(seed)
    settings = HarvestSettings(interval_s=TICK_S, idle_samples=1, policy="throughput" if policy == "throughput"
                               else "fair")
    runs = {s.id: Run(s) for s in specs}
    holds: list[tuple[str, float, float]] = []        # (user, start, end) per GPU held
    since: dict[tuple[str, int], float] = {}          # our worker's GPU -> held since
    now, end_of_day = 0.0, hours * 3600
    shares = {u: [0.0, 0.0] for u in USERS}           # held, fair, GPU-seconds while with work
    waits = {u: [0.0, 0.0] for u in USERS}            # the same, while a job of theirs is queued
    used = free_total = 0.0

    def release(r: Run, wid: int) -> None:
        for w in [w for w in r.workers if w[0] == wid]:
            r.workers.remove(w)
            holds.append((r.spec.user, since.pop((w[1], w[2])), now))

    while any(r.ended is None for r in runs.values()) and now < 10 * end_of_day:
        busy = {(h, d): a for a, b, h, d in owners if a <= now < b}
        held = {(w[1], w[2]): r for r in runs.values() for w in r.workers}
        views = []
        for r in runs.values():
            s = r.spec
            if s.arrival > now or r.ended is not None:
                continue
            static = policy == "static"
            pts = tuple(Point(w, h, v[0] / v[1], v[1]) for (w, h), v in sorted(r.points.items()))
            views.append(JobView(
                id=s.id, state=JobState.RUNNING if r.workers else JobState.QUEUED,
                min_workers=s.asked if static else s.lo, max_workers=s.asked if static else s.hi,
                priority=s.priority, harvest=not static, user=s.user,
                workers=tuple(WorkerView(wid, h, (d,)) for wid, h, d in r.workers), points=pts,
                resized_at=r.resized_at))
        gv = [GpuView(h, d, "owner" if (h, d) in busy and (h, d) in held else "busy" if (h, d) in busy else "idle",
                      owner=f"owner-{h}", idle_streak=9, probed_at=now, foreign_since=busy.get((h, d)))
              for h in hosts for d in range(gpus)]
        usage = {} if policy == "static" else \
            _usage(holds, since, held, now)
        p = plan(views, gv, settings, now, share=Share(usage=usage))
        for a in p.actions:
            r = runs.get(getattr(a, "job", -1))
            if isinstance(a, Requeue):
                for wid in [w[0] for w in r.workers]:
                    release(r, wid)
                r.stall += REQUEUE_S
            elif isinstance(a, Yield) or isinstance(a, Shrink):
                for wid in a.wids:
                    release(r, wid)
                r.stall += RESIZE_S
                if isinstance(a, Shrink):
                    r.resized_at = now
            elif isinstance(a, Place):
                for x in a.assignments:
                    for d in x.devices:
                        r.workers.append((r.next_wid, x.host, d))
                        since[(x.host, d)] = now
                        r.next_wid += 1
                r.stall += STARTUP_S
            elif isinstance(a, Grow):
                for d in a.devices:
                    r.workers.append((r.next_wid, a.host, d))
                    since[(a.host, d)] = now
                    r.next_wid += 1
                r.stall += RESIZE_S
                if policy == "throughput":
                    r.resized_at = now
        # -- a tick of work --
        free_gpus = len(hosts) * gpus - len(busy)
        demand = {u: 0 for u in USERS}
        for r in runs.values():
            if r.spec.arrival <= now and r.ended is None:
                demand[r.spec.user] += r.spec.asked if policy == "static" else r.spec.hi
        fair = fair_shares(demand, free_gpus)
        queued = {r.spec.user for r in runs.values() if r.spec.arrival <= now and r.ended is None and not r.workers}
        for u in USERS:
            if demand[u]:
                mine = sum(len(r.workers) for r in runs.values() if r.spec.user == u) * TICK_S
                shares[u][0] += mine
                shares[u][1] += fair[u] * TICK_S
                if u in queued:
                    waits[u][0] += mine
                    waits[u][1] += fair[u] * TICK_S
        used += sum(len(r.workers) for r in runs.values()) * TICK_S
        free_total += free_gpus * TICK_S
        for r in runs.values():
            if not r.workers or r.ended is not None:
                continue
            hs = {w[1] for w in r.workers}
            x = rate(r.spec, [speed[w[1]] for w in r.workers], len(hs))
            key = (len(r.workers), len(hs))
            got = r.points.setdefault(key, [0.0, 0])
            got[0] += x * rng.uniform(0.97, 1.03)
            got[1] += 1
            stalled = min(r.stall, TICK_S)
            r.stall -= stalled
            left = r.spec.work - r.done
            if x * (TICK_S - stalled) >= left:
                r.ended = now + stalled + left / x
                for wid in [w[0] for w in r.workers]:
                    release(r, wid)
            else:
                r.done += x * (TICK_S - stalled)
        now += TICK_S
    jct = sorted(r.ended - r.spec.arrival for r in runs.values() if r.ended is not None)
    first = min(s.arrival for s in specs)
    last = max((r.ended for r in runs.values() if r.ended is not None), default=first)
    return {"policy": policy, "jobs": len(specs), "completed": len(jct),
            "avg_jct_h": statistics.fmean(jct) / 3600 if jct else math.nan,
            "p90_jct_h": jct[int(0.9 * (len(jct) - 1))] / 3600 if jct else math.nan,
            "makespan_h": (last - first) / 3600, "utilisation": used / free_total if free_total else 0.0,
            "share": {u: (h / f if f else 1.0) for u, (h, f) in shares.items()},
            "waiting": {u: (h / f if f else math.nan) for u, (h, f) in waits.items()}}


def _usage(holds, since, held, now) -> dict[str, float]:
    out: dict[str, float] = {}
    for user, a, b in holds:
        out[user] = out.get(user, 0.0) + decayed_hours(a, b, now, HALF_LIFE_H)
    for ref, a in since.items():
        u = held[ref].spec.user if ref in held else None
        if u is not None:
            out[u] = out.get(u, 0.0) + decayed_hours(a, None, now, HALF_LIFE_H)
    return out


def run_all(hours: float, seed: int, hosts: int, gpus: int) -> list[dict]:
    """The three policies on the same trace (the same seed gives the same figures)."""
    rng = random.Random(seed)
    names = [f"h{i}" for i in range(hosts)]
    speed = {h: 1.0 if i < (hosts + 1) // 2 else 0.5 for i, h in enumerate(names)}
    specs = make_jobs(rng, hours)
    owners = make_owners(rng, names, gpus, hours)
    return [simulate(p, specs, owners, names, gpus, speed, seed, hours) for p in ("static", "fair", "throughput")]


def report(results: list[dict]) -> str:
    by = {r["policy"]: r for r in results}
    lines = [f"{'':22}" + "".join(f"{r['policy']:>12}" for r in results)]
    for key, fmt in (("completed", "{:>12d}"), ("avg_jct_h", "{:>12.2f}"), ("p90_jct_h", "{:>12.2f}"),
                     ("makespan_h", "{:>12.2f}"), ("utilisation", "{:>12.1%}")):
        lines.append(f"{key:22}" + "".join(fmt.format(r[key]) for r in results))
    for u in USERS:
        lines.append(f"{'share of fair ' + u:22}" + "".join(f"{r['share'][u]:>12.2f}" for r in results))
    for u in USERS:
        lines.append(f"{'  while waiting ' + u:22}" + "".join(f"{r['waiting'][u]:>12.2f}" for r in results))
    t = by["throughput"]
    for base in ("static", "fair"):
        b = by[base]
        lines.append(f"throughput vs {base}: avg JCT x{t['avg_jct_h'] / b['avg_jct_h']:.2f}, "
                     f"p90 x{t['p90_jct_h'] / b['p90_jct_h']:.2f}, makespan x{t['makespan_h'] / b['makespan_h']:.2f}")
    return "\n".join(lines)


def _lowest(ratios: dict[str, float]) -> float:
    """The lowest of the users' ratios; a user never waiting (NaN) has none."""
    xs = [x for x in ratios.values() if not math.isnan(x)]
    return min(xs) if xs else math.nan


GOALS = (0.70, 0.85, 0.90)   # avg JCT at most x0.70 of static's and x0.85 of fair's; no share below 0.90


def seeds_report(rows: list[tuple[int, list[dict]]]) -> str:
    """One line per seed and how many seeds meet each of the issue's goals."""
    lines = [f"{'seed':>4} {'jobs':>5} {'vs static':>10} {'vs fair':>8} {'lowest share':>13} {'fair: lowest':>13}"
             f" {'while waiting':>14} {'fair: waiting':>14}"]
    met = [0, 0, 0, 0, 0, 0, 0]
    for seed, results in rows:
        by = {r["policy"]: r for r in results}
        t, low, fair_low = by["throughput"], min(by["throughput"]["share"].values()), min(by["fair"]["share"].values())
        wait_low, fair_wait_low = (_lowest(by[p]["waiting"]) for p in ("throughput", "fair"))
        vs = (t["avg_jct_h"] / by["static"]["avg_jct_h"], t["avg_jct_h"] / by["fair"]["avg_jct_h"])
        ok = (vs[0] <= GOALS[0], vs[1] <= GOALS[1], low >= GOALS[2])
        met = [m + x for m, x in zip(met, (*ok, all(ok), fair_low >= GOALS[2], wait_low >= GOALS[2],
                                           fair_wait_low >= GOALS[2]))]
        lines.append(f"{seed:>4} {t['jobs']:>5} {'x%.2f' % vs[0]:>10} {'x%.2f' % vs[1]:>8} {low:>13.2f} {fair_low:>13.2f}"
                     f" {wait_low:>14.2f} {fair_wait_low:>14.2f}")
    n = len(rows)
    lines.append(f"goals met on {n} seeds: JCT vs static {met[0]}, vs fair {met[1]}, share {met[2]} "
                 f"(fair's own share {met[4]}), all three {met[3]}; share while waiting {met[5]} (fair's {met[6]})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24, help="trace length (arrivals stop LAST_ARRIVAL_H before)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=0, help="seeds 1..N instead, a line each and a count of the goals met")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=4, help="GPUs per host")
    args = ap.parse_args()
    if args.seeds > 0:
        print(f"traces: {args.hours:g} h, seeds 1-{args.seeds}, {args.hosts} hosts x {args.gpus} GPUs; "
              f"throughput's average completion time against static and fair, lowest share of fair")
        print(seeds_report([(s, run_all(args.hours, s, args.hosts, args.gpus)) for s in range(1, args.seeds + 1)]))
        return
    results = run_all(args.hours, args.seed, args.hosts, args.gpus)
    print(f"trace: {args.hours:g} h, seed {args.seed}, {args.hosts} hosts x {args.gpus} GPUs, "
          f"{results[0]['jobs']} jobs, a tick a simulated minute")
    print(report(results))


if __name__ == "__main__":
    main()
