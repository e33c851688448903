"""Load and validate `gpuflex.toml`.

Lookup order: an explicit path (`--config`), `$GPUFLEX_CONFIG`, `./gpuflex.toml`,
`~/.config/gpuflex/gpuflex.toml`, else the built-in default (one local host with CPU
slots). Every error names the file, the key and the bad value.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from gpuflex.errors import ConfigError

BUILTIN = "<built-in default>"
MAX_CPU_SLOTS = 4096  # each slot is a DB row: a typo like cpu:40000000 must not hang every command
DEFAULT_DB_URL = "sqlite:///~/.local/state/gpuflex/gpuflex.db"


@dataclasses.dataclass(frozen=True)
class HarvestSettings:
    interval_s: float = 60
    idle_util_pct: float = 5
    idle_memory_mib: float = 512
    idle_samples: int = 3
    reclaim_deadline_s: float = 30


@dataclasses.dataclass(frozen=True)
class JobSettings:
    cancel_grace_s: float = 10          # SIGTERM, then SIGKILL after this
    checkpoint_interval_s: float = 60   # on-disk checkpoints of elastic jobs
    pg_timeout_s: float = 10            # process-group timeout inside workers
    heartbeat_timeout_s: float = 3      # a worker silent this long is taken for dead


@dataclasses.dataclass(frozen=True)
class HostConfig:
    name: str
    address: str = "local"
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    gpus: str | list[int] = "all"
    owner: str | None = None
    nvidia_smi: str = "nvidia-smi"
    python: str = sys.executable
    workdir: str = "~/.local/state/gpuflex/work"
    connect_timeout_s: float = 5
    command_timeout_s: float = 30

    @property
    def is_local(self) -> bool:
        return self.address == "local"

    @property
    def transport(self) -> str:
        """The kind of transport that reaches the host (gpuflex.hosts.transport's registry)."""
        return "local" if self.is_local else "ssh"

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

    def host(self, name: str) -> HostConfig:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ConfigError(self.path, f"no host named {name!r}", key="hosts")


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
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), f"TOML syntax error: {e}.") from None
    return parse_config(data, str(path))


_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class _Section:
    """Typed reads from one TOML table, remembering which keys were used."""

    def __init__(self, path: str, prefix: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise ConfigError(path, f"must be a table, got {data!r}.", key=prefix)
        self.path, self.prefix, self.data = path, prefix, data

    def _key(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, types: type | tuple[type, ...], default: Any) -> Any:
        if key not in self.data:
            return default
        value = self.data[key]
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            ok = False
        else:
            ok = isinstance(value, types)
        if not ok:
            names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
            raise ConfigError(self.path, f"expected {names}, got {value!r}.", key=self._key(key))
        return value

    def number(self, key: str, default: float, *, minimum: float = 0, integer: bool = False) -> Any:
        value = self.get(key, int if integer else (int, float), default)
        if not math.isfinite(value):  # TOML allows inf and nan
            raise ConfigError(self.path, f"must be a finite number, got {value!r}.", key=self._key(key))
        if value < minimum:
            raise ConfigError(self.path, f"must be >= {minimum}, got {value!r}.", key=self._key(key))
        return value

    def reject_unknown(self, known: set[str]) -> None:
        for key in self.data:
            if key not in known:
                raise ConfigError(
                    self.path,
                    f"unknown key (known: {', '.join(sorted(known))}).",
                    key=self._key(key),
                )


def parse_config(data: dict[str, Any], path: str) -> Config:
    top = _Section(path, "", data)
    top.reject_unknown({"database", "harvest", "jobs", "hosts"})

    db = _Section(path, "database", data.get("database", {}))
    db.reject_unknown({"url"})
    url = db.get("url", str, DEFAULT_DB_URL)
    if "://" not in url:
        raise ConfigError(path, f"not a database URL: {url!r} (e.g. sqlite:///path/gpuflex.db).",
                          key="database.url")

    hv = _Section(path, "harvest", data.get("harvest", {}))
    hv.reject_unknown({f.name for f in dataclasses.fields(HarvestSettings)})
    harvest = HarvestSettings(
        interval_s=hv.number("interval_s", 60, minimum=1),
        idle_util_pct=hv.number("idle_util_pct", 5),
        idle_memory_mib=hv.number("idle_memory_mib", 512),
        idle_samples=hv.number("idle_samples", 3, minimum=1, integer=True),
        reclaim_deadline_s=hv.number("reclaim_deadline_s", 30, minimum=1),
    )
    js = _Section(path, "jobs", data.get("jobs", {}))
    js.reject_unknown({f.name for f in dataclasses.fields(JobSettings)})
    jobs = JobSettings(
        cancel_grace_s=js.number("cancel_grace_s", 10),
        checkpoint_interval_s=js.number("checkpoint_interval_s", 60, minimum=0.1),
        pg_timeout_s=js.number("pg_timeout_s", 10, minimum=1),
        heartbeat_timeout_s=js.number("heartbeat_timeout_s", 3, minimum=1),
    )

    raw_hosts = data.get("hosts")
    if raw_hosts is None:
        hosts = (HostConfig(name="local", gpus=f"cpu:{os.cpu_count() or 1}"),)
    else:
        if not isinstance(raw_hosts, list) or not raw_hosts:
            raise ConfigError(path, "must be a non-empty array of tables ([[hosts]]).", key="hosts")
        hosts = tuple(_parse_host(path, i, h) for i, h in enumerate(raw_hosts))
        seen: set[str] = set()
        for h in hosts:
            if h.name in seen:
                raise ConfigError(path, f"duplicate host name {h.name!r}.", key="hosts")
            seen.add(h.name)
    return Config(path=path, database_url=url, harvest=harvest, jobs=jobs, hosts=hosts)


def _parse_host(path: str, index: int, raw: Any) -> HostConfig:
    sec = _Section(path, f"hosts[{index}]", raw)
    sec.reject_unknown({f.name for f in dataclasses.fields(HostConfig)})
    name = sec.get("name", str, None)
    if name is None:
        raise ConfigError(path, "missing.", key=f"hosts[{index}].name")
    if not _HOST_NAME.match(name):
        raise ConfigError(path, f"invalid host name {name!r} (letters, digits, . _ -).",
                          key=f"hosts[{index}].name")
    address = sec.get("address", str, "local")
    gpus = sec.get("gpus", (str, list), "all")
    if isinstance(gpus, str):
        if gpus != "all" and not re.fullmatch(r"cpu:[1-9][0-9]*", gpus):
            raise ConfigError(path, f'expected "all", "cpu:N" or a list of GPU indices, got {gpus!r}.',
                              key=f"hosts[{index}].gpus")
        if gpus != "all" and (len(gpus) > 12 or int(gpus[4:]) > MAX_CPU_SLOTS):
            raise ConfigError(path, f"at most cpu:{MAX_CPU_SLOTS} slots, got {gpus!r}.",
                              key=f"hosts[{index}].gpus")
    elif not gpus or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus) \
            or len(set(gpus)) != len(gpus):
        raise ConfigError(path, f"expected distinct non-negative GPU indices, got {gpus!r}.",
                          key=f"hosts[{index}].gpus")
    defaults = HostConfig(name=name)
    port = sec.number("port", 22, minimum=1, integer=True)
    if port > 65535:
        raise ConfigError(path, f"must be <= 65535, got {port}.", key=f"hosts[{index}].port")
    return HostConfig(
        name=name,
        address=address,
        port=port,
        user=sec.get("user", str, None),
        identity_file=sec.get("identity_file", str, None),
        known_hosts=sec.get("known_hosts", str, defaults.known_hosts),
        gpus=gpus,
        owner=sec.get("owner", str, None),
        nvidia_smi=sec.get("nvidia_smi", str, defaults.nvidia_smi),
        python=sec.get("python", str, defaults.python if address == "local" else "python3"),
        workdir=sec.get("workdir", str, defaults.workdir if address == "local" else "~/gpuflex"),
        connect_timeout_s=sec.number("connect_timeout_s", 5, minimum=0.1),
        command_timeout_s=sec.number("command_timeout_s", 30, minimum=0.1),
    )
