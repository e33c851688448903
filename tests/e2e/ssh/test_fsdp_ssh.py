"""A sharded job (examples/elastic_fsdp.py, `ElasticRun(shard=...)`) across real sshd hosts
(tests/sshbed.py, 2 fake GPUs each): grown 1 -> 3 over two hosts and shrunk to 2 in place,
then a member killed with kill -9; the job restarts from its distributed checkpoint (the
hosts share the job's checkpoint directory, as a lab's shared file system would) and ends
as the unsharded single-process run. See tests/e2e/test_fsdp_elastic.py for the tolerance."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from gpuflex.elastic.protocol.keys import SHARDS_LOST_EXIT
from tests.sshbed import bed_cli, ssh_hosts  # noqa: F401 (ssh_hosts: a fixture)
from tests.e2e.test_elastic_jobs import live_members, scale, step_of, wait_for
from tests.e2e.test_fsdp_elastic import ARGS, EXAMPLE, STEPS, B, N, close, reference, resumed_steps
from tests.elastic.run.test_runtime import DEADLINE_S, assert_every_sample_once


@pytest.fixture
def fj(ssh_hosts, home):
    yield from bed_cli(ssh_hosts, home, "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 1\n"
                                        "heartbeat_timeout_s = 3\n\n")


def test_a_sharded_job_across_sshd_hosts_resizes_in_place_and_survives_a_kill(fj, home, tmp_path):
    report, hold = home / "r.json", home / "hold"
    epochs = ["--epochs", "6"]   # 96 steps
    hold.touch()   # the pace held until the restart after the kill; then the job runs out at full speed
    job = fj.submit([sys.executable, str(EXAMPLE), *ARGS, *epochs, "--step-sleep", "0.2", "--sleep-while", str(hold),
                     "--report", str(report)], "--workers", "1:3")
    scale(fj, job["id"], 3)
    grown = wait_for(fj, job["id"], lambda j: step_of(j) >= 6 and j["world_size"] == 3, "steps at world size 3")
    assert len({w["host"] for w in live_members(grown)}) >= 2, grown["workers"]
    survivor = live_members(grown)[0]["pid"]
    scale(fj, job["id"], 2)
    shrunk = wait_for(fj, job["id"], lambda j: step_of(j) >= step_of(grown) + 8 and j["world_size"] == 2,
                      "steps at world size 2")
    assert live_members(shrunk)[0]["pid"] == survivor   # resized in place
    os.kill(live_members(shrunk)[1]["pid"], signal.SIGKILL)
    wait_for(fj, job["id"], lambda j: j["restarts"] == 1 and j["state"] == "running", "the restart after the kill")
    hold.unlink()
    done = fj.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded" and done["restarts"] == 1, done
    assert SHARDS_LOST_EXIT in [w["exit_code"] for w in done["workers"]], done["workers"]
    logs = fj.ok("logs", str(job["id"])).stdout
    (resumed,) = resumed_steps(logs)
    assert resumed > step_of(grown) and "shards restored from" in logs
    r = json.loads(report.read_text())
    assert_every_sample_once(r, N, 3 * STEPS, B)
    close(r["params"], reference(tmp_path, "--no-shard", *epochs))
