"""`make demo`: the elastic example on the built-in kind of pool (local CPU slots, no GPU,
no SSH), shrunk and grown in place while it trains. Prints each gpuflex command it runs.

It uses its own config and database under .demo/ (or --dir) so it never touches a real setup.

The job's length is tied to the demo's resizes, not to a guess of this machine's speed:
while it resizes, the demo holds a file (the example's --sleep-while) that keeps the job to
a step every STEP_SLEEP seconds, so the job cannot reach its last step within STEPS x
STEP_SLEEP seconds (8.5 minutes) of the submit. The demo gives its waits that much time in
all (on a busy machine, the newcomers' start, importing torch, is what takes it), then lets
go of the file and the job runs its remaining steps at full speed. Resizes slower than that
end the demo with a line that says so, never with a job that ended before them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPUFLEX = str(Path(sys.executable).parent / "gpuflex")
EPOCHS = 8
STEPS = EPOCHS * 2048 // 64   # examples/elastic_mlp.py: 2048 samples, a global batch of 64
STEP_SLEEP = 2.0
FINAL = ("succeeded", "failed", "cancelled", "timeout")


class Demo:
    def __init__(self, where: Path) -> None:
        self.where = where
        self.deadline = math.inf   # the resizes' time is up (monotonic)

    def gpuflex(self, *args: str, show: bool = True, check: bool = True) -> subprocess.CompletedProcess:
        if show:
            print(f"\n$ gpuflex {' '.join(args)}", flush=True)
        p = subprocess.run([GPUFLEX, *args], capture_output=True, text=True,
                           env={**os.environ, "GPUFLEX_CONFIG": str(self.where / "gpuflex.toml"), "COLUMNS": "120"})
        if show:
            sys.stdout.write(p.stdout)
            sys.stderr.write(p.stderr)
        if check and p.returncode != 0:
            sys.exit(f"demo: 'gpuflex {' '.join(args)}' failed with exit code {p.returncode}")
        return p

    def status(self, job: str) -> dict:
        return json.loads(self.gpuflex("status", job, "--json", show=False).stdout)

    def left(self) -> int:
        """Whole seconds left for the resizes; the demo ends here when none are."""
        s = int(self.deadline - time.monotonic())
        if s < 1:
            sys.exit(f"demo: the resizes took more than the {STEPS * STEP_SLEEP:.0f} s the job is held for")
        return s

    def scale(self, job: str, n: int) -> None:
        self.gpuflex("scale", job, str(n), "--wait", "--timeout", str(self.left()))

    def wait_steps(self, job: str, steps: int) -> None:
        while (self.status(job).get("step") or 0) < steps:
            self.left()
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=ROOT / ".demo", help="its config, database and job files")
    demo = Demo(ap.parse_args(argv).dir.resolve())
    where = demo.where
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    (where / "gpuflex.toml").write_text(
        f'[database]\nurl = "sqlite:///{where}/gpuflex.db"\n\n[jobs]\ncheckpoint_interval_s = 5\n\n'
        f'[[hosts]]\nname = "local"\naddress = "local"\ngpus = "cpu:4"\nworkdir = "{where}/work"\n')
    report, hold = where / "report.json", where / "hold"
    hold.touch()
    try:
        demo.deadline = time.monotonic() + STEPS * STEP_SLEEP   # before the submit: the job's first step is later
        out = demo.gpuflex("submit", "--name", "mlp", "--workers", "1:4", "--json", "--",
                           sys.executable, str(ROOT / "examples" / "elastic_mlp.py"), "--epochs", str(EPOCHS),
                           "--step-sleep", str(STEP_SLEEP), "--sleep-while", str(hold), "--report", str(report),
                           show=False)
        job = str(json.loads(out.stdout)["id"])
        print(f"submitted the elastic MLP example as job {job} (1:4 workers on 4 local CPU slots), "
              f"a step every {STEP_SLEEP:g} s while the demo resizes it")
        demo.scale(job, 2)      # shrink: two leave at a step boundary
        demo.wait_steps(job, 3)
        demo.gpuflex("status", job)
        demo.scale(job, 4)      # grow: two newcomers start, then join in place
        demo.scale(job, 1)      # shrink: three leave
        demo.scale(job, 3)
    finally:
        hold.unlink(missing_ok=True)
    print("\nresizes done: the job runs its remaining steps at full speed")
    deadline = time.monotonic() + 600
    while demo.status(job)["state"] not in FINAL:
        if time.monotonic() > deadline:
            demo.gpuflex("cancel", job)
            break
        time.sleep(1)
    demo.gpuflex("status")
    demo.gpuflex("events", job)
    final = demo.status(job)
    r = json.loads(report.read_text())
    sizes = [ws for _, _, ws in r["step_log"]]
    changes = [ws for i, ws in enumerate(sizes) if i == 0 or sizes[i - 1] != ws]
    once = all(sorted(v) == list(range(len(v))) for v in r["samples"].values()) and len(r["samples"]) == r["epochs"]
    print(f"\njob {job} {final['state']}: {r['steps']} steps, world sizes over time {changes}, "
          f"every sample of each of {r['epochs']} epochs processed exactly once: {once}")
    sys.exit(0 if final["state"] == "succeeded" and once else 1)


if __name__ == "__main__":
    main()
