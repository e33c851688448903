"""`make demo`: the elastic example on the built-in kind of pool (local CPU slots, no GPU,
no SSH), grown and shrunk in place while it trains. Prints each gpuflex command it runs.

It uses its own config and database under .demo/ so it never touches a real setup.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / ".demo"
GPUFLEX = str(Path(sys.executable).parent / "gpuflex")


def gpuflex(*args: str, show: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    if show:
        print(f"\n$ gpuflex {' '.join(args)}", flush=True)
    p = subprocess.run([GPUFLEX, *args], capture_output=True, text=True,
                       env={**os.environ, "GPUFLEX_CONFIG": str(DEMO / "gpuflex.toml"), "COLUMNS": "120"})
    if show:
        sys.stdout.write(p.stdout)
        sys.stderr.write(p.stderr)
    if check and p.returncode != 0:
        sys.exit(f"demo: 'gpuflex {' '.join(args)}' failed with exit code {p.returncode}")
    return p


def status(job: str) -> dict:
    return json.loads(gpuflex("status", job, "--json", show=False).stdout)


def wait_steps(job: str, steps: int) -> None:
    deadline = time.monotonic() + 300
    while (status(job).get("step") or 0) < steps:
        if time.monotonic() > deadline:
            sys.exit(f"demo: job {job} made no progress")
        time.sleep(0.5)


def main() -> None:
    if DEMO.exists():
        shutil.rmtree(DEMO)
    DEMO.mkdir()
    (DEMO / "gpuflex.toml").write_text(
        f'[database]\nurl = "sqlite:///{DEMO}/gpuflex.db"\n\n[jobs]\ncheckpoint_interval_s = 5\n\n'
        f'[[hosts]]\nname = "local"\naddress = "local"\ngpus = "cpu:4"\nworkdir = "{DEMO}/work"\n')
    report = DEMO / "report.json"
    out = gpuflex("submit", "--name", "mlp", "--workers", "1:4", "--json", "--",
                  sys.executable, str(ROOT / "examples" / "elastic_mlp.py"), "--epochs", "16",
                  "--step-sleep", "0.05", "--report", str(report), show=False)
    job = str(json.loads(out.stdout)["id"])
    print(f"submitted the elastic MLP example as job {job} (1:4 workers on 4 local CPU slots)")
    gpuflex("scale", job, "2", "--wait")
    wait_steps(job, 20)
    gpuflex("status", job)
    gpuflex("scale", job, "4", "--wait")      # grow: two newcomers warm up, then join in place
    gpuflex("scale", job, "1", "--wait")      # shrink: three leave at a step boundary
    gpuflex("scale", job, "3", "--wait")
    deadline = time.monotonic() + 600
    while status(job)["state"] not in ("succeeded", "failed", "cancelled"):
        if time.monotonic() > deadline:
            gpuflex("cancel", job)
            break
        time.sleep(1)
    gpuflex("status")
    gpuflex("events", job)
    final = status(job)
    r = json.loads(report.read_text())
    sizes = [ws for _, _, ws in r["step_log"]]
    changes = [ws for i, ws in enumerate(sizes) if i == 0 or sizes[i - 1] != ws]
    print(f"\njob {job} {final['state']}: {r['steps']} steps, world sizes over time {changes}, "
          f"every sample of each of {r['epochs']} epochs processed exactly once: "
          f"{all(sorted(v) == list(range(len(v))) for v in r['samples'].values())}")
    sys.exit(0 if final["state"] == "succeeded" else 1)


if __name__ == "__main__":
    main()
