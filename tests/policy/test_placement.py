"""Gang placement (pure): fewest hosts first, one worker per device, MIN..MAX, why it waits."""

from __future__ import annotations

import itertools

import pytest

from gpuflex.policy.placement import Assignment, HostFree, Placement, devices_per_worker, place


def gpus(name: str, *devices: int) -> HostFree:
    return HostFree(name, tuple(devices), slots=False)


def slots(name: str, *devices: int) -> HostFree:
    return HostFree(name, tuple(devices), slots=True)


A = Assignment

# (id, free hosts, minimum, maximum, per_worker, expected assignments)
PLACED = [
    ("one host that fits all beats two small ones",
     [gpus("a", 0, 1), gpus("b", 0, 1, 2, 3), gpus("c", 5)], 3, 3, 1,
     (A("b", (0,)), A("b", (1,)), A("b", (2,)))),
    ("largest host first, then the next largest",
     [gpus("a", 0, 1), gpus("b", 0, 1, 2, 3), gpus("c", 5)], 5, 5, 1,
     (A("b", (0,)), A("b", (1,)), A("b", (2,)), A("b", (3,)), A("a", (0,)))),
    ("equal hosts: by name",
     [gpus("z", 0, 1), gpus("m", 0, 1)], 2, 2, 1,
     (A("m", (0,)), A("m", (1,)))),
    ("elastic range takes as many as fit",
     [slots("local", 0, 1, 2)], 1, 8, 1,
     (A("local", (0,)), A("local", (1,)), A("local", (2,)))),
    ("elastic range stops at MAX",
     [slots("local", 0, 1, 2, 3)], 1, 2, 1,
     (A("local", (0,)), A("local", (1,)))),
    ("only the free devices are used, in order",
     [gpus("a", 1, 3, 6)], 3, 3, 1,
     (A("a", (1,)), A("a", (3,)), A("a", (6,)))),
    ("K devices per worker, never split",
     [gpus("a", 0, 1, 2, 3, 4)], 1, 4, 2,
     (A("a", (0, 1)), A("a", (2, 3)))),
    ("capacity counts whole workers, not devices",
     [gpus("a", 0, 1, 2), gpus("b", 0, 1)], 2, 2, 2,
     (A("a", (0, 1)), A("b", (0, 1)))),
    ("a CPU-slot worker with 0 GPUs still takes one slot",
     [slots("local", 0, 1)], 1, 4, 0,
     (A("local", (0,)), A("local", (1,)))),
    ("a 0-GPU worker on a GPU host takes no device",
     [gpus("a")], 2, 2, 0,
     (A("a", ()), A("a", ()))),
    ("hosts with nothing free are skipped",
     [slots("empty"), slots("local", 2, 3)], 2, 2, 1,
     (A("local", (2,)), A("local", (3,)))),
]


@pytest.mark.parametrize("free,lo,hi,k,expected", [row[1:] for row in PLACED], ids=[row[0] for row in PLACED])
def test_placed(free, lo, hi, k, expected):
    p = place(free, lo, hi, k)
    assert p.ok and p.reason is None
    assert p.assignments == expected


# (id, free hosts, minimum, maximum, per_worker, reason)
WAITING = [
    ("too few slots", [slots("local", 0, 1)], 3, 3, 1,
     "waiting for 3 free slots on local (2 free now)"),
    ("all slots taken", [slots("local")], 2, 2, 1,
     "waiting for 2 free slots on local (0 free now)"),
    ("MIN not reachable though MAX is generous", [slots("local", 0)], 2, 8, 1,
     "waiting for 2 free slots on local (1 free now)"),
    ("a worker never spans hosts", [gpus("a", 0), gpus("b", 0)], 1, 1, 2,
     "waiting for 2 free GPUs on a, b (2 free now)"),
    ("GPUs per worker multiply", [gpus("a", 0, 1, 2)], 2, 2, 2,
     "waiting for 4 free GPUs on a (3 free now)"),
    ("no host at all", [], 1, 1, 1, "waiting for 1 free GPUs on no host (0 free now)"),
]


@pytest.mark.parametrize("free,lo,hi,k,reason", [row[1:] for row in WAITING], ids=[row[0] for row in WAITING])
def test_waiting(free, lo, hi, k, reason):
    p = place(free, lo, hi, k)
    assert not p.ok
    assert p.assignments == ()
    assert p.reason == reason


@pytest.mark.parametrize("lo,hi,k", [(0, 1, 1), (2, 1, 1), (1, 1, -1)])
def test_bad_request_is_refused(lo, hi, k):
    with pytest.raises(ValueError, match="bad request"):
        place([slots("local", 0)], lo, hi, k)


# Invariants over a grid of pools and requests: never a device twice, never a device that
# was not free, never a worker across hosts, MIN <= placed <= MAX, and as many as fit.
POOLS = [
    [gpus("a", 0, 1, 2, 3), gpus("b", 0, 1), gpus("c", 7)],
    [slots("local", 0, 1, 2, 3)],
    [gpus("a", 0, 2, 4), slots("s", 0, 1, 2)],
]


@pytest.mark.parametrize("pool", POOLS, ids=["gpus", "slots", "mixed"])
@pytest.mark.parametrize("lo,hi,k", list(itertools.product([1, 2, 3], [3, 5], [1, 2])))
def test_invariants(pool, lo, hi, k):
    p = place(pool, lo, hi, k)
    fits = sum(len(h.devices) // devices_per_worker(k, h.slots) for h in pool)
    if fits < lo:
        assert not p.ok and p.reason.startswith("waiting for ")
        return
    assert p.ok
    assert len(p.assignments) == min(fits, hi)
    free = {h.name: set(h.devices) for h in pool}
    used = [(a.host, d) for a in p.assignments for d in a.devices]
    assert len(used) == len(set(used)), "a device was given to two workers"
    for a in p.assignments:
        assert set(a.devices) <= free[a.host]
        assert len(a.devices) == k


def test_fewest_hosts_beats_first_listed():
    pool = [gpus("first", 0), gpus("second", 0), gpus("big", 0, 1, 2)]
    p = place(pool, 2, 3, 1)
    assert {a.host for a in p.assignments} == {"big"}


def test_placement_is_a_value():
    assert Placement(reason="x").ok is False
    assert Placement(assignments=(A("a", (0,)),)).ok is True
