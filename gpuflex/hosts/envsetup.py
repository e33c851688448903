"""Host side of a job's per-host preparation (issue 33; standard library only, like hostops):

    python -m gpuflex.hosts.envsetup      a JSON request on stdin, one JSON reply line

The request (gpuflex.jobenv.setup_request): `argv` (`["sh", "-c", CMD]`, the job's
--env-setup; null: none), `cwd` and `env`/`clean_env` (as a worker's: supervisor.spawn_env),
`log` (the output is appended there, 0600 in gpuflex's 0700 job directory), `timeout_s`,
and `check` (executables the workers need: the venv's bin/python, --python's program).
The reply: {"returncode": rc or null, "timed_out": bool, "seconds": s, "tail": the
output's last lines, "missing": [what `check` named that is not an executable file],
"log": the log's absolute path}. The environment travels on stdin, not on a command
line, which every user of the host can read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from gpuflex.hosts.supervisor import spawn_env
from gpuflex.hosts.private import open_private, private_dir

TAIL_LINES = 10
TAIL_BYTES = 2000


def prepare(req: dict[str, Any]) -> dict[str, Any]:
    log = os.path.abspath(os.path.expanduser(req["log"]))
    private_dir(os.path.dirname(log))
    fd = open_private(log, os.O_WRONLY | os.O_APPEND)
    rc, timed_out, began, start = None, False, time.monotonic(), 0
    try:
        if req.get("argv"):
            os.write(fd, f"== gpuflex: env-setup at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                         f"{req['argv'][-1]}\n".encode())
            start = os.fstat(fd).st_size   # the tail is this run's output, not the line above
            rc, timed_out = _run(req, fd)
    finally:
        os.close(fd)
    return {"returncode": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - began, 3),
            "tail": _tail(log, start) if req.get("argv") else "", "log": log,
            "missing": [p for p in req.get("check") or () if not _executable(os.path.expanduser(p))]}


def _run(req: dict[str, Any], fd: int) -> tuple[int, bool]:
    cwd = os.path.expanduser(req.get("cwd") or "~")
    try:
        # its own session: a timeout ends what it started too (a pip and its children)
        proc = subprocess.Popen(req["argv"], cwd=cwd, env=spawn_env(req), stdin=subprocess.DEVNULL,
                                stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        os.write(fd, f"gpuflex: cannot run {req['argv'][0]!r} in {cwd}: {e.strerror}\n".encode())
        return 127, False
    try:
        return proc.wait(timeout=float(req.get("timeout_s") or 600)), False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        rc = proc.wait()
        os.write(fd, f"gpuflex: env-setup killed after {req.get('timeout_s')} s\n".encode())
        return rc, True


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _tail(log: str, start: int) -> str:
    with open(log, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(start, size - TAIL_BYTES))
        text = f.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-TAIL_LINES:])


def main() -> int:
    try:
        reply: dict[str, Any] = {"ok": prepare(json.loads(sys.stdin.read()))}
    except (OSError, ValueError, KeyError) as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
