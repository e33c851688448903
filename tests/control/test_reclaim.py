"""gpuflex.control.reclaim's watch of the leavers after a harvest yields GPUs back: each
leaver's exit as it is seen, SIGKILL at its kill time for one still alive, and giving up at
its deadline (simulated process groups behind the transport seam; the whole reclaim on a
real host: tests/e2e/test_harvest_cmd_local.py and tests/e2e/ssh/test_harvest_e2e.py)."""

from __future__ import annotations

import signal
import time

import pytest

from gpuflex.config import load_config
from gpuflex.control import reclaim
from gpuflex.control.pool import Pool
from gpuflex.hosts.transport import ProcStatus, Transport
from tests.conftest import write_config


class Groups(Transport):
    """Process groups by pgid: `ends` maps a pgid to (seconds from now it exits, its code),
    None for one that never exits by itself; a SIGKILL ends one with -9."""

    def __init__(self, host, ends: dict[int, tuple[float, int] | None]) -> None:
        super().__init__(host)
        start = time.time()
        self.exit_at = {p: (start + e[0], e[1]) if e else None for p, e in ends.items()}
        self.killed: list[int] = []

    def status(self, items):
        now = time.time()
        out = []
        for pgid, _ in items:
            end = self.exit_at[pgid]
            done = end is not None and now >= end[0]
            out.append(ProcStatus(alive=not done, exit={"returncode": end[1], "ended_at": end[0]} if done else None))
        return out

    def signal(self, pgids, signum):
        assert signum == signal.SIGKILL
        self.killed += pgids
        self.exit_at.update({p: (time.time(), -9) for p in pgids})
        return [True] * len(pgids)

    def run(self, argv, *, input=None, timeout=None):
        raise AssertionError("not used")

    def control_request(self, path, message, timeout=5.0):
        raise AssertionError("not used")


@pytest.fixture
def watch(home):
    config = load_config(str(write_config(home)))

    def run(ends, leavers):
        groups = {}

        def transport(host):
            groups[host.name] = Groups(host, ends)
            return groups[host.name]

        pool = Pool(config, transport)
        return reclaim.watch_exits(config, pool, leavers), groups["local"]

    return run


def leaver(wid: int, pgid: int, kill_in: float, give_up_in: float) -> reclaim.Leaver:
    now = time.time()
    return reclaim.Leaver(job=1, wid=wid, host="local", gpus=(wid,), pgid=pgid, exit_path=f"/x/{wid}.exit",
                          kill_at=now + kill_in, give_up_at=now + give_up_in)


def test_a_leaver_that_exits_by_itself_is_not_killed(watch):
    out, groups = watch({10: (0.1, 0)}, [leaver(0, 10, kill_in=30, give_up_in=40)])
    exit_ = out[(1, 0)]
    assert (exit_.returncode, exit_.killed, exit_.killed_at) == (0, False, None) and exit_.gone_at is not None
    assert groups.killed == []


def test_one_still_alive_at_its_kill_time_is_killed_and_recorded_so(watch):
    out, groups = watch({10: (0.0, 0), 11: None}, [leaver(0, 10, 30, 40), leaver(1, 11, 0.2, 40)])
    assert groups.killed == [11]
    assert out[(1, 0)].killed is False
    assert (out[(1, 1)].returncode, out[(1, 1)].killed) == (-9, True) and out[(1, 1)].killed_at is not None


def test_one_that_outlives_its_deadline_is_given_up_on(watch, monkeypatch):
    monkeypatch.setattr(reclaim, "POLL_S", 0.01)
    out, groups = watch({12: None}, [leaver(2, 12, kill_in=30, give_up_in=0.1)])
    assert out[(1, 2)] == reclaim.Exit(None, None, False)
    assert groups.killed == []


def test_no_leavers_is_no_watch():
    assert reclaim.watch_exits(None, None, []) == {}
