"""The control side's line to a job's coordinator: one request over its control socket,
and whether its process group still runs.

Neither reads nor writes the database. Reading (gpuflex.control.observe.coordinator_status)
and writing (gpuflex.control.executor.ask_membership: the desired membership) both go
through `request`; what the messages and the replies look like is
gpuflex.elastic.protocol.wire.
"""

from __future__ import annotations

import logging
import posixpath
import time
from typing import Any

from gpuflex.config import Config
from gpuflex.control import launch as L
from gpuflex.control.pool import Pool
from gpuflex.db.models import Job
from gpuflex.errors import JobError, TransportError

log = logging.getLogger(__name__)


def request(config: Config, pool: Pool, job: Job, message: dict[str, Any], wait_s: float = 0.0) -> dict[str, Any]:
    """One request to the job's coordinator; retried for up to `wait_s` while it starts.
    Raises TransportError (no answer) or JobError (it refused)."""
    t = pool.transport(job.store_host)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = t.control_request(L.coordinator_socket(job), message)
            break
        except TransportError as e:
            if time.monotonic() >= deadline or not coordinator_alive(config, pool, job):
                if type(e) is not TransportError:
                    raise
                # "gpu01: SSH connection refused by ..." alone does not say what was asked of gpu01
                why = str(e).removeprefix(f"{e.host}: ")
                raise TransportError(e.host, f"cannot reach job {job.id}'s coordinator: {why}") from e
            time.sleep(0.2)
    if not reply.get("ok"):
        raise JobError(f"job {job.id}: coordinator refused {message.get('op')}: {reply.get('error')}")
    return reply


def coordinator_alive(config: Config, pool: Pool, job: Job) -> bool:
    """Whether the coordinator's process group still runs (False when that cannot be told)."""
    return coordinator_process(config, pool, job)[0]


def coordinator_process(config: Config, pool: Pool, job: Job) -> tuple[bool, int | None]:
    """Whether the coordinator's process group still runs, and its exit code from the exit
    record its supervisor wrote (None: none; keys.ORPHAN_EXIT: it ended itself, its job
    gone). (False, None) when that cannot be told."""
    if job.store_pgid is None:
        return False, None
    try:
        host = config.host(job.store_host)
        d = L.job_dir(host, job)
        st = pool.transport(host).status([(job.store_pgid, posixpath.join(d, "coordinator.exit"))])
        return st[0].alive, st[0].returncode
    except (TransportError, TypeError, ValueError, KeyError) as e:
        log.debug("job %s: cannot ask whether the coordinator runs: %s", job.id, e)
        return False, None
