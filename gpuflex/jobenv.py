"""Per-job environments (issue 33): `submit --python PATH`, `--venv PATH`, `--conda NAME`
and `--env-setup CMD`. Pure: what a worker's command and environment become, and what a
host's preparation runs; gpuflex.control.prepare runs it, gpuflex.control.launch applies
the rest when it builds a worker's spawn.

- `--venv PATH`: the workers run as after `source PATH/bin/activate`: `PATH/bin` first on
  PATH, `VIRTUAL_ENV=PATH`, no `PYTHONHOME`; so `python`, `pip`, `torchrun` in the command
  (or in a script it runs) are the venv's. The command itself is left as written.
- `--python PATH`: a command whose first word is exactly `python` or `python3` runs PATH
  instead (`python train.py` -> `PATH train.py`); nothing else changes (a script that
  calls python itself gets the host's: use --venv). Any other first word is refused.
- `--conda NAME`: the command runs as `conda run -n NAME --no-capture-output CMD...`
  (`conda` found on the workers' PATH on the host).
- `--env-setup CMD`: run once per host per run of the job, before that host's workers,
  as `sh -c CMD` in the job's directory with the job's environment (the venv's, with
  --venv); a non-zero exit fails the job (gpuflex.control.prepare).

At most one of --python, --venv and --conda. Paths are the hosts' paths; a relative one
is made absolute from the submit directory, as --workdir is.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
from typing import Any, Mapping

from gpuflex.errors import UsageError

PYTHON_WORDS = ("python", "python3")   # the first words --python replaces
CONDA_RUN = ("conda", "run", "-n")   # then NAME, "--no-capture-output" (else conda holds the output until the end)
_CONDA_NAME = re.compile(r"[A-Za-z0-9._+-]{1,128}")   # what `conda create -n` takes


@dataclasses.dataclass(frozen=True)
class JobEnv:
    """A job's environment options, as recorded with it (None: not given)."""

    python: str | None = None
    venv: str | None = None
    conda: str | None = None
    env_setup: str | None = None

    def __post_init__(self) -> None:
        given = [f"--{n}" for n in ("python", "venv", "conda") if getattr(self, n) is not None]
        if len(given) > 1:
            raise UsageError(f"{' and '.join(given)}: give at most one of --python, --venv and --conda "
                             "(each chooses the workers' interpreter).")
        for name in ("python", "venv", "conda", "env_setup"):
            value = getattr(self, name)
            if value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if not value.strip():
                raise UsageError(f"{flag} is empty.")
            if "\0" in value or ("\n" in value and name != "env_setup"):
                raise UsageError(f"{flag} {value!r} holds a NUL byte or a newline.")
        if self.conda is not None and not _CONDA_NAME.fullmatch(self.conda):
            raise UsageError(f"--conda {self.conda!r} is not an environment name (letters, digits, '.', '_', "
                             "'+', '-'); for an environment by path, use --venv or --python.")

    @classmethod
    def of(cls, job: Any) -> "JobEnv":
        """The options a job row (or anything with these attributes) holds."""
        return cls(*(getattr(job, n, None) for n in ("python", "venv", "conda", "env_setup")))

    @property
    def given(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))

    def absolute(self, base: str) -> "JobEnv":
        """Paths made absolute from `base` (the submit directory; `~` is the submitter's
        home, as for --workdir). A bare --python name (`python3.11`) stays a name, which
        the host looks up on the workers' PATH."""
        def path(p: str | None) -> str | None:
            if p is None:
                return None
            return os.path.normpath(os.path.join(base, os.path.expanduser(p)))
        py = self.python if self.python is None or "/" not in self.python else path(self.python)
        return dataclasses.replace(self, python=py, venv=path(self.venv))

    def checks(self) -> list[str]:
        """The executables a host must have for the workers to start (after --env-setup)."""
        if self.venv is not None:
            return [venv_python(self.venv)]
        if self.python is not None and "/" in self.python:
            return [self.python]
        return []


def venv_python(venv: str) -> str:
    return posixpath.join(venv, "bin", "python")


def check_command(env: JobEnv, argv: list[str]) -> None:
    """--python replaces a `python`/`python3` first word only: any other is a UsageError
    (it would change nothing)."""
    if env.python is not None and argv and argv[0] not in PYTHON_WORDS:
        raise UsageError(f"--python replaces a command's first word python or python3; this command starts "
                         f"with {argv[0]!r}. Use --venv for a script or program that runs python itself.")


def check_local(env: JobEnv) -> None:
    """On a pool of local hosts only, what must exist already (without --env-setup, which
    may make it): the venv's bin/python, the --python program. A UsageError names it."""
    if env.env_setup is not None:
        return
    if env.venv is not None and not os.path.isdir(env.venv):
        raise UsageError(f"--venv {env.venv!r} is not a directory (make it with python -m venv {env.venv}, "
                         "or give --env-setup to make it at launch).")
    for path in env.checks():
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            what = f"--venv {env.venv!r} has no bin/python" if env.venv is not None else \
                f"--python {path!r} is not an executable file"
            raise UsageError(f"{what}.")


def worker_argv(env: JobEnv, argv: list[str]) -> list[str]:
    """The command a worker runs: the job's, with --python's or --conda's change."""
    if env.python is not None and argv and argv[0] in PYTHON_WORDS:
        return [env.python, *argv[1:]]
    if env.conda is not None:
        return [*CONDA_RUN, env.conda, "--no-capture-output", *argv]
    return list(argv)


def environment(env: JobEnv, base: Mapping[str, str]) -> dict[str, str]:
    """The workers' environment `base` with --venv's activation: its bin first on PATH
    (alone when `base` has no PATH, e.g. `#SBATCH --export=NONE`), VIRTUAL_ENV, no
    PYTHONHOME (as `activate` unsets it)."""
    out = dict(base)
    if env.venv is not None:
        bin_dir = posixpath.join(env.venv, "bin")
        out["PATH"] = bin_dir + (":" + base["PATH"] if base.get("PATH") else "")
        out["VIRTUAL_ENV"] = env.venv
        out.pop("PYTHONHOME", None)
    return out


def setup_request(env: JobEnv, *, cwd: str, environ: Mapping[str, str], clean_env: bool, log: str,
                  timeout_s: float) -> dict[str, Any]:
    """What gpuflex.hosts.envsetup is asked on a host (JSON on its stdin, never on a
    command line: the environment may hold secrets): run --env-setup as `sh -c CMD` (if
    given) in `cwd` with `environ`, its output appended to `log`, for at most `timeout_s`;
    then check that the executables the workers need are there."""
    return {"argv": ["sh", "-c", env.env_setup] if env.env_setup is not None else None, "cwd": cwd,
            "env": environment(env, environ), "clean_env": clean_env, "log": log, "timeout_s": timeout_s,
            "check": env.checks()}


def describe(env: JobEnv) -> str:
    """One line for `status JOB`: `venv /opt/envs/a; env-setup: pip install -r req.txt`."""
    parts = [f"{n} {getattr(env, n)}" for n in ("python", "venv", "conda") if getattr(env, n) is not None]
    if env.env_setup is not None:
        parts.append(f"env-setup: {env.env_setup}")
    return "; ".join(parts)
