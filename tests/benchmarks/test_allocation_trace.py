"""benchmarks/allocation_trace.py on a short trace (issue 32): the real plan under the three
policies on a simulated clock, no processes. Invariants only, no figure written down:
every job completes, the same seed gives the same figures, and no user's share under
fair or throughput falls below SHARE_BOUND of their max-min fair share: a floor, far
below the day-long trace's spread (docs/benchmarks.md), that a policy starving a user
would break (static sizes promise nothing about shares)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "allocation_trace.py"
SHARE_BOUND = 0.5


@pytest.fixture(scope="module")
def trace():
    spec = importlib.util.spec_from_file_location("allocation_trace", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["allocation_trace"] = mod    # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(trace):
    return trace.run_all(hours=9, seed=3, hosts=2, gpus=4)


def test_every_job_completes_under_each_policy(results):
    assert [r["policy"] for r in results] == ["static", "fair", "throughput"]
    for r in results:
        assert r["jobs"] > 0 and r["completed"] == r["jobs"], r["policy"]
        assert math.isfinite(r["avg_jct_h"]) and r["p90_jct_h"] >= 0 and 0 < r["utilisation"] <= 1


def test_no_users_share_falls_below_the_bound(results):
    for r in results[1:]:      # static sizes promise nothing about shares
        assert min(r["share"].values()) >= SHARE_BOUND, (r["policy"], r["share"])


def test_the_same_seed_gives_the_same_figures_and_another_seed_another_trace(trace, results):
    assert trace.run_all(hours=9, seed=3, hosts=2, gpus=4) == results
    assert trace.run_all(hours=9, seed=4, hosts=2, gpus=4) != results


def test_the_report_prints_every_policy_and_both_ratios(trace, results):
    text = trace.report(results)
    assert "throughput vs static: avg JCT x" in text and "throughput vs fair: avg JCT x" in text
    assert all(f"share of fair {u}" in text for u in trace.USERS)


def test_the_seeds_report_has_a_line_a_seed_and_counts_the_goals_met(trace, results):
    other = trace.run_all(hours=9, seed=4, hosts=2, gpus=4)
    text = trace.seeds_report([(3, results), (4, other)])
    lines = text.splitlines()
    assert lines[1].split()[0] == "3" and lines[2].split()[0] == "4" and len(lines) == 4
    assert lines[-1].startswith("goals met on 2 seeds: JCT vs static ")
    t, s = results[2], results[0]
    assert f"x{t['avg_jct_h'] / s['avg_jct_h']:.2f}" in lines[1]


def test_the_share_measure_is_max_min_fair(trace):
    """The measure's fair share is the policy's own (gpuflex.policy.shares): a user who could
    use 8 of 12 GPUs beside one who could use 2 is owed 8. The script's own split stopped
    early and owed them 6, flattering every policy's share."""
    assert trace.fair_shares({"ann": 2, "cho": 8}, 12) == {"ann": 2.0, "cho": 8.0}
