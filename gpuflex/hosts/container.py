"""A worker in a container (issue 33: `submit --image IMAGE`): the engine's command line.

Standard library only, like hostops and the supervisor, which call it on the host: the supervisor there
starts `ENGINE run ... IMAGE <worker argv>` as its child instead of the worker itself,
so the exit record holds the container's exit status (the engines return the
command's own). What the container gets, and why:

- the host's network (`--network host`): the process group's ports and the job's
  TCPStore are the host's, as for a worker outside a container;
- the job's directories at the same paths (`-v DIR:DIR`), the working directory as
  its working directory (`-w`): its files, logs, checkpoints and control sockets;
- the worker's whole environment, its values never on the command line, which every user
  of the host reads in /proc (the job's secret is among them): podman and docker get
  `--env K` and read the value from their client's environment, set to the worker's
  (`client_environment`), apptainer gets it as APPTAINERENV_K there. Only the variables
  the engine's client needs for itself (its HOME, PATH, XDG_* dirs: paths, no secret)
  keep the engine's value in the client and go in as `--env K=V`;
- its GPUs as CDI devices (`--device nvidia.com/gpu=N`), CUDA_VISIBLE_DEVICES renumbered
  to the container's view, where only those GPUs exist (a cpu:N host: no device);
- an init process (`--init`) that passes signals on to the command, and `--rm`.

podman and docker run the container under their own monitor (conmon, containerd-shim),
outside the supervisor's process group: a SIGTERM to the group reaches the engine's
client, which passes it on (its signal proxy), but a SIGKILL ends only the client. So
each container is named after its group (`container_name`), and a SIGKILL to a group
also kills that container through the engine (`kill`). apptainer runs the command as
a child of its own process: the group's signals reach it directly.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Callable, Iterable, Mapping, Sequence

ENGINES = ("podman", "docker", "apptainer")
DEFAULT_ENGINE = "podman"
CUDA = "CUDA_VISIBLE_DEVICES"


def container_name(pgid: int) -> str:
    """The container of the worker whose process group is `pgid` (unique on a host while
    the group lives; podman replaces a stale one of the same name)."""
    return f"gpuflex-g{int(pgid)}"


def gpu_devices(env: Mapping[str, str]) -> list[int] | None:
    """The GPU indices CUDA_VISIBLE_DEVICES lists; None when it is unset or not a list of
    indices (a cpu:N worker, or UUIDs: passed on as they are, no device added)."""
    value = env.get(CUDA)
    if value is None or value.strip() == "":
        return None
    parts = [p.strip() for p in value.split(",")]
    return [int(p) for p in parts] if all(p.isdigit() for p in parts) else None


# the client's own variables: where podman/docker find their storage, config and runtime
# (a shared account's HOME, not the submitter's); the worker's values go in as K=V words
ENGINE_OWN = frozenset({"HOME", "PATH", "USER", "LOGNAME", "TMPDIR", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME",
                        "XDG_DATA_HOME", "DBUS_SESSION_BUS_ADDRESS"})
ENGINE_PREFIXES = ("CONTAINERS_", "DOCKER_", "PODMAN_", "APPTAINER", "SINGULARITY")


def engine_own(name: str) -> bool:
    """Whether `name` is one of the engine client's own variables (ENGINE_OWN)."""
    return name in ENGINE_OWN or name.startswith(ENGINE_PREFIXES)


def inside_env(env: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment as the container sees it: CUDA_VISIBLE_DEVICES renumbered
    (only the worker's GPUs exist inside, numbered from 0 in the host's order)."""
    env = dict(env)
    gpus = gpu_devices(env)
    if gpus is not None:
        order = sorted(set(gpus))
        env[CUDA] = ",".join(str(order.index(g)) for g in gpus)
    return env


def client_environment(engine: str, env: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """The environment of the engine's client: `base` (the supervisor's), with the worker's
    values of the variables `run_argv` names without a value (podman, docker) or as
    APPTAINERENV_K (apptainer)."""
    out = dict(base)
    for k, v in inside_env(env).items():
        if engine == "apptainer":
            out[f"APPTAINERENV_{k}"] = v
        elif not engine_own(k):
            out[k] = v
    return out


def run_argv(engine: str, image: str, argv: Sequence[str], *, cwd: str, env: Mapping[str, str],
             mounts: Sequence[str], name: str, extra: Sequence[str] = ()) -> list[str]:
    """The command that runs `argv` in `image` through `engine` (see the module's text).
    `mounts`: directories bound at their own path (duplicates and `cwd` once each);
    `extra`: the host's `container_args`, before the image."""
    if engine not in ENGINES:
        raise ValueError(f"unknown container engine {engine!r} (one of {', '.join(ENGINES)})")
    gpus = gpu_devices(env)
    env = inside_env(env)
    dirs = list(dict.fromkeys([cwd, *mounts]))
    if engine == "apptainer":   # the whole environment through APPTAINERENV_* (client_environment)
        return ["apptainer", "exec", "--cleanenv", "--containall", "--no-home",
                *(w for d in dirs for w in ("--bind", f"{d}:{d}")), "--pwd", cwd,
                *(["--nv"] if gpus is not None else []),
                *extra, image, *argv]
    return [engine, "run", "--rm", "--init", "--network", "host", "--name", name,
            *(["--replace"] if engine == "podman" else []),
            *(w for d in dirs for w in ("-v", f"{d}:{d}")), "-w", cwd,
            *(w for g in sorted(set(gpus or ())) for w in ("--device", f"nvidia.com/gpu={g}")),
            *(w for k, v in env.items() for w in ("--env", f"{k}={v}" if engine_own(k) else k)),
            *extra, image, *argv]


def spec_argv(spec: Mapping[str, Any], argv: list[str], cwd: str, env: Mapping[str, str], pgid: int) -> list[str]:
    """The engine's command for a spawn spec's worker (gpuflex.hosts.supervisor.spawn; its
    `container`: engine, image, args): the job's directories (private_dirs, socket_dir)
    mounted, the container named after the supervisor's group `pgid`."""
    c = spec["container"]
    mounts = [os.path.expanduser(d) for d in [*(spec.get("private_dirs") or ()), spec.get("socket_dir")] if d]
    return run_argv(c["engine"], c["image"], argv, cwd=cwd, env=env, mounts=mounts,
                    name=container_name(pgid), extra=c.get("args") or ())


def engine_in_group(pgid: int, procs: Iterable[tuple[int, str, int, int]],
                    cmdline: Callable[[int], list[str]] | None = None) -> str | None:
    """The engine (podman, docker) whose client (`ENGINE run`) is a live process of group
    `pgid` (`procs`: supervisor.proc_stats), whose container must then be killed through it."""
    for pid, state, _, pgrp in procs:
        if pgrp != pgid or state == "Z":
            continue
        words = (cmdline or _cmdline)(pid)
        if len(words) > 1 and os.path.basename(words[0]) in ("podman", "docker") and words[1] == "run":
            return os.path.basename(words[0])
    return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:   # gone meanwhile
        return []


def kill(engine: str, pgid: int, signum: int, timeout_s: float = 30.0) -> bool:
    """Send `signum` to the container of group `pgid` through the engine (podman,
    docker); True when the engine did. No container of that name is no error."""
    if engine not in ("podman", "docker"):
        return False
    try:
        res = subprocess.run([engine, "kill", "--signal", str(int(signum)), container_name(pgid)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def image_check(engine: str, image: str) -> list[str] | None:
    """The command that exits 0 when `engine` has `image` here; None for apptainer, whose
    images are files or remote references (left to the run)."""
    if engine == "apptainer":
        return None
    return [engine, "image", "inspect", image] if engine == "docker" else [engine, "image", "exists", image]


def image_missing(engine: str, image: str, timeout_s: float = 60.0) -> str | None:
    """Why `engine` cannot run `image` on this machine; None when it has it."""
    argv = image_check(engine, image)
    if argv is None:
        return None
    try:
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return f"the container engine {engine} is not installed"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{engine} did not answer: {e}"
    return None if res.returncode == 0 else missing_text(engine, image)


def missing_text(engine: str, image: str) -> str:
    return f"{engine} has no image {image!r} (pull or build it there first)"
