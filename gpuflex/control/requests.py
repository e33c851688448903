"""What a command asks for, checked at the edge before any database is opened: a submit's
request (`SubmitRequest`), worker counts, job references (id, name or an array's `ID_INDEX`),
`--env` items, and text the database and execve can hold. Every refusal is a UsageError (or
UnknownJobError) naming the value, so the CLI answers it with one line and exit code 2.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from gpuflex.errors import UnknownJobError, UsageError
from gpuflex.jobenv import JobEnv, check_command
from gpuflex.jobspec import After, ArraySpec, check_torchrun, elastic_mode, split_mode

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ID = re.compile(r"[0-9]+")   # ASCII only: str.isdigit() takes '²', which int() refuses
_ARRAY_REF = re.compile(r"([0-9]+)_([0-9]+)")
MAX_RETRIES = 1000
# Every count the CLI takes lands in an INTEGER column, 32 bits wide in PostgreSQL (and
# 64 in SQLite): bounds at the edge so a typo is a clear refusal, never an OverflowError.
INT_MAX = 2**31 - 1
MAX_WORKERS = 65536
MAX_GPUS_PER_WORKER = 4096   # config_fields.MAX_CPU_SLOTS: no host holds more devices


def parse_count(option: str, value: int, low: int, high: int = INT_MAX) -> int:
    """`value` if it is an int in [low, high]; UsageError naming the option and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{option} {value!r}: give a whole number from {low} to {high}.")
    return value


def check_text(what: str, text: str, *, shown: bool = True) -> str:
    """`text` if the database can store it and a process can be given it: UTF-8 (the
    shell hands Python bytes that are not UTF-8 as surrogate escapes, which no column
    or JSON document can hold, and storing them re-encoded would run a different
    command) and no NUL byte (execve cannot pass one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what}{f' {text!r}' if shown else ''} holds bytes that are not UTF-8 (at "
                         f"{e.start}); gpuflex stores commands, paths and variables as UTF-8 text.") from None
    if "\0" in text:
        raise UsageError(f"{what}{f' {text!r}' if shown else ''} holds a NUL byte.")
    return text


@dataclasses.dataclass(frozen=True)
class SubmitRequest:
    argv: list[str]
    name: str | None = None
    min_workers: int = 1
    max_workers: int = 1
    gpus_per_worker: int = 1
    priority: int = 0
    harvest: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    workdir: str | None = None
    retries: int = 0   # restarts allowed after a worker crashed (a bug); faults never count
    # issue 11: --elastic as given (None: inplace for MIN < MAX, a fixed gang otherwise),
    # --time in seconds (None: [jobs] default_time, else none), --after (issue 33: its kinds), --array,
    # --requeue (a higher-priority job may stop and requeue it)
    elastic: str | None = None
    time_limit_s: float | None = None
    after: After = After()
    array: ArraySpec | None = None
    requeue: bool = False
    notify: str | None = None   # --notify: the webhook URL (None: [notify] url, if any)
    split: str | None = None    # --split speed|even (issue 12; None: speed for an in-place job)
    resume_from: str | None = None   # --resume-from PATH as given (issue 13; see control/resume.py)
    # issue 33: where each setting came from (setting -> "command line", "#GPUFLEX",
    # "#SBATCH", "task file" or "default"; gpuflex/cli/job_settings.py); None: not told
    sources: dict[str, str] | None = None
    # issue 33: --sync (pack the workdir, send it to every host), --no-sync (to none, whatever
    # the pool's or a host's `sync`); None: neither given, the config decides per host
    sync: bool | None = None
    job_env: JobEnv = JobEnv()   # issue 33: --python, --venv, --conda, --env-setup (gpuflex.jobenv)
    image: str | None = None   # issue 33: --image (each worker in a container of this image)
    # the submitter's environment, recorded for every worker (launch.submit_environment
    # drops what belongs to the session); None: this process's
    environ: Mapping[str, str] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.argv or not self.argv[0].strip():
            raise UsageError("no command to run; put it after '--', e.g. gpuflex submit -- python train.py.")
        for i, arg in enumerate(self.argv):
            check_text(f"the command's argument {i}", arg)
        if self.min_workers < 1 or self.max_workers < self.min_workers:
            raise UsageError(f"bad worker range {self.min_workers}:{self.max_workers}.")
        parse_count("--workers", self.max_workers, 1, MAX_WORKERS)
        if self.gpus_per_worker < 1:   # 0 would be a worker that holds nothing: never placed, never counted
            raise UsageError(f"--gpus-per-worker {self.gpus_per_worker}: a worker holds at least 1 GPU "
                             "(or CPU slot).")
        parse_count("--gpus-per-worker", self.gpus_per_worker, 1, MAX_GPUS_PER_WORKER)
        parse_count("--priority", self.priority, -INT_MAX, INT_MAX)
        for key, value in self.env.items():
            check_text(f"--env {key}=...", value, shown=False)
        if self.workdir is not None:
            check_text("--workdir", self.workdir)
        if self.name is not None and not _NAME.fullmatch(self.name):
            raise UsageError(f"--name {self.name!r}: use letters, digits, '.', '_' or '-' (at most 64).")
        if self.name is not None and (self.name.isdigit() or _ARRAY_REF.fullmatch(self.name)):
            raise UsageError(f"--name {self.name!r}: a name of digits only would read as a job id "
                             f"(or ID_INDEX as an array's job); add a letter (e.g. run-{self.name}).")
        if self.workdir is not None and not os.path.isdir(os.path.expanduser(self.workdir)):
            raise UsageError(f"--workdir {self.workdir!r} is not a directory.")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) \
                or not 0 <= self.retries <= MAX_RETRIES:
            raise UsageError(f"--retries {self.retries!r}: give a number of restarts from 0 to {MAX_RETRIES}.")
        split_mode(self.split, elastic_mode(self.elastic, self.min_workers, self.max_workers))
        check_torchrun(self.argv, self.gpus_per_worker)
        for flag, value in (("--python", self.job_env.python), ("--venv", self.job_env.venv),
                            ("--conda", self.job_env.conda), ("--env-setup", self.job_env.env_setup)):
            if value is not None:
                check_text(flag, value, shown=flag != "--env-setup")
        check_command(self.job_env, self.argv)
        if self.notify is not None:
            from gpuflex.config_fields import check_webhook_url   # pydantic's: loaded when a URL is given

            check_webhook_url(self.notify)

    @property
    def elastic_mode(self) -> str | None:
        """'inplace', 'restart' or None (a fixed gang): see gpuflex.jobspec.elastic_mode."""
        return elastic_mode(self.elastic, self.min_workers, self.max_workers)


def parse_workers(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' -> (min, max); raises UsageError naming the value."""
    m = re.fullmatch(r"\s*([0-9]+)\s*(?::\s*([0-9]+)\s*)?", text)
    if not m:
        raise UsageError(f"--workers {text!r} is not N or MIN:MAX (e.g. 2 or 1:4).")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise UsageError(f"--workers {text!r}: at least 1 worker is needed.")
    if hi < lo:
        raise UsageError(f"--workers {text!r}: MAX ({hi}) is below MIN ({lo}); write MIN:MAX.")
    if hi > MAX_WORKERS:
        raise UsageError(f"--workers {text!r}: at most {MAX_WORKERS} workers.")
    return lo, hi


@dataclasses.dataclass(frozen=True)
class ArrayRef:
    """`5_3`: index 3 of the array 5 (Slurm's way of naming an array's task)."""

    array_id: int
    index: int


def _id(text: str) -> int:
    if len(text) > 10 or int(text) > INT_MAX:   # no such row can exist; the driver would overflow
        raise UsageError(f"job id {text[:20]}{'...' if len(text) > 20 else ''}: job ids go from 1 "
                         f"to {INT_MAX}.", hint="Run 'gpuflex status' to list jobs.")
    return int(text)


def parse_ref(ref: str | int) -> int | str | ArrayRef:
    """A job reference as the id (int), the array task (`5_3`: ArrayRef) or the name (str)
    it can be, checked before any database is opened; UnknownJobError for what can be
    none of them."""
    text = str(ref).strip()
    if _ID.fullmatch(text):
        return _id(text)
    m = _ARRAY_REF.fullmatch(text)
    if m:
        return ArrayRef(_id(m.group(1)), _id(m.group(2)))
    if _NAME.fullmatch(text):
        return text
    raise UnknownJobError(text)


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--env {item!r} has no '='; write --env KEY=VALUE.")
        if not _ENV_KEY.fullmatch(key):
            raise UsageError(f"--env {key}=...: {key!r} is not a valid variable name.")  # never the value
        env[key] = value
    return env
