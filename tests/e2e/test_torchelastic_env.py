"""Gang and restart workers get torchrun's whole environment (issue 26): what torchrun's
agent gives its workers, so `torch.distributed.is_torchelastic_launched()` is True and a
library that asks (Lightning's TorchElasticEnvironment) reads the run's layout as under
torchrun.

The contract test runs the same script as a 2-worker gang on the local pool and under
`torchrun --nproc-per-node 2` (one node of two: the gang's layout) and compares every
variable torchrun adds, by value, but those that must differ (compared by shape) and those
left out on purpose (each with its reason). A restart job gets them too, its restart count
one higher after a resize.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuflex.config import parse_config
from gpuflex.control import launch
from gpuflex.db.models import Job, Worker
from gpuflex.elastic.protocol.env import WorkerEnv
from tests.conftest import GpuflexCLI, cleanup_jobs, wait_for, write_config

pytestmark = pytest.mark.e2e   # jobs of real workers

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
DEADLINE_S = 300

# Each worker writes its environment and what torch says of it, as env-{restart}-{rank}.json;
# with "wait" it then sleeps until it is stopped (a restart job, to be resized).
DUMP = """\
import json, os, sys, time
import torch.distributed as dist
out = sys.argv[1]
name = f"env-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 'x')}-{os.environ['RANK']}.json"
with open(os.path.join(out, name + ".tmp"), "w") as f:
    json.dump({"env": dict(os.environ), "launched": dist.is_torchelastic_launched()}, f)
os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
while len(sys.argv) > 2 and sys.argv[2] == "wait":
    time.sleep(0.5)
"""

# What torchrun's agent sets that a gpuflex worker does not get, and why.
LEFT_OUT = {
    "TORCHELASTIC_ERROR_FILE": "the agent's collection of a worker's @record error file; gpuflex reads the log",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "torchrun's own setting for its agent, passed on in its environment",
}


def is_port(v: str) -> bool:
    return v.isdigit() and 0 < int(v) < 65536


# Set by both, to values that must differ: compared by shape.
SHAPE = {
    "MASTER_PORT": is_port,                                   # a free port picked at each launch
    "MASTER_ADDR": lambda v: v in ("127.0.0.1", "localhost"),  # rank 0's host as the others reach it
    "TORCHELASTIC_RUN_ID": lambda v: bool(v.strip()),          # the job (torchrun: its rendezvous id)
    # gpuflex serves no store at MASTER_ADDR:MASTER_PORT: rank 0 hosts the group's (torchrun's agent does)
    "TORCHELASTIC_USE_AGENT_STORE": lambda v: v == "False",
    "OMP_NUM_THREADS": lambda v: v.isdigit() and int(v) >= 1,  # the worker's CPU share (torchrun: 1)
}


def dumps(out: Path, restart: int, world: int) -> list[dict]:
    return [json.loads((out / f"env-{restart}-{r}.json").read_text()) for r in range(world)]


def dumped(out: Path, restart: int, world: int) -> bool:
    return all((out / f"env-{restart}-{r}.json").exists() for r in range(world))


def torchrun_dumps(script: Path, out: Path) -> tuple[dict[str, str], list[dict]]:
    """The environment given to torchrun, and each of its two workers' dumps."""
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEX_", "PET_", "TORCHELASTIC_"))}
    p = subprocess.run([TORCHRUN, "--nproc-per-node", "2", str(script), str(out)], env=base, capture_output=True,
                       text=True, timeout=DEADLINE_S)
    assert p.returncode == 0, p.stdout + p.stderr
    return base, dumps(out, 0, 2)


def test_a_gang_s_workers_get_what_torchrun_s_agent_gives_its_workers(home, tmp_path):
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP)
    base, theirs = torchrun_dumps(script, tmp_path / "torchrun")
    added = {k for d in theirs for k in d["env"] if k not in base}
    # not vacuous: torchrun's list as torch 2.13 has it
    assert {"TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK", "RANK"} <= added, added

    cli = GpuflexCLI(home, write_config(home))
    out = tmp_path / "gang"
    out.mkdir()
    try:
        job = cli.submit([sys.executable, str(script), str(out)], "--workers", "2")
        done = cli.wait_final(job["id"], DEADLINE_S)
        assert (done["state"], done["elastic"]) == ("succeeded", None), done
    finally:
        cleanup_jobs(cli, home / "g.db")
    ours = dumps(out, 0, 2)

    assert [d["launched"] for d in theirs] == [d["launched"] for d in ours] == [True, True]
    for rank, (t, o) in enumerate(zip(theirs, ours)):
        for k in sorted(added - set(LEFT_OUT)):
            assert k in o["env"], f"rank {rank}: {k} missing (torchrun: {t['env'][k]!r})"
            if k in SHAPE:
                assert SHAPE[k](o["env"][k]), f"rank {rank}: {k}={o['env'][k]!r}"
            else:
                assert o["env"][k] == t["env"][k], f"rank {rank}: {k}={o['env'][k]!r}, torchrun {t['env'][k]!r}"
    for k in ("MASTER_PORT", "TORCHELASTIC_RUN_ID"):   # one run: the same for every rank
        assert ours[0]["env"][k] == ours[1]["env"][k]


def test_a_restart_job_gets_them_with_its_restart_count_after_a_resize(home, tmp_path):
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP)
    out = tmp_path / "runs"
    out.mkdir()
    cli = GpuflexCLI(home, write_config(home))
    try:
        job = cli.submit([sys.executable, str(script), str(out), "wait"], "--elastic", "restart",
                         "--workers", "1:2", "--retries", "3")
        wait_for(cli, job["id"], lambda j: dumped(out, 0, 2), "the first run's workers")
        cli.ok("scale", str(job["id"]), "1")                 # a restart: the gang again, at 1
        wait_for(cli, job["id"], lambda j: dumped(out, 1, 1), "the second run's worker")
    finally:
        cleanup_jobs(cli, home / "g.db")
    first, second = dumps(out, 0, 2), dumps(out, 1, 1)
    for d, world, rank in [(first[0], 2, 0), (first[1], 2, 1), (second[0], 1, 0)]:
        env = d["env"]
        assert d["launched"], env
        assert (env["WORLD_SIZE"], env["ROLE_WORLD_SIZE"], env["RANK"], env["ROLE_RANK"], env["LOCAL_RANK"]) == \
            (str(world), str(world), str(rank), str(rank), str(rank))
        assert (env["GROUP_WORLD_SIZE"], env["ROLE_NAME"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "default", "3")
    assert [d["env"]["TORCHELASTIC_RESTART_COUNT"] for d in (*first, *second)] == ["0", "0", "1"]
    assert len({d["env"]["TORCHELASTIC_RUN_ID"] for d in (*first, *second)}) == 1   # the job's, over restarts


# ---- the spec: which jobs get them ------------------------------------------------------------
def spec_env(elastic: str | None, argv: list[str], places: list[tuple[str, list[int]]], rank: int, **job) -> dict:
    cfg = parse_config({"hosts": [{"name": h, "gpus": "cpu:4"} for h in dict.fromkeys(p[0] for p in places)]},
                       "f.toml")
    fields = dict(id=7, token="tok7", secret="s", name="j", argv=argv, workdir="/w", env={}, min_workers=1,
                  max_workers=len(places), gpus_per_worker=1, user="u", store_addr="10.0.0.1", store_port=1,
                  socket_dir="/tmp/gpuflex-x", submit_env={"PATH": "/p"}, elastic=elastic, restarts=2, retries=5)
    fields.update(job)
    host, devices = places[rank]
    w = Worker(wid=rank, host=host, gpus=devices, log_path="~/l", exit_path="~/e")
    layout = launch.Layout.of(places, master_port=29500)
    return launch.worker_spec(cfg, cfg.host(host), Job(**fields), w, rank=rank, world=len(places), layout=layout).env


TWO_HOSTS = [("a", [0]), ("b", [0]), ("a", [1])]


@pytest.mark.parametrize("elastic", [None, "restart"])
def test_a_gang_or_restart_worker_gets_torchelastic_s_variables_for_its_place(elastic):
    env = spec_env(elastic, ["python", "t.py"], TWO_HOSTS, rank=2)
    assert {k: env[k] for k in ("TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "GROUP_RANK", "ROLE_NAME", "ROLE_RANK",
                                "ROLE_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING")} == {
        "TORCHELASTIC_RUN_ID": "tok7", "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "0", "ROLE_NAME": "default",
        "ROLE_RANK": "2", "ROLE_WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "5", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert "TORCHELASTIC_ERROR_FILE" not in env


def test_the_job_s_own_nccl_error_handling_is_kept():
    env = spec_env(None, ["python", "t.py"], TWO_HOSTS, rank=0, env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.mark.parametrize("elastic,argv", [
    ("inplace", ["python", "t.py"]),                               # its world changes under the runtime
    (None, ["torchrun", "--nproc-per-node", "2", "t.py"]),         # torchrun's own agent sets them
])
def test_an_inplace_worker_and_a_torchrun_node_do_not(elastic, argv):
    env = spec_env(elastic, argv, TWO_HOSTS, rank=0)
    assert not {"TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_USE_AGENT_STORE"} & set(env)


def test_the_torchelastic_variables_read_back_into_the_worker_s_view():
    env = WorkerEnv(rank=1, world_size=2, job_token="t", group_world_size=2, max_restarts=4, local_world_size=1)
    assert WorkerEnv.from_environ({**env.to_env(), **env.torchelastic_env({})}) == env
