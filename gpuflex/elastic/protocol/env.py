"""The worker environment contract: what gpuflex puts in a worker's environment.

Written by the control side (`gpuflex.control.launch`, through `WorkerEnv.to_env`) and
read by the runtime (`WorkerEnv.from_environ`). Standard library only, like `keys`, so the
control side imports it without torch. Every `GPUFLEX_*` variable a worker reads is named
here and nowhere else.

Besides gpuflex's own variables every worker gets torchrun's contract (issue 11), so an
unmodified `init_process_group()` (env://) works: MASTER_ADDR/MASTER_PORT (rank 0's
host, a port picked at each launch), RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK (the host's index among the job's hosts) and TORCHELASTIC_RESTART_COUNT. A
worker of a gang or restart job gets the rest of what torchrun's agent gives its workers
(`torchelastic_env`), so `torch.distributed.is_torchelastic_launched()` is True and a
library that asks (Lightning's TorchElasticEnvironment) takes the run's layout from it as
under torchrun. A worker running torchrun itself is one torchrun node: `torchrun_env`
gives its agent the static rendezvous through torchrun's PET_* variables (its options'
defaults), so the user's torchrun line holds nothing host-specific.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

JOB_ID = "GPUFLEX_JOB_ID"
JOB_TOKEN = "GPUFLEX_JOB_TOKEN"
# The key of the HMAC over what the job's members write to its store. Given only in the
# environment (readable by the job's owner alone, unlike a command line).
JOB_SECRET = "GPUFLEX_JOB_SECRET"
WORKER_ID = "GPUFLEX_WORKER_ID"
STORE = "GPUFLEX_STORE"                      # host:port of the job's TCPStore; unset = standalone
CONTROL = "GPUFLEX_CONTROL"                  # the worker's unix control socket
CHECKPOINT_DIR = "GPUFLEX_CHECKPOINT_DIR"
# an earlier job's checkpoint directory an in-place job starts from (`submit --resume-from`)
RESUME_FROM = "GPUFLEX_RESUME_FROM"
CHECKPOINT_INTERVAL_S = "GPUFLEX_CHECKPOINT_INTERVAL_S"
PG_TIMEOUT_S = "GPUFLEX_PG_TIMEOUT_S"
HEARTBEAT_TIMEOUT_S = "GPUFLEX_HEARTBEAT_TIMEOUT_S"   # a member silent this long is taken for dead
SLOTS = "GPUFLEX_SLOTS"                      # CPU slots held (on GPU hosts: CUDA_VISIBLE_DEVICES)
GPUS = "GPUFLEX_GPUS"                        # the worker's own GPUs (host indices)
# Its first GPU's index among CUDA_VISIBLE_DEVICES (that lists the job's GPUs on the host,
# in local-rank order, for a gang: torchrun's convention): the device it should use.
CUDA_DEVICE = "GPUFLEX_CUDA_DEVICE"
RESTART_COUNT = "GPUFLEX_RESTART_COUNT"      # the job's relaunches so far (jobs.restarts)
SPLIT = "GPUFLEX_SPLIT"                         # speed | even: how the global batch is divided
SPEED_HINT = "GPUFLEX_SPEED_HINT"               # its first guess of its relative speed
STRAGGLER_FACTOR = "GPUFLEX_STRAGGLER_FACTOR"   # slower than the median by this: a straggler
EXACT = "GPUFLEX_EXACT"                         # allclose | bitwise: ElasticRun(exact=) for an unchanged script
UNIT = "GPUFLEX_UNIT"                           # bitwise mode: samples per unit (ElasticRun(unit=))
EXACT_THREADS = "GPUFLEX_EXACT_THREADS"         # bitwise mode: intra-op threads (default 1)
# Tuning knobs a user may set in a job's environment (read by gpuflex.elastic.data.gradients).
DIRECT_BYTES = "GPUFLEX_DIRECT_BYTES"
EXCHANGE_BYTES = "GPUFLEX_EXCHANGE_BYTES"
# gloo | nccl (collectives.pick_backend): gloo lets several workers share one GPU
BACKEND = "GPUFLEX_BACKEND"

DEFAULT_CHECKPOINT_INTERVAL_S = 60.0
DEFAULT_PG_TIMEOUT_S = 10.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """One worker's view of its job, as the environment carries it."""

    worker_id: int = 0
    store: str | None = None
    job_id: int | None = None
    job_token: str | None = None
    job_secret: str | None = dataclasses.field(default=None, repr=False)
    control: str | None = None
    checkpoint_dir: str | None = None
    resume_from: str | None = None            # an earlier job's checkpoint directory; None: afresh
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    slots: tuple[int, ...] | None = None      # CPU slots; None on GPU hosts
    gpus: tuple[int, ...] | None = None       # GPU indices (CUDA_VISIBLE_DEVICES); None on CPU slots
    rank: int = 0
    world_size: int = 1
    # torchrun's contract (see the module's doc); visible_gpus: what CUDA_VISIBLE_DEVICES
    # lists when more than the worker's own GPUs (None: its own)
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    visible_gpus: tuple[int, ...] | None = None
    group_world_size: int = 1      # the run's hosts (torchrun: its nodes)
    max_restarts: int = 0          # relaunches after a failure the job allows (--retries)

    @property
    def distributed(self) -> bool:
        return bool(self.store)

    def to_env(self) -> dict[str, str]:
        """The variables to set (the control side adds the job's own `--env` first)."""
        env = {
            "PYTHONUNBUFFERED": "1",
            WORKER_ID: str(self.worker_id),
            CHECKPOINT_INTERVAL_S: str(self.checkpoint_interval_s),
            PG_TIMEOUT_S: str(self.pg_timeout_s),
            HEARTBEAT_TIMEOUT_S: str(self.heartbeat_timeout_s),
            # torchrun's variables, for scripts that only read these
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            RESTART_COUNT: str(self.restart_count), "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
        }
        for name, value in ((JOB_ID, self.job_id), (JOB_TOKEN, self.job_token),
                            (JOB_SECRET, self.job_secret), (STORE, self.store),
                            (CONTROL, self.control), (CHECKPOINT_DIR, self.checkpoint_dir),
                            (RESUME_FROM, self.resume_from),
                            ("MASTER_ADDR", self.master_addr), ("MASTER_PORT", self.master_port)):
            if value is not None:
                env[name] = str(value)
        if self.gpus is not None:
            visible = self.visible_gpus or self.gpus
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, visible))
            env[GPUS] = ",".join(map(str, self.gpus))
            env[CUDA_DEVICE] = str(visible.index(self.gpus[0]) if self.gpus and self.gpus[0] in visible else 0)
        if self.slots is not None:
            env[SLOTS] = ",".join(map(str, self.slots))
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "WorkerEnv":
        env = os.environ if environ is None else environ

        def ints(name: str) -> tuple[int, ...] | None:
            raw = env.get(name)
            if raw is None:
                return None
            return tuple(int(x) for x in raw.split(",") if x.strip())

        job_id = env.get(JOB_ID)
        visible = ints("CUDA_VISIBLE_DEVICES") if SLOTS not in env else None
        own = ints(GPUS) if visible is not None and GPUS in env else visible
        port = env.get("MASTER_PORT")
        return cls(
            worker_id=int(env.get(WORKER_ID, "0")),
            store=env.get(STORE) or None,
            job_id=int(job_id) if job_id else None,
            job_token=env.get(JOB_TOKEN),
            job_secret=env.get(JOB_SECRET) or None,
            control=env.get(CONTROL) or None,
            checkpoint_dir=os.path.expanduser(env[CHECKPOINT_DIR]) if env.get(CHECKPOINT_DIR) else None,
            resume_from=os.path.expanduser(env[RESUME_FROM]) if env.get(RESUME_FROM) else None,
            checkpoint_interval_s=float(env.get(CHECKPOINT_INTERVAL_S, DEFAULT_CHECKPOINT_INTERVAL_S)),
            pg_timeout_s=float(env.get(PG_TIMEOUT_S, DEFAULT_PG_TIMEOUT_S)),
            heartbeat_timeout_s=float(env.get(HEARTBEAT_TIMEOUT_S, DEFAULT_HEARTBEAT_TIMEOUT_S)),
            slots=ints(SLOTS),
            gpus=own,
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            group_rank=int(env.get("GROUP_RANK", "0")),
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=int(port) if port else None,
            restart_count=int(env.get(RESTART_COUNT, "0")),
            visible_gpus=visible if visible != own else None,
            group_world_size=int(env.get("GROUP_WORLD_SIZE", "1")),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        )

    def torchelastic_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The rest of what torchrun's agent gives each worker (torch 2.13's
        `LocalElasticAgent._start_workers` and `run.py`'s list), for a gang or restart job,
        `environ` being the job's own environment so far:

        - TORCHELASTIC_RUN_ID: the job's token (torchrun: the rendezvous id, the same for
          every worker and every restart); `is_torchelastic_launched()` reads it.
        - GROUP_WORLD_SIZE: the run's hosts (torchrun: its nodes; GROUP_RANK indexes them);
          ROLE_NAME "default" (torchrun's --role), ROLE_RANK and ROLE_WORLD_SIZE: RANK and
          WORLD_SIZE (one role).
        - TORCHELASTIC_MAX_RESTARTS: the job's --retries, the relaunches after a failure it
          allows (torchrun: --max-restarts). TORCHELASTIC_RESTART_COUNT (to_env) counts
          every relaunch, a restart job's resize and a fault's too, so a script resumes from
          its checkpoint whenever it is above 0; unlike torchrun's, it may pass the maximum.
        - TORCHELASTIC_USE_AGENT_STORE "False": no store of gpuflex's listens at
          MASTER_ADDR:MASTER_PORT (the job's store, GPUFLEX_STORE, is another port and
          holds signed records), so env:// must not connect there as a client: rank 0
          hosts the process group's TCPStore itself, as without torchrun.
        - TORCH_NCCL_ASYNC_ERROR_HANDLING: the job's own value, else "1" (as torchrun).

        Left out: TORCHELASTIC_ERROR_FILE (where torchrun's agent collects a worker's
        `@record` error file; gpuflex reads a crash from the worker's log, and a script
        whose `@record` finds none logs the error instead), and what torchrun passes on
        from its own settings (TORCHELASTIC_SIGNALS_TO_HANDLE, the file timer, the health
        check port): gpuflex's supervisor is not torchrun's agent."""
        env = {"GROUP_WORLD_SIZE": str(self.group_world_size), "ROLE_NAME": "default",
               "ROLE_RANK": str(self.rank), "ROLE_WORLD_SIZE": str(self.world_size),
               "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
               "TORCHELASTIC_USE_AGENT_STORE": str(False),
               "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
        if self.job_token is not None:
            env["TORCHELASTIC_RUN_ID"] = self.job_token
        return env

    def torchrun_env(self) -> dict[str, str]:
        """What a worker whose command is torchrun gives it: one node of a static
        rendezvous of world_size nodes at rank 0's MASTER_ADDR:MASTER_PORT, this worker's
        rank as its node rank, no restarts of its own (gpuflex relaunches the gang). PET_X
        is the default of torchrun's --x (torch/distributed/argparse_util.py): an option
        on the user's line still wins."""
        env = {"PET_NNODES": str(self.world_size), "PET_NODE_RANK": str(self.rank),
               "PET_RDZV_BACKEND": "static", "PET_MAX_RESTARTS": "0"}
        if self.master_addr is not None:
            env["PET_MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            env["PET_MASTER_PORT"] = str(self.master_port)
        return env


def env_bytes(name: str, default: int) -> int:
    """A byte-size tuning knob from the environment (`DIRECT_BYTES`, `EXCHANGE_BYTES`)."""
    raw = os.environ.get(name, "")
    return int(raw) if raw.isdigit() else default
