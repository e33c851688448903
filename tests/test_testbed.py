"""gpuflex.testbed: the mixed-GPU test bed's simulated device time (issue 12)."""

from __future__ import annotations

import argparse

import pytest

from gpuflex import testbed
from gpuflex.elastic.protocol.env import GPUS, SLOTS


def test_slow_slots_are_read_as_slot_factor_pairs():
    assert testbed.slow_slots("2=3, 5=1.5,") == {2: 3.0, 5: 1.5}
    assert testbed.slow_slots("") == {}


@pytest.mark.parametrize("text", ["2", "a=1", "2=x", "2=0", "2=-1"])
def test_a_bad_slow_slot_is_refused_with_what_was_expected(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected SLOT=FACTOR"):
        testbed.slow_slots(text)


def test_a_worker_is_as_slow_as_its_slowest_slot(monkeypatch):
    monkeypatch.setenv(SLOTS, "1,2")
    assert testbed.slowdown({2: 3.0, 7: 9.0}) == 3.0
    assert testbed.slowdown({7: 9.0}) == 1.0


def test_on_a_gpu_host_the_workers_own_gpus_count(monkeypatch):
    monkeypatch.delenv(SLOTS, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv(GPUS, "5")
    assert testbed.slowdown({4: 2.0, 5: 6.0}) == 6.0


def test_the_options_and_the_time_spent(monkeypatch):
    ap = argparse.ArgumentParser()
    testbed.add_device_args(ap)
    args = ap.parse_args(["--device-work-s", "0.5", "--slow-slots", "0=2"])
    assert (args.device_work_s, args.slow_slots) == (0.5, {0: 2.0})
    slept = []
    monkeypatch.setattr(testbed.time, "sleep", slept.append)
    monkeypatch.setattr(testbed, "_factor", [])
    monkeypatch.setenv(SLOTS, "0")
    testbed.device_work(args, 3)
    testbed.device_work(args, 0)
    assert slept == [0.5 * 2.0 * 3]
