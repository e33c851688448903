"""The runtime API that real scripts use: step mode, `run.accumulate`, `run.global_mean`,
`run.register`, `run.loader(..., num_workers=...)` and a model's buffers as state.

Without processes: the sampler's step mode, micro-batch bounds, registration, the loader's
request stream. With processes: a real coordinator (`python -m gpuflex.elastic.coordinator`,
its TCPStore) and real workers over gloo, resized through the coordinator's control
socket, each worker running WORKER below and writing a JSON report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torch.utils.data import TensorDataset

from gpuflex.elastic.state.buffers import BufferSync, check_rule
from gpuflex.elastic.membership.collectives import Collectives
from gpuflex.elastic.data.loader import Prefetcher
from gpuflex.elastic.data.micro import micro_bounds, warm_up_steps
from gpuflex.elastic.run.runtime import ElasticRun
from gpuflex.elastic.data.sampler import ElasticSampler
from gpuflex.hosts.relay import unix_request
from tests import REPO as ROOT

DEADLINE_S = 240


# ---- without processes ---------------------------------------------------------------------
def test_step_mode_crosses_epochs_and_the_last_one_is_partial():
    s = ElasticSampler(50, 8, steps=9, seed=0)   # 7 steps an epoch
    assert (s.total_steps, s.epochs, s.steps_per_epoch) == (9, 2, 7)
    assert s.batch(8, 0, 1).epoch == 1 and s.batch(8, 0, 1).step_in_epoch == 1
    assert ElasticSampler(50, 8, epochs=2).total_steps == 14


@pytest.mark.parametrize("kw,msg", [({}, "exactly one"), ({"epochs": 1, "steps": 3}, "exactly one"),
                                    ({"steps": 0}, "steps must be >= 1"), ({"epochs": 0}, "epochs must be")])
def test_epochs_and_steps_bad_combinations_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ElasticSampler(50, 8, **kw)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=msg):
        ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), num_samples=50,
                   global_batch_size=8, **kw)


def test_micro_batch_bounds_cover_the_share_once():
    assert micro_bounds(10, 4, None) == [(0, 4), (4, 8), (8, 10)]
    assert micro_bounds(10, None, 3) == [(0, 4), (4, 7), (7, 10)]
    assert micro_bounds(2, None, 4) == [(0, 1), (1, 2)]     # no empty micro-batch
    assert micro_bounds(0, 4, None) == [(0, 0)]              # but always one: the reduce must happen
    for bad in ((None, None), (4, 2), (0, None), (None, 0)):
        with pytest.raises(ValueError):
            micro_bounds(10, *bad)


def make_model(bn: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    mid = [torch.nn.BatchNorm1d(16)] if bn else []
    return torch.nn.Sequential(torch.nn.Linear(6, 16), *mid, torch.nn.Tanh(), torch.nn.Linear(16, 1))


def data(n: int = 60) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g))


def train_alone(micro: int | None, steps: int = 9) -> tuple[list[float], list[float]]:
    """A standalone run, with or without accumulation: its parameters and logged losses."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = ElasticRun(model=model, optimizer=opt, num_samples=60, global_batch_size=16, steps=steps, seed=2)
    logged = []
    for x, y in run.loader(data()):
        opt.zero_grad()
        if micro:
            total = 0.0
            for xb, yb in run.accumulate(x, y, micro_batch_size=micro):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                run.backward(loss)
                total += float(loss.detach()) * len(xb)
            logged.append(run.global_mean(total / len(x)))
        else:
            loss = torch.nn.functional.mse_loss(model(x), y)
            run.backward(loss)
            logged.append(run.global_mean(loss))
        opt.step()
    assert run.step == steps
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(), logged


def test_accumulate_alone_gives_the_full_batch_gradient():
    whole, logged = train_alone(None)
    for micro in (1, 5):
        params, logged_m = train_alone(micro)
        assert torch.allclose(torch.tensor(params), torch.tensor(whole), rtol=1e-5, atol=1e-6)
        assert logged_m == pytest.approx(logged, rel=1e-5)


def test_accumulate_refuses_tensors_that_are_not_this_ranks_share():
    model = make_model()
    run = ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), num_samples=60,
                     global_batch_size=16, steps=1)
    for x, y in run.loader(data()):
        with pytest.raises(ValueError, match="share"):
            next(run.accumulate(x[:3], y[:3], micro_batch_size=2))
        with pytest.raises(ValueError, match="differ in length"):
            next(run.accumulate(x, y[:3], micro_batch_size=2))
        run.backward(torch.nn.functional.mse_loss(model(x), y))


PUBLIC = {"accumulate", "agreement", "all_reduce", "backend", "backward", "barrier", "batch", "buffers",
          "checkpoint_dir", "checkpoint_interval_s", "destroy_process_group", "device", "distributed", "env",
          "epoch", "epochs", "formation", "full_parameters", "generation", "global_mean", "group", "is_primary",
          "loader", "micro", "model", "optimizer", "pg", "pg_timeout_s", "progress", "rank", "rdzv", "register",
          "registry", "sampler", "samples", "scheduler", "sharding", "signals", "split", "state", "status", "step",
          "step_log", "stopped", "store_address", "track_samples", "warm_up_steps", "warming_up", "wid",
          "world_size"}


def test_the_run_keeps_every_public_name_it_had_as_one_class_of_mixins():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = ElasticRun(model=model, optimizer=opt, num_samples=60, global_batch_size=16, steps=1)
    assert PUBLIC - set(dir(run)) == set()
    assert (run.model, run.optimizer, run.rank, run.world_size, run.step, run.is_primary) == (model, opt, 0, 1, 0, True)


def test_the_loader_keeps_persistent_workers_true_and_refuses_false():
    """Its read-ahead workers live for the whole run: True (a converted DataLoader call's)
    is what happens, False cannot be done and is not silently ignored."""
    model = make_model()
    run = ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), num_samples=60,
                     global_batch_size=16, steps=1)
    with pytest.raises(ValueError, match="persistent_workers=False"):
        run.loader(data(), persistent_workers=False)
    assert len(run.loader(data(), persistent_workers=True)) == 1


def test_register_refuses_a_taken_name_and_a_late_call_and_its_dict_is_undone(monkeypatch):
    monkeypatch.setenv("GPUFLEX_STORE", "127.0.0.1:1")   # distributed: it commits (never started here)
    model = make_model()
    run = ElasticRun(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), num_samples=60,
                     global_batch_size=16, steps=4, extra={"a": {"x": 1}})
    best = {"val_loss": 9.0}
    assert run.register("best", best) is best
    with pytest.raises(ValueError, match="already registered"):
        run.register("a", {})
    with pytest.raises(TypeError):
        run.register("bad", object())
    run.state.commit()
    best["val_loss"] = 1.0          # a step that fails afterwards ...
    run.state.undo_step()           # ... is undone, the script's scalars with it
    assert best == {"val_loss": 9.0}
    assert run.state.capture()["objects"]["extra.best"] == {"val_loss": 9.0}   # carried and checkpointed
    run.ctx.started = True   # the loop has begun
    with pytest.raises(RuntimeError, match="before the loop"):
        run.register("late", {})


def test_warm_up_is_one_pass_for_a_compiled_model_else_as_given():
    model = make_model()
    assert warm_up_steps(model, None) == 0 and warm_up_steps(model, 3) == 3
    assert warm_up_steps(torch.compile(model), None) == 1
    with pytest.raises(ValueError):
        warm_up_steps(model, -1)
    with pytest.raises(ValueError, match="buffers must be one of"):
        check_rule("mean")


def test_buffer_sync_is_skipped_alone_and_without_buffers():
    group = Collectives(torch.device("cpu"), timeout_s=1)   # world size 1, no process group
    assert BufferSync(make_model(bn=True), group).sync(1.0) is True
    group.world_size = 2
    assert BufferSync(make_model(bn=False), group).sync(1.0) is True   # nothing to send: no collective
    assert group.failure is None


def test_the_loaders_workers_yield_exactly_the_wanted_batch_across_a_resize_and_an_undo():
    ds = TensorDataset(torch.arange(100).float())
    sampler = ElasticSampler(100, 10, epochs=3, seed=4)
    pre = Prefetcher(ds, sampler, 2, prefetch_factor=2)
    try:
        wanted = [(s, 0, 1) for s in range(6)] + [(s, 1, 3) for s in range(6, 12)]   # a grow to 3 at step 6
        wanted += [(11, 1, 3)] + [(s, 0, 2) for s in range(12, 30)]              # step 11 undone, a shrink
        for step, rank, world in wanted:
            b = sampler.batch(step, rank, world)
            (x,) = pre.get(b)
            assert x.long().tolist() == b.indices.tolist()
        # stale read-ahead is thrown away, never more than the prefetch depth (4) at each change:
        # the empty requests made before the first step, the grow, the undo, the shrink
        assert 0 < pre.discarded <= 4 * 4
        assert pre.it is not None
    finally:
        pre.close()
    assert pre.it is None


# ---- with processes --------------------------------------------------------------------------
WORKER = r'''
import json, sys, time
import torch
from torch.utils.data import Dataset
from gpuflex.elastic import ElasticRun

a = json.loads(sys.argv[1])

class Indexed(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i], torch.tensor(i)

torch.manual_seed(0)
mid = [torch.nn.BatchNorm1d(16)] if a["bn"] else []
model = torch.nn.Sequential(torch.nn.Linear(6, 16), *mid, torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
run = ElasticRun(model=model, optimizer=opt, num_samples=a["n"], global_batch_size=a["b"], steps=a["steps"],
                 seed=1, buffers=a["buffers"], track_samples=True)
counters = run.register("counters", {"steps": 0, "best": 1e9})
loader = run.loader(Indexed(a["n"]), num_workers=a["workers"])
wrong, logged = 0, {}
for x, y, idx in loader:
    wrong += idx.tolist() != run.batch.indices.tolist()
    opt.zero_grad()
    total = 0.0
    for xb, yb in run.accumulate(x, y, micro_batch_size=a["micro"]):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        run.backward(loss)
        total += float(loss.detach()) * len(xb)
    opt.step()
    mean = run.global_mean(total / max(1, len(x)))
    logged[run.step] = mean
    counters["steps"] += 1
    counters["best"] = min(counters["best"], mean)
    with open(a["progress"], "w") as f:
        f.write(str(run.step))
    try:   # the test sets the pace: slow while a newcomer starts, fast after
        time.sleep(float(open(a["pace"]).read()))
    except (OSError, ValueError):
        pass
pre = loader.prefetcher
with open(a["report"], "w") as f:
    json.dump({"rank": run.rank, "generation": run.generation, "step": run.step, "counters": counters,
               "wrong": wrong, "discarded": pre.discarded if pre else 0, "logged": logged,
               "workers_closed": pre is None or pre.it is None,
               "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
               "buffers": [b.double().reshape(-1).tolist() for b in model.buffers()],
               "samples": run.samples, "step_log": run.step_log}, f)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A coordinator and its workers, as gpuflex's control side would start them."""

    def __init__(self, tmp: Path, members: list[int], **args) -> None:
        self.tmp, self.port = tmp, free_port()
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        self.args = {"n": 90, "b": 16, "steps": 40, "buffers": "broadcast", "workers": 0, "micro": 5,
                     "bn": True, "pace": str(tmp / "pace"), **args}
        sock_dir = Path(f"/tmp/gpuflex-test-{os.getpid()}-{self.port}")
        sock_dir.mkdir(mode=0o700)
        self.control = str(sock_dir / "coord.sock")
        self.procs: dict[int, subprocess.Popen] = {}
        env = self.env()
        self.coordinator = subprocess.Popen(
            [sys.executable, "-m", "gpuflex.elastic.coordinator", "--port", str(self.port), "--members",
             ",".join(map(str, members)), "--control", self.control, "--bind", "127.0.0.1",
             "--heartbeat-timeout", "10"], env=env, stdout=open(tmp / "coord.log", "w"), stderr=subprocess.STDOUT)
        self.wait(lambda: os.path.exists(self.control), "the coordinator's socket")
        for w in members:
            self.start(w)

    def env(self, wid: int | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GPUFLEX_PG_TIMEOUT_S="30",
                   GPUFLEX_HEARTBEAT_TIMEOUT_S="10",
                   GPUFLEX_SPLIT="even")   # the shares these tests name (speed splits: test_hetero_split)
        if wid is not None:
            env.update(GPUFLEX_STORE=f"127.0.0.1:{self.port}", GPUFLEX_WORKER_ID=str(wid))
        return env

    def start(self, wid: int) -> None:
        args = dict(self.args, report=str(self.tmp / f"report-{wid}.json"),
                    progress=str(self.tmp / f"progress-{wid}"))
        self.procs[wid] = subprocess.Popen([sys.executable, str(self.script), json.dumps(args)], env=self.env(wid),
                                           stdout=open(self.tmp / f"worker-{wid}.log", "w"), stderr=subprocess.STDOUT)

    def step_of(self, wid: int) -> int:
        try:
            return int((self.tmp / f"progress-{wid}").read_text() or -1)
        except (OSError, ValueError):
            return -1

    def resize(self, members: list[int]) -> None:
        reply = unix_request(self.control, {"op": "resize", "members": members}, timeout=10)
        assert reply["ok"], reply

    def wait(self, pred, what: str) -> None:
        end = time.monotonic() + DEADLINE_S
        while not pred():
            if time.monotonic() > end or any(p.poll() not in (None, 0) for p in self.procs.values()):
                raise AssertionError(f"waiting for {what}: {self.logs()}")
            time.sleep(0.1)

    def finish(self) -> dict[int, dict]:
        for wid, p in self.procs.items():
            try:
                rc = p.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                rc = None
            assert rc == 0, f"worker {wid} ended with {rc}: {self.logs()}"
        return {w: json.loads((self.tmp / f"report-{w}.json").read_text())
                for w in self.procs if (self.tmp / f"report-{w}.json").exists()}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def close(self) -> None:
        for p in [*self.procs.values(), self.coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for f in Path(self.control).parent.iterdir():
            f.unlink()
        Path(self.control).parent.rmdir()


@pytest.fixture
def job(tmp_path):
    jobs: list[Job] = []

    def make(members: list[int], **args) -> Job:
        jobs.append(Job(tmp_path, members, **args))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


def assert_every_sample_once(report: dict, n: int, steps: int, b: int) -> None:
    spe = -(-n // b)
    for epoch, ids in report["samples"].items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample twice"
        if (int(epoch) + 1) * spe <= steps:
            assert sorted(ids) == list(range(n)), f"epoch {epoch} not exactly once"
    assert [s for s, _, _ in report["step_log"]] == list(range(steps))


def test_bn_buffers_loader_workers_and_registered_state_across_a_grow_and_a_shrink(job):
    """2 -> 3 -> 2 (the newcomer stays, worker 1 leaves), BatchNorm, a DataLoader with 2
    workers, accumulation: no rollback (the checksums, buffers included, agree at every
    formation), the buffers and the registered scalars equal on the final members, the
    loader gave exactly the run's batch at every step, every sample once per epoch."""
    j = job([0, 1], workers=2, steps=60, b=18, micro=3)   # shares of 9 or 6: micro-batches of 3 (BN needs 2+)
    pace = Path(j.args["pace"])
    pace.write_text("0.5")                      # slow, so the newcomer joins well before the end
    j.wait(lambda: j.step_of(0) >= 8, "step 8")
    j.start(2)
    j.resize([0, 1, 2])
    j.wait(lambda: j.step_of(2) >= 0, "the newcomer's first step")
    grown_at = j.step_of(2)
    j.wait(lambda: j.step_of(2) >= grown_at + 6, "6 steps at 3")
    j.resize([0, 2])
    j.wait(lambda: j.procs[1].poll() == 0, "worker 1 to leave")
    pace.write_text("0")
    reports = j.finish()
    assert sorted(reports) == [0, 2]            # worker 1 left (exit 0, no report)
    r0, r2 = reports[0], reports[2]
    assert r0["generation"] == r2["generation"] == 3, "a rollback or recovery generation happened"
    assert r0["step"] == r2["step"] == 60
    assert r0["buffers"] == r2["buffers"] and r0["params"] == r2["params"]
    assert r0["counters"] == r2["counters"] and r0["counters"]["steps"] == 60
    assert r0["counters"]["best"] == min(r0["logged"].values())
    assert r0["wrong"] == r2["wrong"] == 0
    assert r0["discarded"] + r2["discarded"] > 0   # the read-ahead of an old split was thrown away
    assert r0["workers_closed"] and r2["workers_closed"]
    assert sorted({w for _, _, w in r0["step_log"]}) == [2, 3]
    assert_every_sample_once(r0, 90, 60, 18)
    assert "checksums differ" not in j.logs()


def test_accumulate_at_two_ranks_equals_a_standalone_run_without_it(job, tmp_path):
    """The full-batch mean gradient whatever the split and the micro-batches; the logged
    global mean equals the standalone run's loss."""
    j = job([0, 1], bn=False, micro=3, steps=20)
    reports = j.finish()
    ref_report = tmp_path / "ref.json"
    args = dict(j.args, micro=100, report=str(ref_report), progress=str(tmp_path / "p-ref"))
    subprocess.run([sys.executable, str(j.script), json.dumps(args)], env=j.env(), check=True, timeout=DEADLINE_S)
    ref = json.loads(ref_report.read_text())
    for r in reports.values():
        assert r["step"] == 20 and r["generation"] == 1
        assert torch.allclose(torch.tensor(r["params"]), torch.tensor(ref["params"]), rtol=1e-5, atol=1e-6)
        assert list(r["logged"].values()) == pytest.approx(list(ref["logged"].values()), rel=1e-5)
    assert reports[0]["logged"] == reports[1]["logged"]   # the same global mean on every rank


def test_averaged_buffers_are_equal_on_every_rank_and_follow_every_ranks_samples(job):
    j = job([0, 1], buffers="average", micro=100, steps=6)
    reports = j.finish()
    assert reports[0]["buffers"] == reports[1]["buffers"]
    bj = job([0, 1], buffers="broadcast", micro=100, steps=6)
    rb = bj.finish()
    assert rb[0]["buffers"] == rb[1]["buffers"]
    mean_avg, mean_b = torch.tensor(reports[0]["buffers"][0]), torch.tensor(rb[0]["buffers"][0])
    assert not torch.allclose(mean_avg, mean_b)   # rank 0's statistics alone differ from the average
    assert reports[0]["buffers"][2] == rb[0]["buffers"][2] == [6.0]   # num_batches_tracked: rank 0's
