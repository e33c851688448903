"""Per-job environments with real workers (issue 33): a job in a venv made here runs that
venv's python after its --env-setup ran on the host; a failing --env-setup fails the job
naming the host, the exit code and its output's last lines. The command and environment
building is unit-tested in tests/test_jobenv.py, the refusals in tests/cli/test_submit_env.py."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = "import os, shutil, sys; print('prefix', sys.prefix); print('which', shutil.which('python'))"


def test_a_venv_job_runs_the_venvs_python_after_its_setup(gf, home):
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    job = gf.submit(["python", "-c", PROBE], "--venv", str(venv),
                    "--env-setup", "echo \"$VIRTUAL_ENV\" > setup-marker.txt; echo setup said hello")
    assert (job["venv"], job["python"], job["conda"]) == (str(venv), None, None)
    done = gf.wait_final(job["id"])
    assert done["state"] == "succeeded", done
    out = gf.ok("logs", str(job["id"])).stdout
    assert f"prefix {venv}" in out and f"which {venv}/bin/python" in out, out
    assert (home / "setup-marker.txt").read_text() == f"{venv}\n"   # in the job's directory, its environment
    ready = [e for e in gf.json("events", str(job["id"])) if e["kind"] == "env-ready"]
    assert len(ready) == 1 and ready[0]["data"]["host"] == "local", ready
    assert ready[0]["data"]["tail"] == "setup said hello"
    header, said = gf.ok("logs", str(job["id"]), "--setup").stdout.split("\n", 1)   # a line per run, then its output
    assert header.startswith("== gpuflex: env-setup at ") and said == "setup said hello\n"


def test_a_failing_setup_fails_the_job_with_its_exit_code_and_output(gf, home):
    p = gf("submit", "--json", "--env-setup", "echo first; echo broken mirror >&2; exit 3", "--", "python", "-c",
           "print('never')")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr   # the launch at submit failed it
    done = gf.wait_final(json.loads(p.stdout)["id"])
    assert done["state"] == "failed", done
    reason = done["exit_reason"]
    assert reason.startswith("local: cannot start the job: --env-setup exited with code 3 (all of it: local:"), reason
    assert reason.endswith("its last lines:\nfirst\nbroken mirror"), reason
    assert done["restarts"] == 0 and not any(w["pid"] for w in done["workers"])
    assert gf.ok("logs", str(done["id"]), "--setup").stdout.endswith("\nfirst\nbroken mirror\n")
