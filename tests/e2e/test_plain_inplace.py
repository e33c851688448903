"""A plain script submitted as an in-place elastic job (issue 26): one outcome, never a loop.

`gpuflex submit --workers 1:2 -- python train.py` runs in place by default; a script that
never uses gpuflex.elastic never joins the runtime. Its coordinator ends the job at the
formation deadline (forming.py): the signed abort, the record in the run's directory, and
the run's process groups on its host stopped. The job fails with one whole line that names
`--elastic restart`, is never requeued, and comes out the same whether a command ran in
between or not. Real processes on the local pool; the pure parts are in
tests/elastic/coordinator/test_generations.py and tests/policy/test_lifecycle.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuflex.config import HostConfig
from gpuflex.elastic.protocol import run_dir
from gpuflex.elastic.coordinator.forming import never_joined_reason
from gpuflex.elastic.protocol.keys import ABORTED_EXIT, ORPHAN_EXIT
from gpuflex.hosts.hostops import group_alive
from gpuflex.hosts.transport import LocalTransport, SpawnSpec
from tests.conftest import FINAL_STATES, GpuflexCLI, cleanup_jobs, db_rows, py
from tests.e2e.test_gang_jobs import config, local_host

pytestmark = pytest.mark.e2e   # jobs of real workers and coordinators

FORMATION_S = 2
ORPHAN_S = 4       # past the formation deadline: the coordinator decides, then ends itself
GUARD_S = 180      # against a hang only (the job never ends without the fix): never a timing
PLAIN = py("import time\nwhile True:\n    print('step', flush=True)\n    time.sleep(0.2)\n")
ADVICE = "a plain script runs with --elastic restart, or as a fixed-size gang (--workers N without --elastic)"


@pytest.fixture
def pj(home):
    """The local pool (4 CPU slots), a formation deadline and an orphan timeout of seconds."""
    cli = GpuflexCLI(home, config(home, local_host(home), f"formation_timeout_s = {FORMATION_S}\n"
                                                         f"orphan_timeout_s = {ORPHAN_S}\n"))
    yield cli
    cleanup_jobs(cli, home / "g.db")


def until(what: str, done, guard_s: float = GUARD_S):
    end = time.monotonic() + guard_s
    while not (got := done()):
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.2)
    return got


def assert_failed_once(cli: GpuflexCLI, job: dict) -> None:
    """Failed with the whole line, never requeued, one final state event."""
    assert (job["state"], job["exit_code"], job["restarts"]) == ("failed", ABORTED_EXIT, 0), job
    assert job["exit_reason"] == f"aborted: {never_joined_reason(2, FORMATION_S)}", job["exit_reason"]
    assert ADVICE in job["exit_reason"] and "\n" not in job["exit_reason"]
    states = [e for e in cli.json("events", str(job["id"])) if e["kind"] == "state"]
    assert [e["data"]["state"] for e in states].count("failed") == 1, states
    assert not [e for e in states if e["data"].get("cause")], states   # no requeue, for any cause
    assert ADVICE in states[-1]["message"]


def test_with_no_command_in_between_the_coordinator_ends_the_job_and_the_next_command_reads_it(pj, home):
    job = pj.submit(PLAIN, "--workers", "1:2")
    assert (job["elastic"], len(job["workers"])) == ("inplace", 2), job
    jobdir = next((home / "work" / "jobs").iterdir())
    # no gpuflex command: the coordinator alone stops both workers at the deadline, then
    # ends itself (no command for its orphan timeout), leaving its decision behind
    until("the workers' and the coordinator's exit records", lambda: all(
        (jobdir / name).exists() for name in ("worker-0.exit", "worker-1.exit", "coordinator.exit")))
    ends = [json.loads((jobdir / f"worker-{w}.exit").read_text())["returncode"] for w in (0, 1)]
    assert ends == [-signal.SIGTERM] * 2, ends
    assert json.loads((jobdir / "coordinator.exit").read_text())["returncode"] == ORPHAN_EXIT
    assert "step" in (jobdir / "worker-0.log").read_text()   # it ran, as a plain script does
    done = pj.json("status", str(job["id"]))                  # the one command: it reads the record
    assert_failed_once(pj, done)


def test_under_watch_the_job_ends_the_same_way_once(pj, home, db_path):
    job = pj.submit(PLAIN, "--workers", "1:2")
    watch = subprocess.Popen([pj.script, "watch", "--interval", "1d", "--refresh", "0.3", "--json"],
                             env=pj.env(), cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        until("the job to end", lambda: db_rows(db_path, "SELECT state FROM jobs WHERE id = ?",
                                                (job["id"],))[0][0] in FINAL_STATES)
    finally:
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=120)
    assert watch.returncode == 0, err
    assert_failed_once(pj, pj.json("status", str(job["id"])))


# ---- the coordinator's end, on its host ------------------------------------------------------
IGNORES_TERM = "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nopen(sys.argv[1], 'w').close()\ntime.sleep(600)\n"
ENDS = ("import sys, threading\nfrom gpuflex.elastic.coordinator.main import on_end\n"
        "on_end(sys.argv[1], 1.0)(dict(reason='r', cause=sys.argv[2], at=1.0))\n"
        "[t.join() for t in threading.enumerate() if t is not threading.current_thread()]\n")


def spec(base: Path, run: str, name: str, argv: list[str]) -> SpawnSpec:
    return SpawnSpec(argv=argv, cwd=str(base), env={},
                     log=str(base / f"{name}.log"), exit_path=str(base / f"{name}.exit"), socket_dir=run)


@pytest.mark.parametrize("cause,stopped", [("never-joined", True), ("repeated", False)])
def test_the_coordinator_s_end_is_recorded_and_a_plain_script_s_groups_on_its_host_stopped(tmp_path, cause, stopped):
    """Workers that never joined are stopped as a cancel stops them (SIGTERM, the grace,
    SIGKILL but for the supervisor, which records the end); the coordinator's own group is
    spared. gpuflex.elastic workers (any other cause) read the abort and exit by themselves."""
    t = LocalTransport(HostConfig(name="local"))
    run = f"/tmp/gpuflex-test-{os.urandom(8).hex()}"
    ready = tmp_path / "ignoring"
    groups = []
    try:
        groups.append(t.spawn(spec(tmp_path, run, "plain", ["sleep", "600"])).pgid)
        groups.append(t.spawn(spec(tmp_path, run, "stubborn", [sys.executable, "-c", IGNORES_TERM, str(ready)])).pgid)
        until("the SIGTERM handler", ready.exists)
        groups.append(t.spawn(spec(tmp_path, run, "coordinator", [sys.executable, "-c", ENDS,
                                                                  os.path.join(run, "coord.sock"), cause])).pgid)
        until("the coordinator's end", (tmp_path / "coordinator.exit").exists)
        assert json.loads((tmp_path / "coordinator.exit").read_text())["returncode"] == 0
        assert run_dir.parse_abort(Path(run, run_dir.ABORT_RECORD).read_text()) == {"reason": "r", "cause": cause,
                                                                                   "at": 1.0}
        assert os.stat(Path(run, run_dir.ABORT_RECORD)).st_mode & 0o777 == 0o600
        if stopped:
            until("the workers' exit records", lambda: all((tmp_path / f"{n}.exit").exists() for n in ("plain", "stubborn")))
            codes = [json.loads((tmp_path / f"{n}.exit").read_text())["returncode"] for n in ("plain", "stubborn")]
            assert codes == [-signal.SIGTERM, -signal.SIGKILL]
        else:
            assert all(group_alive(g) for g in groups[:2])
    finally:
        for g in groups:
            if group_alive(g):
                os.killpg(g, signal.SIGKILL)
        shutil.rmtree(run, ignore_errors=True)


@pytest.mark.parametrize("text", ["", "{", "[]", '{"reason": ""}', '{"reason": 3}'])
def test_an_abort_record_that_is_not_one_reads_as_none(text):
    assert run_dir.parse_abort(text) is None


def test_an_abort_record_is_read_printable_and_whole_up_to_its_bound():
    reason = "x" * 900 + "\x1b[31m"
    assert run_dir.parse_abort(json.dumps({"reason": reason, "at": True})) == {
        "reason": "x" * 900 + "[31m", "cause": None, "at": None}
