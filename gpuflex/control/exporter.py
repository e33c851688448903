"""`gpuflex metrics --serve`: the metrics of gpuflex.control.metrics over HTTP, for a
Prometheus to scrape.

prometheus_client's own server (`start_http_server`: a threaded WSGI server, one daemon
thread per request) serves a private registry holding one collector, `Live`, which opens a
session at each scrape, reads the families and closes it: no transaction, and so no
SQLite lock, outlives a scrape, and nothing is written (no refresh: the figures are as
fresh as the last command or `gpuflex watch` tick that refreshed the database, and the
coordinators' progress series, which only a refresh reads, are left out). A scrape that
cannot read the database (busy, gone) answers `gpuflex_database_up 0` instead of an error
page, and logs one line.

It binds to loopback unless told otherwise: the series name users, jobs and hosts, and a
scrape costs database reads, so only the lab's Prometheus (or a proxy in front) should
reach it.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import re
import socket
import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from gpuflex.config import Config
from gpuflex.control.metrics import families
from gpuflex.errors import GpuflexError, UsageError

log = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1:9464"
_EXAMPLE = "give ADDR:PORT, such as 127.0.0.1:9464, 0.0.0.0:9464 or [::1]:9464"
# a host name or an IPv4 address: anything else (NUL, spaces, non-ASCII) would reach
# getaddrinfo and fail there with an error that is no OSError
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")


def parse_bind(text: str) -> tuple[str, int]:
    """'ADDR:PORT' (an IPv6 address in brackets) -> (address, port); UsageError otherwise.
    Port 0 asks the kernel for a free one."""
    host, sep, port = (text or "").strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError(f"--bind {text!r}: {host!r} in brackets is no IPv6 address; {_EXAMPLE}.") from None
    elif not _HOST.match(host):
        raise UsageError(f"--bind {text!r}: {_EXAMPLE}.")
    if not sep:
        raise UsageError(f"--bind {text!r}: {_EXAMPLE}.")
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise UsageError(f"--bind {text!r}: the port must be a number from 0 to 65535; {_EXAMPLE}.")
    return host, int(port)


class Live(Collector):
    """The families read anew from the database at each scrape, plus whether that read worked."""

    def __init__(self, sessions: sessionmaker[Session], config: Config) -> None:
        self.sessions, self.config = sessions, config

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("gpuflex_database_up", "1 when this scrape read the database, 0 when it could "
                               "not (the other gpuflex series are then absent).")
        try:
            with self.sessions() as session:   # closed, its read transaction ended, before the reply
                items = families(session, self.config, {}, time.time())
        except (SQLAlchemyError, GpuflexError) as e:
            log.warning("metrics: this scrape could not read the database: %s", " ".join(str(e).split())[:300])
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from items


def _bind_error(text: str, e: OSError) -> UsageError:
    why = {errno.EADDRINUSE: "the port is in use (another exporter, or another program)",
           errno.EADDRNOTAVAIL: "no interface of this machine has that address",
           errno.EACCES: "not allowed (a port below 1024 needs root)"}.get(e.errno, e.strerror or str(e))
    if isinstance(e, socket.gaierror):
        why = "no such address"
    return UsageError(f"--bind {text}: cannot listen there: {why}.")


def start(sessions: sessionmaker[Session], config: Config, bind: str) -> tuple[Any, str]:
    """Start serving on `bind` in a daemon thread: (the server, its URL). UsageError when
    `bind` is bad or cannot be listened on."""
    host, port = parse_bind(bind)
    registry = CollectorRegistry(auto_describe=False)   # describing would read the database now
    registry.register(Live(sessions, config))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise _bind_error(bind, e) from None
    addr, real_port = server.server_address[:2]
    shown = f"[{addr}]" if ":" in addr else addr
    return server, f"http://{shown}:{real_port}/metrics"

