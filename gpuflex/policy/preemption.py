"""What stands between a queued job and the devices: its dependencies, its array's cap, and
lower-priority jobs holding what it needs. Pure: plain facts in, a decision out.

The queue (gpuflex.control.queueing) asks, per queued job in placing order:
1. `dependency_gate`: every dependency of `--after` is satisfied: afterok (every job it
   names succeeded; an array id stands for each job of the array), afterany (ended,
   however), afternotok (ended, not all succeeded); one that never can be (afterok on a
   job that failed, was cancelled or timed out; afternotok on jobs that all succeeded)
   cancels the job (and a chain below it, one job at a time, in the same command);
   otherwise it waits, naming whom. `singleton_gate`: no other job of its name and owner
   runs or waits ahead of it.
2. `array_gate`: at most `--array ...%N` jobs of its array run at once.
3. `plan_preemption`, when it does not fit: lower-priority jobs give up devices, cheapest
   first, and only as many as needed. In-place elastic jobs first shrink toward their MIN
   (their newest workers leave at the next step boundary: the devices come free a moment
   later, so the waiting job starts at a later command); then restart-elastic jobs and
   jobs submitted with `--requeue` are stopped and requeued, lowest priority first (the
   newest first among equals: it lost the least). Any other job is never preempted, and
   when even all of them would not make room, nobody is preempted. Devices that leavers
   are already giving back count as coming: no second preemption for the same need.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

from gpuflex.policy.placement import HostFree, place
from gpuflex.states import JobState

_ENDED_BADLY = {JobState.FAILED: "failed", JobState.CANCELLED: "was cancelled", JobState.TIMEOUT: "timed out"}


# ---- dependencies and arrays ----------------------------------------------------------------
AFTEROK, AFTERANY, AFTERNOTOK = "afterok", "afterany", "afternotok"


@dataclasses.dataclass(frozen=True)
class Dependency:
    """One id of a job's `--after`: the job it names, or every job of the array it names,
    and how it must end first (`kind`: afterok, afterany or afternotok)."""

    ref: int
    jobs: tuple[tuple[int, JobState], ...]   # (id, state) of each job it stands for
    array: bool = False
    kind: str = AFTEROK


@dataclasses.dataclass(frozen=True)
class Gate:
    """`cancel` (why the job can never start), else `wait` (why not yet), else open."""

    wait: str | None = None
    cancel: str | None = None

    @property
    def open(self) -> bool:
        return self.wait is None and self.cancel is None


def _never(d: Dependency) -> str | None:
    """Why `d` can never be satisfied (None: it still may be). afterok: one of its jobs
    ended badly. afternotok: every job ended, and each succeeded (nothing left to fail).
    afterany: never (any end will do)."""
    of = f" of array {d.ref}" if d.array else ""
    if d.kind == AFTEROK:
        for jid, state in d.jobs:
            if state in _ENDED_BADLY:
                return f"job {jid}{of} {_ENDED_BADLY[state]}"
    elif d.kind == AFTERNOTOK and d.jobs and all(state is JobState.SUCCEEDED for _, state in d.jobs):
        what = f"every job of array {d.ref}" if d.array else f"job {d.ref}"
        return f"{what} succeeded (afternotok:{d.ref} waits for a failure)"
    return None


def _pending(d: Dependency) -> list[tuple[int, JobState]]:
    """The jobs `d` still waits for: not succeeded (afterok), not ended (the others)."""
    if d.kind == AFTEROK:
        return [(jid, state) for jid, state in d.jobs if state is not JobState.SUCCEEDED]
    return [(jid, state) for jid, state in d.jobs if not state.final]


def dependency_gate(deps: Sequence[Dependency]) -> Gate:
    """Open once every dependency is satisfied (Slurm's kinds): afterok, every job it
    stands for succeeded; afterany, every one ended, however; afternotok, every one ended
    and not all succeeded. Cancel when one can never be ("job 12 failed", "job 7 of array 5
    timed out", "job 4 succeeded (afternotok:4 waits for a failure)"); else wait ("waiting
    for job 12 (running), array 5 (3 of 4 not done)"). An id that names no job (deleted
    rows) is never satisfied: the job waits, saying so."""
    waiting = []
    for d in deps:
        never = _never(d)
        if never is not None:
            return Gate(cancel=never)
        pending = _pending(d)
        kind = "" if d.kind == AFTEROK else f" ({d.kind})"
        if not d.jobs:
            waiting.append(f"job {d.ref} (unknown)")
        elif d.array and pending:
            waiting.append(f"array {d.ref} ({len(pending)} of {len(d.jobs)} not done){kind}")
        elif pending:
            waiting.append(", ".join(f"job {jid} ({state.value})" for jid, state in pending) + kind)
    return Gate(wait="waiting for " + ", ".join(waiting)) if waiting else Gate()


def singleton_gate(name: str, others: Sequence[tuple[int, JobState]]) -> Gate:
    """`--after singleton`: wait while another job of the same name and owner runs, or
    waits in the queue ahead of this one (`others`: those jobs, as the caller found them:
    running ones of any id, queued ones with a lower id). Never cancels: they all end."""
    if not others:
        return Gate()
    jobs = ", ".join(f"job {jid} ({state.value})" for jid, state in others)
    return Gate(wait=f"waiting for {jobs} of the same name {name!r} (singleton)")


def array_gate(array_id: int | None, limit: int | None, running: int) -> Gate:
    """At most `limit` of the array's jobs run at once (`running`: those running now)."""
    if array_id is None or limit is None or running < limit:
        return Gate()
    return Gate(wait=f"waiting for a slot of array {array_id}: {running} of at most {limit} running")


# ---- preemption -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeldWorker:
    wid: int
    host: str
    devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Victim:
    """A running job that a higher-priority one might preempt."""

    job_id: int
    priority: int
    elastic: str | None            # 'inplace', 'restart' or None (a fixed gang)
    requeue: bool                  # submitted with --requeue
    min_workers: int
    members: tuple[HeldWorker, ...]   # live, not leaving
    can_shrink: bool = True        # False while it is already resizing
    pinned: bool = False           # an interactive session or alloc (issue 33): never preempted


@dataclasses.dataclass(frozen=True)
class Shrink:
    """Retire these workers of an in-place elastic job (they leave at a step boundary)."""

    job_id: int
    wids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Stop:
    """Stop the job (SIGTERM, grace) and requeue it."""

    job_id: int


Preempt = Union[Shrink, Stop]


@dataclasses.dataclass(frozen=True)
class Plan:
    """`actions` that make room (none: it fits once the `coming` devices are back), or
    `ok` False: nothing would."""

    ok: bool
    actions: tuple[Preempt, ...] = ()


def _with(free: dict[str, tuple[list[int], bool]], workers: Sequence[HeldWorker]) -> dict:
    out = {h: (list(d), s) for h, (d, s) in free.items()}
    for w in workers:
        devices, slots = out.get(w.host, ([], False))
        out[w.host] = (sorted(set(devices) | set(w.devices)), slots)
    return out


def _fits(free: dict[str, tuple[list[int], bool]], minimum: int, per_worker: int) -> bool:
    hosts = [HostFree(h, tuple(d), s) for h, (d, s) in sorted(free.items())]
    return place(hosts, minimum, minimum, per_worker).ok


def _offers(victims: Sequence[Victim], priority: int) -> list[tuple[Preempt, tuple[HeldWorker, ...]]]:
    """Every action allowed against `priority`, cheapest first, with the workers it frees."""
    lower = sorted((v for v in victims if v.priority < priority and not v.pinned),
                   key=lambda v: (v.priority, -v.job_id))
    shrinks = []
    for v in lower:
        if v.elastic == "inplace" and v.can_shrink and len(v.members) > v.min_workers:
            newest = sorted(v.members, key=lambda w: w.wid, reverse=True)[:len(v.members) - v.min_workers]
            shrinks += [(Shrink(v.job_id, (w.wid,)), (w,)) for w in newest]
    stops = [(Stop(v.job_id), v.members) for v in lower if v.elastic == "restart" or v.requeue]
    return shrinks + stops


def could_preempt(victims: Sequence[Victim], priority: int) -> bool:
    """Whether a job of `priority` may preempt any of `victims` at all (a shrink or a
    stop `plan_preemption` could choose), whatever it needs."""
    return bool(_offers(victims, priority))


def plan_preemption(free: Sequence[HostFree], coming: Sequence[HeldWorker], minimum: int, per_worker: int,
                    priority: int, victims: Sequence[Victim]) -> Plan:
    """What to preempt so that `minimum` workers of `per_worker` devices fit (see the
    module's doc). `free`: devices free now; `coming`: devices leavers are giving back."""
    base = _with({h.name: (list(h.devices), h.slots) for h in free}, coming)
    if _fits(base, minimum, per_worker):
        return Plan(ok=True)
    chosen: list[tuple[Preempt, tuple[HeldWorker, ...]]] = []
    for action, workers in _offers(victims, priority):
        if isinstance(action, Stop):   # a stop frees what earlier shrinks of the job did not
            chosen = [c for c in chosen if not (isinstance(c[0], Shrink) and c[0].job_id == action.job_id)]
        chosen.append((action, workers))
        if _fits(_with(base, [w for _, ws in chosen for w in ws]), minimum, per_worker):
            break
    else:
        return Plan(ok=False)
    for c in reversed(list(chosen)):   # drop what turned out not to be needed, dearest first
        rest = [x for x in chosen if x is not c]
        if _fits(_with(base, [w for _, ws in rest for w in ws]), minimum, per_worker):
            chosen = rest
    return Plan(ok=True, actions=_merge([a for a, _ in chosen]))


def _merge(actions: list[Preempt]) -> tuple[Preempt, ...]:
    """One Shrink per job (its wids together), in the order first chosen."""
    out: list[Preempt] = []
    for a in actions:
        prev = next((i for i, o in enumerate(out) if isinstance(o, Shrink) and isinstance(a, Shrink)
                     and o.job_id == a.job_id), None)
        if prev is None:
            out.append(a)
        else:
            out[prev] = Shrink(a.job_id, tuple(sorted(out[prev].wids + a.wids)))
    return tuple(out)
