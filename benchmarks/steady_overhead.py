"""Steady-state overhead: steps per second of the elastic runtime under gpuflex against
plain DDP under torchrun (benchmarks/torchrun_worker.py: the same model, data order, noise
and loss), same fixed world size (2, gloo on CPU). With --fsdp: a sharded job
(examples/elastic_fsdp.py, `ElasticRun(shard=Block)`, an even split, one micro-batch per
rank) against plain FSDP2 under torchrun (benchmarks/torchrun_fsdp_worker.py).

The two runs are interleaved finely: both jobs are started, and then only one of them runs
at a time, in alternating windows of about a second (the other job's processes are held
with SIGSTOP, its coordinator and store included). This machine's speed drifts by several
percent within a minute (another tenant, the hypervisor); whole runs one after the other
see different machines, windows a second apart see the same one. Each window's rate is
taken from the job's own step log (the first steps after a resume left out); each pair of
adjacent windows gives one ratio, and the pairs alternate which job goes first.

Run: .venv/bin/python benchmarks/steady_overhead.py [--hidden 64,700,3535] [--pairs 20]
     .venv/bin/python benchmarks/steady_overhead.py --fsdp [--hidden 64,256] [--window 8] [--checkpoint-s 600]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuflex.hosts.hostops import signal_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EXAMPLE, ROOT, Gpuflex, process_groups, state_bytes  # noqa: E402

WORLD = 2
SKIP = 20        # steps before the measurement starts (start-up, first allocations)
RESUMED = 3      # steps of each window left out: the first ones after SIGCONT
NO_CHECKPOINT = 36000.0   # s: the gpuflex job's checkpoint interval, beyond any run of this benchmark
EPOCHS = 100000  # both jobs run until the measurement is over, then they are stopped
# the step log never gets near this: runs end when the windows are done


class Job:
    """One of the two jobs: its process groups, to hold and release, and its step log."""

    def __init__(self, name: str, pgids: list[int]) -> None:
        self.name, self.pgids = name, pgids
        self.windows: list[tuple[float, float]] = []

    def signal(self, sig: int) -> None:
        signal_groups(self.pgids, sig)

    def run_for(self, seconds: float) -> None:
        self.signal(signal.SIGCONT)
        start = time.time()
        time.sleep(seconds)
        self.signal(signal.SIGSTOP)
        self.windows.append((start, time.time()))

    def rates(self, step_log: list[list[float]]) -> list[tuple[int, float]]:
        """(steps, steps/s) of each window, from the step times inside it."""
        times = sorted(t for _, t, *_ in step_log)
        out = []
        for a, b in self.windows:
            inside = [t for t in times if a <= t <= b][RESUMED:]
            out.append((len(inside) - 1, (len(inside) - 1) / (inside[-1] - inside[0]))
                       if len(inside) >= 5 else (0, float("nan")))
        return out


def lm_state_bytes(hidden: int, layers: int = 2, vocab: int = 32, block: int = 16) -> int:
    """examples/elastic_fsdp.py's LM: parameters + AdamW's two moments, fp32."""
    params = (vocab + block) * hidden + layers * (12 * hidden * hidden + 10 * hidden) + 2 * hidden + vocab * hidden
    return params * 4 * 3


def wait_for(cond, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


FSDP_BATCH = 32   # --fsdp: the global batch, 16 a rank (one micro-batch each)


def start_ddp(tmp: Path, hidden: int, fsdp: bool) -> tuple[Job, subprocess.Popen, Path]:
    log = tmp / "ddp.log"
    worker = ["torchrun_fsdp_worker.py", "--global-batch-size", str(FSDP_BATCH)] if fsdp else ["torchrun_worker.py"]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={WORLD}", str(ROOT / "benchmarks" / worker[0]), *worker[1:],
                             "--hidden", str(hidden), "--epochs", str(EPOCHS), "--steps-file", str(log),
                             "--flush-every", "10"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "ddp.err", "w"),
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for(lambda: lines(log) >= SKIP or proc.poll() is not None, "DDP's first steps")
    if proc.poll() is not None:
        raise RuntimeError(f"torchrun failed: {(tmp / 'ddp.err').read_text()[-2000:]}")
    return Job("DDP", process_groups(proc.pid)), proc, log


def start_gpuflex(tmp: Path, hidden: int, fsdp: bool, checkpoint_s: float) -> tuple[Job, Gpuflex, str]:
    # held for a second at a time: timeouts well above the windows
    gf = Gpuflex(tmp / "gf", slots=WORLD, jobs="pg_timeout_s = 120\nheartbeat_timeout_s = 120\n",
                 checkpoint_interval_s=checkpoint_s)
    script = [str(ROOT / "examples" / "elastic_fsdp.py"), "--global-batch-size", str(FSDP_BATCH),
              "--micro-batch-size", str(FSDP_BATCH // WORLD)] if fsdp else [str(EXAMPLE)]
    job = str(json.loads(gf("submit", "--workers", str(WORLD), "--elastic", "inplace", "--split", "even",
                            "--json", "--env", "OMP_NUM_THREADS=1", "--", sys.executable, *script,
                            "--hidden", str(hidden), "--epochs", str(EPOCHS)))["id"])
    try:
        wait_for(lambda: gf.step(job) >= SKIP, "gpuflex's first steps")
    except BaseException:   # the job would train on (100000 epochs) after the benchmark is gone
        gf("cancel", job)
        raise
    return Job("gpuflex", gf.pgids(job)), gf, job


def measure(hidden: int, pairs: int, window: float, fsdp: bool,
            checkpoint_s: float) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    with tempfile.TemporaryDirectory(prefix="gpuflex-bench-") as t:
        tmp = Path(t)
        ddp, proc, ddp_log = start_ddp(tmp, hidden, fsdp)
        ddp.signal(signal.SIGSTOP)
        ours = gf = None
        try:
            ours, gf, job = start_gpuflex(tmp, hidden, fsdp, checkpoint_s)
            ours.signal(signal.SIGSTOP)
            for i in range(pairs):
                first, second = (ddp, ours) if i % 2 == 0 else (ours, ddp)
                first.run_for(window)
                second.run_for(window)
            ddp.signal(signal.SIGCONT)   # alone, until its log is flushed past the last window
            n = lines(ddp_log)
            wait_for(lambda: lines(ddp_log) > n, "DDP's step log")
        finally:
            ddp.signal(signal.SIGCONT)
            ddp.signal(signal.SIGKILL)
            proc.wait()
            if ours is not None:
                ours.signal(signal.SIGCONT)
                gf("cancel", job)   # the example checkpoints its step log on the way out
                gf.wait_workers_gone(job)
                gf.status(job)
        ddp_steps = [list(map(float, ln.split())) for ln in ddp_log.read_text().splitlines()]
        from gpuflex.elastic.state.checkpoints import load_checkpoint

        ck = next((tmp / "gf" / "work").rglob("checkpoint.pt"))
        our_steps = load_checkpoint(str(ck))["logs"]["step_log"]
        return ddp.rates(ddp_steps), ours.rates(our_steps)


def rate(r: float) -> str:
    """Steps/s with three significant digits at least (a 1 GB model's 0.301)."""
    return f"{r:.1f}" if r >= 10 else f"{r:.2f}" if r >= 1 else f"{r:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default=None, help="widths (default 64,700,3535: 0.04, 4 and 100 MB of "
                    "state; with --fsdp 64,256)")
    ap.add_argument("--fsdp", action="store_true", help="a sharded job against plain FSDP2 under torchrun")
    ap.add_argument("--pairs", type=int, default=20, help="window pairs per size")
    ap.add_argument("--window", type=float, default=0.0,
                    help="seconds per window (default: 1 s, or ~25 steps at large sizes)")
    ap.add_argument("--checkpoint-s", type=float, default=NO_CHECKPOINT,
                    help="the gpuflex job's checkpoint_interval_s (default: none inside the measurement, as "
                    "the torchrun workers write none; 600 is the config's default)")
    args = ap.parse_args()
    base = "FSDP2" if args.fsdp else "DDP"
    ck = "none while measured" if args.checkpoint_s >= NO_CHECKPOINT else f"every {args.checkpoint_s:g} s"
    print(f"world size {WORLD}, gloo on CPU, {base} under torchrun against gpuflex"
          f"{' (ElasticRun(shard=))' if args.fsdp else ''}; the jobs take turns in windows, {args.pairs} pairs per size;"
          f" gpuflex's checkpoints: {ck}")
    rows, size = [], lm_state_bytes if args.fsdp else state_bytes
    for hidden in [int(h) for h in (args.hidden or ("64,256" if args.fsdp else "64,700,3535")).split(",")]:
        # ~25 steps of the 100 MB model take ~3 s on 2 cores
        window = args.window or max(1.0, 3.0 * (hidden / 3535) ** 2)
        d, o = measure(hidden, args.pairs, window, args.fsdp, args.checkpoint_s)
        ratios = [ro / rd for (_, rd), (_, ro) in zip(d, o) if rd == rd and ro == ro]
        pooled_d = sum(n for n, _ in d) / sum(n / r for n, r in d if n)
        pooled_o = sum(n for n, _ in o) / sum(n / r for n, r in o if n)
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [float("nan")] * 3
        print(f"\nhidden {hidden} ({size(hidden) / 1e6:.1f} MB of state), windows of {window:.1f} s")
        print(f"  {base:5} steps/s   " + " ".join(f"{rate(r):>6}" for _, r in d))
        print("  gpuflex steps/s " + " ".join(f"{rate(r):>6}" for _, r in o))
        print("  pair ratios     " + " ".join(f"{r:6.3f}" for r in ratios))
        rows.append((hidden, pooled_d, pooled_o, statistics.median(ratios), q[0], q[2], len(ratios),
                     sum(n for n, _ in d), sum(n for n, _ in o)))
    print(f"\nhidden  state MB  {base:5} steps/s  gpuflex steps/s  pooled ratio  median pair ratio (IQR)     pairs  steps torchrun/gpuflex")
    for hidden, pd, po, med, q1, q3, n, sd, so in rows:
        print(f"{hidden:6d}  {size(hidden) / 1e6:8.1f}  {rate(pd):>13}  {rate(po):>15}  {po / pd:8.3f} "
              f"({100 * (po / pd - 1):+.1f}%)  {med:8.3f} ({q1:.3f}-{q3:.3f})  {n:5d}  {sd}/{so}")


if __name__ == "__main__":
    main()
