"""Scale pause: the stall surviving workers see on a grow and on a shrink, gpuflex in place
against torchrun's elastic restart of the same model, side by side, at two state sizes.

Stall = the gap between the two steps around the event minus the median step time at
the new world size, read from each run's own step log. torchrun: `--nnodes=2:3`, c10d rendezvous, one agent
per "node" on loopback, workers reload the last checkpoint when they restart.
Unless --no-bitwise, the same gpuflex run again in bitwise mode (examples/bitwise_mlp.py,
`exact="bitwise"`), its stalls printed beside the default mode's (issue 31).
Run: .venv/bin/python benchmarks/scale_pause.py [--sizes 4e6,100e6] [--events 2] [--no-bitwise]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuflex.hosts.hostops import signal_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (EXAMPLE, ROOT, Gpuflex, free_port, hidden_for, median, process_groups,  # noqa: E402
                    state_bytes, stalls)


def gpuflex_run(tmp: Path, hidden: int, events: int, sleep: float,
                bitwise: bool = False) -> tuple[float, list, list]:
    name = "bitwise" if bitwise else "gpuflex"
    gf = Gpuflex(tmp / name, slots=3)
    script = ROOT / "examples" / "bitwise_mlp.py" if bitwise else EXAMPLE
    job = json.loads(gf("submit", "--workers", "2:3", "--json", "--env", "OMP_NUM_THREADS=1",
                        "--", sys.executable, str(script),
                        "--hidden", str(hidden), "--epochs", "10000", "--step-sleep", str(sleep)))["id"]
    job = str(job)
    gf("scale", job, "2", "--wait")
    gf.wait_steps(job, 8)
    for _ in range(events):
        gf("scale", job, "3", "--wait")
        gf.wait_steps(job, 8)
        gf("scale", job, "2", "--wait")
        gf.wait_steps(job, 8)
    ev = json.loads(gf("events", job, "--json"))
    gf("cancel", job)
    gf.wait_workers_gone(job)
    # the step log from the checkpoint the example writes when cancelled; a --report (every
    # parameter as JSON: ~280 MB at 100 MB of state) outlasted the cancel grace in bitwise mode
    from gpuflex.elastic.state.checkpoints import load_checkpoint

    ck = next((tmp / name / "work").rglob("checkpoint.pt"))
    med, st = stalls(load_checkpoint(str(ck))["logs"]["step_log"])
    copies = [e["data"]["timings"] for e in ev if e["kind"] == "scale" and e["data"].get("timings")]
    for log in sorted((tmp / name / "work").rglob("*.log")):   # formation lines, for --no-torchrun work
        if os.environ.get("GPUFLEX_BENCH_LOGS"):
            print(f"--- {log.name}\n" + "".join(ln for ln in open(log) if "generation" in ln))
    return med, st, copies


def torchrun_run(tmp: Path, hidden: int, events: int, sleep: float) -> tuple[float, list, str]:
    d = tmp / "torchrun"
    d.mkdir()
    log, ckpt = d / "steps.log", d / "ckpt.pt"
    port = free_port()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench",
           "--max-restarts=20", "--monitor-interval=0.5",
           str(ROOT / "benchmarks" / "torchrun_worker.py"), "--hidden", str(hidden),
           "--step-sleep", str(sleep), "--ckpt", str(ckpt), "--ckpt-every", "5", "--steps-file", str(log)]
    agents = []

    def start(i):
        out = open(d / f"agent{i}.log", "w")
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def lines():
        return [list(map(float, ln.split())) for ln in log.read_text().splitlines()] if log.exists() else []

    def wait(pred, timeout=240):
        end = time.monotonic() + timeout
        while not pred(lines()):
            if time.monotonic() > end:
                return False
            time.sleep(0.5)
        return True

    error = ""
    try:
        agents += [start(0), start(1)]
        if not wait(lambda ls: len(ls) >= 8):
            return float("nan"), [], "torchrun did not start training"
        for k in range(events):
            n = len(lines())
            agents.append(start(2 + k))
            if not wait(lambda ls: len(ls) >= n + 8 and ls[-1][2] == 3):
                error = f"torchrun could not complete a scale-up: see {d}/agent*.log"
                break
            n = len(lines())
            os.killpg(agents[-1].pid, signal.SIGTERM)       # the third node leaves
            agents[-1].wait(timeout=60)
            if not wait(lambda ls: len(ls) >= n + 8 and ls[-1][2] == 2):
                error = "torchrun did not resume after a node left"
                break
    finally:   # the agents and their workers (torchrun starts each in a session of its own)
        signal_groups(sorted({g for a in agents if a.poll() is None for g in process_groups(a.pid)}), signal.SIGKILL)
        for a in agents:
            a.wait()
    med, st = stalls(lines())
    return med, st, error


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4e6,100e6", help="state sizes in bytes")
    ap.add_argument("--events", type=int, default=2, help="grow+shrink pairs per run")
    ap.add_argument("--no-torchrun", action="store_true",
                    help="gpuflex alone (while working on it; the comparison needs both)")
    ap.add_argument("--no-bitwise", action="store_true", help="leave out the gpuflex run in bitwise mode")
    args = ap.parse_args()
    rows = []
    # the machine is shared: its load beside the figures (1, 5, 15 min averages)
    print("load average at the start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    for size in [float(s) for s in args.sizes.split(",")]:
        hidden = hidden_for(size)
        sleep = 0.05 if size < 20e6 else 0.0
        with tempfile.TemporaryDirectory(prefix="gpuflex-bench-") as t:
            tmp = Path(t)
            g_med, g_st, copies = gpuflex_run(tmp, hidden, args.events, sleep)
            b_med, b_st, b_copies = ((float("nan"), [], []) if args.no_bitwise
                                     else gpuflex_run(tmp, hidden, args.events, sleep, bitwise=True))
            t_med, t_st, err = ((float("nan"), [], "not run (--no-torchrun)") if args.no_torchrun
                                else torchrun_run(tmp, hidden, args.events, sleep))
        mb = state_bytes(hidden) / 1e6
        print(f"\nstate {mb:.1f} MB (hidden {hidden}): median step gpuflex {g_med * 1000:.0f} ms, "
              f"torchrun {t_med * 1000:.0f} ms")
        for kind, a, b, s in g_st:
            print(f"  gpuflex  {kind:6s} {a}->{b}: stall {s:.3f} s")
        for c in copies:
            print(f"  gpuflex  phases: agree {c['agree']:.3f} rebuild {c['rebuild']:.3f} copy {c['copy']:.3f} "
                  f"verify {c['verify']:.3f} first_step {c['first_step']:.3f} s, {c['bytes'] / 1e6:.1f} MB copied")
        for kind, a, b, s in t_st:
            print(f"  torchrun {kind:6s} {a}->{b}: stall {s:.3f} s")
        if err:
            print(f"  torchrun: {err}")
        if not args.no_bitwise:
            print(f"  bitwise mode: median step {b_med * 1000:.0f} ms")
            for kind, a, b, s in b_st:
                print(f"  bitwise  {kind:6s} {a}->{b}: stall {s:.3f} s")
            for c in b_copies:
                print(f"  bitwise  phases: agree {c['agree']:.3f} rebuild {c['rebuild']:.3f} copy {c['copy']:.3f} "
                      f"verify {c['verify']:.3f} first_step {c['first_step']:.3f} s, {c['bytes'] / 1e6:.1f} MB copied")
        print("  load average: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
        for kind in ("grow", "shrink"):
            g = median([s for k, _, _, s in g_st if k == kind])
            tr = median([s for k, _, _, s in t_st if k == kind])
            bw = median([s for k, _, _, s in b_st if k == kind])
            rows.append((mb, kind, g, tr, bw))
    print("\nstate MB  event   gpuflex stall s  torchrun stall s  torchrun/gpuflex"
          + ("" if args.no_bitwise else "  bitwise stall s  bitwise/gpuflex"))
    for mb, kind, g, tr, bw in rows:
        ratio = tr / g if g > 0 else float("inf")
        print(f"{mb:8.1f}  {kind:6s}  {g:15.3f}  {tr:16.3f}  {ratio:16.1f}x"
              + ("" if args.no_bitwise else f"  {bw:15.3f}  {bw / g if g > 0 else float('inf'):15.2f}x"))


if __name__ == "__main__":
    main()
