"""The pool of hosts: config mirrored into the DB, transports, free devices."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from sqlalchemy.orm import Session

from gpuflex.config import Config, HostConfig
from gpuflex.db import queries
from gpuflex.db.models import Gpu, Host
from gpuflex.hosts.fanout import Result, fan_out
from gpuflex.hosts.transport import Transport, TransportFactory, make_transport
from gpuflex.policy.harvest import probe_max_age_s
from gpuflex.policy.placement import HostFree

T = TypeVar("T")


class Pool:
    """Hosts from the config with one transport each, made by `transports` on first use
    (the registry-backed `make_transport` unless a test or benchmark gives fakes)."""

    def __init__(self, config: Config, transports: TransportFactory = make_transport) -> None:
        self.config = config
        self.make_transport = transports
        self._transports: dict[str, Transport] = {}

    def transport(self, host: str | HostConfig) -> Transport:
        cfg = host if isinstance(host, HostConfig) else self.config.host(host)
        if cfg.name not in self._transports:
            self._transports[cfg.name] = self.make_transport(cfg)
        return self._transports[cfg.name]

    def fan_out(self, hosts: list[HostConfig], fn: Callable[[Transport], T],
                timeout: float) -> dict[str, Result[T]]:
        """`fn(transport)` on every host at once; one Result per host (gpuflex.hosts.fanout).
        The transports are made here, in the calling thread: the pool is not thread-safe."""
        transports = {h.name: self.transport(h) for h in hosts}
        return fan_out(hosts, lambda h: fn(transports[h.name]), timeout)

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()

    def sync_hosts(self, session: Session) -> None:
        """Mirror the configured hosts (and the slots of CPU hosts) into the DB."""
        existing = {h.name: h for h in queries.hosts(session)}
        for cfg in self.config.hosts:
            host = existing.get(cfg.name)
            if host is None:
                host = Host(name=cfg.name, address=cfg.address)
                session.add(host)
            host.address, host.owner = cfg.address, cfg.owner
            slots = cfg.cpu_slots
            if slots is not None:
                have = {g.index: g for g in host.gpus}
                for i in range(slots):
                    if i not in have:
                        host.gpus.append(Gpu(index=i, kind="slot", verdict="slot"))
                for i, g in have.items():
                    if i >= slots or g.kind != "slot":
                        host.gpus.remove(g)
            elif isinstance(cfg.gpus, list):
                for g in list(host.gpus):
                    if g.index not in cfg.gpus:
                        host.gpus.remove(g)
        session.flush()

    def free(self, session: Session) -> list[HostFree]:
        """Free devices per host: configured devices minus held ones (GPU hosts: the probed
        GPUs that are usable now)."""
        held = queries.held_devices(session)
        now = time.time()
        out = []
        for cfg in self.config.hosts:
            host = queries.host(session, cfg.name)
            if host is None or host.reachable is False:
                continue
            taken = held.get(cfg.name, set())
            if cfg.cpu_slots is not None:
                devices = [i for i in range(cfg.cpu_slots) if i not in taken]
                out.append(HostFree(cfg.name, tuple(devices), slots=True))
            else:
                # verdicts come from gpuflex.hosts.probe: "free" (no owner, no foreign
                # process) or "idle" (an owner's GPU quiet for idle_samples probes); a
                # probe too old to trust offers nothing
                if host.last_probe_at is not None and now - host.last_probe_at > self.probe_max_age_s:
                    continue
                usable = sorted((g.index, g.model) for g in host.gpus if g.kind == "gpu"
                                and g.verdict in ("idle", "free") and g.index not in taken)
                out.append(HostFree(cfg.name, tuple(i for i, _ in usable), slots=False,
                                    models=tuple(m for _, m in usable)))
        return out

    @property
    def probe_max_age_s(self) -> float:
        """How old a GPU host's last probe may be for its verdicts to still place work."""
        return probe_max_age_s(self.config.harvest)
