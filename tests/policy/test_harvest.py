"""The harvest plan as a table: (jobs, GPUs, settings, now) -> actions. Pure, no I/O."""

from __future__ import annotations

import dataclasses

import pytest

from gpuflex.config import HarvestSettings
from gpuflex.policy.harvest import (Grow, GpuView, HostDown, JobView, Place, Plan, Requeue, WorkerView,
                                    Yield, plan)

NOW = 10_000.0
S = HarvestSettings(interval_s=60, idle_samples=3, reclaim_deadline_s=30)


def g(ref: str, verdict: str = "idle", owner: str | None = "alice", streak: int = 3, age: float = 1,
      foreign: float | None = None, kind: str = "gpu") -> GpuView:
    host, index = ref.split(":")
    return GpuView(host=host, index=int(index), verdict=verdict, owner=owner, kind=kind,
                   idle_streak=streak, probed_at=None if kind == "slot" else NOW - age,
                   foreign_since=foreign)


def w(wid: int, ref: str, state: str = "running") -> WorkerView:
    host, devices = ref.split(":")
    return WorkerView(wid=wid, host=host, gpus=tuple(int(d) for d in devices.split(",")), state=state)


def job(id: int, workers=(), lo: int = 1, hi: int = 4, prio: int = 0, harvest: bool = True,
        state: str = "running", per: int = 1) -> JobView:
    return JobView(id=id, state=state, min_workers=lo, max_workers=hi, gpus_per_worker=per,
                   priority=prio, harvest=harvest, workers=tuple(workers))


def summary(p: Plan) -> list[tuple]:
    out = []
    for a in p.actions:
        if isinstance(a, Grow):
            out.append(("grow", a.job, f"{a.host}:{','.join(map(str, a.devices))}"))
        elif isinstance(a, Yield):
            out.append(("yield", a.job, a.wids, [f"{h}:{i}" for h, i in a.gpus]))
        elif isinstance(a, Requeue):
            out.append(("requeue", a.job, a.wids, [f"{h}:{i}" for h, i in a.gpus]))
        elif isinstance(a, Place):
            out.append(("place", a.job, [f"{x.host}:{','.join(map(str, x.devices))}" for x in a.assignments]))
        elif isinstance(a, HostDown):
            out.append(("down", a.host))
    return out


A0, A1, B0, B1 = "a:0", "a:1", "b:0", "b:1"
FOREIGN = NOW - 2

CASES = {
    # ---- growth and hysteresis ------------------------------------------------------------
    "grows onto every idle GPU up to MAX":
        ([job(1, [w(0, "c:0")], hi=3)], [g(A0), g(A1), g(B0), g("c:0", "free", owner=None)], {},
         [("grow", 1, A0), ("grow", 1, A1)]),
    "nothing idle long enough yet (streak below idle_samples)":
        ([job(1, [w(0, "c:0")])], [g(A0, "owner", streak=2), g(A1, "idle", streak=2)], {}, []),
    "owner, busy, zombie and unknown GPUs are never grown onto":
        ([job(1, [w(0, "c:0")])],
         [g(A0, "owner", streak=0), g(A1, "busy", streak=0), g(B0, "zombie", streak=0),
          g(B1, "unknown", streak=0)], {}, []),
    "a stale probe offers nothing":
        ([job(1, [w(0, "c:0")])], [g(A0, age=301), g(A1, age=10)], {}, [("grow", 1, A1)]),
    "GPUs of hosts without an owner are not harvested":
        ([job(1, [w(0, "c:0")])], [g(A0, "free", owner=None, streak=9)], {}, []),
    "only --harvest jobs that run grow":
        ([job(1, [w(0, "c:0")], harvest=False), job(2, state="queued", lo=2, hi=2, per=2),
          job(3, [w(0, "c:1")], state="scaling")],
         [g(A0)], {}, [("grow", 3, A0)]),
    "a job at MAX does not grow; a CPU-only job never":
        ([job(1, [w(0, "c:0"), w(1, "c:1")], hi=2), job(2, [w(0, "c:2")], per=0)], [g(A0)], {}, []),
    "a worker's GPUs come from one host, a host the job already uses first":
        ([job(1, [w(0, "b:2,3")], per=2, hi=3)], [g(A0), g(A1), g("a:2"), g(B0), g(B1)], {},
         [("grow", 1, "b:0,1"), ("grow", 1, "a:0,1")]),
    "devices held by any worker are not offered":
        ([job(1, [w(0, A0)]), job(2, [w(0, "c:0")], harvest=False)], [g(A0), g(A1)], {},
         [("grow", 1, A1)]),
    # ---- priorities and fair share -------------------------------------------------------
    "higher priority takes what it can first":
        ([job(1, [w(0, "c:0")], prio=0), job(2, [w(0, "c:1")], prio=5, hi=3)],
         [g(A0), g(A1), g(B0)], {}, [("grow", 2, A0), ("grow", 2, A1), ("grow", 1, B0)]),
    "equal priority: fewest harvested GPUs first, then the older job":
        ([job(1, [w(0, "c:0"), w(1, B0)]), job(2, [w(0, "c:1")]), job(3, [w(0, "c:2")])],
         [g(A0), g(A1), g("a:2"), g(B0, "idle")], {},
         [("grow", 2, A0), ("grow", 3, "a:1"), ("grow", 1, "a:2")]),
    "queued jobs are placed before harvest jobs grow (and keep their devices)":
        ([job(1, [w(0, "c:0")]), job(2, state="queued", lo=1, hi=1)], [g(A0), g(A1)], {},
         [("place", 2, [A0]), ("grow", 1, A1)]),
    # ---- owners come back: yield, MIN, requeue -------------------------------------------
    "a foreign process on a GPU we hold: that worker leaves":
        ([job(1, [w(0, "c:0"), w(1, A0), w(2, A1)])],
         [g(A0, "busy", streak=0, foreign=FOREIGN), g(A1, "idle")], {},
         [("yield", 1, (1,), [A0])]),
    "yielding also on hosts without an owner":
        ([job(1, [w(0, "c:0"), w(1, "c:1")], hi=2)],
         [g("c:0", "busy", owner=None, streak=0, foreign=FOREIGN), g("c:1", "free", owner=None)], {},
         [("yield", 1, (0,), ["c:0"])]),
    "never below MIN: requeue instead":
        ([job(1, [w(0, A0), w(1, A1)], lo=2)], [g(A0, "busy", streak=0, foreign=FOREIGN), g(A1)], {},
         [("requeue", 1, (0,), [A0])]),
    "the last worker's owner is back: requeue":
        ([job(1, [w(0, A0)])], [g(A0, "busy", streak=0, foreign=FOREIGN)], {},
         [("requeue", 1, (0,), [A0])]),
    "only a newcomer without state would stay: requeue":
        ([job(1, [w(0, A0), w(1, A1, "starting")])], [g(A0, "busy", streak=0, foreign=FOREIGN), g(A1)], {},
         [("requeue", 1, (0,), [A0])]),
    "a job that has not formed yet (nobody holds state): shrinks in place":
        ([job(1, [w(0, A0, "starting"), w(1, A1, "starting")], state="running")],
         [g(A0, "busy", streak=0, foreign=FOREIGN), g(A1)], {}, [("yield", 1, (0,), [A0])]),
    "a multi-GPU worker leaves whole; both of its GPUs are noted only where foreign":
        ([job(1, [w(0, "c:0"), w(1, "a:0,1")], per=2)],
         [g(A0), g(A1, "busy", streak=0, foreign=FOREIGN)], {}, [("yield", 1, (1,), [A1])]),
    "a yielding job still grows elsewhere, counted without its leavers":
        ([job(1, [w(0, "c:0"), w(1, A0)], hi=2)], [g(A0, "busy", streak=0, foreign=FOREIGN), g(B0)], {},
         [("yield", 1, (1,), [A0]), ("grow", 1, B0)]),
    "a requeued job does not grow; another job takes the idle GPU":
        ([job(1, [w(0, A0)]), job(2, [w(0, "c:0")])], [g(A0, "busy", streak=0, foreign=FOREIGN), g(B0)], {},
         [("requeue", 1, (0,), [A0]), ("grow", 2, B0)]),
    "a worker already leaving is not counted as staying":
        ([job(1, [w(0, A0), w(1, A1, "leaving")])], [g(A0, "busy", streak=0, foreign=FOREIGN)], {},
         [("requeue", 1, (0,), [A0])]),
    # ---- partial host failures ----------------------------------------------------------
    "a host that failed this tick: reported, neither yielded nor grown onto; others go on":
        ([job(1, [w(0, A0), w(1, "c:0")])],
         [g(A0, "unknown", streak=0, foreign=FOREIGN), g(A1, "unknown", streak=0), g(B0)],
         {"a": "a: connection refused"},
         [("down", "a"), ("grow", 1, B0)]),
    "a GPU the job released a straggler from is not grown back onto; another is":
        ([dataclasses.replace(job(1, [w(0, "c:0")], hi=3), shunned=frozenset({("a", 0)}))],
         [g(A0), g(B0)], {}, [("grow", 1, B0)]),
    "only shunned GPUs idle: no grow (another job may take them)":
        ([dataclasses.replace(job(1, [w(0, "c:0")], hi=3), shunned=frozenset({("a", 0), ("a", 1)})),
          job(2, [w(0, "d:0")], hi=2)],
         [g(A0), g(A1)], {}, [("grow", 2, A0)]),
    "a stale foreign sample does not yield":
        ([job(1, [w(0, A0), w(1, "c:0")])], [g(A0, "busy", streak=0, foreign=FOREIGN, age=400)], {}, []),
}


@pytest.mark.parametrize("jobs,gpus,errors,expected", CASES.values(), ids=CASES.keys())
def test_plan_table(jobs, gpus, errors, expected):
    assert summary(plan(jobs, gpus, S, NOW, host_errors=errors)) == expected


def test_yield_carries_the_first_moment_the_owner_was_seen():
    jobs = [job(1, [w(0, "c:0"), w(1, A0), w(2, A1)])]
    gpus = [g(A0, "busy", streak=0, foreign=NOW - 5), g(A1, "busy", streak=0, foreign=NOW - 1)]
    (y,) = plan(jobs, gpus, S, NOW).of(Yield)
    assert y.since == NOW - 5 and y.wids == (1, 2) and "a:0, a:1" in y.reason


def test_a_pinned_job_is_never_yielded_nor_requeued_for_a_process_on_its_gpus():
    """An interactive session (issue 33): the process on its GPU is its user's own, not an
    owner coming back; an ordinary job on the same kind of GPU yields."""
    gpus = [g(A0, "busy", streak=0, foreign=NOW - 5), g(A1, "busy", streak=0, foreign=NOW - 5)]
    session = dataclasses.replace(job(1, [w(0, A0)], hi=1, harvest=False), pinned=True)
    other = job(2, [w(0, A1), w(1, "c:0")], harvest=False)
    p = plan([session, other], gpus, S, NOW)
    assert p.of(Requeue) == [] and [(y.job, y.wids) for y in p.of(Yield)] == [(2, (0,))]


def test_the_plan_is_repeatable_and_serialisable():
    jobs = [job(1, [w(0, "c:0")]), job(2, state="queued", hi=1)]
    gpus = [g(A0), g(A1), g("c:0", "slot", owner=None, kind="slot"), g("c:1", "slot", owner=None, kind="slot")]
    first, second = plan(jobs, gpus, S, NOW), plan(jobs, gpus, S, NOW)
    assert first == second
    assert first.to_json() == [
        {"action": "place", "job": 2, "assignments": [{"host": "a", "devices": [0]}]},
        {"action": "grow", "job": 1, "host": "a", "devices": [1]},
    ]


def test_bad_job_shapes_are_refused_at_construction():
    with pytest.raises(ValueError, match="job 7"):
        JobView(id=7, state="running", min_workers=3, max_workers=2)
