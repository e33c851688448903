"""benchmarks/soak.py's pure parts: the seeded schedule repeats for a seed and stays within
its bounds (time, owners, arguments), and the not-training figure reads a step log as its
docstring says. No processes: the soak itself is a benchmark, not a test."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter

import pytest

from tests import REPO

_SPEC = importlib.util.spec_from_file_location("soak", REPO / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("soak", soak)   # dataclasses look their module up by name
_SPEC.loader.exec_module(soak)


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_a_seed_gives_the_same_bounded_schedule(seed):
    minutes = 10
    plan = soak.make_schedule(seed, minutes)
    assert plan == soak.make_schedule(seed, minutes)
    assert plan != soak.make_schedule(seed + 1, minutes)
    assert [p.at for p in plan] == sorted(p.at for p in plan)
    assert all(0 < p.at <= minutes * 60 for p in plan)
    assert len(plan) <= 2 * minutes * 60 / soak.GAP_S[0] + 1
    assert set(p.action for p in plan) <= set(soak.WEIGHTS) - {"owner"} | {"owner_arrive", "owner_leave"}
    held: set[tuple[str, int]] = set()
    for p in plan:       # leaves sort before an arrival at the same GPU; never more than MAX_OWNED
        gpu = (p.args.get("host"), p.args.get("gpu"))
        if p.action == "owner_arrive":
            assert gpu in soak.GPUS and gpu not in held
            held.add(gpu)
            assert len(held) <= soak.MAX_OWNED
        elif p.action == "owner_leave":
            held.remove(gpu)
        elif p.action in ("scale", "kill_scale"):
            assert soak.MIN_WORKERS <= p.args["n"] <= soak.MAX_WORKERS
    assert held == set()     # every owner leaves by the end
    arrivals = [p for p in plan if p.action == "owner_arrive"]
    leaves = {(p.args["host"], p.args["gpu"], p.at) for p in plan if p.action == "owner_leave"}
    assert len(arrivals) == len(leaves)


def test_a_long_schedule_holds_every_kind_of_action():
    kinds = Counter(p.action for p in soak.make_schedule(3, 30))
    assert set(kinds) == set(soak.WEIGHTS) - {"owner"} | {"owner_arrive", "owner_leave"}
    assert kinds["owner_arrive"] == kinds["owner_leave"]


def test_not_training_counts_the_start_and_the_long_gaps_less_a_step():
    log = [[i, 100.0 + 10 + 0.5 * i, 2] for i in range(10)]          # first step 10 s after submit
    log += [[10 + i, log[-1][1] + 20 + 0.5 * i, 3] for i in range(10)]  # a 20 s gap, then steady again
    nt = soak.not_training(log, started=100.0)
    assert nt["median_step_s"] == 0.5 and nt["first_step_s"] == 10.0
    assert nt["gaps"] == [(log[9][1], 19.5)]
    assert nt["total_s"] == 29.5
    assert soak.not_training([], 0.0)["total_s"] is None
