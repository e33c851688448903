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
import math
import os
import re
import sys
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Optional, Union

from pydantic import (AfterValidator, BeforeValidator, ConfigDict, Field, PlainValidator, StrictBool, StrictInt,
                      StrictStr, TypeAdapter, ValidationError, field_validator)
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from gpuflex.errors import ConfigError, UsageError

BUILTIN = "<built-in default>"
MAX_CPU_SLOTS = 4096  # each slot is a DB row: a typo like cpu:40000000 must not hang every command
DEFAULT_DB_URL = "sqlite:///~/.local/state/gpuflex/gpuflex.db"
REMOTE_DEFAULTS = {"python": "python3", "workdir": "~/gpuflex"}  # a host whose address is not "local"

# One TOML table per model: every key it does not declare is an error. Types are strict
# per field (StrictStr, StrictInt, Number): TOML's "22" is not a port, true is not 1.
_TABLE = ConfigDict(extra="forbid")
_MESSAGE = "gpuflex_config"  # our own errors carry the whole message (see _config_error)


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError(_MESSAGE, "{message}", {"message": message})


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(f"expected int or float, got {value!r}.")
    if not math.isfinite(value):  # TOML allows inf and nan
        raise _invalid(f"must be a finite number, got {value!r}.")
    return value


def _host_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", value):
        raise _invalid(f"invalid host name {value!r} (letters, digits, . _ -).")
    return value


def _gpus(value: Any) -> Any:
    if isinstance(value, str):
        if value != "all" and not re.fullmatch(r"cpu:[1-9][0-9]*", value):
            raise _invalid(f'expected "all", "cpu:N" or a list of GPU indices, got {value!r}.')
        if value != "all" and (len(value) > 12 or int(value[4:]) > MAX_CPU_SLOTS):
            raise _invalid(f"at most cpu:{MAX_CPU_SLOTS} slots, got {value!r}.")
        return value
    if not isinstance(value, list):
        raise _invalid(f"expected str or list, got {value!r}.")
    if not value or not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < MAX_CPU_SLOTS
                            for g in value) or len(set(value)) != len(value):
        raise _invalid(f"expected distinct GPU indices from 0 to {MAX_CPU_SLOTS - 1}, got {value!r}.")
    return value


def _text(value: str) -> str:
    """A path, command or address: never blank (an empty `workdir` or `python` would fail
    on the host at the first launch, long after the mistake), never a NUL byte."""
    if not value.strip():
        raise _invalid(f"must not be empty, got {value!r}.")
    if "\0" in value:
        raise _invalid(f"must not hold a NUL byte, got {value!r}.")
    return value


def _time_limit(value: str) -> str:
    """A `--time` spelling (gpuflex.jobspec.parse_time), kept as written."""
    from gpuflex.errors import UsageError
    from gpuflex.jobspec import parse_time

    try:
        parse_time(value, "default_time")
    except UsageError as e:
        raise _invalid(str(e)) from None
    return value


def _database_url(value: str) -> str:
    if "://" not in value or "\0" in value:
        raise _invalid(f"not a database URL: {value!r} (e.g. sqlite:///path/gpuflex.db).")
    return value


# int or float as written (an int stays an int), finite; never a bool
Number = Annotated[Union[int, float], BeforeValidator(_number)]
HostName = Annotated[StrictStr, AfterValidator(_host_name)]
Text = Annotated[StrictStr, AfterValidator(_text)]
Gpus = Annotated[Union[str, list[int]], PlainValidator(_gpus)]  # "all", "cpu:N" or [indices]


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
    default_time: Optional[Annotated[StrictStr, AfterValidator(_time_limit)]] = None
    # issue 12: a worker slower than its job's median by this factor for this long, in a job
    # above its MIN, is released (shrunk away in place)
    straggler_factor: Number = Field(3, ge=1.1, le=1000)
    straggler_s: Number = Field(300, ge=1, le=DAY_S)


# what a job's owner can hear of by webhook (gpuflex.control.notify); `[notify] events`
NOTIFY_EVENTS = ("succeeded", "failed", "timeout", "preempted", "cancelled")
MAX_URL = 2048


def check_webhook_url(url: str, option: str = "--notify") -> str:
    """`url` if it is an http(s) URL with a host and no spaces or control characters;
    UsageError naming the option and the URL otherwise (checked before anything is written)."""
    shown = url if len(url) <= 80 else url[:77] + "..."
    if len(url) > MAX_URL or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise UsageError(f"{option} {shown!r}: a URL holds no spaces or control characters (at most "
                         f"{MAX_URL} characters); e.g. https://hooks.example.org/gpuflex.")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port   # raises ValueError for a port that is no number or out of range
    except ValueError as e:
        raise UsageError(f"{option} {shown!r}: not a URL ({e}).") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{option} {shown!r}: give an http:// or https:// URL with a host, "
                         "e.g. https://hooks.example.org/gpuflex.")
    return url


def _notify_url(value: str) -> str:
    try:
        return check_webhook_url(value, "")
    except UsageError as e:
        raise _invalid(str(e).lstrip()) from None


def _notify_events(value: tuple[str, ...]) -> tuple[str, ...]:
    for name in value:
        if name not in NOTIFY_EVENTS:
            raise _invalid(f"unknown event {name!r} (known: {', '.join(NOTIFY_EVENTS)}).")
    return value


@dataclass(frozen=True, config=_TABLE)
class NotifySettings:
    """Webhooks (gpuflex.control.notify): the URL a job gets unless `submit --notify`
    names one (stored with the job at submit), and which of its moves are posted."""

    url: Optional[Annotated[StrictStr, AfterValidator(_notify_url)]] = None
    events: Annotated[tuple[StrictStr, ...], AfterValidator(_notify_events)] = \
        ("succeeded", "failed", "timeout", "preempted")


def _user_or_group(value: str) -> str:
    if not re.fullmatch(r"@?[A-Za-z_][A-Za-z0-9_.-]{0,63}\$?", value):
        raise _invalid(f"not a user or @group name: {value!r}.")
    return value


UserOrGroup = Annotated[StrictStr, AfterValidator(_user_or_group)]


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
    users: dict[Annotated[StrictStr, AfterValidator(_user_or_group)], Annotated[int, Field(ge=0, le=1 << 20)]] = \
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
    url: Annotated[StrictStr, AfterValidator(_database_url)] = DEFAULT_DB_URL


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
            raise _invalid("must be a non-empty array of tables ([[hosts]]).")
        return [{**REMOTE_DEFAULTS, **h} if isinstance(h, dict) and h.get("address", "local") != "local" else h
                for h in hosts]

    @field_validator("hosts")
    @classmethod
    def _distinct_names(cls, hosts: tuple[HostConfig, ...]) -> tuple[HostConfig, ...]:
        seen: set[str] = set()
        for h in hosts:
            if h.name in seen:
                raise _invalid(f"duplicate host name {h.name!r}.")
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
    elif kind == _MESSAGE:
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
