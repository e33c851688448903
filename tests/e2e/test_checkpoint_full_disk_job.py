"""A full disk under a running job: every checkpoint write fails, training goes on, each
failure is one event, the job still ends exact. Real processes on the local pool, the
job's directory on a tmpfs too small for one checkpoint (needs root to mount it)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import GpuflexCLI, cleanup_jobs, tmpfs
from tests.e2e.test_elastic_jobs import EXAMPLE, assert_matches_reference, reference

pytestmark = pytest.mark.e2e   # a job of real workers, on a tmpfs

ARGS = ("--hidden", "256", "--global-batch-size", "64", "--seed", "5")   # ~0.6 MB of state
EPOCHS = 3


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "work", "192k") as d:
        yield d


def test_a_full_disk_fails_each_checkpoint_as_an_event_and_the_job_ends_exact(small_disk, home, tmp_path_factory):
    cfg = home / "g.toml"
    cfg.write_text(
        f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
        "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 1\nheartbeat_timeout_s = 3\n\n"
        f'[[hosts]]\nname = "local"\ngpus = "cpu:4"\nworkdir = "{small_disk}"\n')
    cli = GpuflexCLI(home, cfg)
    try:
        report = home / "report.json"
        job = cli.submit([sys.executable, EXAMPLE, *ARGS, "--epochs", str(EPOCHS), "--step-sleep", "0.05",
                          "--report", str(report)], "--workers", "2")
        final = cli.wait_final(job["id"])
        assert final["state"] == "succeeded", cli("logs", str(job["id"])).stdout[-3000:]
        events = cli.json("events", str(job["id"]))
        failed = [e for e in events if e["kind"] == "checkpoint-failed"]
        assert failed, [e["kind"] for e in events]
        assert all("No space left on device" in e["message"] and "training goes on" in e["message"]
                   for e in failed), failed
        counts = [e["data"]["count"] for e in failed]
        assert counts == sorted(set(counts)), "a failure was recorded twice"
        ckpts = list(small_disk.rglob("checkpoints/*"))
        assert not [p for p in ckpts if ".tmp." in p.name], "a partial checkpoint was left behind"
        assert_matches_reference(json.loads(report.read_text()), reference(tmp_path_factory, EPOCHS, ARGS))
    finally:
        cleanup_jobs(cli, home / "g.db")
