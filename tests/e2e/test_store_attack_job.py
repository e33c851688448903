"""A process without the job's secret attacks a running job through its store (issue 17):
it publishes a generation with a fake member, asks for a shrink to one worker, and joins
the forged generation to send a pickle as the state header. The job ignores all three,
its coordinator reports them, and it ends succeeded and exact. Real processes, real gloo,
real TCPStore (the local pool)."""

from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys
import time

from gpuflex.hosts.transport import unix_request
from tests import TESTS
from tests.conftest import db_rows
from tests.e2e.test_elastic_jobs import (DEADLINE_S, assert_matches_reference, ej, example_argv,  # noqa: F401
                                     live_members, reference, step_of, wait_for)

ATTACKER = str(TESTS / "fakes" / "store_attacker.py")

FORK_START = True   # the `ej` fixture's jobs fork their workers from a warm interpreter


def test_a_process_without_the_secret_cannot_forge_a_generation_a_resize_or_state(ej, tmp_path_factory, home):
    report, marker = home / "r.json", home / "pwned"
    job = ej.submit(example_argv(report, epochs=8, sleep=0.05), "--workers", "3")
    running = wait_for(ej, job["id"], lambda j: step_of(j) >= 5 and len(live_members(j)) == 3,
                       "three workers training")
    wids = sorted(w["wid"] for w in live_members(running))
    port, sockets, token = db_rows(home / "g.db", "SELECT store_port, socket_dir, token FROM jobs WHERE id = ?",
                                   (job["id"],))[0]
    attacker_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    p = subprocess.run([sys.executable, ATTACKER, "--store", f"127.0.0.1:{port}", "--marker", str(marker)],
                       capture_output=True, text=True, timeout=120, env=attacker_env)
    assert p.returncode == 0, p.stdout + p.stderr
    did = json.loads(p.stdout.strip().splitlines()[-1])
    assert not marker.exists(), "a worker unpickled the attacker's state header"
    assert did["state"].startswith("no group"), did   # no worker joined the forged generation

    time.sleep(2)   # a few coordinator ticks
    st = unix_request(posixpath.join(sockets, "coord.sock"), {"op": "status"}, timeout=5)
    assert st["ok"], st
    assert st["desired"] == wids and sorted(st["members"]) == wids, st
    assert st["generation"] == did["generation"] - 1            # nothing was published after the forgery
    assert st["forged"]["count"] >= 3, st["forged"]                # generation, latest, two requests
    assert len(live_members(ej.json("status", str(job["id"])))) == 3

    done = ej.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded", done
    assert not marker.exists(), "a worker unpickled the attacker's header"
    r = json.loads(report.read_text())
    assert_matches_reference(r, reference(tmp_path_factory, 8))
    assert {ws for _, _, ws in r["step_log"]} == {3}              # never shrunk, never grew
    coordinator_log = (home / "work" / "jobs" / token / "coordinator.log").read_text()
    for key in (f"members/{did['generation']}", "desired_request"):
        assert f"ignored a forged record at {key}" in coordinator_log, coordinator_log[-3000:]
    forged = [e for e in ej.json("events", str(job["id"])) if e["kind"] == "forged"]
    assert forged and forged[-1]["data"]["count"] >= 3, forged   # recorded as the job's events too
