"""Launch intents: a command that dies half-way through starting a run leaves no process
the database does not know.

Starting a job spawns its coordinator and workers inside the command's transaction
(under the ops lock); the rows and the processes become real together only when it
commits. A command killed between the first spawn and the commit (Ctrl-C at the wrong
moment, an OOM kill, a lost terminal) used to leave a whole run behind: processes
training against a store the database had never heard of, while the next command started
the job again beside them (issue 16: "the database must match the processes").

So before the first spawn of a run, `note` appends the run (job id, its fresh socket
directory, its hosts) to a small file beside the database, flushed to disk. Each host's
supervisor marks every process group of the run in that socket directory before the
process starts (gpuflex.hosts.supervisor.mark_group). The next command, under the same
ops lock, `settle`s the file: a run whose job now records that socket directory was
committed and is forgotten; any other was not, and `end-run` on each of its hosts kills
the groups marked there and removes the directory. A host that cannot be reached keeps
its entry for the next command.

The same file holds the runs whose processes a stop could not reach (`note_stop`: the
job ended or was requeued while a host of its run did not answer, so its coordinator or
workers there ran on; seen in the 2-hour multi-host soak, issue 28). Such an entry is
ended whatever the job records, by the same `end-run`, once its host answers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from gpuflex.config import Config
from gpuflex.control.pool import Pool
from gpuflex.db import queries
from gpuflex.db.locks import shared_directory
from gpuflex.db.url import space_note, sqlite_path
from gpuflex.errors import DatabaseError, TransportError

log = logging.getLogger(__name__)

SUFFIX = ".launches"
MAX_ENTRIES = 1000   # a file that somehow grew past this is read no further


def intents_path(url: str) -> Path:
    """`<db>.launches` beside a SQLite database; for a server database, a file under the
    user's state directory named after the URL (never the shared temp directory: its
    entries name processes to kill)."""
    path = sqlite_path(url)
    if path is not None:   # one file per user beside a lab's shared database: each is 0600
        return Path(str(path) + (f"{SUFFIX}.{os.getuid()}" if shared_directory(path.parent) else SUFFIX))
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return Path(os.path.expanduser("~/.local/state/gpuflex")) / f"launches-{digest}"


def note(url: str, job_id: int, socket_dir: str, hosts: list[str]) -> None:
    """Record a run about to be spawned (before its first process), durably."""
    path = intents_path(url)
    line = json.dumps({"job": job_id, "socket_dir": socket_dir, "hosts": sorted(set(hosts))}) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:   # nothing spawned yet: the command's transaction is rolled back with it
        raise DatabaseError(f"cannot note the launch of job {job_id} in {path}: {e.strerror or e}"
                            f"{space_note(path.parent)}; the job was not started.",
                            hint="Free space there, then run the command again.") from None


def note_stop(url: str, job_id: int, socket_dir: str | None, hosts: list[str]) -> None:
    """Record that a run's processes on `hosts` could not be stopped (the hosts did not
    answer when its job ended or was requeued): a later command's `settle` ends them there
    by the run's socket directory once the host answers. Best effort: a file that cannot be
    written is said in a warning."""
    if not socket_dir or not hosts:
        return
    path = intents_path(url)
    line = json.dumps({"job": job_id, "socket_dir": socket_dir, "hosts": sorted(set(hosts)), "stop": True}) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("job %s: could not note its processes left on %s to stop later (%s): %s",
                    job_id, ", ".join(sorted(set(hosts))), path, e.strerror or e)


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for raw in text.splitlines()[:MAX_ENTRIES]:
        with contextlib.suppress(ValueError):
            entry = json.loads(raw)
            if isinstance(entry, dict) and isinstance(entry.get("job"), int) \
                    and isinstance(entry.get("socket_dir"), str) and isinstance(entry.get("hosts"), list):
                out.append(entry)
    return out


def settle(config: Config, pool: Pool, session: Session) -> list[dict[str, Any]]:
    """Forget the committed runs of the intents file and end the others (see the module's
    doc); returns the runs ended. Call under the ops lock, before anything is spawned."""
    path = intents_path(config.database_url)
    entries = _read(path)
    if not entries:
        return []
    ended, kept = [], []
    for entry in entries:
        job = queries.job(session, entry["job"])
        if not entry.get("stop") and job is not None and job.socket_dir == entry["socket_dir"]:
            continue   # committed: the database knows this run
        left = [h for h in entry["hosts"] if not _end_run(config, pool, h, entry)]
        if left:
            kept.append({**entry, "hosts": left})
        else:
            ended.append(entry)
    _rewrite(path, kept)
    return ended


def _end_run(config: Config, pool: Pool, host_name: str, entry: dict[str, Any]) -> bool:
    """Kill the run's groups on one host; True when done (or the host is no longer ours)."""
    host = next((h for h in config.hosts if h.name == host_name), None)
    if host is None:   # a host removed from the config: nothing of ours can be reached there
        return True
    try:
        killed = pool.transport(host).hostop("end-run", {"socket_dir": entry["socket_dir"]})
    except TransportError as e:
        log.warning("job %s: could not end the uncommitted run %s on %s: %s",
                    entry["job"], entry["socket_dir"], host_name, e)
        return False
    if killed and entry.get("stop"):
        log.warning("job %s: ended process group(s) %s on %s, left running when the run was stopped "
                    "while %s did not answer", entry["job"], killed, host_name, host_name)
    elif killed:
        log.warning("job %s: ended process group(s) %s on %s, left by a command that died before it "
                    "recorded them", entry["job"], killed, host_name)
    return True


def _rewrite(path: Path, entries: list[dict[str, Any]]) -> None:
    if not entries:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
