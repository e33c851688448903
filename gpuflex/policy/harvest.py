"""The harvest plan: pure (jobs, GPUs, settings, now) -> actions. No I/O.

One tick of `gpuflex harvest` asks `plan()` what to do and an executor
(gpuflex.control.harvest) carries it out. The plan, in order:

1. HostDown: a host whose probe failed this tick. Its GPUs are "unknown": nothing is
   grown onto them and nothing is yielded there (we cannot see what happens on them).
2. Yield / Requeue: a foreign (not gpuflex) process is on a GPU that one of our workers
   holds. The workers on such GPUs leave their job (an in-place shrink). A job that would
   fall below MIN that way, or whose training state would leave with them (only newcomers
   that never joined a generation would stay), is checkpointed and requeued instead.
   Yielding happens on every host, owned or not.
3. Place: queued jobs that fit on free or idle devices, by priority, then their owner's
   decayed usage, then age, each within its owner's quota (what `lifecycle.place_queued`
   will do; listed so a dry run shows it). Under the throughput policy a --harvest job
   starts no bigger than its owner's fair share, the user furthest below theirs first
   (gpuflex.policy.shares.Starting).
4. Grow: `--harvest` jobs grow onto idle GPUs of owned hosts, one worker at a time, up to
   their MAX and within their owner's quota: higher priority first, then the job of the
   user with the least decayed usage (fair share between users, gpuflex.policy.fairshare),
   then the job with the fewest harvested GPUs, then the older job. A job whose training
   has finished (`training_finished`) is never grown: its newcomers would exit at once. A
   worker's devices are on one host, preferably a host the job already uses.
   With `[harvest] policy = "throughput"` (issue 32) step 4 is gpuflex.policy.allocation's
   instead: by measured scaling, with Shrink actions (to start a queued job, to even out
   users' shares, or past a job's optimum) and a Note, the event, with each decision's
   reason (for a grow, the size actually placed: placed_reason).

Hysteresis: a GPU is grown onto only with verdict "idle" and at least `idle_samples`
quiet probes in a row (see gpuflex.hosts.probe), from a probe no older than
`max_probe_age_s`; one busy probe resets the streak.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

from gpuflex.config import HarvestSettings
from gpuflex.elastic.protocol.wire import CoordinatorStatus
from gpuflex.policy import allocation, shares
from gpuflex.policy.fairshare import Quota
from gpuflex.policy.harvest_actions import Action, GpuRef, Grow, HostDown, Note, Place, Plan, Requeue, Shrink, Yield
from gpuflex.policy.placement import HostFree, place
from gpuflex.policy.throughput import Point
from gpuflex.states import JobState, WorkerState

ACTIVE = (JobState.RUNNING, JobState.SCALING)


@dataclasses.dataclass(frozen=True)
class WorkerView:
    wid: int
    host: str
    gpus: tuple[int, ...]
    state: WorkerState = WorkerState.RUNNING   # starting | running | leaving (live workers only)


@dataclasses.dataclass(frozen=True)
class JobView:
    id: int
    state: JobState               # queued | running | scaling
    min_workers: int
    max_workers: int
    gpus_per_worker: int = 1
    priority: int = 0
    harvest: bool = False
    workers: tuple[WorkerView, ...] = ()
    target_workers: int | None = None
    name: str = ""
    user: str = ""
    finished: bool = False        # its training ended (training_finished): never grown
    shunned: frozenset[GpuRef] = frozenset()   # not grown onto: a straggler's lately, or where it cannot start
    # an interactive session or alloc (issue 33): its user is at the terminal, so a process
    # on its GPUs is theirs, not an owner's coming back: never yielded nor requeued
    pinned: bool = False
    # issue 32, the throughput policy: measured (world, hosts) points, whether it shrinks in
    # place (a restart job does not), when that policy last resized it
    points: tuple[Point, ...] = ()
    inplace: bool = True
    resized_at: float | None = None

    def __post_init__(self) -> None:
        if self.min_workers < 1 or self.max_workers < self.min_workers or self.gpus_per_worker < 0:
            raise ValueError(f"job {self.id}: bad shape {self.min_workers}:{self.max_workers}"
                             f" x {self.gpus_per_worker}")

    @property
    def members(self) -> tuple[WorkerView, ...]:
        """Workers meant to stay: alive and not retiring."""
        return tuple(w for w in self.workers if w.state != WorkerState.LEAVING)


@dataclasses.dataclass(frozen=True)
class Share:
    """Fair share between users: decayed GPU-hours and quotas (limit and devices held now)
    by user; a user missing from `quotas` has no limit."""

    usage: Mapping[str, float] = dataclasses.field(default_factory=dict)
    quotas: Mapping[str, Quota] = dataclasses.field(default_factory=dict)

    def room(self, user: str) -> int | None:
        q = self.quotas.get(user)
        return None if q is None else q.room()


def training_finished(status: CoordinatorStatus | None, exited_ok: Iterable[int]) -> bool:
    """Whether a running job's training has ended: its coordinator says "finished", or a
    worker it still wants (in "desired") exited 0 (a done record: a retired worker leaves
    "desired" before it exits; a newcomer that finds training over exits 0 too). Without
    the coordinator's word (None), nothing is known to have finished."""
    if status is None:
        return False
    if status.finished:
        return True
    return status.desired is not None and any(w in status.desired for w in exited_ok)


@dataclasses.dataclass(frozen=True)
class GpuView:
    """One device as the last probe saw it (kind "slot": a CPU slot, never probed)."""

    host: str
    index: int
    verdict: str | None           # free | idle | owner | busy | zombie | unknown | slot
    owner: str | None = None
    kind: str = "gpu"
    idle_streak: int = 0
    probed_at: float | None = None      # time of the last successful probe of this GPU
    foreign_since: float | None = None  # first of the consecutive probes that saw a foreign process

    @property
    def ref(self) -> GpuRef:
        return (self.host, self.index)


# ---- the plan -------------------------------------------------------------------------
def probe_max_age_s(settings: HarvestSettings) -> float:
    """How old a GPU's last probe may be for its verdict to still place or grow work:
    three ticks, and never under five minutes (a cron tick may be late)."""
    return max(3 * settings.interval_s, 300.0)


def plan(jobs: Sequence[JobView], gpus: Sequence[GpuView], settings: HarvestSettings, now: float, *,
         host_errors: Mapping[str, str] | None = None, max_probe_age_s: float | None = None,
         share: Share | None = None) -> Plan:
    """What one tick should do; see the module docstring for the rules and their order."""
    host_errors = dict(host_errors or {})
    share = share or Share()
    room = {u: share.room(u) for u in {j.user for j in jobs}}   # devices each user may still take
    max_age = max_probe_age_s if max_probe_age_s is not None else probe_max_age_s(settings)
    actions: list[Action] = [HostDown(h, e) for h, e in sorted(host_errors.items())]

    def seen(g: GpuView) -> bool:
        """A GPU whose last probe succeeded recently, on a host that answered this tick."""
        return (g.kind == "gpu" and g.host not in host_errors and g.probed_at is not None
                and now - g.probed_at <= max_age)

    holder: dict[GpuRef, tuple[JobView, WorkerView]] = {}
    for j in jobs:
        for w in j.workers:
            for d in w.gpus:
                holder[(w.host, d)] = (j, w)

    # -- yield to owners --
    reclaimed: dict[int, dict[int, set[GpuRef]]] = {}   # job -> wid -> GPUs
    since: dict[int, float] = {}
    for g in gpus:
        if g.foreign_since is None or not seen(g) or g.ref not in holder:
            continue
        j, w = holder[g.ref]
        if j.state not in ACTIVE or j.pinned:
            continue
        reclaimed.setdefault(j.id, {}).setdefault(w.wid, set()).add(g.ref)
        since[j.id] = min(since.get(j.id, g.foreign_since), g.foreign_since)
    requeued: set[int] = set()
    leaving_now: dict[int, set[int]] = {}
    for j in sorted(jobs, key=lambda j: j.id):
        if j.id not in reclaimed:
            continue
        wids = tuple(sorted(reclaimed[j.id]))
        refs = tuple(sorted(set().union(*reclaimed[j.id].values())))
        stay = [w for w in j.members if w.wid not in wids]
        where = ", ".join(f"{h}:{i}" for h, i in refs)
        stateful = any(w.state == WorkerState.RUNNING for w in j.members if w.wid in wids)
        if len(stay) < j.min_workers or (stateful and not any(w.state == WorkerState.RUNNING for w in stay)):
            requeued.add(j.id)
            keeps = f"{len(stay)} worker(s) would stay, below MIN {j.min_workers}" \
                if len(stay) < j.min_workers else "no remaining worker holds the training state"
            actions.append(Requeue(j.id, wids, refs, since[j.id], f"owner back on {where}; {keeps}"))
        else:
            leaving_now[j.id] = set(wids)
            actions.append(Yield(j.id, wids, refs, since[j.id], f"owner back on {where}"))

    # -- devices nobody holds, by host --
    taken = set(holder)
    free: dict[str, list[int]] = {}
    idle: dict[str, list[int]] = {}
    for g in sorted(gpus, key=lambda g: (g.host, g.index)):
        if g.ref in taken:
            continue
        if g.kind == "slot":
            free.setdefault(g.host, []).append(g.index)
        elif seen(g) and g.verdict in ("free", "idle"):
            free.setdefault(g.host, []).append(g.index)
            if (g.verdict == "idle" and g.owner is not None
                    and g.idle_streak >= settings.idle_samples):
                idle.setdefault(g.host, []).append(g.index)
    slot_hosts = {g.host for g in gpus if g.kind == "slot"}

    # -- queued jobs, as place_queued will start them --
    queued = (j for j in jobs if j.state == JobState.QUEUED)
    starts = starting(jobs, free) if settings.policy == "throughput" else None
    for j in sorted(queued, key=lambda j: (-j.priority, starts.behind(j.user) if starts else 0.0,
                                           share.usage.get(j.user, 0.0), j.id)):
        offer = [HostFree(h, tuple(d), slots=h in slot_hosts) for h, d in sorted(free.items())]
        most = max(j.target_workers or j.max_workers, j.min_workers)
        cost = max(j.gpus_per_worker, 1)
        if starts is not None and j.harvest and not j.target_workers:
            most = starts.most(j.user, most, j.min_workers, cost)
        if room[j.user] is not None:
            if room[j.user] < j.min_workers * cost:
                continue
            most = max(j.min_workers, min(most, room[j.user] // cost))
        p = place(offer, j.min_workers, most, j.gpus_per_worker)
        if not p.ok:
            continue
        actions.append(Place(j.id, p.assignments))
        for a in p.assignments:
            _take(free, idle, a.host, a.devices)
            if starts is not None:
                starts.took(j.user, len(a.devices))
        if room[j.user] is not None:
            room[j.user] -= sum(len(a.devices) for a in p.assignments)

    # -- grow --harvest jobs onto idle GPUs --
    owned_hosts = {g.host for g in gpus if g.owner is not None}
    size: dict[int, int] = {}
    harvested: dict[int, int] = {}
    hosts_of: dict[int, set[str]] = {}
    growers = []
    for j in jobs:
        if not j.harvest or j.state not in ACTIVE or j.id in requeued or j.gpus_per_worker < 1 or j.finished:
            continue
        stay = [w for w in j.members if w.wid not in leaving_now.get(j.id, set())]
        size[j.id] = len(stay)
        harvested[j.id] = sum(len(w.gpus) for w in stay if w.host in owned_hosts)
        hosts_of[j.id] = {w.host for w in stay}
        growers.append(j)
    if settings.policy == "throughput":
        placed = {a.job for a in actions if isinstance(a, Place)}
        waiting = [j for j in jobs if j.state == JobState.QUEUED and j.id not in placed]
        # devices on their way to being idle: not quiet long enough yet, or a leaver's (not an owner's)
        owners_back = {g.ref for g in gpus if g.foreign_since is not None}
        coming = sum(1 for g in gpus if g.ref not in taken and seen(g) and g.verdict == "idle"
                     and g.owner is not None and g.idle_streak < settings.idle_samples)
        coming += sum(1 for j in jobs if j.state in ACTIVE for w in j.workers if w.state == WorkerState.LEAVING
                      for d in w.gpus if (w.host, d) not in owners_back)
        actions += _by_throughput(growers, size, hosts_of, idle, free, waiting, room, settings, now,
                                  leaving_now, sum(len(d) for d in free.values()), coming)
        return Plan(tuple(actions))
    while True:
        best = None
        for j in growers:
            if size[j.id] >= j.max_workers or (room[j.user] is not None and room[j.user] < j.gpus_per_worker):
                continue
            offer = _without(idle, j.shunned)
            host = _pick_host(offer, j.gpus_per_worker, hosts_of[j.id])
            if host is None:
                continue
            key = (-j.priority, share.usage.get(j.user, 0.0), harvested[j.id], j.id)
            if best is None or key < best[0]:
                best = (key, j, host, offer)
        if best is None:
            break
        _, j, host, offer = best
        devices = tuple(offer[host][:j.gpus_per_worker])
        _take(free, idle, host, devices)
        actions.append(Grow(j.id, host, devices))
        size[j.id] += 1
        harvested[j.id] += len(devices)
        if room[j.user] is not None:
            room[j.user] -= len(devices)
        hosts_of[j.id].add(host)
    return Plan(tuple(actions))


def starting(jobs: Sequence[JobView], free: Mapping[str, list[int]]) -> shares.Starting:
    """The throughput policy's start sizes and order (shares.Starting) for this pool."""
    return shares.starting((shares.claim(j, j.state in ACTIVE) for j in jobs
                            if j.state in ACTIVE or j.state == JobState.QUEUED), sum(len(d) for d in free.values()))


def _by_throughput(growers, size, hosts_of, idle, free, waiting, room, settings, now, leaving_now,
                   unheld: int, coming: int = 0) -> list[Action]:
    """The throughput policy's moves (gpuflex.policy.allocation) as Grow, Shrink and Note."""
    views = [dataclasses.replace(j, workers=tuple(w for w in j.members if w.wid not in leaving_now.get(j.id, ())))
             for j in growers]
    held: dict[str, int] = {}
    for j in views:
        held[j.user] = held.get(j.user, 0) + sum(len(w.gpus) for w in j.workers)
    alloc = allocation.allocate(
        [allocation.elastic(j) for j in views],
        [allocation.Waiting(j.id, j.user, j.min_workers * max(j.gpus_per_worker, 1), j.priority,
                            most=j.max_workers * max(j.gpus_per_worker, 1)) for j in waiting],
        sum(len(d) for d in idle.values()), held=held, pool=unheld + sum(held.values()), room=room,
        rules=allocation.rules_of(settings), now=now, coming=coming)
    out: list[Action] = [Note(d.job, d.reason) for d in alloc.stays]
    for d in alloc.changes:
        j = next(v for v in views if v.id == d.job)
        if d.new < d.old:   # the newest workers leave, never the last one holding the state
            out.append(Note(j.id, d.reason))
            order = sorted(j.workers, key=lambda w: (w.state == WorkerState.RUNNING, -w.wid))   # newcomers first
            wids = tuple(w.wid for w in order)[:d.old - d.new]
            out.append(Shrink(j.id, tuple(sorted(wids)), d.reason))
            continue
        grows = []
        for _ in range(d.new - d.old):
            offer = _without(idle, j.shunned)
            host = _pick_host(offer, j.gpus_per_worker, hosts_of[j.id])
            if host is None:
                break
            devices = tuple(offer[host][:j.gpus_per_worker])
            _take(free, idle, host, devices)
            hosts_of[j.id].add(host)
            grows.append(Grow(j.id, host, devices))
        out.append(Note(j.id, placed_reason(d, len(grows), max(j.gpus_per_worker, 1))))
        out += grows
    return out


def placed_reason(d: allocation.Decision, placed: int, per_worker: int) -> str:
    """A grow decision's reason as carried out: the policy counts idle devices, not where
    they are, so only `placed` of the planned workers may find a host with `per_worker`
    idle GPUs (or the devices a shrink of this tick frees are not idle until it is done).
    The event says the size the job is actually grown to, and why the rest was not."""
    planned = d.new - d.old
    if placed >= planned:
        return d.reason
    head = f"job {d.job} {d.old}->{d.old + placed}" if placed else f"job {d.job} stays at {d.old}"
    why = d.reason.split(": ", 1)[1] if ": " in d.reason else d.reason
    return (f"{head} ({d.old}->{d.new} planned; {planned - placed} worker(s) not placed: no host has "
            f"{per_worker} idle GPU(s) it may take this tick): {why}")


def _pick_host(idle: Mapping[str, list[int]], need: int, used: Iterable[str]) -> str | None:
    """A host with `need` idle GPUs: one the job already uses first, then the most idle, then by name."""
    used = set(used)
    fits = [h for h, d in idle.items() if len(d) >= need]
    if not fits:
        return None
    return min(fits, key=lambda h: (h not in used, -len(idle[h]), h))


def _without(idle: Mapping[str, list[int]], shunned: frozenset[GpuRef]) -> dict[str, list[int]]:
    """`idle` less the `shunned` devices (a job's released stragglers: growing it back onto
    one would release it again after [jobs] straggler_s, again and again)."""
    if not shunned:
        return dict(idle)
    return {h: [d for d in ds if (h, d) not in shunned] for h, ds in idle.items()}


def _take(free: dict[str, list[int]], idle: dict[str, list[int]], host: str, devices: Iterable[int]) -> None:
    gone = set(devices)
    for pool in (free, idle):
        if host in pool:
            pool[host] = [d for d in pool[host] if d not in gone]
