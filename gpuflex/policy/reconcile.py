"""What a reconcile decides before the lifecycle policy: pure (job, what was observed,
now) -> a time-out, or the workers to stop. No I/O.

gpuflex.control.lifecycle.reconcile observes, asks `first_look` here, applies it (ends the
run at its time limit, or stops the workers it names), then asks gpuflex.policy.lifecycle's
`decide` with the facts as the stops left them (a stopped worker is STOPPED, or LOST when
its host did not answer: only applying tells which).

The stops make the database match the processes where a command died half-way
(gpuflex.control.scaling writes a newcomer's row before its process and asks the
coordinator last, all under the ops lock, so no reconcile runs between): a STARTING worker
that the coordinator neither counts nor wants was never asked for, and is stopped; a
LEAVING worker still alive `leave_bound_s` after the shrink was asked, that the coordinator
no longer wants, never left, and is stopped too (it held its devices from every later
grow); so is a newcomer the coordinator left out of a resize (it never became ready: one
stuck before it ever beat would otherwise hold its devices for the job's life).
"""

from __future__ import annotations

import dataclasses

from gpuflex.policy.facts import JobFacts, Observation, WorkerFacts
from gpuflex.states import WorkerState

STRAY = "the database and the coordinator disagree: a resize that was never asked for, or a leaver that never left"
LEFT_OUT = "left out of a resize by the coordinator: it did not become ready"


@dataclasses.dataclass(frozen=True)
class Stop:
    """Stop these live workers, with this reason."""

    wids: tuple[int, ...]
    why: str


@dataclasses.dataclass(frozen=True)
class FirstLook:
    """A reconcile's first decision: end the run at its time limit (then nothing else), or
    the stops, in order (none: straight on to the lifecycle policy)."""

    time_out: bool = False
    stops: tuple[Stop, ...] = ()

    def without_stopped(self, seen: Observation) -> Observation:
        """`seen` without the stopped workers' process groups: they are no longer what was seen."""
        gone = {w for s in self.stops for w in s.wids}
        return dataclasses.replace(seen, procs={k: v for k, v in seen.procs.items() if k not in gone}) \
            if gone else seen


def first_look(job: JobFacts, seen: Observation, now: float, leave_bound_s: float) -> FirstLook:
    if timed_out(job, seen, now):
        return FirstLook(time_out=True)
    stray = strays(job, seen, now - leave_bound_s)
    stray_ids = {w.wid for w in stray}
    # a stray stopped first is not stopped again as left out
    dropped = [w for w in left_out_alive(job, seen) if w.wid not in stray_ids]
    return FirstLook(stops=tuple(Stop(tuple(w.wid for w in ws), why)
                                 for ws, why in ((stray, STRAY), (dropped, LEFT_OUT)) if ws))


def live(job: JobFacts) -> list[WorkerFacts]:
    return [w for w in job.workers if not w.state.final]


def timed_out(job: JobFacts, seen: Observation, now: float) -> bool:
    """Whether the run reached its time limit: the deadline passed and some live worker
    did not end before it (alive, ended at or after it — its supervisor stopped it —, or
    on a host that did not answer). A run whose workers all ended before the deadline
    ends by its exit codes, whenever a command sees it."""
    deadline = job.deadline
    workers = live(job)
    if deadline is None or now < deadline or not workers:
        return False
    for w in workers:
        p = seen.procs.get(w.wid)
        if p is None or p.alive or not p.exited or p.ended_at is None or p.ended_at >= deadline:
            return True
    return False


def strays(job: JobFacts, seen: Observation, asked_before: float) -> list[WorkerFacts]:
    """Live workers the coordinator does not want: STARTING ones it never heard of (neither
    members, desired nor known), alive or with no group recorded, and LEAVING ones not
    desired and still alive when the job's newest resize request (`job.resize_asked_at`,
    None: none) is older than `asked_before`. None when the coordinator did not answer, or
    did not say what it desires: without its word nothing is a stray."""
    coord = seen.coordinator
    if coord is None or coord.desired is None:
        return []

    def running(w: WorkerFacts) -> bool:
        p = seen.procs.get(w.wid)
        return p is not None and p.alive

    # a worker the coordinator knows (rejected after a rollback, released) ends by itself,
    # with its own exit code: only one it never heard of is the database's to end
    out = [w for w in live(job) if w.wid not in coord.desired and w.state is WorkerState.STARTING
           and w.wid not in coord.members and w.wid not in coord.known and (w.pgid is None or running(w))]
    leavers = [w for w in live(job) if w.wid not in coord.desired and w.state is WorkerState.LEAVING
               and running(w)]
    if leavers and (job.resize_asked_at is None or job.resize_asked_at < asked_before):
        out += leavers
    return out


def left_out_alive(job: JobFacts, seen: Observation) -> list[WorkerFacts]:
    """STARTING workers still running that the coordinator's status lists under `left_out`
    (newcomers it dropped from a resize: dead, or never started in time) and that are not
    members: a dead one is reaped by the policy; one alive (stuck, frozen) is stopped."""
    coord = seen.coordinator
    if coord is None:
        return []
    left = {e.wid for e in coord.left_out}
    return [w for w in live(job) if w.wid in left and w.wid not in coord.members
            and w.state is WorkerState.STARTING and (p := seen.procs.get(w.wid)) is not None and p.alive]
