"""Steady-state overhead: steps per second of the elastic runtime under gpuflex against
plain DDP under torchrun (benchmarks/torchrun_worker.py: the same model, data order, noise
and loss), same fixed world size, runs interleaved.

Run: .venv/bin/python benchmarks/steady_overhead.py [--hidden 64,700,3535] [--rounds 5] [--epochs 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EXAMPLE, ROOT, Gpuflex, state_bytes  # noqa: E402

WORLD = 2
SKIP = 10   # warm-up steps left out of the rate


def rate(step_log: list) -> float:
    part = step_log[SKIP:]
    return (len(part) - 1) / (part[-1][1] - part[0][1])


def ddp_rate(tmp: Path, hidden: int, epochs: int, n: int) -> float:
    log = tmp / f"ddp{n}.log"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={WORLD}", str(ROOT / "benchmarks" / "torchrun_worker.py"),
                    "--hidden", str(hidden), "--epochs", str(epochs), "--steps-file", str(log)],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return rate([list(map(float, ln.split())) for ln in log.read_text().splitlines()])


def gpuflex_rate(tmp: Path, hidden: int, epochs: int, n: int) -> float:
    gf = Gpuflex(tmp / f"gf{n}", slots=WORLD)
    job = str(json.loads(gf("submit", "--workers", str(WORLD), "--json", "--env", "OMP_NUM_THREADS=1",
                            "--", sys.executable, str(EXAMPLE), "--hidden", str(hidden),
                            "--epochs", str(epochs)))["id"])
    # the report (--report) adds sample tracking; measure without it, from the checkpoint's log
    gf.wait_workers_gone(job)
    gf.status(job)   # one refresh records the outcome
    import torch

    ck = next((tmp / f"gf{n}" / "work").rglob("checkpoint.pt"))
    return rate(torch.load(ck, weights_only=False)["logs"]["step_log"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="64,700,3535", help="widths: 0.04, 4 and 100 MB of state")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=40)
    args = ap.parse_args()
    print(f"world size {WORLD}, gloo on CPU, {args.rounds} interleaved rounds, first {SKIP} steps skipped")
    rows = []
    for hidden in [int(h) for h in args.hidden.split(",")]:
        ddp, ours = [], []
        # about the same number of steps... but no more than ~20 s per run at large sizes
        epochs = max(2, min(args.epochs, int(args.epochs * (700 / hidden) ** 2)))
        with tempfile.TemporaryDirectory(prefix="gpuflex-bench-") as t:
            for i in range(args.rounds):
                ddp.append(ddp_rate(Path(t), hidden, epochs, i))
                ours.append(gpuflex_rate(Path(t), hidden, epochs, i))
        paired = [o / d for o, d in zip(ours, ddp)]
        print(f"hidden {hidden} ({epochs} epochs of 32 steps): DDP steps/s {' '.join(f'{x:.1f}' for x in ddp)}")
        print(f"{'':{len(str(hidden)) + 8}}gpuflex   {' '.join(f'{x:.1f}' for x in ours)}")
        print(f"{'':{len(str(hidden)) + 8}}round ratios {' '.join(f'{x:.3f}' for x in paired)}")
        rows.append((hidden, statistics.median(ddp), statistics.median(ours), statistics.median(paired)))
    print("\nhidden  state MB   DDP steps/s   gpuflex steps/s   gpuflex/DDP (medians)   median round ratio")
    for hidden, d, o, p in rows:
        print(f"{hidden:6d}  {state_bytes(hidden) / 1e6:8.1f}  {d:12.1f}  {o:16.1f}  {o / d:11.3f} "
              f"({100 * (o / d - 1):+.1f}%)  {p:18.3f}")


if __name__ == "__main__":
    main()
