"""Issue 12: throughput of a job on workers of different speeds, split even, split by
speed, and the ideal, side by side in one run.

Standalone: a coordinator and N worker processes of examples/elastic_mlp.py on this host
(gloo, the job store, no control plane or database), as gpuflex's control side would start
them. Each worker spends --device-work-s seconds of simulated device time per sample
(gpuflex/testbed.py); the workers on the slow slots FACTOR times as long. For each case
(slowdown FACTOR of 1 worker of 3, and of 2 of 4) and each split, the job trains EPOCHS
epochs; its samples/s is taken from rank 0's step log after the first 2 x 8 steps (the plan
made from measurements is in place by then). The ideal is the sum of each worker's own
measured rate (its samples per second of compute, from rank 0's progress record via its
control socket, as `gpuflex status` shows them), read during the speed run.

    .venv/bin/python benchmarks/hetero_split.py [--device-work-s 0.004] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuflex.hosts.transport import unix_request

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "elastic_mlp.py"
SKIP_STEPS = 16
CASES = [(3, 1, 1.5), (3, 1, 3.0), (3, 1, 6.0), (4, 2, 1.5), (4, 2, 3.0), (4, 2, 6.0)]   # workers, slow, factor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GPUFLEX_PG_TIMEOUT_S="60",
               GPUFLEX_HEARTBEAT_TIMEOUT_S="20")
    return env


def run_job(tmp: Path, workers: int, slow: int, factor: float, split: str, args: argparse.Namespace) -> dict:
    """One job to its end: samples/s after SKIP_STEPS and rank 0's last `workers` record."""
    port, members = free_port(), list(range(workers))
    control = tmp / "coord.sock"
    env = base_env()
    coord = subprocess.Popen([sys.executable, "-m", "gpuflex.elastic.coordinator", "--port", str(port),
                              "--members", ",".join(map(str, members)), "--control", str(control),
                              "--bind", "127.0.0.1", "--heartbeat-timeout", "20"],
                             env=env, stdout=open(tmp / "coord.log", "w"), stderr=subprocess.STDOUT)
    procs, report = [], tmp / "report.json"
    slow_slots = ",".join(f"{s}={factor}" for s in range(workers - slow, workers))
    try:
        deadline = time.monotonic() + 60
        while not control.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        for w in members:
            wenv = dict(env, GPUFLEX_STORE=f"127.0.0.1:{port}", GPUFLEX_WORKER_ID=str(w), GPUFLEX_SLOTS=str(w),
                        GPUFLEX_SPLIT=split, GPUFLEX_CONTROL=str(tmp / f"w{w}.sock"))
            argv = [sys.executable, str(EXAMPLE), "--hidden", "32", "--epochs", str(args.epochs),
                    "--device-work-s", str(args.device_work_s), "--slow-slots", slow_slots, "--report", str(report)]
            procs.append(subprocess.Popen(argv, env=wenv, stdout=open(tmp / f"w{w}.log", "w"),
                                          stderr=subprocess.STDOUT))
        record = None
        while procs[0].poll() is None:   # rank 0's record, as late as it can be read
            try:
                st = unix_request(str(tmp / "w0.sock"), {"op": "status"}, timeout=5)
                if st.get("ok") and st.get("workers") and (st.get("step") or 0) >= SKIP_STEPS:
                    record = st
            except (OSError, ValueError, RuntimeError):
                pass
            time.sleep(0.5)
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"worker ended with {p.returncode}: {(tmp / 'w0.log').read_text()[-2000:]}")
    finally:
        for p in [*procs, coord]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    log = json.loads(report.read_text())["step_log"]
    times = [t for s, t, _ in log if s >= SKIP_STEPS]
    rate = (len(times) - 1) * 64 / (times[-1] - times[0])
    return {"rate": rate, "workers": (record or {}).get("workers") or {}, "replans": (record or {}).get("replans")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device-work-s", type=float, default=0.004)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--cases", default="all", help="'all' or indices into CASES, e.g. 1,4")
    args = ap.parse_args()
    cases = CASES if args.cases == "all" else [CASES[int(i)] for i in args.cases.split(",")]
    print(f"device work {args.device_work_s * 1e3:.1f} ms/sample, global batch 64, {args.epochs} epochs, "
          f"rate from step {SKIP_STEPS}; host load {os.getloadavg()[0]:.1f}")
    print(f"{'case':<16} {'even':>8} {'speed':>8} {'ideal':>8} {'speed/ideal':>11} {'speed/even':>10}  shares")
    for workers, slow, factor in cases:
        out = {}
        for split in ("even", "speed"):
            tmp = Path(tempfile.mkdtemp(prefix="gpuflex-hetero-"))
            try:
                out[split] = run_job(tmp, workers, slow, factor, split, args)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        ws = out["speed"]["workers"]
        ideal = sum(v["samples_per_s"] or 0.0 for v in ws.values())
        shares = "/".join(str(ws[k]["share"]) for k in sorted(ws, key=int))
        even, speed = out["even"]["rate"], out["speed"]["rate"]
        print(f"{slow} of {workers} x{factor:<6} {even:8.1f} {speed:8.1f} {ideal:8.1f} "
              f"{speed / ideal if ideal else float('nan'):11.2f} {speed / even:10.2f}  {shares}", flush=True)


if __name__ == "__main__":
    main()
