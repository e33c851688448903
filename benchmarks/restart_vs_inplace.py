"""Restart against in place: the stall of a restart-elastic resize (`--elastic restart`:
SIGTERM, checkpoint, the whole gang started again at the new size, which loads the
checkpoint) against an in-place one (gpuflex.elastic: newcomers warm up beside the
running job, the state is copied at a step boundary) of the same model, side by side in
one run, both resized 3 -> 2 -> 3 on a local CPU-slot pool.

Stall = the gap between the two steps around the world-size change minus the median step
time at the new world size (benchmarks/common.stalls), from each run's own step log: the
in-place job's report (examples/elastic_mlp.py), the restart job's --steps-file
(examples/restart/ddp_ckpt.py, rank 0 appends a line per step). The restart's "down"
figure is the control side's part of it (the "restart" event's down_s: SIGTERM sent ->
new gang spawned); the rest is the new processes' start-up (interpreter, torch, process
group) and the checkpoint load.
Run: .venv/bin/python benchmarks/restart_vs_inplace.py [--sizes 4e6,100e6] [--events 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EXAMPLE, ROOT, Gpuflex, hidden_for, median, state_bytes, stalls  # noqa: E402

RESTART_EXAMPLE = ROOT / "examples" / "restart" / "ddp_ckpt.py"


def inplace_run(tmp: Path, hidden: int, events: int, sleep: float) -> tuple[float, list]:
    gf = Gpuflex(tmp / "inplace", slots=3)
    report = tmp / "inplace" / "report.json"
    job = str(json.loads(gf("submit", "--elastic", "inplace", "--workers", "2:3", "--json",
                            "--env", "OMP_NUM_THREADS=1", "--", sys.executable, str(EXAMPLE),
                            "--hidden", str(hidden), "--epochs", "10000", "--step-sleep", str(sleep),
                            "--report", str(report)))["id"])
    gf.wait_steps(job, 8)
    for _ in range(events):
        gf("scale", job, "2", "--wait")
        gf.wait_steps(job, 8)
        gf("scale", job, "3", "--wait")
        gf.wait_steps(job, 8)
    gf("cancel", job)
    gf.wait_workers_gone(job)
    return stalls(json.loads(report.read_text())["step_log"])


def restart_run(tmp: Path, hidden: int, events: int, sleep: float) -> tuple[float, list, list]:
    gf = Gpuflex(tmp / "restart", slots=3)
    log = tmp / "restart" / "steps.log"

    def lines() -> list[list[float]]:
        return [list(map(float, ln.split())) for ln in log.read_text().splitlines() if ln.strip()] \
            if log.exists() else []

    def wait(world: int, more: int, timeout: float = 600) -> None:
        """Until `more` steps at `world` were logged after the ones there now."""
        start, end = len(lines()), time.monotonic() + timeout
        while sum(1 for ln in lines()[start:] if ln[2] == world) < more:
            if time.monotonic() > end:
                raise RuntimeError(f"the restart job logged no {more} steps at {world} worker(s) in {timeout} s")
            time.sleep(0.5)

    job = str(json.loads(gf("submit", "--elastic", "restart", "--workers", "2:3", "--json",
                            "--env", "OMP_NUM_THREADS=1", "--", sys.executable, str(RESTART_EXAMPLE),
                            "--hidden", str(hidden), "--epochs", "10000", "--step-sleep", str(sleep),
                            "--ckpt-dir", str(tmp / "restart" / "ckpt"), "--ckpt-every", "20",
                            "--steps-file", str(log)))["id"])
    wait(3, 8)
    for _ in range(events):
        gf("scale", job, "2")
        wait(2, 8)
        gf("scale", job, "3")
        wait(3, 8)
    down = [e["data"]["down_s"] for e in json.loads(gf("events", job, "--json")) if e["kind"] == "restart"]
    gf("cancel", job)
    gf.wait_workers_gone(job)
    med, st = stalls(lines())
    return med, st, down


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4e6,100e6", help="state sizes in bytes")
    ap.add_argument("--events", type=int, default=1, help="shrink+grow pairs per run")
    args = ap.parse_args()
    rows = []
    for size in [float(s) for s in args.sizes.split(",")]:
        hidden = hidden_for(size)
        sleep = 0.05 if size < 20e6 else 0.0
        with tempfile.TemporaryDirectory(prefix="gpuflex-bench-") as t:
            tmp = Path(t)
            i_med, i_st = inplace_run(tmp, hidden, args.events, sleep)
            r_med, r_st, down = restart_run(tmp, hidden, args.events, sleep)
        mb = state_bytes(hidden) / 1e6
        print(f"\nstate {mb:.1f} MB (hidden {hidden}): median step in place {i_med * 1000:.0f} ms, "
              f"restart {r_med * 1000:.0f} ms")
        for kind, a, b, s in i_st:
            print(f"  in place {kind:6s} {a}->{b}: stall {s:.3f} s")
        for (kind, a, b, s), d in zip(r_st, down):
            print(f"  restart  {kind:6s} {a}->{b}: stall {s:.3f} s (down {d:.3f} s: SIGTERM -> new gang spawned)")
        for kind in ("shrink", "grow"):
            rows.append((mb, kind, median([s for k, _, _, s in i_st if k == kind]),
                         median([s for k, _, _, s in r_st if k == kind])))
    print("\nstate MB  event   in-place stall s  restart stall s  restart/in-place")
    for mb, kind, i, r in rows:
        ratio = r / i if i > 0 else float("inf")
        print(f"{mb:8.1f}  {kind:6s}  {i:16.3f}  {r:15.3f}  {ratio:16.1f}x")


if __name__ == "__main__":
    main()
