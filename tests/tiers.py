"""The suite's two tiers: the fast one (`make test-fast`) and the rest, by marker.

A test that starts a process or a server carries a marker (registered in pyproject.toml):
`e2e` (gpuflex jobs, their workers and coordinators, the console script, any other child
process), `ssh` (the sshd bed), `postgres` (the PostgreSQL server), `slow` (frameworks, wheel
builds, the demo: anything that takes more than ~20 s). The fast tier is every test with
none of them.

Most tests get their marker here, from the fixtures they use, so a new test that takes
`gf` or `ssh_hosts` is marked without anyone remembering to. Modules whose tests start
processes themselves say so with `pytestmark`. And a test left in the fast tier that
starts a process anyway fails, in `make test` as in `make test-fast`: it must be marked.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

TIERS = ("e2e", "ssh", "postgres", "slow")

# Fixtures that start processes or servers, and the tier a test using them (directly or
# through another fixture) belongs to.
FIXTURE_TIERS = {
    "gf": "e2e",            # the console script, and the jobs it starts
    "busy_slots": "e2e",    # a job of real `sleep` workers
    "ssh_hosts": "ssh",
    "ssh_bed": "ssh",
    "pg_cluster": "postgres",
    "pg_url": "postgres",
}

# A fixture parametrized over "clirunner" (in process) and "script" (the console script in
# a subprocess): only the "script" half starts a process.
PROCESS_PARAMS = {"script"}


def mark_by_fixtures(items: list[pytest.Item]) -> None:
    """Add to each test the tier markers its fixtures (and its "script" parameters) imply."""
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            tier = FIXTURE_TIERS.get(name)
            if tier is not None:
                item.add_marker(tier)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and PROCESS_PARAMS & {v for v in callspec.params.values() if isinstance(v, str)}:
            item.add_marker("e2e")


def tiers_of(item: pytest.Item) -> set[str]:
    return {m.name for m in item.iter_markers() if m.name in TIERS}


class StartedAProcess(BaseException):
    """Raised where a fast-tier test starts a process. A BaseException, so that the code
    under test's `except Exception` (or `except OSError`, as around a Popen) cannot swallow it."""


@pytest.fixture(autouse=True)
def fast_tier_starts_no_process(request, monkeypatch):
    """In a test with no tier marker, starting a process (subprocess, fork, posix_spawn,
    os.system, multiprocessing) raises StartedAProcess, and the test fails at teardown too
    (in case the start happened on a thread whose exception the test never sees). Yields
    the starts it refused (None in a marked test)."""
    if tiers_of(request.node):
        yield None
        return
    started: list[str] = []

    def refuse(what: str):
        def refused(*args, **kwargs):
            started.append(f"{what}{args[1:2] if what == 'subprocess' else ''}")
            raise StartedAProcess(
                f"{request.node.nodeid} started a process ({what}) but has no tier marker: "
                f"mark it with one of {', '.join(TIERS)} (tests/tiers.py), or use a marked fixture")
        return refused

    # _execute_child is where every Popen (run, check_output, asyncio's subprocesses) forks,
    # whichever way the caller imported Popen.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    yield started
    if started:
        pytest.fail(f"{request.node.nodeid} started a process with no tier marker ({started[0]}): "
                    f"mark it with one of {', '.join(TIERS)} (tests/tiers.py)", pytrace=False)
