"""`submit --image` (issue 33): workers in podman containers, on the local pool.

A gang of two prints what it sees inside (the container's marker, its working directory,
gpuflex's environment contract) and exits 0, then one exits 3: each exit code recorded
through the supervisor, whose child the engine's client is. A cancel's SIGTERM reaches the
command through the engine and its init; a command that ignores it is killed with its
container after the grace. An in-place job resizes 1 -> 2 with both workers in containers
(the host's network: the job's store and process group). The image and this machine's
podman words come from tests/podbed.py; the command lines themselves are
tests/hosts/test_container.py's.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows, py, wait_for
from tests.e2e.test_elastic_jobs import example_argv, live_members, scale
from tests.e2e.test_gang_jobs import config
from tests.podbed import PodmanBed, podman_bed  # noqa: F401 (a fixture)

pytestmark = pytest.mark.e2e   # jobs of real workers and coordinators, in containers

SHOW = py("import json, os\n"
          "print('SEEN', json.dumps({'container': os.path.exists('/run/.containerenv'), 'cwd': os.getcwd(),\n"
          "      'rank': os.environ.get('RANK'), 'world': os.environ.get('WORLD_SIZE'),\n"
          "      'job': os.environ.get('GPUFLEX_JOB_ID'), 'lr': os.environ.get('LR')}), flush=True)\n"
          "raise SystemExit(int(os.environ.get('CODE', '0')))\n")


@pytest.fixture
def cj(home, podman_bed: PodmanBed):
    cli = GpuflexCLI(home, config(home, podman_bed.host_toml(home),
                                  "checkpoint_interval_s = 1\nheartbeat_timeout_s = 3\n"))
    yield cli
    cleanup_jobs(cli, home / "g.db")


def seen(cli: GpuflexCLI, job_id: int) -> list[dict]:
    out = cli.ok("logs", str(job_id)).stdout
    return sorted((json.loads(line.split("SEEN ", 1)[1]) for line in out.splitlines() if "SEEN " in line),
                  key=lambda s: s["rank"])


def containers_of(pgids: list[int]) -> list[str]:
    names = "|".join(f"gpuflex-g{p}" for p in pgids)
    p = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", f"name=^({names})$"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_a_gang_runs_in_containers_and_its_exit_codes_are_recorded(cj, home, podman_bed):
    job = cj.submit(SHOW, "--workers", "2", "--image", podman_bed.image, "--env", "LR=3e-4")
    assert job["image"] == podman_bed.image
    done = cj.wait_final(job["id"])
    assert (done["state"], done["exit_code"]) == ("succeeded", 0), done
    assert seen(cj, job["id"]) == [{"container": True, "cwd": str(home), "rank": str(r), "world": "2",
                                    "job": str(job["id"]), "lr": "3e-4"} for r in (0, 1)]
    assert f"image: {podman_bed.image}" in cj.ok("status", str(job["id"])).stdout
    failing = cj.submit(SHOW, "--image", podman_bed.image, "--env", "CODE=3")
    done = cj.wait_final(failing["id"])
    assert (done["state"], done["exit_code"]) == ("failed", 3), done
    assert db_rows(home / "g.db", "SELECT exit_code FROM workers WHERE job_id = ?", (failing["id"],)) == [(3,)]
    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers")]
    assert containers_of(pgids) == []   # --rm


def test_cancel_reaches_the_command_and_kills_a_container_that_ignores_it(cj, home, podman_bed):
    stubborn = py("import signal, time\n"
                  "signal.signal(signal.SIGTERM, lambda *a: print('got SIGTERM, staying', flush=True))\n"
                  "print('up', flush=True)\n"
                  "while True:\n    time.sleep(0.2)\n")
    job = cj.submit(stubborn, "--image", podman_bed.image)
    wait_for(cj, job["id"], lambda j: "up" in cj.ok("logs", str(j["id"])).stdout, "the command to start")
    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers")]
    assert len(containers_of(pgids)) == 1
    cj.ok("cancel", str(job["id"]))
    assert cj.wait_final(job["id"])["state"] == "cancelled"
    assert "got SIGTERM, staying" in cj.ok("logs", str(job["id"])).stdout   # through the engine's client
    assert containers_of(pgids) == []   # the SIGKILL after the grace reached the container too


def test_an_in_place_job_resizes_from_one_to_two_in_containers(cj, home, podman_bed):
    report, hold = home / "r.json", home / "hold"
    hold.touch()
    job = cj.submit(example_argv(report, epochs=4, sleep=0.3, hold=hold), "--workers", "1:2",
                    "--image", podman_bed.image)
    scale(cj, job["id"], 1)
    wait_for(cj, job["id"], lambda j: (j.get("step") or 0) >= 3, "some steps at world size 1")
    scale(cj, job["id"], 2)
    running = cj.json("status", str(job["id"]))
    assert running["world_size"] == 2 and len(live_members(running)) == 2
    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers WHERE state = 'running'")]
    assert len(pgids) == 2 and len(containers_of(pgids)) == 2
    hold.unlink()
    done = cj.wait_final(job["id"])
    assert done["state"] == "succeeded", done
    assert json.loads(report.read_text())["steps"] > 0
