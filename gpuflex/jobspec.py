"""What a lab's job asks for besides its command: how it changes size, how long it may run,
what it waits for and which array it belongs to (issue 11), how its batch is split (issue
12) and which checkpoint it resumes from (issue 13). Pure parsing, shared by the
CLI (`submit --elastic/--time/--after/--array`) and the config (`[jobs] default_time`), so
one spelling means one thing everywhere; every refusal is a UsageError naming the value.

The spellings follow Slurm where a lab already knows them: `--time` takes `90s`, `30m`,
`4h`, `2d`, or Slurm's `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS` (a
bare number is minutes, as in Slurm); `--array` takes `A-B`, `A,B,C` or a mix, with
`%N` for at most N running at once.
"""

from __future__ import annotations

import dataclasses
import os
import re

from gpuflex.errors import UsageError

INPLACE = "inplace"
RESTART = "restart"
ELASTIC_MODES = (INPLACE, RESTART)
SPLIT_SPEED = "speed"
SPLIT_EVEN = "even"
SPLIT_MODES = (SPLIT_SPEED, SPLIT_EVEN)
MAX_TIME_S = 366 * 86400      # a year: anything longer is a typo
MAX_ARRAY = 10000             # jobs in one array (Slurm's default MaxArraySize is 1001)
MAX_AFTER = 100               # jobs one job may wait for

_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SUFFIXED = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")
_SLURM = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")


def parse_time(text: str, option: str = "--time") -> float:
    """Seconds of a time limit (see the module's doc); UsageError for what is not one,
    for 0 and for more than a year."""
    raw = str(text).strip().lower()
    seconds = _suffixed(raw) if _SUFFIXED.fullmatch(raw) else _slurm(raw)
    if seconds is None:
        raise UsageError(f"{option} {text!r} is not a time: write e.g. 90s, 30m, 4h, 2d or "
                         "1-12:00:00 (days-hours:minutes:seconds).")
    if not 0 < seconds <= MAX_TIME_S:
        raise UsageError(f"{option} {text!r}: a time limit is more than 0 and at most 366 days.")
    return seconds


def _suffixed(raw: str) -> float | None:
    m = _SUFFIXED.fullmatch(raw)
    return float(m.group(1)) * _UNIT[m.group(2)] if m else None


def _slurm(raw: str) -> float | None:
    m = _SLURM.fullmatch(raw)
    if not m or len(raw) > 32:
        return None
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:       # D-HH, D-HH:MM, D-HH:MM:SS
        h, mi, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + mi * 60 + s
    if len(parts) == 1:        # MM
        return parts[0] * 60
    if len(parts) == 2:        # MM:SS
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]   # HH:MM:SS


def format_time(seconds: float) -> str:
    """`1-02:03:04` or `02:03:04`: Slurm's way of writing a time (rounded down to seconds)."""
    s = max(0, int(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}-" if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """The indices of an array and its cap on running jobs (None: no cap)."""

    indices: tuple[int, ...]
    limit: int | None = None


def parse_array(text: str) -> ArraySpec:
    """`0-15%4`, `1,3,5`, `0-3,8`: UsageError for an empty, reversed or too large one."""
    raw = str(text).strip()
    body, sep, cap = raw.partition("%")
    limit = None
    if sep:
        if not cap.isascii() or not cap.isdigit() or int(cap) < 1 or len(cap) > 6:
            raise UsageError(f"--array {text!r}: the part after % is the number of jobs that may run at "
                             "once, at least 1 (e.g. 0-15%4).")
        limit = int(cap)
    indices: list[int] = []
    for part in body.split(","):
        m = re.fullmatch(r"\s*([0-9]{1,9})\s*(?:-\s*([0-9]{1,9})\s*)?", part)
        if not m:
            raise UsageError(f"--array {text!r} is not a list of indices: write e.g. 0-15, 1,3,5 or 0-15%4.")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise UsageError(f"--array {text!r}: the range {lo}-{hi} goes down; write {hi}-{lo}.")
        if hi - lo + 1 + len(indices) > MAX_ARRAY:
            raise UsageError(f"--array {text!r}: at most {MAX_ARRAY} jobs in one array.")
        indices.extend(range(lo, hi + 1))
    if len(set(indices)) != len(indices):
        raise UsageError(f"--array {text!r} names an index twice.")
    return ArraySpec(tuple(indices), limit)


AFTER_KINDS = ("afterok", "afterany", "afternotok")


@dataclasses.dataclass(frozen=True)
class After:
    """What `--after` asks a job to wait for (Slurm's --dependency kinds, ANDed): job ids
    that must succeed (afterok), end however (afterany), end badly (afternotok), and
    `singleton` (no other job of its name and owner running or queued ahead of it)."""

    afterok: tuple[int, ...] = ()
    afterany: tuple[int, ...] = ()
    afternotok: tuple[int, ...] = ()
    singleton: bool = False

    @property
    def ids(self) -> tuple[int, ...]:
        """Every id named, once (whether each names a job is the service's to check)."""
        return tuple(dict.fromkeys(self.afterok + self.afterany + self.afternotok))

    def extra(self) -> dict | None:
        """The kinds beyond afterok, as jobs.dependency stores them (None: none)."""
        out: dict = {k: list(getattr(self, k)) for k in ("afterany", "afternotok") if getattr(self, k)}
        if self.singleton:
            out["singleton"] = True
        return out or None


def _after_id(text: str, p: str) -> int:
    if not p.isascii() or not p.isdigit() or len(p) > 10 or not 1 <= int(p) <= 2**31 - 1:
        raise UsageError(f"--after {text!r}: give job ids separated by commas (e.g. --after 12,13), or "
                         "afterok:ID[:ID...], afterany:ID, afternotok:ID, singleton.")
    return int(p)


def parse_after(text: str) -> After:
    """`12,13` (afterok, as before), `afterok:12:13`, `afterany:7`, `afternotok:7`,
    `singleton`, and these joined by commas (every one must hold: Slurm's `,`; its `?`,
    any one of them, is refused)."""
    kinds: dict[str, list[int]] = {k: [] for k in AFTER_KINDS}
    singleton = False
    for part in str(text).split(","):
        p = part.strip()
        head, colon, rest = p.partition(":")
        if p.lower() == "singleton":
            singleton = True
        elif colon and head.lower() in AFTER_KINDS:
            kinds[head.lower()] += [_after_id(text, i.strip()) for i in rest.split(":")]
        elif colon or "?" in p:
            raise UsageError(f"--after {text!r}: {p!r} is not afterok:ID, afterany:ID, afternotok:ID or "
                             "singleton (several joined by ',' must all hold; '?' is not supported).")
        else:
            kinds["afterok"].append(_after_id(text, p))
    after = After(**{k: tuple(dict.fromkeys(v)) for k, v in kinds.items()}, singleton=singleton)
    if len(after.ids) > MAX_AFTER:
        raise UsageError(f"--after {text!r}: at most {MAX_AFTER} jobs.")
    if set(after.afterok) & set(after.afternotok):
        raise UsageError(f"--after {text!r}: a job cannot be both afterok and afternotok (it could never start).")
    return after


def elastic_mode(value: str | None, min_workers: int, max_workers: int) -> str | None:
    """The job's `elastic` from `--elastic` and its worker range: `inplace` by default for
    MIN < MAX, None (a fixed gang) for N workers. `restart` needs a range to move in;
    `inplace` at a fixed size is today's fixed-size elastic job (faults are ridden out by
    a requeue from its checkpoint, where a gang fails)."""
    if value is None:
        return INPLACE if min_workers < max_workers else None
    mode = str(value).strip().lower()
    if mode not in ELASTIC_MODES:
        raise UsageError(f"--elastic {value!r}: give inplace (gpuflex.elastic scripts, resized in place) or "
                         "restart (scripts that resume from their own checkpoints, relaunched at each resize).")
    if mode == RESTART and min_workers == max_workers:
        raise UsageError(f"--elastic restart with --workers {min_workers}:{max_workers}: a restart job needs "
                         "a range to resize in (e.g. --workers 1:4); a fixed size runs as a gang without "
                         "--elastic.")
    return mode


def split_mode(value: str | None, elastic: str | None) -> str | None:
    """The job's `split` (issue 12) from `--split` and its elastic mode: how gpuflex divides
    an in-place job's fixed global batch over its workers, `speed` (by measured speed; the
    default) or `even`. None for a gang or restart job, whose own script divides its batch:
    `--split` given with one is refused rather than silently ignored."""
    if value is None:
        return SPLIT_SPEED if elastic == INPLACE else None
    mode = str(value).strip().lower()
    if mode not in SPLIT_MODES:
        raise UsageError(f"--split {value!r}: give speed (each worker's share of the global batch in "
                         "proportion to its measured speed; the default) or even (equal shares).")
    if elastic != INPLACE:
        raise UsageError(f"--split {mode} applies to in-place jobs (gpuflex.elastic scripts, whose global "
                         f"batch gpuflex divides); this is a {elastic or 'gang'} job, whose script divides "
                         "its own batch: leave --split out (or submit with --elastic inplace).")
    return mode


def resume_path(value: str, elastic: str | None, cwd: str) -> str:
    """The job's `resume_from` (issue 13) from `--resume-from PATH`: the checkpoint directory
    of an earlier job, `~` expanded, made absolute against `cwd` (the caller's) and
    normalised. Only an in-place job starts from gpuflex's checkpoint (its runtime reads one
    written at any world size); a gang or restart job's script resumes from its own, so
    the option is refused there rather than silently ignored."""
    text = str(value)
    if elastic != INPLACE:
        raise UsageError(f"--resume-from applies to in-place jobs (gpuflex.elastic scripts, which start from "
                         f"gpuflex's checkpoint at any world size); this is a {elastic or 'gang'} job, whose "
                         "script resumes from its own checkpoints: leave --resume-from out (or submit with "
                         "--elastic inplace).")
    if not text.strip():
        raise UsageError(f"--resume-from {text!r}: give the checkpoint directory of an earlier job (the "
                         "directory holding its checkpoint.pt).")
    if not _one_utf8_line(text):
        raise UsageError(f"--resume-from {text!r} holds a NUL byte, a line break or bytes that are not UTF-8.")
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(text)))


def _one_utf8_line(text: str) -> bool:
    """Whether `text` can be stored (UTF-8), passed in an environment (no NUL) and shown on
    one line of a message or log (no line break)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:   # the shell's bytes that are not UTF-8, as surrogate escapes
        return False
    return not any(c in text for c in "\0\n\r")


def torchrun_args(argv: list[str]) -> list[str] | None:
    """The arguments torchrun reads (up to its script) when `argv` runs torchrun
    (`torchrun ...` or `python -m torch.distributed.run ...`); None for any other command."""
    if not argv:
        return None
    name = argv[0].rsplit("/", 1)[-1]
    if name == "torchrun":
        rest = argv[1:]
    elif name.startswith("python") and argv[1:3] == ["-m", "torch.distributed.run"]:
        rest = argv[3:]
    else:
        return None
    for i, a in enumerate(rest):   # its own options end at the script (or -m module)
        if not a.startswith("-") and (i == 0 or not _takes_value(rest[i - 1])):
            return rest[:i]
    return rest


def _takes_value(option: str) -> bool:
    return option.startswith("--") and "=" not in option and option not in (
        "--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--module", "-m")


def torchrun_nproc(argv: list[str]) -> str | None:
    """The value of torchrun's --nproc-per-node in `argv` (None: not torchrun, or not given)."""
    args = torchrun_args(argv)
    for i, a in enumerate(args or []):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def check_torchrun(argv: list[str], gpus_per_worker: int) -> None:
    """A torchrun command runs one agent per worker ("node"), whose processes share the
    worker's GPUs: --nproc-per-node must fit them (a number up to --gpus-per-worker, or
    torchrun's gpu/auto, which count the GPUs it is given)."""
    nproc = torchrun_nproc(argv)
    if nproc is None or nproc in ("gpu", "auto", "cpu", "xpu"):
        return
    if not nproc.isascii() or not nproc.isdigit() or int(nproc) < 1:
        raise UsageError(f"torchrun --nproc-per-node {nproc!r}: give a number of processes per node.")
    if int(nproc) > gpus_per_worker:
        raise UsageError(f"torchrun --nproc-per-node {nproc} does not fit --gpus-per-worker {gpus_per_worker}: "
                         f"each worker is one torchrun node; give --gpus-per-worker {nproc}.")
