"""A job script's `#SBATCH --time` ends its job (issue 33: the directive was ignored, and the
job ran its whole 12 s). The parsing and the mapping are unit-tested in tests/test_jobscript.py
and tests/cli/test_job_settings.py; this is the one check with real workers."""

from __future__ import annotations

import json


def test_an_sbatch_time_limit_in_a_script_ends_the_job_at_that_limit(gf, home):
    script = home / "sleepy.sh"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=sleepy\n#SBATCH --time=00:00:05\n"
                      "echo started\nsleep 12\necho not reached\n")
    script.chmod(0o755)
    job = json.loads(gf.ok("submit", "--json", "sleepy.sh").stdout)
    assert (job["name"], job["time_limit_s"], job["argv"]) == ("sleepy", 5, ["./sleepy.sh"])
    assert job["sources"]["time"] == "#SBATCH" and job["sources"]["workers"] == "default"
    done = gf.wait_final(job["id"])
    assert done["state"] == "timeout" and done["exit_reason"] == "time limit 00:00:05 reached", done
    log = gf.ok("logs", str(job["id"])).stdout
    assert "started" in log and "not reached" not in log
