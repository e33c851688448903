"""A throw-away PostgreSQL cluster for the tests: one per pytest session.

`start_cluster()` runs Debian's `initdb` into a new directory under the temp dir and
starts `postgres` on 127.0.0.1 at a free port (and a unix socket in that directory),
tuned for tests (no fsync). The server refuses to run as root, so as root the cluster
belongs to the `postgres` system user the Debian package creates (else `nobody`).
`PgCluster.database()` creates a fresh database for one test and returns its URL;
`PgCluster.restart()` drops every connection and starts the server again;
`PgCluster.stop()` stops the server and removes the directory.

Plain functions (a benchmark can use them too); the fixtures are in conftest.py.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

START_TIMEOUT_S = 60
SUPERUSER = "gpuflex_admin"
TEST_ROLE = "gpuflex"
_MISSING = "PostgreSQL's initdb is not installed (make test installs Debian's postgresql as root)"


def find_bin_dir() -> Path | None:
    """The directory of initdb, pg_ctl and postgres: Debian keeps them off PATH, in
    /usr/lib/postgresql/<major>/bin (the newest major wins)."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    majors = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                    key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(majors[-1]).parent if majors else None


def missing_reason() -> str | None:
    """Why no cluster can be started here, or None when one can."""
    return _MISSING if find_bin_dir() is None else None


def _run_as() -> pwd.struct_passwd | None:
    """The unprivileged user that runs the server when we are root; None when we are not."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' user exists")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class PgCluster:
    bin_dir: Path
    dir: Path
    port: int
    user: pwd.struct_passwd | None
    _names: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1))

    @property
    def data(self) -> Path:
        return self.dir / "data"

    def url(self, database: str, role: str = TEST_ROLE) -> str:
        return f"postgresql+psycopg://{role}@127.0.0.1:{self.port}/{database}"

    def run(self, *argv: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
        """A PostgreSQL program of the cluster's bin dir, as the cluster's user."""
        kw = {} if self.user is None else {"user": self.user.pw_uid, "group": self.user.pw_gid,
                                           "extra_groups": []}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8",
               "HOME": str(self.dir)}
        p = subprocess.run([str(self.bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True,
                           timeout=timeout, cwd=self.dir, env=env, stdin=subprocess.DEVNULL, **kw)
        if p.returncode != 0:
            log = (self.dir / "server.log")
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} -> {p.returncode}\n{p.stdout}\n{p.stderr}\n{tail}")
        return p

    def sql(self, statement: str, database: str = "postgres") -> str:
        """One statement as the superuser, through psql over the unix socket."""
        return self.run("psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-h", str(self.dir),
                        "-p", str(self.port), "-U", SUPERUSER, "-d", database, "-c", statement).stdout

    def database(self, prefix: str = "t") -> str:
        """A new empty database owned by the test role; returns its URL."""
        name = f"{prefix}{next(self._names)}"
        self.sql(f'CREATE DATABASE "{name}" OWNER {TEST_ROLE}')
        return self.url(name)

    def restart(self) -> None:
        """Stop the server (`-m fast`: every connection dropped, what was committed kept: the
        cluster runs with synchronous_commit off, so an immediate stop would lose the last
        commits, which a real server does not) and start it again with the options it ran
        with (postmaster.opts)."""
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-m", "fast",
                 "-w", "-t", str(START_TIMEOUT_S), "restart", timeout=START_TIMEOUT_S + 10)

    def stop(self) -> None:
        try:
            self.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-t", "30", "stop")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def start_cluster() -> PgCluster:
    """initdb + start (bounded by START_TIMEOUT_S) + the test role; the caller stops it."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise RuntimeError(_MISSING)
    user = _run_as()
    root = Path(tempfile.mkdtemp(prefix="gpuflex-pg-"))   # under /tmp: reachable by that user
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)
    cluster = PgCluster(bin_dir, root, _free_port(), user)
    try:
        cluster.run("initdb", "-D", str(cluster.data), "-U", SUPERUSER, "--auth=trust",
                    "-E", "UTF8", "--no-sync", "--no-instructions")
        options = (f"-k {root} -p {cluster.port} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        cluster.run("pg_ctl", "-D", str(cluster.data), "-l", str(root / "server.log"), "-o", options,
                    "-w", "-t", str(START_TIMEOUT_S), "start", timeout=START_TIMEOUT_S + 10)
        cluster.sql(f"CREATE ROLE {TEST_ROLE} LOGIN")
    except BaseException:
        cluster.stop()
        raise
    return cluster
