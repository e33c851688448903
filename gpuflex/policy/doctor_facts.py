"""The facts `gpuflex doctor` gathers and the lines it prints: plain data, no rules.

`gpuflex.control.doctor` gathers the facts through the transports and types them here
once (`HostFacts.parse`, `PgSide.parse` read the hosts' JSON); the rules that judge them
are gpuflex.policy.doctor (a host) and gpuflex.policy.doctor_pairs (a pair of hosts).
The thresholds are here because both the rules and the documentation name them.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

TORCH_MIN = (2, 11)                # pyproject.toml: torch>=2.11,<2.14
CLOCK_WARN_S = 2.0
CLOCK_FAIL_S = 30.0
DISK_WARN_BYTES = 5 << 30          # 5 GiB: a few checkpoints of a mid-size model
DISK_FAIL_BYTES = 256 << 20        # 256 MiB: logs and exit records may not fit
GIB = float(1 << 30)


class Verdict(str, enum.Enum):
    """A check's outcome; only FAIL makes `gpuflex doctor` exit 1."""

    OK = "ok"        # passed
    WARN = "warn"    # works, but worth a look
    FAIL = "fail"    # a job would fail or misbehave here
    SKIP = "skip"    # not checked: not configured, or a check it needs failed


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of the doctor's table."""

    host: str
    check: str
    verdict: Verdict
    detail: str
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "check": self.check, "verdict": self.verdict.value,
                "detail": self.detail, "fix": self.fix}


def exit_code(findings: list[Finding]) -> int:
    """1 when a check failed, else 0 (warnings and skips pass)."""
    return 1 if any(f.verdict is Verdict.FAIL for f in findings) else 0


# ---- facts ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Unanswered:
    """A probe without a usable answer: `message` says why; `timeout_s` is set when it did
    not finish within that bound."""

    message: str
    timeout_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Reach:
    """How the host was reached. `how`: "local", "ssh" or another transport's kind.
    `stage` where it failed ("connect", "key", "login"; None: it did not). For SSH: `where`
    (address:port), `key` the offered key (type and fingerprint), `key_state` "pinned",
    "unknown" or "mismatch" and `pinned` the key known_hosts pins on a mismatch."""

    how: str
    user: str | None = None
    where: str | None = None
    key: str | None = None
    key_state: str | None = None
    pinned: str | None = None
    stage: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class TorchFacts:
    version: str | None = None
    cuda: str | None = None             # torch.version.cuda: None for a CPU build
    cuda_available: bool = False
    device_count: int = 0
    gloo: bool = False
    nccl: bool = False
    error: str | None = None            # the import failed
    cuda_error: str | None = None       # torch.cuda raised

    @property
    def usable(self) -> bool:
        return self.error is None and version_tuple(self.version) >= TORCH_MIN and self.gloo


@dataclasses.dataclass(frozen=True)
class WorkdirFacts:
    path: str
    existed: bool = False
    is_dir: bool = False
    owned: bool = False
    mode: int | None = None
    modes_kept: bool = False
    free_bytes: int | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class HostFacts:
    """The host's python's answer (gpuflex.hosts.hostfacts)."""

    python_version: str
    executable: str
    gpuflex_version: str | None
    gpuflex_path: str | None
    gpuflex_error: str | None
    torch: TorchFacts
    workdir: WorkdirFacts

    @classmethod
    def parse(cls, data: Any) -> "HostFacts":
        """From hostfacts' JSON object; ValueError when it is not of that shape."""
        try:
            py, gf, tf, wd = data["python"], data["gpuflex"], data["torch"], data["workdir"]
            torch = TorchFacts(**{k: tf[k] for k in tf if k in _TORCH_KEYS})
            workdir = WorkdirFacts(**{k: wd[k] for k in wd if k in _WORKDIR_KEYS})
            return cls(str(py["version"]), str(py["executable"]), gf.get("version"), gf.get("path"),
                       gf.get("error"), torch, workdir)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not the doctor's facts: {e!r}") from None

    @property
    def usable(self) -> bool:
        """gpuflex and torch are there to run a job's processes (and the pair check)."""
        return self.gpuflex_error is None and self.torch.usable


_TORCH_KEYS = {f.name for f in dataclasses.fields(TorchFacts)}
_WORKDIR_KEYS = {f.name for f in dataclasses.fields(WorkdirFacts)}


@dataclasses.dataclass(frozen=True)
class Smi:
    """What nvidia-smi answered to the probe's queries. `gpus`: (index, model) per GPU
    row; `apps`: compute-process rows; `driver`: driver_version; `stray`: lines that were
    not rows; `error`: a query that failed or printed nothing parsable; `missing`: the
    program is not there (exit 127)."""

    gpus: tuple[tuple[int, str | None], ...] = ()
    apps: int = 0
    driver: str | None = None
    stray: tuple[str, ...] = ()
    error: str | None = None
    missing: bool = False


@dataclasses.dataclass(frozen=True)
class Clock:
    offset_s: float         # host minus this machine, at the round trip's midpoint
    uncertainty_s: float    # half the round trip


@dataclasses.dataclass(frozen=True)
class HostObservation:
    reach: Reach
    facts: HostFacts | Unanswered | None = None
    smi: Smi | Unanswered | None = None
    clock: Clock | Unanswered | None = None


@dataclasses.dataclass(frozen=True)
class Reference:
    """The control host's versions, which every host is compared with."""

    gpuflex: str
    torch: str | None


def version_tuple(text: str | None) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); None or no digits -> ()."""
    if not text:
        return ()
    m = re.match(r"(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


@dataclasses.dataclass(frozen=True)
class PgSide:
    """One side's line from gpuflex.hosts.pgcheck: the `stage` it stopped at ("done" when
    every backend all-reduced), the `backend` it was at, its `error`, and the seconds
    each finished backend took (formation and all-reduce)."""

    rank: int
    stage: str
    backend: str | None = None
    error: str | None = None
    seconds: tuple[tuple[str, float], ...] = ()

    @property
    def ok(self) -> bool:
        return self.stage == "done"

    @classmethod
    def parse(cls, data: Any) -> "PgSide":
        """From pgcheck's JSON object; ValueError when it is not of that shape."""
        try:
            results = data.get("results") or {}
            return cls(int(data["rank"]), str(data["stage"]), data.get("backend"), data.get("error"),
                       tuple((str(b), float(r["s"])) for b, r in results.items()))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a pgcheck line: {e!r}") from None


@dataclasses.dataclass(frozen=True)
class PairObservation:
    """A process-group check between hosts `a` (rank 0, serving the store at addr:port)
    and `b` (rank 1), for `backends`, each wait bounded by `timeout_s`. `port` is None
    when no port could be picked (`port_error` says why); `sides` are rank 0's and rank
    1's answers."""

    a: str
    b: str
    addr: str
    timeout_s: float
    backends: tuple[str, ...]
    port: int | None = None
    port_error: Unanswered | None = None
    sides: tuple[PgSide | Unanswered, PgSide | Unanswered] | None = None
