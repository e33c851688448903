"""Steady-state overhead: steps per second of the elastic runtime under gpuflex against
plain DDP under torchrun (benchmarks/torchrun_worker.py: the same model, data order, noise
and loss), same fixed world size (2, gloo on CPU). With --fsdp: a sharded job
(examples/elastic_fsdp.py, `ElasticRun(shard=Block)`, an even split, one micro-batch per
rank) against plain FSDP2 under torchrun (benchmarks/torchrun_fsdp_worker.py).
Without --fsdp, a third job runs beside them unless --no-bitwise: the same model in bitwise
mode (examples/bitwise_mlp.py, `exact="bitwise"`, units of the global batch / 8 samples, or
each unit of --bitwise-unit, a job each: `--bitwise-unit 8,32` compares the default unit
with one unit a member at world size 2), with its rate against the default mode's and DDP's
(issue 31's cost of bitwise mode).

The two runs are interleaved finely: both jobs are started, and then only one of them runs
at a time, in alternating windows of about a second (the other job's processes are held
with SIGSTOP, its coordinator and store included). This machine's speed drifts by several
percent within a minute (another tenant, the hypervisor); whole runs one after the other
see different machines, windows a second apart see the same one. Each window's rate is
taken from the job's own step log (the first steps after a resume left out); each pair of
adjacent windows gives one ratio, and the pairs alternate which job goes first. With the
bitwise jobs, each pair becomes a round of windows, one a job, in an order that rotates
through their permutations from round to round; a round's windows give its ratios.

Run: .venv/bin/python benchmarks/steady_overhead.py [--hidden 64,700,3535] [--pairs 20] [--no-bitwise]
                                                   [--bitwise-unit 8,32]
     .venv/bin/python benchmarks/steady_overhead.py --fsdp [--hidden 64,256] [--window 8] [--checkpoint-s 600]
"""

from __future__ import annotations

import argparse
import itertools
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

    def __init__(self, name: str, pgids: list[int], stretch: float = 1.0) -> None:
        """`stretch`: this job's windows are that many windows long (a slow job needs more
        time for the steps a window's rate is taken from)."""
        self.name, self.pgids, self.stretch = name, pgids, stretch
        self.windows: list[tuple[float, float]] = []

    def signal(self, sig: int) -> None:
        signal_groups(self.pgids, sig)

    def run_for(self, seconds: float) -> None:
        self.signal(signal.SIGCONT)
        start = time.time()
        time.sleep(seconds * self.stretch)
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


DEFAULT_UNIT = 64 // 8   # examples/bitwise_mlp.py's global batch / gpuflex.elastic.data.exact.DEFAULT_UNITS
BITWISE_STRETCH = 2.0   # the bitwise job's windows: at 100 MB it runs ~2 steps/s, and a 3 s
# window less the RESUMED steps left it under the 5 steps a window's rate needs


def start_gpuflex(tmp: Path, hidden: int, fsdp: bool, checkpoint_s: float,
                  bitwise: bool = False, unit: int | None = None) -> tuple[Job, Gpuflex, str]:
    # held for a second at a time: timeouts well above the windows; the step log comes from the
    # checkpoint written on cancel, which at 100 MB under load 12 outlasted a 60 s grace
    gf = Gpuflex(tmp / (f"gfb{unit or DEFAULT_UNIT}" if bitwise else "gf"), slots=WORLD,
                 jobs="pg_timeout_s = 120\nheartbeat_timeout_s = 120\n", checkpoint_interval_s=checkpoint_s,
                 cancel_grace_s=300)
    script = ([str(ROOT / "examples" / "elastic_fsdp.py"), "--global-batch-size", str(FSDP_BATCH),
               "--micro-batch-size", str(FSDP_BATCH // WORLD)] if fsdp
              else [str(ROOT / "examples" / "bitwise_mlp.py"), *(["--unit", str(unit)] if unit else [])] if bitwise
              else [str(EXAMPLE)])
    job = str(json.loads(gf("submit", "--workers", str(WORLD), "--elastic", "inplace", "--split", "even",
                            "--json", "--env", "OMP_NUM_THREADS=1", "--", sys.executable, *script,
                            "--hidden", str(hidden), "--epochs", str(EPOCHS)))["id"])
    try:
        wait_for(lambda: gf.step(job) >= SKIP, "gpuflex's first steps")
    except BaseException:   # the job would train on (100000 epochs) after the benchmark is gone
        gf("cancel", job)
        raise
    name = f"bitwise u{unit or DEFAULT_UNIT}" if bitwise else "gpuflex"
    return Job(name, gf.pgids(job), BITWISE_STRETCH if bitwise else 1.0), gf, job


def step_log(gf: Gpuflex) -> list[list[float]]:
    """The job's step log, from the checkpoint the example writes when it is cancelled."""
    from gpuflex.elastic.state.checkpoints import load_checkpoint

    ck = next((gf.dir / "work").rglob("checkpoint.pt"))
    return load_checkpoint(str(ck))["logs"]["step_log"]


def stop_gpuflex(job: Job | None, gf: Gpuflex | None, job_id: str | None) -> None:
    if job is not None:
        job.signal(signal.SIGCONT)
        gf("cancel", job_id)   # the example checkpoints its step log on the way out
        gf.wait_workers_gone(job_id)
        gf.status(job_id)


def measure(hidden: int, pairs: int, window: float, fsdp: bool, checkpoint_s: float,
            units: tuple[int, ...] = ()) -> tuple[list[tuple[int, float]], ...]:
    """(DDP's, gpuflex's, then each bitwise job's (one per unit in `units`)) (steps, steps/s)
    of each window, one window a job a round."""
    with tempfile.TemporaryDirectory(prefix="gpuflex-bench-") as t:
        tmp = Path(t)
        ddp, proc, ddp_log = start_ddp(tmp, hidden, fsdp)
        ddp.signal(signal.SIGSTOP)
        ours = gf = job = None
        bits: list[tuple[Job, Gpuflex, str]] = []
        try:
            ours, gf, job = start_gpuflex(tmp, hidden, fsdp, checkpoint_s)
            ours.signal(signal.SIGSTOP)
            for unit in units:
                bits.append(start_gpuflex(tmp, hidden, fsdp, checkpoint_s, bitwise=True, unit=unit))
                bits[-1][0].signal(signal.SIGSTOP)
            orders = list(itertools.permutations((ddp, ours, *(b[0] for b in bits))))
            for i in range(pairs):
                if bits:   # every order in turn: none of the jobs always follows the same one
                    for one in orders[i % len(orders)]:
                        one.run_for(window)
                    continue
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
            try:
                stop_gpuflex(ours, gf, job)
            finally:
                for one in bits:
                    stop_gpuflex(*one)
        ddp_steps = [list(map(float, ln.split())) for ln in ddp_log.read_text().splitlines()]
        return (ddp.rates(ddp_steps), ours.rates(step_log(gf)), *(b.rates(step_log(g)) for b, g, _ in bits))


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
    ap.add_argument("--no-bitwise", action="store_true",
                    help="leave the bitwise-mode job out (two jobs, window pairs, as before issue 31)")
    ap.add_argument("--bitwise-unit", default=str(DEFAULT_UNIT),
                    help="samples per unit of the bitwise job, or several (8,32): a bitwise job each "
                    f"(default: {DEFAULT_UNIT}, the global batch of 64 / 8)")
    ap.add_argument("--checkpoint-s", type=float, default=NO_CHECKPOINT,
                    help="the gpuflex job's checkpoint_interval_s (default: none inside the measurement, as "
                    "the torchrun workers write none; 600 is the config's default)")
    args = ap.parse_args()
    base = "FSDP2" if args.fsdp else "DDP"
    bitwise = not (args.fsdp or args.no_bitwise)   # bitwise mode refuses shard=
    units = tuple(int(u) for u in args.bitwise_unit.split(",")) if bitwise else ()
    ck = "none while measured" if args.checkpoint_s >= NO_CHECKPOINT else f"every {args.checkpoint_s:g} s"
    print(f"world size {WORLD}, gloo on CPU, {base} under torchrun against gpuflex"
          f"{' (ElasticRun(shard=))' if args.fsdp else ''}; the jobs take turns in windows, {args.pairs} pairs per size;"
          f" gpuflex's checkpoints: {ck}")
    for unit in units:   # a member's share at world size 2 is 32 samples: 32 / unit passes a step
        print(f"and gpuflex in bitwise mode (examples/bitwise_mlp.py, units of {unit} samples"
              f"{' (the default, global batch / 8)' if unit == DEFAULT_UNIT else ''}: "
              f"{-(-64 // WORLD // unit)} forward and backward pass(es) a member a step at world size {WORLD})")
    if units:
        print(f"rounds of {2 + len(units)} windows instead of pairs, a bitwise job's {BITWISE_STRETCH:g}x as long")
    # the machine is shared: its load beside the figures (1, 5, 15 min averages)
    print("load average at the start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    rows, brows, size = [], [], lm_state_bytes if args.fsdp else state_bytes
    for hidden in [int(h) for h in (args.hidden or ("64,256" if args.fsdp else "64,700,3535")).split(",")]:
        # ~25 steps of the 100 MB model take ~3 s on 2 cores
        window = args.window or max(1.0, 3.0 * (hidden / 3535) ** 2)
        d, o, *bs = measure(hidden, args.pairs, window, args.fsdp, args.checkpoint_s, units)
        if not any(n for n, _ in d) or not any(n for n, _ in o):
            raise SystemExit(f"{base} or gpuflex made too few steps in every window to measure (a loaded "
                             "machine?): give a longer --window")
        ratios = [ro / rd for (_, rd), (_, ro) in zip(d, o) if rd == rd and ro == ro]
        pooled_d = sum(n for n, _ in d) / sum(n / r for n, r in d if n)
        pooled_o = sum(n for n, _ in o) / sum(n / r for n, r in o if n)
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [float("nan")] * 3
        print(f"\nhidden {hidden} ({size(hidden) / 1e6:.1f} MB of state), windows of {window:.1f} s")
        print(f"  {base:5} steps/s   " + " ".join(f"{rate(r):>6}" for _, r in d))
        print("  gpuflex steps/s " + " ".join(f"{rate(r):>6}" for _, r in o))
        print("  pair ratios     " + " ".join(f"{r:6.3f}" for r in ratios))
        for unit, b in zip(units, bs):
            if not any(n for n, _ in b):
                raise SystemExit(f"the bitwise job (unit {unit}) made too few steps in every window to measure: "
                                 "give --window")
            pooled_b = sum(n for n, _ in b) / sum(n / r for n, r in b if n)
            vs_o = [rb / ro for (_, ro), (_, rb) in zip(o, b) if ro == ro and rb == rb]
            vs_d = [rb / rd for (_, rd), (_, rb) in zip(d, b) if rd == rd and rb == rb]
            print(f"  bitwise u{unit:<3} steps/s " + " ".join(f"{rate(r):>6}" for _, r in b))
            print(f"  bitwise u{unit:<3}/gpuflex " + " ".join(f"{r:6.3f}" for r in vs_o))
            print(f"  bitwise u{unit:<3}/{base:7s} " + " ".join(f"{r:6.3f}" for r in vs_d))
            brows.append((hidden, unit, pooled_d, pooled_o, pooled_b, statistics.median(vs_o),
                          statistics.median(vs_d), sum(n for n, _ in b)))
        print("  load average: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
        rows.append((hidden, pooled_d, pooled_o, statistics.median(ratios), q[0], q[2], len(ratios),
                     sum(n for n, _ in d), sum(n for n, _ in o)))
    print(f"\nhidden  state MB  {base:5} steps/s  gpuflex steps/s  pooled ratio  median pair ratio (IQR)     pairs  steps torchrun/gpuflex")
    for hidden, pd, po, med, q1, q3, n, sd, so in rows:
        print(f"{hidden:6d}  {size(hidden) / 1e6:8.1f}  {rate(pd):>13}  {rate(po):>15}  {po / pd:8.3f} "
              f"({100 * (po / pd - 1):+.1f}%)  {med:8.3f} ({q1:.3f}-{q3:.3f})  {n:5d}  {sd}/{so}")
    if brows:   # pooled: all steps over all window time; medians: of the rounds' ratios
        print(f"\nhidden  state MB  unit  {base:5} steps/s  gpuflex steps/s  bitwise steps/s  bitwise/gpuflex pooled "
              f"(median)  bitwise/{base} pooled (median)  bitwise steps")
        for hidden, unit, pd, po, pb, mo, md, sb in brows:
            print(f"{hidden:6d}  {size(hidden) / 1e6:8.1f}  {unit:4d}  {rate(pd):>13}  {rate(po):>15}  {rate(pb):>15}  "
                  f"{pb / po:6.3f} ({100 * (pb / po - 1):+.1f}%) ({mo:.3f})  {pb / pd:12.3f} ({md:.3f})  {sb:13d}")


if __name__ == "__main__":
    main()
