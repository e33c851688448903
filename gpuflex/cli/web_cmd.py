"""`gpuflex web`: the read-only dashboard (gpuflex.web.app) served by uvicorn.

The web packages (starlette, uvicorn) are imported only here, when the command runs:
the CLI's start-up and every other command go without them (`pip install
'gpuflex[web]'` adds them).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Optional

import typer

from gpuflex.cli.common import command, console, obj
from gpuflex.errors import UsageError

DEFAULT_BIND = "127.0.0.1:8470"
_BIND = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d{1,5})$")
_HEADER = re.compile(r"^[A-Za-z0-9-]{1,64}$")


def register(app: typer.Typer) -> None:
    app.command()(web)


def parse_bind(text: str) -> tuple[str, int]:
    """'HOST:PORT' (an IPv4 address or a name), '[IPv6]:PORT' or ':PORT' (loopback) ->
    (host, port); UsageError otherwise."""
    m = _BIND.match(text.strip())
    port = int(m.group("port")) if m else 0
    if not m or not 1 <= port <= 65535:
        raise UsageError(f"--bind {text!r}: give HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:8470 "
                         "or [::1]:8470.")
    if m.group("v6") is not None:
        try:
            ipaddress.IPv6Address(m.group("v6"))
        except ValueError:
            raise UsageError(f"--bind {text!r}: {m.group('v6')!r} is no IPv6 address.") from None
        return m.group("v6"), port
    return m.group("host") or "127.0.0.1", port


def listen(host: str, port: int, text: str) -> socket.socket:
    """A listening socket on (host, port), opened here so that a port in use or an address
    not on this machine is one line (UsageError) before any server starts."""
    try:
        family, kind, proto, _name, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--bind {text!r}: no address {host!r} ({e}).") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UsageError(f"--bind {text!r}: cannot listen there: {e.strerror or e} "
                         "(another server on that port? choose another with --bind).") from None
    return sock


@command
def web(
    ctx: typer.Context,
    bind: str = typer.Option(DEFAULT_BIND, "--bind", help="Address and port to serve on; loopback by default. "
                             "Put it behind the lab's reverse proxy rather than on a public address "
                             "(README, 'The web dashboard'). Example: --bind 127.0.0.1:8470"),
    user_header: Optional[str] = typer.Option(None, "--user-header", help="Take the viewer from this request "
                                              "header, set by a reverse proxy that authenticated the user "
                                              "(trust it only behind that proxy). Example: "
                                              "--user-header X-Forwarded-User"),
) -> None:
    """Serve a read-only dashboard: the pool, the queue, each job, accounting, with plots.

    It reads the database (no lock, no write) and shows each job as the viewer may see it:
    their own jobs whole, others' as the queue shows them.

    Example: gpuflex web --bind 127.0.0.1:8470
    """
    host, port = parse_bind(bind)
    if user_header is not None and not _HEADER.match(user_header):
        raise UsageError(f"--user-header {user_header!r}: give an HTTP header name, e.g. X-Forwarded-User.")
    try:   # only this command needs them (pip install 'gpuflex[web]')
        import uvicorn

        from gpuflex.web.app import create_app
    except ImportError as e:
        raise UsageError(f"gpuflex web needs the {e.name} package, which is not installed; "
                         "pip install 'gpuflex[web]' (starlette and uvicorn).") from None
    svc = obj(ctx).service()
    app = create_app(svc.config, svc.sessions, user_header=user_header, pool=svc.pool)
    sock = listen(host, port, bind)
    shown = f"[{host}]" if ":" in host else host
    console.print(f"gpuflex web: serving http://{shown}:{sock.getsockname()[1]}/ (Ctrl-C stops it)")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
