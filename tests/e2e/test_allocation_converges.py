"""Issue 32 item 4 on real processes: three elastic in-place jobs whose scaling differs,
on a local GPU host whose nvidia-smi is the fake (7 GPUs, all idle, its owner away), and
harvest ticks under `[harvest] policy = "throughput"`. The jobs report their own
samples/s; the ticks measure each at a second size, fit the model, and move the GPUs to
the job that scales. The end state must be what the pure policy decides on the points
the jobs measured, reached from MIN, and it must hold for more ticks.

The two kinds of job are the example's: compute-bound, `--device-work-s` (simulated
device time per sample: a fixed global batch split over more workers takes less time a
step), and communication-heavy: a bigger model (`--hidden`) on a small global batch, so
each step's all-reduce (gloo, on this machine's cores) outweighs the compute more workers
would share, plus a fixed wait a step (`--step-sleep`) that more workers do not shorten,
as a slow link between hosts would not."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from gpuflex.config import load_config
from gpuflex.policy import allocation
from gpuflex.policy.throughput import Point, fit
from tests.conftest import FINAL_STATES, GpuflexCLI, cleanup_jobs, db_rows
from tests.e2e.test_elastic_jobs import ARGS, EXAMPLE
from tests.e2e.test_harvest_cmd_local import fake_host, invoke, tick
from tests.sshbed import default_gpus

pytestmark = pytest.mark.e2e   # harvest ticks probe the fake nvidia-smi and run real jobs

GPUS = 7
# the communication-heavy variant: 1M parameters (a 4 MB all-reduce a step) for a global
# batch of 16, paced by a 20 ms wait a step that more workers do not shorten
CHATTY = ["--hidden", "1024", "--global-batch-size", "16", "--step-sleep", "0.02"]
STABLE_TICKS = 4      # ticks in a row without a resize, every job measured at two sizes
DEADLINE_S = 240      # a bound for a hang, not a timing: the run prints its own duration


@pytest.fixture
def pool(home):
    state, table = fake_host(home)
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home / "g.db"}"\n\n'
                   '[harvest]\nidle_samples = 1\npolicy = "throughput"\nhold_s = 2\n\n'
                   "[jobs]\ncancel_grace_s = 2\ncheckpoint_interval_s = 1\nheartbeat_timeout_s = 3\n\n" + table)
    yield cfg, state
    # one cancel, in this process, for all of them (a console script each costs seconds here)
    alive = [str(i) for i, st in db_rows(home / "g.db", "SELECT id, state FROM jobs") if st not in FINAL_STATES]
    if alive:
        invoke(cfg, "cancel", *alive)
    cleanup_jobs(GpuflexCLI(home, cfg), home / "g.db")


def only_idle(state: Path, idle: set[int]) -> None:
    """The fake GPUs: those in `idle` quiet, the others in use by their owner."""
    gpus = default_gpus("box", GPUS)
    for g in gpus:
        if g["index"] not in idle:
            g.update(utilization=90, memory_used=20000)
    state.write_text(json.dumps({"gpus": gpus, "processes": []}))


def submit_on_one_gpu(cfg: Path, state: Path, gpu: int, argv: list[str]) -> int:
    """Each job starts at its MIN, 1, on a GPU of its own: only that GPU is idle when it is
    submitted (submit starts a job at up to its MAX on what is free)."""
    only_idle(state, {gpu})
    tick(cfg)
    r = invoke(cfg, "submit", "--harvest", "--workers", "1:3", "--json", "--", *argv)
    assert r.exit_code == 0, r.output
    job = json.loads(r.stdout)
    assert [w["gpus"] for w in job["workers"]] == [[gpu]], job
    return job["id"]


def status(cfg: Path, job_id: int) -> dict:
    r = invoke(cfg, "status", str(job_id), "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def listed(cfg: Path) -> list[dict]:
    r = invoke(cfg, "status", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def points_in_db(home: Path, job_id: int) -> list[Point]:
    """The job's measured points as its "throughput" events hold them (a point of 0
    readings is a first reading left out)."""
    rows = db_rows(home / "g.db", "SELECT data FROM events WHERE job_id = ? AND kind = 'throughput'", (job_id,))
    data = [json.loads(d) for (d,) in rows]
    return [Point(d["world"], d["hosts"], d["samples_per_s"], d["readings"]) for d in data if d["readings"] >= 1]


def size_of(job: dict) -> int:
    return sum(1 for w in job["workers"] if w["state"] in ("starting", "running"))


def pure_view(job: dict, size: int) -> allocation.Elastic:
    pts = [Point(p["world"], p["hosts"], p["samples_per_s"], p["readings"]) for p in job["scaling"]["points"]]
    return allocation.Elastic(id=job["id"], user=job["user"], size=size, min_workers=1, max_workers=3,
                              model=fit(pts), measured=frozenset(p.world for p in pts))


def settle(views: list[allocation.Elastic], rules: allocation.Rules) -> dict[int, int]:
    """The pure policy's allocation from these sizes, applied until it moves nothing."""
    for _ in range(20):
        held = sum(v.size for v in views)
        a = allocation.allocate(views, [], GPUS - held, held={views[0].user: held}, pool=GPUS, rules=rules,
                                now=1e9)
        if not a.changes:
            return dict(a.sizes)
        views = [dataclasses.replace(v, size=a.sizes[v.id]) for v in views]
    raise AssertionError(f"the pure policy did not settle: {a}")


def test_the_throughput_policy_converges_to_the_model_s_allocation_and_stays(pool, home):
    cfg, state = pool
    started = time.monotonic()
    common = [sys.executable, EXAMPLE, "--seed", "3", "--epochs", "1000"]
    fast = submit_on_one_gpu(cfg, state, 0, [*common, *ARGS[:4], "--device-work-s", "0.004"])
    chatty = [submit_on_one_gpu(cfg, state, g, [*common, *CHATTY]) for g in (1, 2)]
    ids = [fast, *chatty]
    only_idle(state, set(range(GPUS)))

    history: list[dict[int, int]] = []
    quiet = 0
    while quiet < STABLE_TICKS:
        assert time.monotonic() - started < DEADLINE_S, f"no convergence: sizes by tick {history}"
        out = tick(cfg)
        # a resize the job cannot take yet (its last one not done) fails and is tried again
        resized = [a for a in out["actions"] if a["action"] in ("grow", "shrink")]
        jobs = {j["id"]: j for j in listed(cfg)}   # one refresh for the three, not one each
        assert all(jobs[i]["state"] in ("running", "scaling") for i in ids), jobs
        history.append({i: size_of(jobs[i]) for i in ids})
        measured = all(fit(points_in_db(home, i)) is not None for i in ids)
        settled = all(jobs[i]["state"] == "running" and size_of(jobs[i]) == jobs[i]["world_size"] for i in ids)
        quiet = quiet + 1 if measured and settled and not resized else 0
        time.sleep(1.0)
    final = history[-1]
    jobs = {i: status(cfg, i) for i in ids}
    print(f"converged in {len(history)} ticks, {time.monotonic() - started:.0f} s; sizes by tick {history}")
    for j in jobs.values():
        print(f"job {j['id']}: points {[(p['world'], round(p['samples_per_s'])) for p in j['scaling']['points']]}")

    rules = allocation.rules_of(load_config(str(cfg)).harvest)
    views = {i: pure_view(jobs[i], final[i]) for i in ids}
    # the model as measured: one more worker pays for the compute-bound job, not for the others
    assert views[fast].model.gain(1, 2) > rules.threshold, jobs[fast]["scaling"]
    for i in chatty:
        assert views[i].model.gain(1, 2) < rules.threshold, jobs[i]["scaling"]
    # the pure policy on the measured points, from every job at MIN, decides what the ticks reached
    predicted = settle([pure_view(jobs[i], 1) for i in ids], rules)
    assert final == predicted, (history, predicted)
    assert final[fast] == 3 and all(final[i] < 3 for i in chatty), history
    # ... and from where they are it moves nothing: the last ticks resized nobody
    assert all(h == final for h in history[-STABLE_TICKS:]), history
    assert allocation.allocate(list(views.values()), [], GPUS - sum(final.values()),
                               held={jobs[fast]["user"]: sum(final.values())}, pool=GPUS, rules=rules,
                               now=1e9).changes == ()
