"""`gpuflex fetch JOB PATH` (issue 33): copy back a file or directory a job wrote on its hosts.

PATH is relative to the directory the job's workers ran in on each host (the sent code's
`<workdir>/.gpuflex/code/<sha256>` with `--sync`, else the workdir: launch.worker_cwd);
an absolute PATH or one climbing out with `..` is refused before any host is asked. The
host side (gpuflex.hosts.gather) lists what to copy, resolving links there and never
following one out of that directory; the files come back by SFTP on the pooled SSH
connection, or by a copy on the local host.

Where the copy goes, as scp and Slurm's sgather do it: `DIR/<last part of PATH>` when one
host holds it; when the job ran on several hosts and no `--host` chose one, each host's
copy goes to `DIR/<host>/<last part of PATH>`, so no host's file overwrites another's. A
host without PATH (only rank 0 wrote it) is reported, not an error, as long as one host
had it. Like `gpuflex logs`, fetch changes nothing in the database; unlike logs it asks
for the job's owner or an admin, since it copies files out.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath

from gpuflex.config import Config
from gpuflex.control import access
from gpuflex.control.launch import worker_cwd
from gpuflex.control.pool import Pool
from gpuflex.control.views import JobInfo
from gpuflex.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Fetched:
    """One host's part: where its copy went (None: PATH is not there) and what was left out."""

    host: str
    dest: str | None
    files: int = 0
    skipped: tuple[tuple[str, str], ...] = ()
    missing: str | None = None     # why nothing came from this host


def check_path(path: str) -> str:
    """PATH normalized ("out/" -> "out"); UsageError for one that is absolute or leaves
    the job's directory."""
    if not path or "\0" in path:
        raise UsageError("PATH is empty; give a path relative to the job's directory, e.g. out/model.pt.")
    if path.startswith(("/", "~")):
        raise UsageError(f"{path}: give a path relative to the directory the job ran in (e.g. out/model.pt), "
                         "not an absolute one.")
    if ".." in path.split("/"):
        raise UsageError(f"{path}: '..' would leave the job's directory; fetch copies only what is in it.")
    return posixpath.normpath(path)


def hosts_of(job: JobInfo, host: str | None) -> list[str]:
    """The hosts to fetch from: `host`, or every host any of the job's workers ran on."""
    ran = list(dict.fromkeys(w.host for w in job.workers))
    if not ran:
        raise UsageError(f"job {job.id} has never run ({job.state}): it wrote nothing on any host.")
    if host is not None and host not in ran:
        raise UsageError(f"job {job.id} did not run on {host}; its hosts: {', '.join(ran)}.")
    return [host] if host is not None else ran


def check_access(config: Config, job: JobInfo) -> None:
    """A job's files are its output: its owner's and the admins' (access.check_reader)."""
    if not access.may_read(config, job.user):
        raise access.NotReaderError(job.id, job.user, "files")


def fetch(config: Config, pool: Pool, job: JobInfo, path: str, host: str | None, to: str) -> list[Fetched]:
    """Copy PATH from the job's hosts into `to`; one Fetched per host. UsageError (exit 2)
    for bad input or when no host holds PATH; TransportError when a host cannot be read."""
    path = check_path(path)
    check_access(config, job)
    names = hosts_of(job, host)
    known = {h.name: h for h in config.hosts}
    gone = [n for n in names if n not in known]
    if gone:
        raise UsageError(f"job {job.id} ran on {', '.join(gone)}, no longer in the configuration.")
    base = f"job-{job.id}" if path == "." else posixpath.basename(path)
    out = []
    for name in names:
        root = worker_cwd(config, known[name], job)   # type: ignore[arg-type]  # JobInfo has the fields it reads
        dest = os.path.join(to, name, base) if len(names) > 1 else os.path.join(to, base)
        out.append(_one(pool, name, root, path, dest))
    if all(f.dest is None for f in out):
        raise UsageError("; ".join(f"{f.host}: {f.missing}" for f in out) + ".")
    return out


def _one(pool: Pool, name: str, root: str, path: str, dest: str) -> Fetched:
    transport = pool.transport(name)
    reply = transport.gather(root, path)
    if "error" in reply:
        if reply.get("missing"):
            return Fetched(name, None, missing=reply["error"])
        raise UsageError(f"{name}: {reply['error']}.")
    got = reply["ok"]
    pairs = []
    for rel, real in got["files"]:
        _local_rel(rel)
        pairs.append((real, os.path.join(dest, rel) if rel else dest))
    try:
        if got["kind"] == "dir":
            os.makedirs(dest, exist_ok=True)
            for rel in got["dirs"]:
                os.makedirs(os.path.join(dest, _local_rel(rel)), exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot make {e.filename}: {e.strerror}.") from None
    transport.get(pairs)
    return Fetched(name, dest, len(pairs), tuple((r, w) for r, w in got["skipped"]))


def _local_rel(rel: str) -> str:
    """A path the host named, checked before it is written here: under the destination."""
    if rel.startswith("/") or ".." in rel.split("/"):
        raise UsageError(f"fetch: the host named {rel!r}, outside the destination; nothing more is copied.")
    return rel
