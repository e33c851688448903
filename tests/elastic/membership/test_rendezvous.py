"""The formation barrier (`Rendezvous.barrier`) against a real TCPStore, with each worker's
own connection and heartbeat thread (tests/elastic/membership/test_liveness.py's Job): a
missing member that still beats is waited for past the timeout (a resize is agreed at the
members' next step boundary, and one may evaluate for longer than that first); one that
stopped beating or crashed fails the barrier. Every wait is bounded."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from gpuflex.elastic.protocol import keys
from tests.elastic.membership.test_liveness import BOUND_S, G, make_job  # noqa: F401

TIMEOUT_S = 0.4   # the barrier's timeout in these tests: a live member is waited for well past it


def barrier_in_thread(job: Any, wid: int, members: list[int]) -> dict[str, Any]:
    """worker `wid` at generation G's formation barrier, in a thread: its outcome lands in the dict."""
    rdzv = job.worker(wid).rdzv
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            rdzv.barrier(G, members, timeout_s=TIMEOUT_S)
            out["result"] = "passed"
        except TimeoutError as e:
            out["result"] = str(e)

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def outcome(run: dict[str, Any]) -> str:
    run["thread"].join(BOUND_S)
    assert not run["thread"].is_alive(), "the barrier did not return (bounded wait)"
    return run["result"]


def test_a_member_busy_past_the_timeout_is_waited_for_while_it_beats(make_job):  # noqa: F811
    job = make_job([0, 1])
    busy = job.worker(0).rdzv   # beats from its heartbeat thread, but is not at the barrier yet
    newcomer = barrier_in_thread(job, 1, [0, 1])
    time.sleep(4 * TIMEOUT_S)
    assert newcomer["thread"].is_alive() and "result" not in newcomer
    busy.barrier(G, [0, 1], timeout_s=TIMEOUT_S)   # it arrives: both pass
    assert outcome(newcomer) == "passed"


@pytest.mark.parametrize("how,expect", [("silent", "worker 0 sent no heartbeat"), ("crashed", "worker 0 crashed")])
def test_a_member_that_stopped_beating_or_crashed_fails_the_barrier(make_job, how, expect):  # noqa: F811
    job = make_job([0, 1])
    gone = job.worker(0).rdzv
    if how == "silent":
        gone.close()   # frozen: its heartbeat stops
    else:
        job.write(keys.crashed(0), json.dumps({"error": "RuntimeError: boom"}))
    result = outcome(barrier_in_thread(job, 1, [0, 1]))
    assert result.startswith(f"generation {G}: members missing at the barrier: ['{keys.joined(G, 0)}']")
    assert expect in result
