"""What gpuflex starts on hosts for a job: the coordinator (store) and the workers."""

from __future__ import annotations

import os
import posixpath
import socket

from gpuflex.config import Config, HostConfig
from gpuflex.db.models import Job, Worker
from gpuflex.hosts.transport import SpawnSpec, Transport

SOCKET_ROOT = "/tmp"  # unix socket paths must stay short (108 bytes)


def job_dir(host: HostConfig, job: Job) -> str:
    return posixpath.join(host.workdir, "jobs", job.token)


def socket_dir(job: Job) -> str:
    return posixpath.join(SOCKET_ROOT, f"gpuflex-{job.token}")


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
              "--port", str(port), "--members", ",".join(map(str, members)),
              "--control", coordinator_socket(job),
              "--heartbeat-timeout", str(config.jobs.heartbeat_timeout_s)],
        cwd=d, env={"PYTHONUNBUFFERED": "1"},
        log=posixpath.join(d, "coordinator.log"),
        exit_path=posixpath.join(d, "coordinator.exit"),
    )


def worker_spec(config: Config, host: HostConfig, job: Job, worker: Worker, rank: int, world: int) -> SpawnSpec:
    d = job_dir(host, job)
    env = dict(job.env)
    env.update({
        "PYTHONUNBUFFERED": "1",
        "GPUFLEX_JOB_ID": str(job.id),
        "GPUFLEX_JOB_TOKEN": job.token,
        "GPUFLEX_WORKER_ID": str(worker.wid),
        "GPUFLEX_STORE": f"{job.store_addr}:{job.store_port}",
        "GPUFLEX_CONTROL": worker_socket(job, worker.wid),
        "GPUFLEX_CHECKPOINT_DIR": job.checkpoint_dir or posixpath.join(d, "checkpoints"),
        "GPUFLEX_CHECKPOINT_INTERVAL_S": str(config.jobs.checkpoint_interval_s),
        "GPUFLEX_PG_TIMEOUT_S": str(config.jobs.pg_timeout_s),
        # torch-style variables for scripts that only read these
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
    })
    if host.cpu_slots is None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, worker.gpus))
    else:
        env["GPUFLEX_SLOTS"] = ",".join(map(str, worker.gpus))
    return SpawnSpec(argv=list(job.argv), cwd=job.workdir, env=env,
                     log=worker.log_path, exit_path=worker.exit_path)


def worker_paths(host: HostConfig, job: Job, wid: int) -> tuple[str, str]:
    d = job_dir(host, job)
    return posixpath.join(d, f"worker-{wid}.log"), posixpath.join(d, f"worker-{wid}.exit")


def local_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
