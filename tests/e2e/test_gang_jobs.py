"""Gang jobs (issue 11 items 1 and 2): any torch.distributed program, as torchrun runs it.

A job that is not an in-place elastic one runs as a gang of N workers with torchrun's
environment contract. Real processes: an unmodified env:// DDP script
(examples/torchrun/ddp_tutorial.py) on the local pool and across two sshd hosts, torchrun
as the command (2 nodes x 2 processes), a gang whose worker is killed or exits 3 (stopped,
failed with that code, relaunched once with --retries 1), and a plain command that runs
longer than the formation deadline and the orphan timeout (it ran once: before gang mode
it was requeued again and again).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from gpuflex.control.launch import Layout, visible_gpus
from gpuflex.db.models import Job
from gpuflex.cli.render import forming_text
from gpuflex.elastic.protocol.env import WorkerEnv
from gpuflex.elastic.coordinator.failures import Heartbeats
from gpuflex.elastic.coordinator.forming import NOT_JOINED_ADVICE, FormationWatch, never_joined_reason
from gpuflex.hosts.hostops import group_alive
from gpuflex.policy.lifecycle import Finish, JobFacts, Requeue, WorkerFacts, gang_failure
from gpuflex.states import JobState, WorkerState
from tests import REPO
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows, py
from tests.sshbed import host_toml, restart_sshd, ssh_hosts  # noqa: F401 (fixtures)

DDP = str(REPO / "examples" / "torchrun" / "ddp_tutorial.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
FORMATION_S = 1
ORPHAN_S = 2
DEADLINE_S = 300


def config(home: Path, hosts: str, jobs: str = "") -> Path:
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
                   f"[jobs]\ncancel_grace_s = 3\n{jobs}\n" + hosts)
    return cfg


def local_host(home: Path, slots: int = 4) -> str:
    return f'[[hosts]]\nname = "local"\naddress = "local"\ngpus = "cpu:{slots}"\nworkdir = "{home}/work"\n'


@pytest.fixture
def gj(home):
    """The local pool (4 CPU slots) with a formation deadline and an orphan timeout of
    seconds: a plain process outlives both."""
    cli = GpuflexCLI(home, config(home, local_host(home), f"formation_timeout_s = {FORMATION_S}\n"
                                                         f"orphan_timeout_s = {ORPHAN_S}\n"))
    yield cli
    cleanup_jobs(cli, home / "g.db")


# ---- the pure parts ---------------------------------------------------------------------------
def test_a_layout_gives_local_ranks_host_groups_and_the_gpus_in_local_rank_order():
    run = Layout.of([("a", [3]), ("b", [0]), ("a", [1]), ("c", [2]), ("b", [1])], master_port=5)
    assert [run.local_ranks(r).index(r) for r in range(5)] == [0, 0, 1, 0, 1]        # LOCAL_RANK
    assert [len(run.local_ranks(r)) for r in range(5)] == [2, 2, 2, 1, 2]             # LOCAL_WORLD_SIZE
    assert [run.group_rank(r) for r in range(5)] == [0, 1, 0, 2, 1]                   # GROUP_RANK
    assert run.local_devices(2) == (3, 1)


@pytest.mark.parametrize("elastic,argv,own,visible", [
    (None, ["python", "t.py"], (1,), (3, 1)),            # a gang, one GPU each: cuda:{LOCAL_RANK} is its own
    ("restart", ["python", "t.py"], (1,), (3, 1)),
    ("inplace", ["python", "t.py"], (1,), None),         # the runtime uses cuda:0
    (None, ["torchrun", "--nproc-per-node", "1", "t.py"], (1,), None),   # torchrun's node: its own GPUs
    (None, ["python", "t.py"], (1, 2), None),            # several GPUs each: its own
])
def test_cuda_visible_devices_follows_torchruns_convention(elastic, argv, own, visible):
    run = Layout.of([("a", [3]), ("b", [0]), ("a", list(own))])
    assert visible_gpus(Job(elastic=elastic, argv=argv), run, 2, own) == visible


def test_a_torchrun_node_gets_a_static_rendezvous_and_no_restarts_of_its_own():
    env = WorkerEnv(rank=1, world_size=2, master_addr="10.0.0.1", master_port=29511, gpus=(5,),
                    visible_gpus=(4, 5), local_rank=1, local_world_size=2, restart_count=2)
    assert env.torchrun_env() == {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_RDZV_BACKEND": "static",
                                  "PET_MAX_RESTARTS": "0", "PET_MASTER_ADDR": "10.0.0.1",
                                  "PET_MASTER_PORT": "29511"}
    vars = env.to_env()
    assert (vars["CUDA_VISIBLE_DEVICES"], vars["GPUFLEX_CUDA_DEVICE"], vars["LOCAL_RANK"]) == ("4,5", "1", "1")
    assert (vars["GPUFLEX_RESTART_COUNT"], vars["TORCHELASTIC_RESTART_COUNT"]) == ("2", "2")
    assert WorkerEnv.from_environ(vars) == env


def gang(elastic, *ends, retries=0, crash_restarts=0) -> JobFacts:
    """A two-worker job on hosts a and b; `ends`: (wid, state, exit code, ended_at)."""
    workers = {0: WorkerFacts(0, "a", WorkerState.RUNNING), 1: WorkerFacts(1, "b", WorkerState.RUNNING)}
    for wid, state, rc, at in ends:
        workers[wid] = WorkerFacts(wid, workers[wid].host, state, exit_code=rc, ended_at=at)
    return JobFacts(7, JobState.RUNNING, 2, tuple(workers.values()), elastic=elastic, retries=retries,
                    crash_restarts=crash_restarts, restarts=crash_restarts)


@pytest.mark.parametrize("job,wid,outcome", [
    (gang(None), None, None),
    (gang(None, (0, WorkerState.EXITED, 0, 5.0)), None, None),                # rank 0 done first: wait for 1
    (gang(None, (1, WorkerState.FAILED, -9, 5.0)), 1,
     Finish(JobState.FAILED, 137, "worker 1 on b was killed by signal 9 (exit code 137)")),
    (gang(None, (1, WorkerState.LOST, None, None)), 1, Finish(JobState.FAILED, 137, "no exit record")),
    # the first to end decides: worker 0 failed because worker 1 was killed
    (gang(None, (0, WorkerState.FAILED, 3, 6.0), (1, WorkerState.FAILED, -15, 5.0)), 1,
     Finish(JobState.FAILED, 143, "signal 15")),
    (gang(None, (0, WorkerState.FAILED, 3, 5.0), retries=1), 0, Requeue("relaunch 1 of 1", "gang")),
    (gang(None, (0, WorkerState.FAILED, 3, 5.0), retries=1, crash_restarts=1), 0,
     Finish(JobState.FAILED, 3, "worker 0 on a ended with exit code 3")),
    (gang("restart", (0, WorkerState.FAILED, -9, 5.0)), 0, Requeue("from its checkpoint", "fault")),
    (gang("restart", (0, WorkerState.FAILED, 3, 5.0)), 0, Finish(JobState.FAILED, 3, "exit code 3")),
])
def test_a_gang_is_stopped_and_fails_with_its_first_bad_workers_code_unless_retries_are_left(job, wid, outcome):
    actions = gang_failure(job, job.workers, None, {})
    if outcome is None:
        assert actions == []
        return
    record, end = actions
    assert (record.kind, record.data["wid"], record.data["host"]) == ("worker-failed", wid, "ab"[wid])
    assert type(end) is type(outcome) and outcome.reason in end.reason
    if isinstance(outcome, Finish):
        assert (end.state, end.exit_code, record.data["exit_code"]) == (outcome.state, outcome.exit_code,
                                                                         outcome.exit_code)
    else:
        assert end.cause == outcome.cause


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch(beating: set[int], clock: Clock) -> FormationWatch:
    hb = Heartbeats(lambda key: int(key.rsplit("/", 1)[1]) in beating, lambda key: str(clock.now).encode(), 3.0, clock)
    return FormationWatch(10.0, hb, lambda key: False, clock=clock, wall=lambda: 1000.0)


def test_an_inplace_job_of_a_plain_script_says_so_and_a_gang_waits_for_its_processes():
    clock = Clock()
    plain, gang_watch, killed = watch(set(), clock), watch(set(), clock), watch({1}, clock)
    gang_watch.as_gang()
    for w in (plain, gang_watch, killed):
        assert w.first([0, 1], [], 1) is None
    assert "hint" not in plain.record()            # it may still be importing torch
    clock.now = 6.0                               # past half the deadline: status says why
    assert plain.first([0, 1], [], 1) is None and "--elastic restart" in plain.record()["hint"]
    assert "never joined the gpuflex.elastic runtime" in forming_text(plain.record(), now=1006.0)
    clock.now = 11.0
    ended = plain.first([0, 1], [], 1)    # at the deadline: the job ends, never held (a requeue would loop)
    assert ended.hold is None and ended.end == never_joined_reason(2, 10.0)
    assert ended.end.startswith("its 2 worker(s) never joined the gpuflex.elastic runtime") and NOT_JOINED_ADVICE in ended.end
    assert gang_watch.first([0, 1], [], 1) is None and gang_watch.record() is None   # never dropped nor held
    # worker 1 beat (a gpuflex.elastic script), worker 0 was killed while it started: no hint
    assert killed.first([0, 1], [1], 1).hold is None and "runtime" not in killed.first([0, 1], [1], 1).message


# ---- real processes ---------------------------------------------------------------------------
def ranks(out: Path, world: int) -> list[dict]:
    """Every rank's file, in rank order; each saw the same world and ended with the same
    parameters (DDP keeps them equal)."""
    files = sorted(out.glob("rank-*.json"))
    got = sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])
    assert [r["rank"] for r in got] == list(range(world))
    assert {r["world_size"] for r in got} == {world}
    assert len({r["hash"] for r in got}) == 1, [r["hash"] for r in got]
    assert json.loads((out / "params.json").read_text())   # rank 0's parameters
    return got


def events(cli: GpuflexCLI, job_id: int, kind: str) -> list[dict]:
    return [e for e in cli.json("events", str(job_id)) if e["kind"] == kind]


def test_a_plain_command_longer_than_the_formation_deadline_and_the_orphan_timeout_runs_once(gj, home):
    job = gj.submit(["sleep", "10"])
    # no command for longer than the orphan timeout: the coordinator lives on while its
    # local worker runs (its exit record not written), and the deadline never holds it
    time.sleep(ORPHAN_S + FORMATION_S + 4)
    done = gj.wait_final(job["id"], DEADLINE_S)
    assert (done["state"], done["exit_code"], done["restarts"], done["elastic"]) == ("succeeded", 0, 0, None), done
    jobdir = next((home / "work" / "jobs").iterdir())
    assert "held" not in (jobdir / "coordinator.log").read_text()
    # it may end itself once its worker ended and no command came for the orphan timeout
    # (a loaded host's commands are slow), never while the worker ran
    # (an orphan's record is written by its supervisor; one stopped by the finish may not be yet)
    worker = json.loads((jobdir / "worker-0.exit").read_text())
    if (jobdir / "coordinator.exit").exists():
        coordinator = json.loads((jobdir / "coordinator.exit").read_text())
        assert coordinator["ended_at"] >= worker["ended_at"], (coordinator, worker)
    assert not [e for e in gj.json("events", str(job["id"])) if e["kind"] == "state" and "queued" in e["message"]
                and e["data"].get("cause")]


def test_the_ddp_tutorial_runs_unmodified_on_the_local_pool(gj, home):
    out = home / "out"
    job = gj.submit([sys.executable, DDP, "--out", str(out)], "--workers", "2")
    done = gj.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded" and done["restarts"] == 0, (done, gj("logs", str(job["id"])).stdout[-3000:])
    env = [r["env"] for r in ranks(out, 2)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in env] == \
        [("0", "0", "2", "0"), ("1", "1", "2", "0")]
    assert {e["MASTER_ADDR"] for e in env} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in env}) == 1
    store_port = db_rows(home / "g.db", "SELECT store_port FROM jobs")[0][0]
    assert env[0]["MASTER_PORT"] != str(store_port)
    assert {(e["GPUFLEX_RESTART_COUNT"], e["TORCHELASTIC_RESTART_COUNT"]) for e in env} == {("0", "0")}
    assert {e["CUDA_VISIBLE_DEVICES"] for e in env} == {None}   # CPU slots


def test_torchrun_as_the_command_two_nodes_of_two_processes(gj, home):
    out = home / "out"
    job = gj.submit([TORCHRUN, "--nproc-per-node", "2", DDP, "--out", str(out)],
                    "--workers", "2", "--gpus-per-worker", "2")
    done = gj.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded", (done, gj("logs", str(job["id"])).stdout[-3000:])
    env = [r["env"] for r in ranks(out, 4)]
    assert [(e["LOCAL_RANK"], e["GROUP_RANK"]) for e in env] == [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")]


# rank 1 is SIGKILLed in the first run and exits 3 in the second; rank 0 would sleep on
FAILING = """
import os, signal, sys, time
out, run, rank = sys.argv[1], os.environ["GPUFLEX_RESTART_COUNT"], os.environ["RANK"]
with open(os.path.join(out, f"run{run}-rank{rank}"), "w") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"])
if rank == "1":
    time.sleep(1)
    if run == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(600)
"""


def test_a_failed_worker_stops_the_gang_which_is_relaunched_once_then_fails_with_its_code(gj, home):
    out = home / "out"
    out.mkdir()
    job = gj.submit([*py(FAILING), str(out)], "--workers", "2", "--retries", "1")
    done = gj.wait_final(job["id"], DEADLINE_S)
    assert (done["state"], done["exit_code"], done["restarts"]) == ("failed", 3, 1), done
    assert sorted(p.name for p in out.iterdir()) == ["run0-rank0", "run0-rank1", "run1-rank0", "run1-rank1"]
    assert (out / "run1-rank1").read_text() == "1"   # TORCHELASTIC_RESTART_COUNT in the relaunch
    failed = events(gj, job["id"], "worker-failed")
    assert [(e["data"]["exit_code"], e["data"]["host"]) for e in failed] == [(137, "local"), (3, "local")]
    assert "signal 9" in failed[0]["message"] and "ended with exit code 3" in failed[1]["message"]
    # rank 0 (sleeping) was stopped both times, rank 1 failed
    assert sorted((w["rank"], w["state"]) for w in done["workers"]) == \
        [(0, "stopped"), (0, "stopped"), (1, "failed"), (1, "failed")], done["workers"]
    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers")]
    assert len(pgids) == 4 and not any(group_alive(p) for p in pgids)


@pytest.fixture
def two_hosts(ssh_hosts, home):
    bed = ssh_hosts
    bed.reset_smi()
    cli = GpuflexCLI(home, config(home, "\n".join(host_toml(h, bed) for h in bed.hosts[:2])))
    yield cli
    for h in bed.hosts:
        if h.proc is None or h.proc.poll() is not None:
            restart_sshd(bed, h)
    cleanup_jobs(cli, home / "g.db")


def test_the_ddp_tutorial_across_two_sshd_hosts_with_torchruns_environment(two_hosts, home):
    out = home / "out"
    job = two_hosts.submit([sys.executable, DDP, "--out", str(out)], "--workers", "3")
    done = two_hosts.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded", (done, two_hosts("logs", str(job["id"])).stdout[-3000:])
    env = [r["env"] for r in ranks(out, 3)]
    hosts = {w["rank"]: (w["host"], w["gpus"]) for w in done["workers"]}
    assert [hosts[r][0] for r in range(3)] == ["gpu01", "gpu01", "gpu02"], hosts
    # one fake GPU per worker: CUDA_VISIBLE_DEVICES lists the job's GPUs on the host in
    # local-rank order, so cuda:{LOCAL_RANK} is the worker's own
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in env] == \
        [("0", "2", "0"), ("1", "2", "0"), ("0", "1", "1")]
    visible = [e["CUDA_VISIBLE_DEVICES"].split(",") for e in env]
    for r, e in enumerate(env):
        assert visible[r][int(e["LOCAL_RANK"])] == str(hosts[r][1][0])
    assert visible[0] == visible[1] and len(visible[0]) == 2 and len(visible[2]) == 1
    assert {e["MASTER_ADDR"] for e in env} == {"127.0.0.2"}   # gpu01, as gpu02 reaches it
