"""A job's environment: what its workers get (the environment recorded at submit, plus
--env, plus OMP_NUM_THREADS from their CPU share), never that of whoever runs the
command that starts them; `~` in configured paths; a job the pool can never hold.

The end-to-end test runs the elastic example on the local pool with real processes; a
`gpuflex scale` from a different environment (PATH without the venv, a marker changed,
a variable of its own) starts the newcomer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gpuflex.config import parse_config
from gpuflex.control import launch
from gpuflex.db.models import Job, Worker
from gpuflex.hosts import supervisor
from tests import REPO
from tests.conftest import GpuflexCLI, cleanup_jobs, db_dump, db_rows, wait_for
from tests.sshbed import host_toml, ssh_bed, ssh_hosts  # noqa: F401 (fixtures)

EXAMPLE = str(REPO / "examples" / "elastic_mlp.py")
VENV_BIN = str(Path(sys.executable).parent)
DEADLINE_S = 300

# Dumps its environment (and which python ran it), then runs the elastic example.
ENV_DUMP = f"""
import json, os, runpy, sys
path = os.path.join(os.environ["ENV_DUMP_DIR"], "w" + os.environ["GPUFLEX_WORKER_ID"] + ".json")
with open(path, "w") as f:
    json.dump({{"env": dict(os.environ), "executable": sys.executable}}, f)
sys.argv = [{EXAMPLE!r}, *sys.argv[1:]]
runpy.run_path({EXAMPLE!r}, run_name="__main__")
"""


def _job(**kw) -> Job:
    fields = dict(id=7, token="tok", secret="s", name="j", argv=["python", "t.py"], workdir="/w", env={},
                  min_workers=1, max_workers=2, gpus_per_worker=1, user="u", store_addr="127.0.0.1",
                  store_port=1, socket_dir="/tmp/gpuflex-x", submit_env={"PATH": "/venv/bin:/usr/bin"})
    fields.update(kw)
    return Job(**fields)


def _spec(host: dict, devices: list[int], **job):
    cfg = parse_config({"hosts": [{"name": "h", **host}]}, "f.toml")
    w = Worker(wid=0, host="h", gpus=devices, log_path="~/l", exit_path="~/e")
    return launch.worker_spec(cfg, cfg.hosts[0], _job(**job), w, rank=0, world=1)


# ---- OMP_NUM_THREADS: the worker's share of its host's cores (half on a GPU host) -------------------
OMP = [
    ("cpu slots: cores // slots per slot held", {"gpus": "cpu:4", "cpus": 8}, [0], "2"),
    ("two slots held", {"gpus": "cpu:4", "cpus": 8}, [1, 2], "4"),
    ("more slots than cores: at least 1", {"gpus": "cpu:16", "cpus": 4}, [3], "1"),
    ("gpu list: half of cores // gpus per gpu held", {"gpus": [0, 1, 2, 3], "cpus": 32}, [0, 1], "8"),
    ("one gpu of 16 cores: 8, room for the host's other processes", {"gpus": [0], "cpus": 16}, [0], "8"),
    ("more gpus than half the cores: at least 1 per gpu", {"gpus": [0, 1, 2, 3, 4, 5, 6, 7], "cpus": 8}, [0, 1], "2"),
    ("remote host without cpus: 1 as torchrun", {"address": "r.lab", "gpus": "cpu:4"}, [0], "1"),
    ("gpus = all, never probed: 1", {"gpus": "all", "cpus": 32}, [0], "1"),
    ("local host: this machine's cores", {"gpus": "cpu:1"}, [0], str(os.cpu_count())),
]


@pytest.mark.parametrize("host,devices,threads", [r[1:] for r in OMP], ids=[r[0] for r in OMP])
def test_omp_num_threads_from_the_cpu_share(host, devices, threads):
    assert _spec(host, devices).env["OMP_NUM_THREADS"] == threads


@pytest.mark.parametrize("where", ["env", "submit_env"])
def test_omp_num_threads_set_by_the_user_is_kept(where):
    job = {"env": {"OMP_NUM_THREADS": "5"}} if where == "env" else \
        {"submit_env": {"PATH": "/p", "OMP_NUM_THREADS": "5"}}
    assert _spec({"gpus": "cpu:4", "cpus": 8}, [0], **job).env["OMP_NUM_THREADS"] == "5"


def test_a_job_recorded_with_its_environment_spawns_clean_with_it_and_env_on_top():
    spec = _spec({"gpus": "cpu:2"}, [0], env={"A": "from --env"},
                 submit_env={"PATH": "/venv/bin", "A": "from the shell", "B": "b"})
    assert spec.clean_env
    assert (spec.env["PATH"], spec.env["A"], spec.env["B"]) == ("/venv/bin", "from --env", "b")
    assert spec.env["GPUFLEX_WORKER_ID"] == "0" and spec.env["RANK"] == "0"


def test_a_job_from_before_the_upgrade_keeps_the_spawners_environment():
    spec = _spec({"gpus": "cpu:2"}, [0], submit_env=None, env={"A": "a"})
    assert not spec.clean_env and spec.env["A"] == "a" and "PATH" not in spec.env


def test_the_supervisor_gives_a_clean_spawn_only_the_hosts_identity(monkeypatch):
    for k, v in {"HOME": "/home/h", "USER": "h", "LOGNAME": "h", "SHELL": "/bin/zsh", "PATH": "/scaler",
                 "SCALER_ONLY": "1"}.items():
        monkeypatch.setenv(k, v)
    clean = supervisor.spawn_env({"env": {"PATH": "/submit", "MARK": "m"}, "clean_env": True})
    assert clean == {"HOME": "/home/h", "USER": "h", "LOGNAME": "h", "SHELL": "/bin/zsh",
                     "PATH": "/submit", "MARK": "m"}
    inherited = supervisor.spawn_env({"env": {"MARK": "m"}})
    assert inherited["SCALER_ONLY"] == "1" and inherited["PATH"] == "/scaler"


def test_what_is_recorded_at_submit_leaves_the_session_and_the_host_out():
    shell = {"PATH": "/venv/bin:/usr/bin", "VIRTUAL_ENV": "/venv", "HOME": "/home/a", "USER": "a",
             "SSH_AUTH_SOCK": "/tmp/ssh-x", "SSH_CONNECTION": "1 2 3 4", "DISPLAY": ":0", "TERM": "xterm",
             "PWD": "/x", "SHLVL": "2", "_": "/usr/bin/gpuflex", "XDG_RUNTIME_DIR": "/run/user/1",
             "XDG_SESSION_ID": "3", "DBUS_SESSION_BUS_ADDRESS": "unix:x", "GPUFLEX_CONFIG": "/c.toml",
             "GPUFLEX_DIRECT_BYTES": "4096", "CUDA_VISIBLE_DEVICES": "0", "RANK": "3", "HOSTNAME": "login1",
             "OMP_NUM_THREADS": "3", "WANDB_API_KEY": "k"}
    assert launch.submit_environment(shell, {"X": "1", "PATH": "/mine"}) == {
        "PATH": "/mine", "VIRTUAL_ENV": "/venv", "GPUFLEX_DIRECT_BYTES": "4096", "OMP_NUM_THREADS": "3",
        "WANDB_API_KEY": "k", "X": "1"}


# ---- end to end ---------------------------------------------------------------------------------
@pytest.fixture
def tilde_pool(home):
    """4 local CPU slots whose python is `~/bin/py` (a wrapper around this interpreter) and
    whose workdir and checkpoints are the built-in defaults under `~`; 8 cores."""
    (home / "bin").mkdir()
    (home / "bin" / "py").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (home / "bin" / "py").chmod(0o755)
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
                   "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 1\n\n"
                   '[[hosts]]\nname = "local"\ngpus = "cpu:2"\ncpus = 8\npython = "~/bin/py"\n')
    cli = GpuflexCLI(home, cfg)
    yield cli
    cleanup_jobs(cli, home / "g.db")


def _env(cli: GpuflexCLI, path: str, **extra: str) -> dict[str, str]:
    """A shell's environment: `path` as PATH, the test's home and config (and its
    PYTHONPATH, if it runs gpuflex from another checkout)."""
    keep = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
    return {"PATH": path, "HOME": str(cli.home), "GPUFLEX_CONFIG": str(cli.config), "COLUMNS": "200",
            **keep, **extra}


def test_a_newcomer_started_from_another_environment_gets_the_submit_one(tilde_pool, home):
    cli = tilde_pool
    dumps, cwd = home / "dumps", home / "jobcwd"
    dumps.mkdir()
    cwd.mkdir()
    (home / "envdump.py").write_text(ENV_DUMP)
    submit_env = _env(cli, f"{VENV_BIN}:/usr/bin:/bin", MARK="submitted", SSH_CONNECTION="1 2 3 4", TERM="xterm")
    p = cli("submit", "--workers", "1:2", "--env", f"ENV_DUMP_DIR={dumps}", "--json", "--",
            "python", str(home / "envdump.py"), "--hidden", "16", "--epochs", "30", "--step-sleep", "0.05",
            env=submit_env, cwd=cwd)
    assert p.returncode == 0, p.stdout + p.stderr
    job_id = json.loads(p.stdout)["id"]
    wait_for(cli, job_id, lambda j: (j.get("step") or 0) >= 3, "some steps")

    # the scale comes from a shell without the venv, with the marker changed
    scaler_env = _env(cli, "/usr/bin:/bin", MARK="scaler", SCALER_ONLY="1")
    for n in (1, 2):
        s = cli("scale", str(job_id), str(n), "--wait", "--timeout", str(DEADLINE_S), env=scaler_env,
                timeout=DEADLINE_S + 30)
        assert s.returncode == 0 and f"world size {n}" in s.stdout, s.stdout + s.stderr
    # every worker has dumped its environment (the newcomer joined: scale --wait said so);
    # the rest of the training would test nothing more: cancel, which checkpoints
    cli.ok("cancel", str(job_id))
    wait_for(cli, job_id, lambda j: j["state"] == "cancelled", "the job to stop")

    seen = {f.name: json.loads(f.read_text()) for f in dumps.iterdir()}
    assert sorted(seen) == ["w0.json", "w1.json", "w2.json"]   # w2: the newcomer
    for name, dump in seen.items():
        env = dump["env"]
        assert dump["executable"].startswith(VENV_BIN), (name, dump["executable"])
        assert env["MARK"] == "submitted" and "SCALER_ONLY" not in env, name
        assert env["PATH"] == f"{VENV_BIN}:/usr/bin:/bin" and env["HOME"] == str(home)
        assert not {"SSH_CONNECTION", "TERM", "GPUFLEX_CONFIG"} & set(env), name
        assert env["OMP_NUM_THREADS"] == "4", name          # 8 cores // 2 slots, one slot each
        assert env["ENV_DUMP_DIR"] == str(dumps)

    # `~` was the home everywhere: no literal "~" in the job's directory, checkpoints at home
    assert not [p for p in cwd.rglob("*") if "~" in p.name]
    token = db_rows(home / "g.db", "SELECT token FROM jobs WHERE id = ?", (job_id,))[0][0]
    assert (home / ".local/state/gpuflex/work/jobs" / token / "checkpoints" / "checkpoint.pt").is_file()


def test_a_job_more_than_the_probed_gpus_can_hold_is_refused_and_nothing_changes(home):
    """A `gpus = "all"` host counts the GPUs its last probe found; its nvidia-smi path
    starts with `~` (expanded on the host, here this one)."""
    from tests.sshbed import FAKE_SMI

    state = home / "smi.json"
    state.write_text(json.dumps({"gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "fake", "utilization": 0,
                                           "memory_used": 0, "memory_total": 1000} for i in range(2)],
                                 "processes": []}))
    (home / "bin").mkdir()
    (home / "bin" / "nvidia-smi").write_text(
        f'#!/bin/sh\nexec {sys.executable} {FAKE_SMI} --state {state} "$@"\n')
    (home / "bin" / "nvidia-smi").chmod(0o755)
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
                   f'[[hosts]]\nname = "local"\ngpus = "all"\nnvidia_smi = "~/bin/nvidia-smi"\n'
                   f'workdir = "{home}/work"\n')
    cli = GpuflexCLI(home, cfg)
    assert [len(h["devices"]) for h in cli.json("hosts")] == [2]   # probed through ~/bin/nvidia-smi
    before = db_dump(home / "g.db")
    p = cli("submit", "--workers", "3", "--", "true")
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1
    assert "at most 2 such worker(s) (local: 2 GPUs)" in p.stderr
    assert db_dump(home / "g.db") == before


def test_over_ssh_a_worker_gets_the_submit_environment_and_the_hosts_own_home(ssh_bed, home):
    """A remote host's HOME (its sshd sets it) is the worker's, and `~` in its workdir
    is that home, not the submitter's; the rest is the submitter's shell."""
    h = ssh_bed.hosts[0]
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
                   + host_toml(h, ssh_bed, workdir="~/gfwork", cpus=12))
    cli = GpuflexCLI(home, cfg)
    code = f"import json, os; open({str(home / 'env.json')!r}, 'w').write(json.dumps(dict(os.environ)))"
    try:
        p = cli("submit", "--json", "--", "python", "-c", code,
                env=_env(cli, f"{VENV_BIN}:/usr/bin:/bin", MARK="submitted", SSH_AUTH_SOCK="/tmp/agent"))
        assert p.returncode == 0, p.stdout + p.stderr
        job = cli.wait_final(json.loads(p.stdout)["id"], DEADLINE_S)
        assert job["state"] == "succeeded", job
        env = json.loads((home / "env.json").read_text())
        assert env["HOME"] == str(h.dir / "home") and env["MARK"] == "submitted"
        assert env["PATH"].startswith(VENV_BIN) and "SSH_AUTH_SOCK" not in env
        assert env["OMP_NUM_THREADS"] == "3"       # 12 cores // the 2 GPUs the probe found // 2
        token = db_rows(home / "g.db", "SELECT token FROM jobs")[0][0]
        assert (h.dir / "home" / "gfwork" / "jobs" / token / "worker-0.log").is_file()
        assert not [q for q in home.rglob("*") if q.name == "~"]
    finally:
        cleanup_jobs(cli, home / "g.db")


# ---- issue 33: --venv, --python, --conda in the worker's spawn ----------------------------------
def test_a_venv_job_spawns_the_command_as_written_with_the_venv_first_on_path():
    spec = _spec({"gpus": "cpu:4"}, [0], venv="/envs/a")
    assert spec.argv == ["python", "t.py"]
    assert spec.env["PATH"] == "/envs/a/bin:/venv/bin:/usr/bin" and spec.env["VIRTUAL_ENV"] == "/envs/a"


def test_python_and_conda_change_the_spawned_command_not_its_environment():
    spec = _spec({"gpus": "cpu:4"}, [0], python="/opt/py/bin/python3")
    assert spec.argv == ["/opt/py/bin/python3", "t.py"] and spec.env["PATH"] == "/venv/bin:/usr/bin"
    spec = _spec({"gpus": "cpu:4"}, [0], conda="torch2")
    assert spec.argv == ["conda", "run", "-n", "torch2", "--no-capture-output", "python", "t.py"]
    assert "VIRTUAL_ENV" not in spec.env
