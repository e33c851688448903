"""`gpuflex web`'s application: four read-only pages over the database (issue 30).

Served by Starlette (gpuflex.cli.web_cmd runs it under uvicorn). Starlette because the
dashboard needs routing, query parameters and an in-process test client and nothing
more: it is maintained, small (a few pure-Python packages, no template engine or ORM of
its own) and its synchronous handlers run in a thread pool, so a page that reads the
database never holds the server's event loop.

Each page reads in one short session (gpuflex.control.dashboard) and draws after the
session is closed: the web process takes no lock and writes nothing, so it never blocks
a CLI command; it never refreshes either (reconciling and placing are the commands'
work, which need their user's processes): the pages show the database as the last
command left it. The viewer is the unix user running the server, or with `user_header`
the user a trusted reverse proxy authenticated, named in that request header.
"""

from __future__ import annotations

import threading
from typing import Callable

from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route

from gpuflex.config import Config
from gpuflex.control import access, dashboard
from gpuflex.control.pool import Pool
from gpuflex.errors import UsageError
from gpuflex.web import pages


def create_app(config: Config, sessions: sessionmaker[Session], *, user_header: str | None = None,
               pool: Pool | None = None) -> Starlette:
    """The dashboard on `sessions`' database. `pool` reaches running jobs' coordinators for
    their workers' shares and speeds (None: a pool over the config's hosts, never closed:
    the CLI gives its own and closes it)."""
    pool = pool or Pool(config)
    pool_lock = threading.Lock()   # a Pool is not thread-safe; pages run in a thread pool

    def viewer(request: Request) -> str:
        if user_header is None:
            return access.caller()
        name = (request.headers.get(user_header) or "").strip()
        if not name:
            raise PermissionError(f"no {user_header} header: this dashboard is served behind an "
                                  "authenticating proxy, which names the user.")
        return name

    def reader(who: str) -> Callable[[str], bool]:
        return lambda owner: access.may_change(config, owner, who)

    def params(request: Request) -> dict[str, str]:
        return dict(request.query_params)

    def pool_view(request: Request) -> Response:
        who = viewer(request)
        w = dashboard.window(params(request))
        with sessions() as session:
            data = dashboard.pool(session, config, w)
        return HTMLResponse(pages.pool_page(data, who))

    def queue_view(request: Request) -> Response:
        who = viewer(request)
        _no_params(request)
        with sessions() as session:
            shown = dashboard.queue(session, reader(who))
        return HTMLResponse(pages.queue_page(shown, who))

    def progress(job):
        with pool_lock:
            return dashboard.live_progress(config, pool, job)

    def job_view(request: Request) -> Response:
        who = viewer(request)
        _no_params(request)
        ref = request.path_params["ref"]
        if not ref.isdigit() or len(ref) > 18:
            raise UsageError(f"job {ref!r}: give a job id (a number).")
        with sessions() as session:
            data = dashboard.job(session, int(ref), reader(who), progress)
        if data is None:
            return PlainTextResponse(f"no job {ref}.\n", status_code=404)
        return HTMLResponse(pages.job_page(data, who))

    def acct_view(request: Request) -> Response:
        who = viewer(request)
        w = dashboard.window(params(request), default="7d")
        with sessions() as session:
            data = dashboard.accounting(session, w)
        return HTMLResponse(pages.acct_page(data, who))

    async def bad_input(_request: Request, exc: Exception) -> Response:
        return PlainTextResponse(f"{exc}\n", status_code=400)

    async def unauthenticated(_request: Request, exc: Exception) -> Response:
        return PlainTextResponse(f"{exc}\n", status_code=401)

    app = Starlette(routes=[Route("/", pool_view), Route("/queue", queue_view), Route("/jobs/{ref}", job_view),
                            Route("/acct", acct_view)],
                    exception_handlers={UsageError: bad_input, PermissionError: unauthenticated}
                    )
    return app


def _no_params(request: Request) -> None:
    if request.query_params:
        raise UsageError(f"unknown parameter {sorted(request.query_params)[0]!r}: this page takes none.")
