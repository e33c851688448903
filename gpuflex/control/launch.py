"""What gpuflex starts on hosts for a job: the coordinator (store) and the workers.

Every worker gets the GPUFLEX_* contract and torchrun's (gpuflex.elastic.protocol.env), so an
unmodified torch.distributed script runs as a gang; a gang's or restart job's workers get
the rest of torchrun's agent's too (is_torchelastic_launched() is True), but those of a
torchrun command, whose own agent sets them. torchrun's variables need the whole
run's layout (`Layout`: which host and devices each rank has, and rank 0's MASTER_PORT,
a free port picked at each launch): the starter passes it; without it (a newcomer of an
in-place resize) the job's live rows stand in, and MASTER_PORT is left out.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import secrets
import socket
from pathlib import Path
from typing import Any, Mapping

from sqlalchemy.orm import object_session

from gpuflex import jobenv
from gpuflex.config import Config, HostConfig
from gpuflex.db import queries
from gpuflex.db.models import Job, Worker
from gpuflex.errors import TransportError, UsageError
from gpuflex.elastic.protocol import env as env_contract
from gpuflex.elastic.protocol import failpoints
from gpuflex.jobspec import INPLACE, SPLIT_EVEN, torchrun_args
from gpuflex.elastic.protocol.env import SPEED_HINT, SPLIT, STRAGGLER_FACTOR, WorkerEnv
from gpuflex.hosts import container, supervisor
from gpuflex.hosts import sync as sync_code
from gpuflex.hosts.transport import SpawnSpec, Transport
from gpuflex.policy.speeds import speed_hint

SOCKET_ROOT = "/tmp"  # unix socket paths must stay short (108 bytes)
SOCKET_PREFIX = "gpuflex-"
SOCKET_TOKEN_BYTES = 16   # random bytes in a run's directory name (hex: twice as many digits)
# a run's directory, as new_socket_dir names it: only such names are ever swept (a user's
# own /tmp/gpuflex-results is not ours to remove)
SOCKET_NAME = f"{SOCKET_PREFIX}[0-9a-f]{{{2 * SOCKET_TOKEN_BYTES}}}"
OMP_THREADS = "OMP_NUM_THREADS"
ARRAY_ID = "GPUFLEX_ARRAY_ID"        # an array job's array (the id of its first job)
ARRAY_INDEX = "GPUFLEX_ARRAY_INDEX"  # and its index in it
# issue 12: to each in-place worker, for the runtime's split of the global batch


def job_dir(host: HostConfig, job: Job) -> str:
    return posixpath.join(host.workdir, "jobs", job.token)


def new_socket_dir() -> str:
    """A fresh control-socket directory name for one run of a job: 128 random bits, so no
    other user can create it first (/tmp is shared); kept only in the (private) database."""
    return posixpath.join(SOCKET_ROOT, SOCKET_PREFIX + secrets.token_hex(SOCKET_TOKEN_BYTES))


def socket_dir(job: Job) -> str:
    """The current run's socket directory (each host's hostops creates it 0700 before
    the run's first process there starts; the executor removes it when the run ends)."""
    if job.socket_dir is None:
        raise ValueError(f"job {job.id} has not been started: it has no socket directory")
    return job.socket_dir


def coordinator_socket(job: Job) -> str:
    return posixpath.join(socket_dir(job), "coord.sock")


def worker_socket(job: Job, wid: int) -> str:
    return posixpath.join(socket_dir(job), f"w{wid}.sock")


def free_port(transport: Transport) -> int:
    """A free TCP port on the host (bound and released: a brief race is accepted)."""
    if transport.host.is_local:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]
    res = transport.run([transport.host.python, "-c",
                         "import socket; s=socket.socket(); s.bind(('',0)); print(s.getsockname()[1])"],
                        timeout=transport.host.command_timeout_s)
    return int(res.stdout.strip())


def store_address(host: HostConfig) -> str:
    return "127.0.0.1" if host.is_local else host.address


def coordinator_spec(config: Config, host: HostConfig, job: Job, port: int, members: list[int]) -> SpawnSpec:
    d = job_dir(host, job)
    return SpawnSpec(
        argv=[host.python, "-m", "gpuflex.elastic.coordinator",
              "--bind", job.store_addr or store_address(host),   # only where the workers connect
              "--port", str(port), "--members", ",".join(map(str, members)),
              "--control", coordinator_socket(job),
              "--heartbeat-timeout", str(config.jobs.heartbeat_timeout_s),
              # never a generation below MIN (the survivors wait; the control side requeues
              # or fails the job), and the same failure this many times ends the job
              "--min-workers", str(job.min_workers),
              "--max-failures", str(config.jobs.max_same_failures),
              "--max-workers", str(job.max_workers),
              # it ends itself once its job is gone (no daemon watches the hosts)
              "--orphan-timeout", str(config.jobs.orphan_timeout_s), "--job-dir", d,
              # a member that does not join a forming generation in time is left out (or held)
              "--formation-timeout", str(config.jobs.formation_timeout_s),
              # workers that never joined the runtime (a plain script) are stopped as a cancel would
              "--stop-grace", str(config.jobs.cancel_grace_s),
              # a gang's plain processes never join: the control side watches them instead
              *(["--gang"] if is_gang(job) else [])],
        cwd=d, env={"PYTHONUNBUFFERED": "1", env_contract.JOB_TOKEN: job.token,
                     env_contract.JOB_SECRET: job.secret, **armed_failpoints(job)},
        log=posixpath.join(d, "coordinator.log"),
        exit_path=posixpath.join(d, "coordinator.exit"),
        private_dirs=[d], socket_dir=socket_dir(job),
        deadline=coordinator_deadline(config, job), grace_s=5,
    )


def armed_failpoints(job: Job) -> dict[str, str]:
    """The failpoint spec the job's workers get (failpoints.py: the submitter's, or --env's;
    "": none), for the coordinator, whatever the environment of the command starting it."""
    return {failpoints.ENV: {**(job.submit_env or {}), **(job.env or {})}.get(failpoints.ENV, "")}


def is_gang(job: Job) -> bool:
    """A job launched as a whole (a fixed gang, or a restart job): anything but 'inplace'."""
    return job.elastic != INPLACE


@dataclasses.dataclass(frozen=True)
class Layout:
    """A run's ranks: `places[rank]` is (host, devices) of each rank known, and rank 0's
    `master_port` (None: not picked)."""

    places: Mapping[int, tuple[str, tuple[int, ...]]]
    master_port: int | None = None

    @classmethod
    def of(cls, places: list[tuple[str, list[int] | tuple[int, ...]]], master_port: int | None = None) -> "Layout":
        """From (host, devices) in rank order: what a launch of the whole run gives."""
        return cls({r: (h, tuple(d)) for r, (h, d) in enumerate(places)}, master_port)

    def local_ranks(self, rank: int) -> list[int]:
        """The ranks on `rank`'s host, in order: LOCAL_RANK is the index in it."""
        host = self.places[rank][0]
        return sorted(r for r, (h, _) in self.places.items() if h == host)

    def hosts(self) -> list[str]:
        """The run's hosts, in rank order (torchrun's nodes)."""
        return list(dict.fromkeys(self.places[r][0] for r in sorted(self.places)))

    def group_rank(self, rank: int) -> int:
        """GROUP_RANK: the index of `rank`'s host among the run's hosts, in rank order."""
        return self.hosts().index(self.places[rank][0])

    def local_devices(self, rank: int) -> tuple[int, ...]:
        """The devices of the ranks on `rank`'s host, in local-rank order."""
        return tuple(d for r in self.local_ranks(rank) for d in self.places[r][1])


def rows_layout(job: Job, worker: Worker, rank: int) -> Layout:
    """A layout from the job's live rows of its current run (ranked ones in rank order,
    then the others by id), `worker` at `rank`: a stand-in where no launch gave one."""
    since = job.started_at or 0.0
    others = sorted((w for w in job.workers if w is not worker and not w.state.final and w.started_at >= since),
                    key=lambda w: (w.rank is None, w.rank or 0, w.wid))
    order = [w for w in others]
    order.insert(min(rank, len(order)), worker)
    return Layout({r: (w.host, tuple(w.gpus)) for r, w in enumerate(order)})


def visible_gpus(job: Job, layout: Layout, rank: int, own: tuple[int, ...]) -> tuple[int, ...] | None:
    """What CUDA_VISIBLE_DEVICES lists beyond the worker's own GPUs, so that
    `cuda:{LOCAL_RANK}` is its own: the job's GPUs on the host in local-rank order for a
    gang or restart job of one GPU per worker (torchrun's convention). None (own GPUs
    only) for several per worker, a torchrun command, or an in-place job (the runtime
    uses cuda:0)."""
    if not is_gang(job) or len(own) != 1 or torchrun_args(list(job.argv)) is not None:
        return None
    devices = layout.local_devices(rank)
    return devices if len(devices) > 1 and own[0] in devices else None


def worker_spec(config: Config, host: HostConfig, job: Job, worker: Worker, rank: int, world: int,
                layout: Layout | None = None) -> SpawnSpec:
    """The worker's process: the job's command with the GPUFLEX_* and torchrun contracts
    (gpuflex.elastic.protocol.env) in the environment recorded at submit; `layout` (None: the
    job's rows stand in, see `rows_layout`) gives the torchrun variables."""
    d = job_dir(host, job)
    layout = layout if layout is not None and rank in layout.places else rows_layout(job, worker, rank)
    own = tuple(worker.gpus)
    local = layout.local_ranks(rank)
    contract = WorkerEnv(
        worker_id=worker.wid, job_id=job.id, job_token=job.token, job_secret=job.secret,
        store=f"{job.store_addr}:{job.store_port}", control=worker_socket(job, worker.wid),
        checkpoint_dir=job.checkpoint_dir or posixpath.join(d, "checkpoints"), resume_from=job.resume_from,
        checkpoint_interval_s=config.jobs.checkpoint_interval_s, pg_timeout_s=config.jobs.pg_timeout_s,
        gpus=tuple(worker.gpus) if host.cpu_slots is None else None,
        slots=tuple(worker.gpus) if host.cpu_slots is not None else None,
        rank=rank, world_size=world,
        local_rank=local.index(rank), local_world_size=len(local), group_rank=layout.group_rank(rank),
        master_addr=job.store_addr, master_port=layout.master_port, restart_count=job.restarts or 0,
        visible_gpus=visible_gpus(job, layout, rank, own) if host.cpu_slots is None else None,
        group_world_size=len(layout.hosts()), max_restarts=job.retries or 0)
    # the environment recorded at submit, never that of whoever runs this (a scale, a
    # harvest tick); a job from before it was recorded keeps the spawner's
    env = {**(job.submit_env or {}), **job.env}
    env.setdefault(OMP_THREADS, str(omp_threads(host, len(worker.gpus), _gpus_on_host(host, job))))
    env.update(contract.to_env())
    if torchrun_args(list(job.argv)) is not None:
        env.update(contract.torchrun_env())
    elif is_gang(job):   # an in-place job's world changes under its runtime: no fixed torchelastic run
        env.update(contract.torchelastic_env(env))
    if job.array_id is not None:
        env.update({ARRAY_ID: str(job.array_id), ARRAY_INDEX: str(job.array_index)})
    if not is_gang(job):
        env.update(split_env(config, host, job, worker))
    job_env = jobenv.JobEnv.of(job)   # issue 33: --venv's PATH, --python's or --conda's command
    env, argv = jobenv.environment(job_env, env), jobenv.worker_argv(job_env, list(job.argv))
    return SpawnSpec(argv=argv, cwd=worker_cwd(config, host, job), env=env,
                     log=worker.log_path, exit_path=worker.exit_path,
                     private_dirs=[d, contract.checkpoint_dir], socket_dir=socket_dir(job),
                     clean_env=job.submit_env is not None,
                     deadline=run_deadline(job), grace_s=config.jobs.cancel_grace_s,
                     container=container_spec(host, job),
                     # an in-place job's workers all import torch and gpuflex's runtime: forked
                     # from one interpreter per host that did, waited for well within the spawn's
                     # own timeout while it starts (gpuflex.hosts.zygote)
                     fork_start=config.jobs.fork_start and not is_gang(job),
                     fork_ready_s=min(30.0, host.command_timeout_s / 3))


def container_spec(host: HostConfig, job: Job) -> dict[str, Any] | None:
    """`submit --image` (issue 33): what the host's supervisor runs the worker in."""
    if not job.image:
        return None
    return {"engine": host.container, "image": job.image, "args": list(host.container_args)}


def check_image(config: Config, image: str | None) -> None:
    """`submit --image`: a UsageError (exit 2, nothing recorded) for a name no engine takes,
    or when the engine of a host on this machine lacks the image; remote hosts are asked
    at launch (gpuflex.control.executor)."""
    if image is None:
        return
    if not image.strip() or image.startswith("-") or any(c.isspace() for c in image):
        raise UsageError(f"--image: {image!r} is not an image name; e.g. --image docker.io/pytorch/pytorch:latest.")
    for host in config.hosts:
        why = container.image_missing(host.container, image) if host.is_local else None
        if why:
            raise UsageError(f"--image: {why} (host {host.name}).")


def check_remote_image(transport: Transport, image: str) -> None:
    """Before a worker of a `--image` job starts on a remote host: a TransportError (the
    launch fails with it as the reason) when that host's engine lacks the image."""
    host = transport.host
    argv = container.image_check(host.container, image)
    if argv is None:
        return
    res = transport.run(argv, timeout=host.command_timeout_s)
    if res.returncode == 127:   # the remote shell's "command not found"
        raise TransportError(host.name, f"--image: the container engine {host.container} is not installed there")
    if res.returncode != 0:
        raise TransportError(host.name, f"--image: {container.missing_text(host.container, image)}")


def split_env(config: Config, host: HostConfig, job: Job, worker: Worker) -> dict[str, str]:
    """What an in-place worker needs to divide the global batch (issue 12): the job's split
    (a job from before `--split` existed ran even, and goes on so), its speed hint and the
    straggler factor."""
    return {SPLIT: job.split or SPLIT_EVEN, SPEED_HINT: repr(worker_speed_hint(host, job, worker)),
            STRAGGLER_FACTOR: repr(float(config.jobs.straggler_factor))}


def worker_speed_hint(host: HostConfig, job: Job, worker: Worker) -> float:
    """The worker's first guess of its speed: its host's `speed`, else the slowest of its
    GPUs' models as the last probe recorded them (gpuflex.policy.speeds), else 1.0."""
    if host.speed is not None or host.cpu_slots is not None:
        return speed_hint(None, host.speed)
    session = object_session(job)
    row = queries.host(session, host.name) if session is not None else None
    models = {g.index: g.model for g in row.gpus if g.kind == "gpu"} if row is not None else {}
    return min((speed_hint(models.get(i), None) for i in worker.gpus), default=speed_hint(None, None))


def run_deadline(job: Job) -> float | None:
    """When the current run reaches its time limit (epoch seconds; None: no limit). Each
    run (a requeue restarts the clock) is limited on its own: a worker's supervisor
    enforces it, the coordinator ends after the grace."""
    if job.time_limit_s is None or job.started_at is None:
        return None
    return job.started_at + job.time_limit_s


def coordinator_deadline(config: Config, job: Job) -> float | None:
    """The coordinator outlives the workers' grace at the time limit (a gpuflex.elastic
    job checkpoints on the SIGTERM, through its store)."""
    deadline = run_deadline(job)
    return None if deadline is None else deadline + config.jobs.cancel_grace_s


# What belongs to a login session or to a host rather than to a job: not recorded at
# submit. HOME, USER, LOGNAME and SHELL come from the host a worker runs on
# (supervisor.HOST_IDENTITY); a worker's place in the job (rank, devices, the GPUFLEX_*
# contract) from gpuflex when it starts.
SESSION_VARIABLES = frozenset({
    *supervisor.HOST_IDENTITY, "DISPLAY", "WAYLAND_DISPLAY", "XAUTHORITY", "TERM", "COLORTERM",
    "COLUMNS", "LINES", "SHLVL", "PWD", "OLDPWD", "_", "HOSTNAME", "MAIL", "XDG_RUNTIME_DIR",
    "TMUX", "TMUX_PANE", "STY", "WINDOW",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES"})
SESSION_PREFIXES = ("SSH_", "XDG_SESSION_", "DBUS_", "TERM_", "GPUFLEX_")
# GPUFLEX_* a job may set; the failpoints a test armed reach the job's processes too
_JOB_KNOBS = frozenset({env_contract.DIRECT_BYTES, env_contract.EXCHANGE_BYTES, env_contract.BACKEND, failpoints.ENV})


def submit_environment(environ: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """What a job's workers get from its submitter: `environ` without SESSION_VARIABLES
    and SESSION_PREFIXES, with `env` (--env) on top."""
    kept = {k: v for k, v in environ.items()
            if k in _JOB_KNOBS or (k not in SESSION_VARIABLES and not k.startswith(SESSION_PREFIXES))}
    kept.update(env)
    return kept


def omp_threads(host: HostConfig, devices: int, gpus_on_host: int | None) -> int:
    """OMP_NUM_THREADS for a worker holding `devices` slots or GPUs of `host`: its share of
    the host's cores per device held (cores // slots); on a GPU host half of it
    (cores // GPUs // 2), since the compute is the GPU's and the host's other processes (the
    job's coordinator, data loaders, gpuflex's own commands) need cores: on an H200 with 16
    cores a one-GPU worker at 16 threads ran the example at 0.74 of plain training, at 8, 4
    or 1 at 0.89 (docs/benchmarks.md, "On a real GPU"). 1, as torchrun sets, where the
    host's core count or its number of GPUs is unknown."""
    cores = host.cpu_count
    gpu_host = host.cpu_slots is None
    shares = gpus_on_host if gpu_host else host.cpu_slots
    if cores is None or not shares:
        return 1
    share = cores // shares // 2 if gpu_host else cores // shares
    return max(1, share) * max(1, devices)


def _gpus_on_host(host: HostConfig, job: Job) -> int | None:
    """The GPUs of a GPU host: its configured list, else those its last probe found."""
    if isinstance(host.gpus, list):
        return len(host.gpus)
    session = object_session(job)
    row = queries.host(session, host.name) if session is not None else None
    return sum(1 for g in row.gpus if g.kind == "gpu") if row is not None else None


def worker_paths(host: HostConfig, job: Job, wid: int) -> tuple[str, str]:
    d = job_dir(host, job)
    return posixpath.join(d, f"worker-{wid}.log"), posixpath.join(d, f"worker-{wid}.exit")


def local_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def pack_code(config: Config, sync: bool | None, workdir: str) -> str | None:
    """`submit --sync` (issue 33): the submit directory packed into the submitter's cache, its
    sha256 returned; None when no host would use it (neither --sync, `[jobs] sync` nor any
    host's `sync`), or `--no-sync` (`sync` False, not None) turned them all off. A tree over
    `[jobs] sync_cap_mib` is a UsageError (exit 2)."""
    if sync is False or not (sync or any(h.syncs(config.jobs.sync) for h in config.hosts)):
        return None
    return sync_code.pack_to_cache(Path(workdir), cap=int(config.jobs.sync_cap_mib * 1024 * 1024)).sha256


def syncs(config: Config, host: HostConfig, job: Job) -> bool:
    """Whether `job` runs on `host` in its sent code rather than in its submit directory."""
    return job.code_sha256 is not None and (bool(job.sync) or host.syncs(config.jobs.sync))


def worker_cwd(config: Config, host: HostConfig, job: Job) -> str:
    return sync_code.code_dir(host.workdir, job.code_sha256) if syncs(config, host, job) else job.workdir
