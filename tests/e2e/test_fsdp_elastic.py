"""`ElasticRun(shard=...)` (issue 13's first stage): examples/elastic_fsdp.py sharded with FSDP2
by the runtime, standalone, across in-place resizes 2 -> 3 -> 2 (a coordinator and workers
started directly) and 1 -> 3 -> 2 -> 4 (`gpuflex submit`/`scale` on the local pool), against a
fixed-size sharded run and the unsharded single-process reference; a member killed (the
job ends, saying why); a corrupted move (refused everywhere, rolled back bit for bit).

The tolerance, rtol 1e-5 and atol 1e-5 on float32 parameters: every run computes the same
weighted-mean gradient of the same global batches (each rank's mean loss times its share of
the global batch, summed over the members by FSDP's reduce-scatter with divide factor 1);
runs differ only in how that sum is cut (per rank, per micro-batch) and in which order the
partial sums are added, i.e. float32 rounding. A sum of 25 samples' terms carries a relative
error up to ~25 x 6e-8 times sum|terms| / |sum|: ~1e-4 for a gradient element that nearly
cancels. AdamW turns a relative gradient error into the same relative error of its update
(at most lr = 3e-3 an element a step), so 32 steps differ by at most ~32 x 3e-3 x 1e-4 = 1e-5
(a worst case: the runs here differ by 1e-7 to 3e-7, also over the local pool's 128 steps).
A wrong share weight, a sample lost or counted twice, or a misplaced shard row changes the
updates by O(lr), 1e-3 and more. (The example's q/k/v have no bias: the key bias's true
gradient is 0, so it is pure rounding noise that AdamW turns into lr-sized steps.)

The direct jobs are a real coordinator (`python -m gpuflex.elastic.coordinator`) and real
workers over gloo, as tests/elastic/run/test_runtime.py starts them (its Job), running the example.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gpuflex.elastic.sharding import pages, reshard
from gpuflex.elastic.membership.collectives import backward
from gpuflex.elastic.membership.joining import StateMismatch
from gpuflex.elastic.protocol.keys import SHARDS_LOST_EXIT, STORE_LOST_EXIT
from gpuflex.elastic.data.micro import lockstep_bounds, micro_bounds
from gpuflex.elastic.run.runtime import ElasticRun
from gpuflex.elastic.data.sampler import ElasticSampler
from gpuflex.elastic.sharding.sharded_run import Sharding
from gpuflex.hosts.relay import unix_request
from tests.e2e.test_elastic_jobs import (ej, elastic_cli, live_members, scale, step_of,  # noqa: F401 (ej: the fixture)
                                          wait_for, world_sizes)
from tests.conftest import cleanup_jobs, db_rows, exits_without_teardown
from tests.elastic.run.test_runtime import DEADLINE_S, ROOT, Job, assert_every_sample_once, free_port

EXAMPLE = ROOT / "examples" / "elastic_fsdp.py"
ARGS = ["--global-batch-size", "25", "--micro-batch-size", "8"]   # shares of 13/12 and 9/8/8; 16 steps an epoch
STEPS, N, B = 32, 384, 25
SHARE_LINE = re.compile(r"newcomer's share of the sharded state is (\d+) bytes; (\d+) bytes reserved")


class FsdpJob(Job):
    """A job running examples/elastic_fsdp.py with `argv` (each worker writes report-<wid>.json)."""

    def __init__(self, tmp: Path, members: list[int], argv: list[str]) -> None:
        self.argv = argv
        super().__init__(tmp, members)

    def start(self, wid: int) -> None:
        self.procs[wid] = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *self.argv, "--report", str(self.tmp / f"report-{wid}.json")],
            env=self.env(wid), stdout=open(self.tmp / f"worker-{wid}.log", "w"), stderr=subprocess.STDOUT)

    def status(self) -> dict:
        return unix_request(self.control, {"op": "status"}, timeout=10)

    def at(self, generation: int, step: int) -> bool:
        """Generation `generation` formed and rank 0 reported step `step` or later in it."""
        s = self.status()
        progress = s.get("progress") or {}
        return s["generation"] >= generation and progress.get("generation", 0) >= generation \
            and progress.get("step", -1) >= step


def plain_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    return dict(env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


_refs: dict[tuple[str, ...], list[float]] = {}


def reference(tmp: Path, *extra: str) -> list[float]:
    """A standalone run of the example (one process): its report's parameters; run once per
    `extra` for the module (several tests compare with the same run)."""
    if extra not in _refs:
        out = tmp / f"ref{'-'.join(extra)}.json"
        subprocess.run([sys.executable, str(EXAMPLE), *ARGS, *extra, "--report", str(out)], check=True,
                       timeout=DEADLINE_S, env=plain_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _refs[extra] = json.loads(out.read_text())["params"]
    return _refs[extra]


def close(a: list[float], b: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


@pytest.fixture
def jobs(tmp_path):
    made: list[FsdpJob] = []

    def make(members: list[int], name: str, argv: list[str]) -> FsdpJob:
        d = tmp_path / name
        d.mkdir()
        made.append(FsdpJob(d, members, argv))
        return made[-1]

    yield make
    for j in made:
        j.close()


def test_shard_needs_an_optimizer_factory_and_a_shard_spec_of_the_model():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    kw = dict(num_samples=8, global_batch_size=4, steps=1)
    with pytest.raises(TypeError, match="function of the parameters"):
        ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), shard=torch.nn.Linear, **kw)
    with pytest.raises(TypeError, match="not a torch optimizer"):
        ElasticRun(model=model, optimizer=lambda params: None, shard=torch.nn.Linear, **kw)
    with pytest.raises(ValueError, match="not part of the model"):
        ElasticRun(model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                   shard=lambda root: [torch.nn.Linear(2, 2)], **kw)
    run = ElasticRun(model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), shard=torch.nn.Linear,
                     scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1), **kw)
    assert run.scheduler.optimizer is run.optimizer
    assert "model" not in run.registry.objects and "optimizer" not in run.registry.objects   # shards move alone


def test_sharded_micro_batches_are_as_many_on_every_rank_and_cover_each_share():
    """Every forward is a collective under FSDP: a share of 9 and shares of 8 (micro-batches
    of 8) all take 2, cut near-equally; alone, the cut is the data-parallel one."""
    sampler = ElasticSampler(384, 25, epochs=1, seed=0)
    for world in (2, 3):
        cuts = [lockstep_bounds(sampler.batch(15, r, world), 8, None) for r in range(world)]   # 9 samples
        sizes = [len(sampler.batch(15, r, world).indices) for r in range(world)]
        assert {len(c) for c in cuts} == {max(len(micro_bounds(n, 8, None)) for n in sizes)}
        for cut, n in zip(cuts, sizes):
            assert cut[0][0] == 0 and cut[-1][1] == n and all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
            assert max(b - a for a, b in cut) - min(b - a for a, b in cut) <= 1
    assert lockstep_bounds(sampler.batch(0, 1, 3), 8, None) == [(0, 4), (4, 8)]   # an 8 in 2, as the 9 needs
    assert lockstep_bounds(sampler.batch(15, 0, 3), 1, None) == [(0, 1), (1, 2), (2, 3)]
    assert lockstep_bounds(sampler.batch(15, 2, 4), 1, None) == [(0, 1), (1, 2), (2, 2)]   # 2 of 9: one empty


def test_standalone_sharded_equals_the_unsharded_script(tmp_path):
    """One process, FSDP2 over a group of one, against the same script unsharded."""
    close(reference(tmp_path), reference(tmp_path, "--no-shard"))


def test_a_resize_2_3_2_in_place_equals_a_fixed_size_run_and_the_unsharded_one(jobs, tmp_path):
    """Grown to 3 (a newcomer receives its shards), then shrunk to 2 by a survivor leaving
    (its shards go to the others first): no rollback, every sample once per epoch, the
    final full parameters allclose to 2 fixed workers' and to one unsharded process's."""
    j = jobs([0, 1], "resized", [*ARGS, "--step-sleep", "0.4"])
    j.wait(lambda: j.at(1, 1), "step 1")
    j.start(2)
    j.resize([0, 1, 2])   # published once the newcomer is ready (it imports torch meanwhile)
    j.wait(lambda: j.at(2, 0), "the grow")
    grown = j.status()["progress"]["step"]
    j.wait(lambda: j.at(2, grown + 3), "3 steps at 3")
    j.resize([0, 2])
    j.wait(lambda: j.procs[1].poll() == 0, "worker 1 to leave")
    resized = j.finish()
    fixed = jobs([0, 1], "fixed", ARGS).finish()
    plain = reference(tmp_path, "--no-shard")
    assert sorted(resized) == [0] and sorted(fixed) == [0]   # rank 0 (worker 0) writes the report
    r = resized[0]
    assert r["steps"] == STEPS and j.status()["generation"] == 3, "a rollback or recovery generation happened"
    assert sorted({w for _, _, w in r["step_log"]}) == [2, 3]
    assert_every_sample_once(r, N, STEPS, B)
    close(r["params"], fixed[0]["params"])
    close(r["params"], plain)
    assert "rolling back" not in j.logs()
    # the newcomer learned the sharded state's size from rank 0's count (too small to reserve)
    (share,) = [int(m.group(1)) for m in SHARE_LINE.finditer((j.tmp / "worker-2.log").read_text())]
    assert share > 0


def test_a_newcomer_reserves_its_share_before_it_meets_the_others_and_a_holder_does_not(caplog):
    """Sharding.prepare, as a resize's formation calls it before the barrier: a CPU newcomer
    (never sharded) asks rank 0's count of the state and reserves its share (pages.py; at
    most 4x its own model); a member holding shards does not even ask; a share under
    pages.MIN_BYTES is not worth it."""
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])   # 25 MB of parameters
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    s = Sharding(model, lambda params: torch.optim.AdamW(params), nn.Linear, torch.device("cpu"))
    asked: list[int] = []

    def total() -> int:
        asked.append(1)
        return 3 * own   # parameters and AdamW's two moments

    caplog.set_level("INFO", logger="gpuflex.elastic.sharding.sharded_run")
    glibc = pages._glibc() is not None

    def reserved() -> list[tuple[int, int]]:
        """(share, bytes reserved) of each newcomer's line logged since the last call."""
        got = [tuple(map(int, m.groups())) for r in caplog.records
               if (m := SHARE_LINE.search(r.getMessage()))]
        caplog.clear()
        return got

    s.prepare(3, total)
    assert asked == [1]
    assert reserved() == [(own, (-(-own // pages.BLOCK) + pages.MARGIN) * pages.BLOCK if glibc else 0)]
    s.prepare(3, lambda: 10 ** 15)   # a count far above the model: capped at 4x its own bytes
    share = 4 * own // 3
    assert reserved() == [(share, (-(-share // pages.BLOCK) + pages.MARGIN) * pages.BLOCK if glibc else 0)]
    s.prepare(3, lambda: pages.MIN_BYTES)   # a share too small to matter
    assert reserved() == [(pages.MIN_BYTES // 3, 0)]
    s.started = True                       # a holder of shards
    s.prepare(3, total)
    assert asked == [1] and reserved() == []


def test_a_member_killed_ends_the_survivor_with_the_shards_lost_exit(jobs):
    """kill -9 takes the only copy of a member's shards: the survivor does not train on or
    hang; it ends with SHARDS_LOST_EXIT (the control side restarts the job from its
    distributed checkpoint: the local-pool tests below), saying why in one line."""
    j = jobs([0, 1], "killed", [*ARGS, "--step-sleep", "0.4"])
    j.wait(lambda: j.at(1, 2), "step 2")
    j.procs[1].kill()
    rc = j.procs[0].wait(timeout=DEADLINE_S)
    log = (j.tmp / "worker-0.log").read_text()
    assert rc == SHARDS_LOST_EXIT, log
    assert "a sharded job keeps one copy of each shard" in log and "restarts from its last distributed" in log, log
    assert "Traceback" not in log, log


@exits_without_teardown
def _rollback_worker(rank: int, port: int, out: dict) -> None:
    """Generation 1: ranks 0-1 shard and train a step. Generation 2: a grow to 3 whose move
    rank 0 corrupts. Generation 3 (the rollback): ranks 0-1 again, from their held shards."""
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=dt.timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
    s = Sharding(model, lambda params: torch.optim.AdamW(params, lr=0.05), nn.Linear, torch.device("cpu"))

    def generation(g: int, world: int) -> None:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"g{g}", store), rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=60))

    if rank < 2:
        generation(1, 2)
        s.form(rank, 2)
        backward(model(torch.randn(4, 5)).sum(), "gloo")   # not .backward(): torch 2.13's gloo exit race (collectives.py)
        s.optimizer.step()
        out[("before", rank)] = {n: t.tolist() for n, t in s.full_parameters().items()}
        dist.destroy_process_group()
    generation(2, 3)
    move_all = reshard.move_all
    if rank == 0:   # every new shard of this rank is changed once moved: a bit flipped on the way

        def corrupted(*args, **kwargs):
            shards = move_all(*args, **kwargs)
            for shard in shards:
                if shard is not None and shard.numel():
                    shard.view(-1)[:1] += 1.0
            return shards

        reshard.move_all = corrupted
    try:
        s.form(rank, 3)
    except StateMismatch:
        out[("refused", rank)] = True
    finally:
        reshard.move_all = move_all
    dist.destroy_process_group()
    if rank < 2:
        generation(3, 2)
        s.form(rank, 2)
        out[("after", rank)] = {n: t.tolist() for n, t in s.full_parameters().items()}
        out[("step", rank)] = [float(st["step"]) for st in s.optimizer.state.values()]
        dist.destroy_process_group()


def test_a_corrupted_move_is_refused_everywhere_and_the_old_holders_roll_back_exactly():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rollback_worker, args=(free_port(), out), nprocs=3, join=True)
        out = dict(out)
    assert all(out.get(("refused", r)) for r in range(3))
    assert out[("after", 0)] == out[("before", 0)] == out[("after", 1)]   # bit for bit: moves copy rows
    assert out[("step", 0)] == out[("step", 1)] == [1.0] * 4              # AdamW's state came back too


def test_on_the_local_pool_1_3_2_4_in_place_ends_as_the_unsharded_run(ej, home, tmp_path):
    """`gpuflex submit` and `gpuflex scale` (the issue's sequence): the survivor keeps its
    process through every resize, no rollback, the job succeeds, every sample once, and the
    final parameters are allclose to the unsharded run's."""
    report, hold = home / "r.json", home / "hold"
    epochs = ["--epochs", "8"]   # 128 steps: still running after three resizes (newcomers import torch)
    hold.touch()   # the pace held until the last resize is in; then the job runs out at full speed
    job = ej.submit([sys.executable, str(EXAMPLE), *ARGS, *epochs, "--step-sleep", "0.2", "--sleep-while", str(hold),
                     "--report", str(report)], "--workers", "1:4")
    scale(ej, job["id"], 1)
    first = wait_for(ej, job["id"], lambda j: step_of(j) >= 2, "some steps at world size 1")
    survivor = live_members(first)[0]["pid"]
    for n in (3, 2, 4):
        scale(ej, job["id"], n)
    assert live_members(ej.json("status", str(job["id"])))[0]["pid"] == survivor
    hold.unlink()
    done = ej.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded", done
    r = json.loads(report.read_text())
    assert world_sizes(r) == [1, 3, 2, 4]
    assert_every_sample_once(r, N, 4 * STEPS, B)
    assert not [e for e in ej.json("events", str(job["id"])) if e["kind"] == "rollback"]
    close(r["params"], reference(tmp_path, "--no-shard", *epochs))


def test_untracked_the_vote_rides_the_step_barrier_through_a_grow_and_checkpoints(ej, home, tmp_path):
    """Without sample tracking a sharded step's vote is packed into the step barrier before
    its first forward (agreement.pack, no collective of its own): rank 0's switch to the grown
    generation and its checkpoint requests (1 s interval) reach every member that way; the
    job ends as the unsharded run, every step once."""
    report, hold = home / "r.json", home / "hold"
    epochs = ["--epochs", "4"]
    hold.touch()   # the pace held until the grow is in; then the job runs out at full speed
    job = ej.submit([sys.executable, str(EXAMPLE), *ARGS, *epochs, "--step-sleep", "0.2", "--sleep-while", str(hold),
                     "--untracked", "--report", str(report)], "--workers", "2:3", "--elastic", "inplace")
    scale(ej, job["id"], 2)
    wait_for(ej, job["id"], lambda j: step_of(j) >= 4 and j["world_size"] == 2, "steps at world size 2")
    scale(ej, job["id"], 3)
    hold.unlink()
    done = ej.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded" and done["restarts"] == 0, done
    r = json.loads(report.read_text())
    assert r["samples"] == {}
    assert world_sizes(r) == [2, 3]
    assert [s for s, _, _ in r["step_log"]] == list(range(2 * STEPS))
    logs = ej.ok("logs", str(job["id"])).stdout
    assert "resharded 2 -> 3 shards" in logs and "rolling back" not in logs
    steps = dcp_steps(home)
    assert any(0 < s < 2 * STEPS for s in steps), f"no checkpoint before the last step: {steps}"   # asked for in a vote
    close(r["params"], reference(tmp_path, "--no-shard", *epochs))


@pytest.fixture
def ej_pg2(home):
    """The `ej` pool with pg_timeout_s = 2: a collective waiting longer than that fails."""
    cli = elastic_cli(home, "pg_timeout_s = 2\n")
    yield cli
    cleanup_jobs(cli, home / "g.db")


def test_rank_0_busy_past_the_pg_timeout_before_the_next_forward_and_the_last_checkpoint_is_waited_for(
        ej_pg2, home, tmp_path):
    """Untracked, a sharded step's vote rides the barrier before its first forward and the
    boundary crosses none; rank 0 busy for 5 s (an evaluation, pg_timeout_s = 2) after step
    10 and after the last step: the other member waits at step 11's forward barrier, then at
    the fence before the final distributed checkpoint's collectives, as long as rank 0 is
    alive. No fault or restart, the final checkpoint written whole, every step once, the
    parameters those of the unsharded run."""
    report = home / "r.json"
    job = ej_pg2.submit([sys.executable, str(EXAMPLE), *ARGS, "--untracked", "--busy-at", "10", str(STEPS - 1),
                         "--busy-s", "5", "--report", str(report)], "--workers", "2", "--elastic", "inplace")
    done = ej_pg2.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded" and done["restarts"] == 0, done
    kinds = {e["kind"] for e in ej_pg2.json("events", str(job["id"]))}
    assert not kinds & {"fault", "rollback", "checkpoint-failed"}, kinds
    logs = ej_pg2.ok("logs", str(job["id"])).stdout
    assert "distributed checkpoint at step" not in logs and "Traceback" not in logs, logs[-3000:]
    (final,) = [d for d in home.rglob(f"dcp/step-{STEPS}") if d.is_dir()]   # renamed in once all wrote
    assert sorted(p.name for p in final.iterdir()) == ["rank-0", "rank-1"]
    r = json.loads(report.read_text())
    assert [s for s, _, _ in r["step_log"]] == list(range(STEPS)) and {w for _, _, w in r["step_log"]} == {2}
    close(r["params"], reference(tmp_path, "--no-shard"))


def dcp_steps(home: Path) -> list[int]:
    """The steps of the job's whole distributed checkpoints (renamed in once every rank wrote;
    one being written is step-N.tmp), [0] while there is none."""
    return [int(m.group(1)) for d in home.rglob("dcp/step-*")
            if d.is_dir() and (m := re.fullmatch(r"step-(\d+)", d.name))] or [0]


def resumed_steps(logs: str) -> list[int]:
    """The steps the job's restarts resumed at, from the workers' log lines."""
    return [int(part.split()[0]) for part in logs.split("resumed from checkpoint at step ")[1:]]


def test_a_member_killed_then_the_store_lost_each_restart_the_job_from_its_distributed_checkpoint(
        ej, home, tmp_path):
    """One job, two faults (one job run for both: the suite's time).

    kill -9 of a member of a 3-worker sharded job (2 may go on): the survivors end with
    SHARDS_LOST_EXIT, the job is requeued (cause shards-lost, not counted against --retries)
    and restarts from its last DCP checkpoint at whatever size it gets, replaying the steps
    since. Then, in the restarted run, the job store killed: every member exits
    STORE_LOST_EXIT and the job restarts again from its DCP checkpoint (not from step 0).
    It ends as the unsharded run, every sample once."""
    report, hold = home / "r.json", home / "hold"
    epochs = ["--epochs", "4"]   # 64 steps; 1 s checkpoints (the ej config)
    hold.touch()   # the pace held until the store is killed; then the job runs out at full speed
    job = ej.submit([sys.executable, str(EXAMPLE), *ARGS, *epochs, "--step-sleep", "0.2", "--sleep-while", str(hold),
                     "--report", str(report)], "--workers", "2:3", "--elastic", "inplace")
    running = wait_for(ej, job["id"], lambda j: step_of(j) >= 12 and j["world_size"] == 3, "steps at world size 3")
    victim = live_members(running)[1]
    os.kill(victim["pid"], 9)
    def resumed_so_far() -> list[int]:
        return resumed_steps(ej.inside("logs", str(job["id"])))

    wait_for(ej, job["id"], lambda j: j["restarts"] == 1 and j["state"] == "running" and resumed_so_far(),
             "the restart after the kill")
    (first_resumed,) = resumed_so_far()
    assert 0 < first_resumed <= step_of(running) + 10, (first_resumed, step_of(running))
    # a checkpoint past the one it resumed from is the restarted run's (a resume takes the last whole one)
    restarted = wait_for(ej, job["id"], lambda j: max(dcp_steps(home)) > first_resumed,
                         "a checkpoint of the restarted run")
    assert restarted["restarts"] == 1, restarted
    (store_pgid,) = db_rows(home / "g.db", "SELECT store_pgid FROM jobs WHERE id = ?", (job["id"],))[0]
    os.killpg(store_pgid, 9)
    wait_for(ej, job["id"], lambda j: j["restarts"] == 2 and j["state"] == "running", "the restart after the store")
    hold.unlink()
    done = ej.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded" and done["restarts"] == 2, done
    first_run = done["workers"][:3]
    assert sorted(w["exit_code"] for w in first_run) == [-9, SHARDS_LOST_EXIT, SHARDS_LOST_EXIT], first_run
    requeues = [e for e in ej.json("events", str(job["id"])) if (e["data"] or {}).get("cause") == "shards-lost"]
    assert requeues and f"worker {victim['wid']}" in requeues[0]["message"], requeues
    lost_store_run = [w for w in done["workers"][3:] if w["wid"] in {m["wid"] for m in live_members(restarted)}]
    assert lost_store_run and {w["exit_code"] for w in lost_store_run} == {STORE_LOST_EXIT}, done["workers"]
    logs = ej.ok("logs", str(job["id"])).stdout
    resumed = resumed_steps(logs)
    assert len(resumed) == 2 and resumed[0] == first_resumed and resumed[1] > first_resumed, resumed
    assert logs.count("shards restored from") >= 2 and "/dcp/step-" in logs
    r = json.loads(report.read_text())
    assert_every_sample_once(r, N, 2 * STEPS, B)
    close(r["params"], reference(tmp_path, "--no-shard", *epochs))


def test_a_cancelled_sharded_job_resumes_at_another_size_with_resume_from(ej, home, tmp_path):
    """Job A (2 workers) is cancelled mid-run: its stop writes a distributed checkpoint.
    Job B (`submit --resume-from` A's checkpoint directory, 3 workers) starts at A's step
    with A's shards cut for 3, and ends as the unsharded run, every sample once (its logs
    go on from A's)."""
    epochs = ["--epochs", "4"]
    argv = [sys.executable, str(EXAMPLE), *ARGS, *epochs]
    a = ej.submit([*argv, "--step-sleep", "0.2", "--report", str(home / "a.json")], "--workers", "2",
                  "--elastic", "inplace")   # paced: cancelled mid-run; B is not
    wait_for(ej, a["id"], lambda j: step_of(j) >= 10, "steps of job A")
    ej.ok("cancel", str(a["id"]))
    a_done = ej.wait_final(a["id"], DEADLINE_S)
    assert a_done["state"] == "cancelled", a_done
    ckpt = a_done["checkpoint_dir"]
    b = ej.submit([*argv, "--report", str(home / "b.json")], "--workers", "3", "--elastic", "inplace",
                  "--resume-from", ckpt)
    done = ej.wait_final(b["id"], DEADLINE_S)
    assert done["state"] == "succeeded" and done["resume_from"] == ckpt, done
    logs = ej.ok("logs", str(b["id"])).stdout
    (resumed,) = resumed_steps(logs)
    assert resumed >= 10 and f"shards restored from {ckpt}/dcp/step-{resumed}" in logs, logs[-2000:]
    r = json.loads((home / "b.json").read_text())
    assert_every_sample_once(r, N, 2 * STEPS, B)
    sizes = [ws for _, _, ws in r["step_log"]]
    assert sizes[:resumed] == [2] * resumed and set(sizes[resumed:]) == {3}
    close(r["params"], reference(tmp_path, "--no-shard", *epochs))
