"""Task files (issue 33): a job's settings and command in TOML, for `gpuflex submit task.toml`.

    [job]
    name = "mlp"
    workers = "1:4"
    time = "2h"
    env = { LR = "3e-4" }
    run = "python train.py --lr 3e-4"     # or a list: ["python", "train.py"]

The keys are submit's option names with underscores, as `gpuflex.toml` writes its keys
(`gpus_per_worker`, `resume_from`); each value becomes the option's words for submit's own
parser, so it is checked as the option on the command line is. Pure: text in, words out.
"""

from __future__ import annotations

import shlex
import tomllib
from typing import Any, Mapping

from gpuflex.errors import UsageError

SUFFIX = ".toml"


def is_task_file(path: str) -> bool:
    return path.endswith(SUFFIX)


def task_args(text: str, options: Mapping[str, tuple[str, bool]]) -> tuple[list[tuple[str, tuple[str, ...]]],
                                                                            list[str]]:
    """(each setting's key and option words, the command) of a task file. `options`:
    each key a task file may hold -> (its option, whether it is a flag; a two-way flag is
    written as click does, "--sync/--no-sync"). A file that is
    not TOML, a key that is none of them, a value of the wrong kind or no `run` is a
    UsageError naming it."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"not TOML: {e}.") from None
    for key in data:
        if key != "job":
            raise UsageError(f"unknown table or key {key!r}: a task file holds one [job] table.")
    job = data.get("job")
    if not isinstance(job, dict):
        raise UsageError("no [job] table: write [job] with the settings and run = \"CMD ARGS\".")
    out: list[tuple[str, tuple[str, ...]]] = []
    run = None
    for key, value in job.items():
        if key == "run":
            run = _command(value)
            continue
        if key not in options:
            near = " (write keys with underscores)" if key.replace("-", "_") in options else ""
            raise UsageError(f"[job] {key}: unknown key{near}; the keys are run and " + ", ".join(sorted(options))
                             + ".")
        flag, is_flag = options[key]
        out.append((key, _words(key, flag, is_flag, value)))
    if run is None:
        raise UsageError("[job] has no run: give the command, e.g. run = \"python train.py\".")
    return out, run


def _command(value: Any) -> list[str]:
    if isinstance(value, str):
        try:
            argv = shlex.split(value)
        except ValueError as e:
            raise UsageError(f"[job] run {value!r}: {e} (it is split as a shell splits it).") from None
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        argv = list(value)
    else:
        raise UsageError("[job] run: give the command as a string or a list of strings.")
    if not argv:
        raise UsageError("[job] run is empty: give the command, e.g. run = \"python train.py\".")
    return argv


def _words(key: str, flag: str, is_flag: bool, value: Any) -> tuple[str, ...]:
    """The option words a key's value stands for."""
    if is_flag:
        if not isinstance(value, bool):
            raise UsageError(f"[job] {key} = {value!r}: give true or false.")
        on, _, off = flag.partition("/")   # "--sync/--no-sync": false says --no-sync (over a default true)
        return (on,) if value else ((off,) if off else ())
    if key == "env" and isinstance(value, dict):
        return tuple(w for k, v in value.items() for w in (flag, f"{k}={_scalar(key, v)}"))
    if key == "env" and isinstance(value, list):
        return tuple(w for v in value for w in (flag, _scalar(key, v)))
    if key == "after" and isinstance(value, list):
        return flag, ",".join(_scalar(key, v) for v in value)
    return flag, _scalar(key, value)


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UsageError(f"[job] {key} = {value!r}: give a string or a number.")
    return str(value)
