"""What a kill -9 costs a sharded job (issue 13): a member of a 3-worker FSDP2 job
(examples/elastic_fsdp.py under `gpuflex submit --workers 2:3 --elastic inplace` on the
local pool) is killed; the job rolls back to its last distributed checkpoint and replays
the steps since. Per run, from the job's own records:

- kill -> first step: the kill (taken just before os.kill) to the first step completed
  after the restart (the report's step_log row of the step the restart resumed at);
- replayed: the steps done before the kill (rank 0's own status from its control socket,
  read just before the kill and again just after it) minus the step the restart resumed
  at (the workers' "resumed from checkpoint at step N" log line);
- replay s: replayed x the median step time at world size 3 before the kill;
- overhead s: kill -> first step minus one median step (that first step is itself the
  first replayed one): detection, requeue, new workers, DCP load;
- kill -> caught up: the kill to the step after the restart that ends where the run stood
  at the kill (overhead + replay, as measured);
- exact: the final parameters allclose (rtol = atol = 1e-5, tests/e2e/test_fsdp_elastic.py)
  to an unsharded run of the same script (`--no-shard`, one process), every sample once
  an epoch and every step once in the step log;
- requeue, spawn, formed: the restart's milestones in the job's events, s after the kill
  (see `milestones`);
- detected by: how the survivors learnt of the death (see `detected_by`).

The job is refreshed (`gpuflex status JOB --json`, which requeues it) once a second after
the kill, as a `gpuflex watch --interval 1` would: the requeue part of the overhead
includes up to that second. The kill falls at a random point of the checkpoint interval:
once the first checkpoint is due, the benchmark waits a random fraction of an interval.
Figures are printed, not asserted.

Run: .venv/bin/python benchmarks/fsdp_kill.py [--interval 5 [10 ...]] [--repeat 3] [--epochs 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, Gpuflex, median  # noqa: E402

FSDP_EXAMPLE = ROOT / "examples" / "elastic_fsdp.py"
N, BATCH = 384, 24            # the example's samples and its default global batch
WORLD = 3
WARM_STEPS = 5                # steps at world size 3 before the kill can be planned
REFRESH_S = 1.0               # `status` polls after the kill (each one is a refresh)
DEADLINE_S = 600              # any one wait


def wait_for(cond, what: str, timeout: float = DEADLINE_S, every: float = 0.2):
    """cond()'s first truthy value; RuntimeError naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def script_args(args: argparse.Namespace) -> list[str]:
    return ["--hidden", str(args.hidden), "--epochs", str(args.epochs)]


def reference(tmp: Path, args: argparse.Namespace) -> list[float]:
    """The unsharded run of the same script in one process: its final parameters."""
    out = tmp / "reference.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    subprocess.run([sys.executable, str(FSDP_EXAMPLE), *script_args(args), "--no-shard", "--report", str(out)],
                   check=True, timeout=DEADLINE_S, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())["params"]


def members(gf: Gpuflex, job: str) -> dict[int, dict]:
    """The running members by rank (`status --json` workers)."""
    return {w["rank"]: w for w in gf.status(job)["workers"] if w["state"] == "running" and w["rank"] is not None}


def member_status(control: str) -> dict:
    """A member's own status (step: the steps it has done) from its control socket, read at
    once: rank 0's progress record reaches the coordinator up to ~0.6 s late, two steps."""
    from gpuflex.hosts.relay import unix_request

    return unix_request(control, {"op": "status"}, 5)


def kill_member(gf: Gpuflex, job: str, interval: float, rng: random.Random) -> tuple[float, int]:
    """Once the job is past WARM_STEPS at world size 3 and its first checkpoint is due, a
    random part of an interval later: kill -9 of rank 1. Returns (the kill's time, the steps
    done by then: rank 0's step read just before the kill, or just after it if a step
    ended in between)."""
    wait_for(lambda: (p := gf.progress(job)).get("world_size") == WORLD and p.get("step", 0) >= WARM_STEPS,
             f"{WARM_STEPS} steps at world size {WORLD}")
    time.sleep(interval * (1 + rng.random()))
    ranks = members(gf, job)
    if sorted(ranks) != list(range(WORLD)):
        raise RuntimeError(f"job {job}: running members of ranks {sorted(ranks)}, not {WORLD}")
    before = member_status(ranks[0]["control"])
    t_kill = time.time()
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    try:
        after = member_status(ranks[0]["control"])["step"]
    except OSError:   # rank 0 already gone: a collective with the dead member failed at once
        after = 0
    return t_kill, max(before["step"], after)


def wait_restarted(gf: Gpuflex, job: str) -> dict:
    """Refresh the job once a second (that requeues it) until its restart runs, then wait
    for its workers to end without refreshing (a `gpuflex` command costs ~0.7 s of CPU,
    which would slow the replayed steps); the final status."""
    wait_for(lambda: ((j := gf.status(job))["restarts"] >= 1 and j["state"] == "running")
             or j["state"] in ("succeeded", "failed", "cancelled", "timeout"), "the restart", every=REFRESH_S)
    gf.wait_workers_gone(job, timeout=DEADLINE_S)
    return wait_for(lambda: (j := gf.status(job))["state"] not in ("queued", "running", "scaling") and j,
                    "the job's final state", every=REFRESH_S)


def resumed_step(logs: str) -> int:
    """The step the restart resumed at, from the workers' "resumed from checkpoint" line."""
    found = [int(part.split()[0]) for part in logs.split("resumed from checkpoint at step ")[1:]]
    if len(found) != 1:
        raise RuntimeError(f"expected one resume, the logs show {found}")
    return found[0]


def detected_by(logs: str) -> str:
    """How the survivors learnt of the death: "heartbeat" when they waited at the boundary
    barrier (through the store) until the dead member's heartbeat timed out, "collective"
    when a gloo collective with it failed at once (its sockets closed)."""
    return "heartbeat" if "sent no heartbeat" in logs else "collective"


def exact(report: dict, ref: list[float], steps: int) -> bool:
    """Allclose to the unsharded run, every sample once an epoch, every step logged once."""
    try:
        torch.testing.assert_close(torch.tensor(report["params"]), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    except AssertionError:
        return False
    once = all(sorted(ids) == list(range(N)) for ids in report["samples"].values())
    return once and [s for s, _, _ in report["step_log"]] == list(range(steps))


def milestones(events: list[dict], t_kill: float) -> dict:
    """Seconds from the kill to the restart's milestones in the job's events: the requeue
    (the survivors gave up on the dead member and exited, and a refresh saw it), the new
    workers started, their generation formed (interpreters up, torch imported, met in the
    rendezvous; before the DCP load). The first two are stamped by the refresh that saw
    them (up to REFRESH_S late); the third by the coordinator."""
    requeue = next(e["time"] for e in events if (e["data"] or {}).get("cause") == "shards-lost")
    spawn = next(e["time"] for e in events if e["kind"] == "state" and e["time"] > requeue
                 and (e["data"] or {}).get("state") == "running")
    formed = min(e["data"]["created"] for e in events if e["kind"] == "formed" and e["data"]["created"] > t_kill)
    return {"requeue": requeue - t_kill, "spawn": spawn - t_kill, "formed": formed - t_kill}


def figures(report: dict, t_kill: float, done: int, resumed: int) -> dict:
    """The run's figures from its report's step_log ([step, time, world size] rows; the rows
    before `resumed` are the first run's, restored from its checkpoint)."""
    log = report["step_log"]
    before = [b[1] - a[1] for a, b in zip(log[:resumed], log[1:resumed]) if a[2] == b[2] == WORLD]
    step_s = median(before)
    first = log[resumed][1] - t_kill
    caught_up = log[done - 1][1] - t_kill if done > resumed else first
    replayed = done - resumed
    return {"first": first, "replayed": replayed, "replay": replayed * step_s, "overhead": first - step_s,
            "caught_up": caught_up, "step": step_s, "world_after": int(log[resumed][2])}


def one_run(args: argparse.Namespace, interval: float, ref: list[float], rng: random.Random) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpuflex-fsdp-kill-") as d:
        gf = Gpuflex(Path(d) / "gf", slots=WORLD, checkpoint_interval_s=interval)
        report = Path(d) / "report.json"
        job = str(json.loads(gf("submit", "--workers", f"2:{WORLD}", "--elastic", "inplace", "--json",
                                "--env", "OMP_NUM_THREADS=1", "--", sys.executable, str(FSDP_EXAMPLE),
                                *script_args(args), "--step-sleep", str(args.step_sleep),
                                "--report", str(report)))["id"])
        ended = False
        try:
            t_kill, done = kill_member(gf, job, interval, rng)
            final = wait_restarted(gf, job)
            ended = True
            if final["state"] != "succeeded" or final["restarts"] != 1:
                raise RuntimeError(f"job {job} ended {final['state']} after {final['restarts']} restart(s)")
            logs = gf("logs", job)
            resumed = resumed_step(logs)
            r = json.loads(report.read_text())
            events = json.loads(gf("events", job, "--json"))
        finally:
            if not ended:
                gf("cancel", job)
                gf.wait_workers_gone(job, timeout=DEADLINE_S)
        steps = args.epochs * -(-N // BATCH)
        return {**figures(r, t_kill, done, resumed), **milestones(events, t_kill), "by": detected_by(logs), "resumed": resumed, "done": done, "exact": exact(r, ref, steps)}


def row(r: dict) -> str:
    return (f"{r['first']:12.2f} {r['replayed']:8d} {r['replay']:9.2f} {r['overhead']:11.2f} {r['caught_up']:12.2f}"
            f" {r['step']:7.3f} {r['done']:6d} {r['resumed']:7d} {r['world_after']:6d}"
            f" {r['requeue']:8.2f} {r['spawn']:6.2f} {r['formed']:7.2f}  {r['exact']!s:5} {r['by']}")


HEADER = (f"{'kill->first':>12} {'replayed':>8} {'replay s':>9} {'overhead s':>11} {'kill->caught':>12}"
          f" {'step s':>7} {'killed':>6} {'resumed':>7} {'world':>6} {'requeue':>8} {'spawn':>6} {'formed':>7}  exact detected by")


def at_least(kind: type, low: float):
    """An argparse type: a `kind` number not below `low`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value
    return parse


def main() -> None:
    ap = argparse.ArgumentParser(description="What a kill -9 costs a sharded job (issue 13).")
    ap.add_argument("--interval", type=at_least(float, 0.1), nargs="+", default=[5.0],
                    help="checkpoint intervals (s), the job config's checkpoint_interval_s (its minimum: 0.1); "
                    "one set of runs each")
    ap.add_argument("--repeat", type=at_least(int, 1), default=3, help="runs per interval")
    ap.add_argument("--hidden", type=at_least(int, 2), default=64, help="the example's width (even)")
    ap.add_argument("--epochs", type=at_least(int, 1), default=8,
                    help="16 steps each; enough for the warm-up and two intervals before the kill")
    ap.add_argument("--step-sleep", type=at_least(float, 0), default=0.2, help="the example's sleep per step (s)")
    ap.add_argument("--seed", type=int, default=0, help="where in the checkpoint interval the kills fall")
    args = ap.parse_args()
    if args.hidden % 2:
        ap.error(f"--hidden must be even (the example's 2 attention heads), got {args.hidden}")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="gpuflex-fsdp-ref-") as d:
        ref = reference(Path(d), args)
    print(f"kill -9 of one of {WORLD} members of a sharded job (examples/elastic_fsdp.py, hidden {args.hidden}, "
          f"{args.epochs} epochs, step sleep {args.step_sleep} s), local pool, gloo on CPU ({os.cpu_count()} cores): "
          "rollback to the last DCP checkpoint and replay; times in s")
    for interval in args.interval:
        print(f"\ncheckpoint_interval_s = {interval:g}")
        print(HEADER)
        runs = []
        for _ in range(args.repeat):
            runs.append(one_run(args, interval, ref, rng))
            print(row(runs[-1]), flush=True)
        mid = {k: median([r[k] for r in runs]) for k in ("first", "replayed", "replay", "overhead", "caught_up", "step",
                                                          "requeue", "spawn", "formed")}
        print(f"{mid['first']:12.2f} {mid['replayed']:8.1f} {mid['replay']:9.2f} {mid['overhead']:11.2f} "
              f"{mid['caught_up']:12.2f} {mid['step']:7.3f} {'':22} {mid['requeue']:8.2f} {mid['spawn']:6.2f} "
              f"{mid['formed']:7.2f}  {sum(r['exact'] for r in runs)}/{len(runs)}  (medians)")


if __name__ == "__main__":
    main()
