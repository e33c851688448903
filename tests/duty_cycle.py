"""A worker made slower from outside, as a GPU it shares with another process makes it:
SIGSTOP and SIGCONT in turns, so that it gets about 1 / (1 + ratio) of the time it would
have. The runtime sees it only as the compute time it measures for its steps
(run/context.py), so the speed split re-plans without the script knowing (the bitwise CNN
and LM scripts stay unchanged).

The turns are counted in the process's runnable time (on a CPU or waiting for one:
/proc/PID/schedstat), not in wall-clock time: the process runs until it has been
runnable for `run_s`, then stays stopped for `ratio` times as long as that took. Wall-clock
turns failed on this 2-core machine under other tests' load: a stop spent while the process
only waited for a CPU anyway, or slept between steps, cost it nothing, and a worker stopped
2/3 of the time came out the fastest of three. Counted this way, a stop follows only time
the process wanted a CPU, so it is about (1 + ratio) times slower than its peers whatever
the load, and never stopped while it sleeps.

A stop lasts at most MAX_STOP_S, far below the job's heartbeat and process-group timeouts
(seconds): a slower member, never a fault. The cycler runs as its own process
(`duty_cycled`), not as a thread of the test, whose in-process status polls would hold the
GIL through its turns. It is bounded three ways: the test's `finally:` ends it (SIGTERM)
and sends SIGCONT itself; it ends by itself after `limit_s`, when the process it slows is
gone, or when its parent (the test) is; and every way out of its loop passes its own
`finally:`, which sends SIGCONT.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

MAX_STOP_S = 0.25   # one stop at most; heartbeats time out after seconds
POLL_S = 0.001


def check(run_s: float, ratio: float, limit_s: float) -> None:
    """Raise ValueError naming the bad value."""
    if not 0 < run_s <= MAX_STOP_S:
        raise ValueError(f"run_s must be in (0, {MAX_STOP_S}] seconds, got {run_s!r}")
    if not 0 < ratio <= 10:
        raise ValueError(f"ratio must be in (0, 10], got {ratio!r}")
    if not limit_s > 0:
        raise ValueError(f"limit_s must be > 0, got {limit_s!r}")


def runnable_s(pid: int) -> float:
    """Seconds the process's main thread has been on a CPU or waiting for one (the first two
    fields of its schedstat, in nanoseconds). The main thread is the training loop's, and
    bitwise mode runs one intra-op thread; reading every thread's file at each poll cost
    the cycler a tenth of a core here."""
    with open(f"/proc/{pid}/schedstat") as f:   # FileNotFoundError: the process is gone
        on_cpu, waiting, _ = f.read().split()
    return (int(on_cpu) + int(waiting)) / 1e9


def resume(pid: int) -> None:
    """SIGCONT `pid` (nothing if it is gone): a process is never left stopped."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


class _Ended(Exception):
    """SIGTERM or SIGINT: leave the loop through its finally."""


def _ended(signum, frame) -> None:
    raise _Ended(signum)


def cycle(pid: int, run_s: float, ratio: float, limit_s: float) -> tuple[int, float]:
    """The loop (the cycler process's main). Returns (stops made, seconds stopped)."""
    check(run_s, ratio, limit_s)
    parent, end, stops, stopped = os.getppid(), time.monotonic() + limit_s, 0, 0.0
    signal.signal(signal.SIGTERM, _ended)
    signal.signal(signal.SIGINT, _ended)
    try:
        mark = runnable_s(pid)
        while time.monotonic() < end and os.getppid() == parent:
            time.sleep(POLL_S)
            now = runnable_s(pid)
            if now - mark < run_s:
                continue
            pause = min(ratio * (now - mark), MAX_STOP_S)
            os.kill(pid, signal.SIGSTOP)
            stops, stopped = stops + 1, stopped + pause
            time.sleep(pause)
            os.kill(pid, signal.SIGCONT)
            mark = runnable_s(pid)
    except (_Ended, ProcessLookupError, FileNotFoundError):
        pass
    finally:
        resume(pid)
    return stops, stopped


@contextlib.contextmanager
def duty_cycled(pid: int, run_s: float = 0.002, ratio: float = 3.0,
                limit_s: float = 120.0) -> Iterator[subprocess.Popen]:
    """Process `pid` slower by about 1 + `ratio` while the block runs, and for at most
    `limit_s`; resumed on the way out, whatever ends the block. The default ratio, 3, made
    a busy process 3.1 times slower than two unthrottled peers at a load average of 12 on
    this 2-core machine (2 made it 2.3 times slower: a process back from a stop gets a CPU
    sooner than its peers)."""
    check(run_s, ratio, limit_s)
    cycler = subprocess.Popen([sys.executable, __file__, str(pid), str(run_s), str(ratio), str(limit_s)])
    try:
        yield cycler
    finally:
        cycler.terminate()
        try:
            cycler.wait(timeout=10)
        except subprocess.TimeoutExpired:
            cycler.kill()
            cycler.wait()
        resume(pid)   # the cycler's own finally did, unless it was killed between a stop and its SIGCONT


if __name__ == "__main__":
    _pid, _run, _ratio, _limit = sys.argv[1:]
    cycle(int(_pid), float(_run), float(_ratio), float(_limit))
