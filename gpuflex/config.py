"""Load and validate `gpuflex.toml`.

Lookup order: an explicit path (`--config`), `$GPUFLEX_CONFIG`, `./gpuflex.toml`,
`~/.config/gpuflex/gpuflex.toml`, else the built-in default (one local host with CPU
slots). Every error names the file, the key and the bad value.

Each TOML table is a pydantic model (a pydantic dataclass, so `dataclasses.replace`
works on it): the keys it declares, their defaults, strict types and bounds. A key it
does not declare is an error. `_config_error` turns pydantic's first error (an unknown
key before any other) into one `ConfigError` line with the file, the key and the bad
value.

Paths may start with `~`, kept as written here and expanded where they are used: on
this machine for `database.url`, `known_hosts` and `identity_file`; on the host itself
(its user's home) for a host's `workdir`, `python` and `nvidia_smi`, which is why they
cannot be expanded when the file is read.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import ConfigDict, Field, StrictBool, StrictInt, TypeAdapter, ValidationError, field_validator
from pydantic.dataclasses import dataclass

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from gpuflex.config_fields import (MESSAGE, DatabaseUrl, Gpus, HostName, Number, NotifyEvents, Text, TimeLimit,
                                   UserOrGroup, WebhookUrl, invalid)
from gpuflex.errors import ConfigError

BUILTIN = "<built-in default>"
DEFAULT_DB_URL = "sqlite:///~/.local/state/gpuflex/gpuflex.db"
REMOTE_DEFAULTS = {"python": "python3", "workdir": "~/gpuflex"}  # a host whose address is not "local"

# One TOML table per model: every key it does not declare is an error. Types are strict
# per field (StrictStr, StrictInt, Number): TOML's "22" is not a port, true is not 1.
_TABLE = ConfigDict(extra="forbid")


# Upper bounds on every number: a typo such as 1e10 seconds must be refused here, not
# overflow time.sleep or a deadline (time_t) in the middle of `cancel`. A day is the
# longest wait any setting needs; an hour for what a user would sit through.
DAY_S = 86400
HOUR_S = 3600


@dataclass(frozen=True, config=_TABLE)
class HarvestSettings:
    interval_s: Number = Field(60, ge=1, le=DAY_S)
    idle_util_pct: Number = Field(5, ge=0, le=100)
    idle_memory_mib: Number = Field(512, ge=0, le=1 << 24)   # 16 TiB
    idle_samples: StrictInt = Field(3, ge=1, le=1000)
    reclaim_deadline_s: Number = Field(30, ge=1, le=HOUR_S)
    # issue 32: who gets idle GPUs. "fair": priority, then fair share, then age, one worker
    # at a time; "throughput": by each job's measured scaling (gpuflex.policy.allocation)
    policy: Literal["fair", "throughput"] = "fair"
    horizon_s: Number = Field(900, ge=1, le=DAY_S)        # a resize must pay for its stall within this
    resize_stall_s: Number = Field(5, ge=0, le=HOUR_S)    # what one resize costs the job
    min_gain_pct: Number = Field(5, ge=0, le=100)         # smaller gains are noise (hysteresis)
    hold_s: Number = Field(300, ge=0, le=DAY_S)           # a resized job is left alone this long


@dataclass(frozen=True, config=_TABLE)
class JobSettings:
    cancel_grace_s: Number = Field(10, ge=0, le=HOUR_S)            # SIGTERM, then SIGKILL after this
    checkpoint_interval_s: Number = Field(60, ge=0.1, le=DAY_S)    # on-disk checkpoints of elastic jobs
    pg_timeout_s: Number = Field(10, ge=1, le=HOUR_S)              # process-group timeout inside workers
    heartbeat_timeout_s: Number = Field(3, ge=1, le=HOUR_S)        # a worker silent this long is taken for dead
    max_same_failures: StrictInt = Field(3, ge=1, le=1000)  # the same rollback/formation failure this often ends the job
    orphan_timeout_s: Number = Field(120, gt=0, le=DAY_S)          # a coordinator without heartbeats or commands this long ends itself
    formation_timeout_s: Number = Field(60, ge=1, le=DAY_S)        # a worker not ready/joined this long is formed without
    refresh_s: Number = Field(5, ge=0, le=DAY_S)    # `gpuflex watch` reconciles the jobs this often between ticks (0: at ticks)
    # a run's time limit when submit gives no --time (same spellings: 90s, 4h, 1-12:00:00)
    default_time: Optional[TimeLimit] = None
    # issue 12: a worker slower than its job's median by this factor for this long, in a job
    # above its MIN, is released (shrunk away in place)
    straggler_factor: Number = Field(3, ge=1.1, le=1000)
    straggler_s: Number = Field(300, ge=1, le=DAY_S)
    # issue 33: `submit --sync` by default (a host's own `sync` overrides it), and the most
    # the packed submit directory may hold (gpuflex.hosts.sync)
    sync: StrictBool = False
    sync_cap_mib: Number = Field(100, gt=0, le=1 << 20)
    # issue 27: an in-place run's workers on a host forked from one interpreter that
    # imported torch once (gpuflex.hosts.zygote); false: each worker its own interpreter.
    # Off until the whole suite has run with it on (test_elastic_jobs.py runs with it on)
    fork_start: StrictBool = False


@dataclass(frozen=True, config=_TABLE)
class NotifySettings:
    """Webhooks (gpuflex.control.notify): the URL a job gets unless `submit --notify`
    names one (stored with the job at submit), and which of its moves are posted."""

    url: Optional[WebhookUrl] = None
    events: NotifyEvents = \
        ("succeeded", "failed", "timeout", "preempted")


@dataclass(frozen=True, config=_TABLE)
class AccessSettings:
    """Who may change other users' jobs (issue 14): user names and `@group` unix groups."""

    admins: tuple[UserOrGroup, ...] = ()


@dataclass(frozen=True, config=_TABLE)
class QuotaSettings:
    """Fair share (issue 14): GPUs a user's jobs may hold at once (`default_gpus`, None:
    no limit; `users` overrides it per user name), whether admins are exempt, and the
    half-life of the decayed GPU-hours that order equal-priority queued jobs and harvest."""

    default_gpus: Optional[StrictInt] = Field(None, ge=0, le=1 << 20)
    users: dict[UserOrGroup, Annotated[int, Field(ge=0, le=1 << 20)]] = \
        Field(default_factory=dict)
    admins_exempt: StrictBool = True
    half_life_h: Number = Field(24, gt=0, le=24 * 365)


@dataclass(frozen=True, config=_TABLE)
class HostConfig:
    name: HostName
    address: Text = "local"
    port: StrictInt = Field(22, ge=1, le=65535)
    user: Optional[Text] = None
    identity_file: Optional[Text] = None
    known_hosts: Text = "~/.ssh/known_hosts"
    gpus: Gpus = "all"
    owner: Optional[Text] = None
    nvidia_smi: Text = "nvidia-smi"
    python: Text = sys.executable
    workdir: Text = "~/.local/state/gpuflex/work"
    connect_timeout_s: Number = Field(5, ge=0.1, le=HOUR_S)
    command_timeout_s: Number = Field(30, ge=0.1, le=DAY_S)
    cpus: Optional[StrictInt] = Field(None, ge=1, le=1 << 20)  # CPU cores, for OMP_NUM_THREADS
    # relative speed of its GPUs (issue 12: the first guess of a worker's share before it is
    # measured); None: from the GPU model (gpuflex.policy.speeds' table)
    speed: Optional[Number] = Field(None, gt=0, le=1000)
    # issue 33: whether jobs on this host get the submit directory sent (`submit --sync`);
    # None: the pool's `[jobs] sync`
    sync: Optional[StrictBool] = None
    # issue 33: the engine that runs `submit --image` workers here (gpuflex.hosts.container),
    # and words added to its command before the image (mounts, ulimits, a runtime)
    container: Literal["podman", "docker", "apptainer"] = "podman"
    container_args: tuple[Text, ...] = ()

    def syncs(self, pool_default: bool) -> bool:
        """Whether a job not asking for `--sync` gets its code sent here anyway."""
        return pool_default if self.sync is None else self.sync

    @property
    def is_local(self) -> bool:
        return self.address == "local"

    @property
    def transport(self) -> str:
        """The kind of transport that reaches the host (gpuflex.hosts.transport's registry)."""
        return "local" if self.is_local else "ssh"

    @property
    def cpu_count(self) -> int | None:
        """The host's CPU cores: `cpus` if configured, else this machine's for the local
        host; None (unknown) for a remote host without `cpus`."""
        if self.cpus is not None:
            return self.cpus
        return (os.cpu_count() or 1) if self.is_local else None

    @property
    def cpu_slots(self) -> int | None:
        """N for `gpus = "cpu:N"`, else None (a GPU host)."""
        if isinstance(self.gpus, str) and self.gpus.startswith("cpu:"):
            return int(self.gpus[4:])
        return None


@dataclasses.dataclass(frozen=True)
class Config:
    path: str
    database_url: str
    harvest: HarvestSettings
    jobs: JobSettings
    hosts: tuple[HostConfig, ...]
    notify: NotifySettings = NotifySettings()
    access: AccessSettings = AccessSettings()
    quota: QuotaSettings = QuotaSettings()

    def host(self, name: str) -> HostConfig:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ConfigError(self.path, f"no host named {name!r}", key="hosts")


@dataclass(frozen=True, config=_TABLE)
class _Database:
    url: DatabaseUrl = DEFAULT_DB_URL


def _local_host() -> tuple[HostConfig, ...]:
    return (HostConfig(name="local", gpus=f"cpu:{os.cpu_count() or 1}"),)


@dataclass(frozen=True, config=_TABLE)
class _File:
    """The shape of gpuflex.toml."""

    database: _Database = _Database()
    harvest: HarvestSettings = HarvestSettings()
    jobs: JobSettings = JobSettings()
    hosts: tuple[HostConfig, ...] = Field(default_factory=_local_host)
    notify: NotifySettings = NotifySettings()
    access: AccessSettings = AccessSettings()
    quota: QuotaSettings = QuotaSettings()

    @field_validator("hosts", mode="before")
    @classmethod
    def _remote_defaults(cls, hosts: Any) -> Any:
        if not isinstance(hosts, list) or not hosts:
            raise invalid("must be a non-empty array of tables ([[hosts]]).")
        return [{**REMOTE_DEFAULTS, **h} if isinstance(h, dict) and h.get("address", "local") != "local" else h
                for h in hosts]

    @field_validator("hosts")
    @classmethod
    def _distinct_names(cls, hosts: tuple[HostConfig, ...]) -> tuple[HostConfig, ...]:
        seen: set[str] = set()
        for h in hosts:
            if h.name in seen:
                raise invalid(f"duplicate host name {h.name!r}.")
            seen.add(h.name)
        return hosts


_FILE = TypeAdapter(_File)
_TABLES = {"": _File, "database": _Database, "harvest": HarvestSettings, "jobs": JobSettings,
           "hosts": HostConfig, "notify": NotifySettings, "access": AccessSettings, "quota": QuotaSettings}
_UNKNOWN = ("unexpected_keyword_argument", "extra_forbidden")
_TYPE_NAMES = {"int_type": "int", "string_type": "str"}


def find_config_path(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get("GPUFLEX_CONFIG")
    if env:
        return Path(env).expanduser()
    for candidate in (Path("gpuflex.toml"), Path("~/.config/gpuflex/gpuflex.toml").expanduser()):
        if candidate.is_file():
            return candidate
    return None


def load_config(explicit: str | None = None) -> Config:
    path = find_config_path(explicit)
    if path is None:
        return parse_config({}, BUILTIN)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "file not found.") from None
    except OSError as e:
        raise ConfigError(str(path), f"cannot read: {e.strerror}.") from None
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), f"not UTF-8 text (byte {e.start}); TOML files are UTF-8.") from None
    except ValueError:   # a NUL byte: no file can be named so
        raise ConfigError(repr(str(path)), "not a file name (it holds a NUL byte).") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), f"TOML syntax error: {e}.") from None
    return parse_config(data, str(path))


def parse_config(data: dict[str, Any], path: str) -> Config:
    """Validate the TOML document `data` read from `path`; raises ConfigError."""
    try:
        f = _FILE.validate_python(data)
    except ValidationError as e:
        raise _config_error(path, e) from None
    return Config(path=path, database_url=f.database.url, harvest=f.harvest, jobs=f.jobs, hosts=f.hosts,
                  notify=f.notify, access=f.access, quota=f.quota)


def _config_error(path: str, error: ValidationError) -> ConfigError:
    """The first problem as one line naming the key and the bad value; an unknown key first,
    as a misspelt key is the likeliest cause of whatever else is wrong."""
    errors = error.errors()
    e = next((x for x in errors if x["type"] in _UNKNOWN), errors[0])
    loc, kind, value, ctx = e["loc"], e["type"], e.get("input"), e.get("ctx") or {}
    key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if kind in _UNKNOWN:
        table = _TABLES[str(loc[0]) if len(loc) > 1 else ""]
        message = f"unknown key (known: {', '.join(sorted(f.name for f in dataclasses.fields(table)))})."
    elif kind == MESSAGE:
        message = ctx["message"]
    elif kind in ("missing", "missing_argument"):
        message = "missing."
    elif kind in ("dataclass_type", "dataclass_args_type"):
        message = f"must be a table, got {value!r}."
    elif kind in _TYPE_NAMES:
        message = f"expected {_TYPE_NAMES[kind]}, got {value!r}."
    elif kind == "greater_than_equal":
        message = f"must be >= {ctx['ge']}, got {value!r}."
    elif kind == "less_than_equal":
        message = f"must be <= {ctx['le']}, got {value!r}."
    else:  # a check pydantic makes that none of the above names
        message = f"{e['msg']}, got {value!r}."
    return ConfigError(path, message, key=key)
