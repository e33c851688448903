"""tests/duty_cycle.py, the cycler that slows a worker from outside (the bitwise jobs'
re-splits): it stops the process it is given, and never leaves it stopped, whatever ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.duty_cycle import check, duty_cycled

pytestmark = pytest.mark.e2e   # a busy child process and the cycler's own

BUSY = "while True:\n    sum(range(10000))\n"


def state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2]


def seen_stopped(pid: int, deadline_s: float = 30.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if state(pid) == "T":
            return True
        time.sleep(0.0005)
    return False


@pytest.fixture
def busy():
    p = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("run_s, ratio, limit_s, word", [
    (0, 3, 10, "run_s"), (1.0, 3, 10, "run_s"), (0.002, 0, 10, "ratio"), (0.002, 11, 10, "ratio"),
    (0.002, 3, 0, "limit_s")])
def test_slices_it_cannot_keep_are_refused_before_anything_starts(run_s, ratio, limit_s, word):
    with pytest.raises(ValueError, match=word):
        check(run_s, ratio, limit_s)
    with pytest.raises(ValueError, match=word):
        with duty_cycled(os.getpid(), run_s, ratio, limit_s):
            pytest.fail("the block ran")


def test_it_stops_a_busy_process_and_resumes_it_even_when_killed_mid_stop(busy):
    with duty_cycled(busy.pid) as cycler:
        assert seen_stopped(busy.pid), "the busy process was never seen stopped"
        os.kill(busy.pid, signal.SIGSTOP)   # as if the cycler died between a stop and its SIGCONT
        cycler.kill()
        cycler.wait()
    assert state(busy.pid) != "T"
    assert busy.poll() is None


def test_it_ends_by_itself_at_its_limit_and_when_its_process_is_gone(busy):
    with duty_cycled(busy.pid, limit_s=0.5) as cycler:
        assert cycler.wait(timeout=60) == 0   # not ended by the block: the limit
        assert state(busy.pid) != "T"
    other = subprocess.Popen([sys.executable, "-c", BUSY])
    with duty_cycled(other.pid) as cycler:
        assert seen_stopped(other.pid)
        other.kill()
        other.wait()
        assert cycler.wait(timeout=60) == 0   # the process it slowed is gone
