"""Fork starts: a run's workers forked from an interpreter that has already imported what
they all import, instead of each paying for the imports.

A training script's worker spends its first seconds of CPU importing torch and, at its
optimizer's construction, torch's compiler front end (which `Optimizer.__init__` imports
through torch's `_disable_dynamo` wrapper): about 2.5 s of CPU a worker on a 2-core
machine. Three such workers started fresh took 8.1 s of CPU, forked from one interpreter
that had imported them 2.8 s.

`spawn` is hostops' spawn. A spec that asks for it (`fork_start`: an in-place job's
worker) and that a fork can run as a fresh interpreter would (gpuflex.hosts.forkrun: a
Python interpreter with no option but `-u`, a script or `-m MODULE`; no container) is
forked from the run's zygote on this host; anything else, and any spawn that finds no
zygote serving within `fork_ready_s`, starts cold (gpuflex.hosts.supervisor.start).

The zygote: one per run, host, interpreter and common environment (`zygote_key`: a
worker's environment less what differs between workers, `WORKER_ONLY`, which its
imports never see), started by the first spawn that needs it with that interpreter and
environment, in a session of its own whose group is marked in the run's socket directory
(hostops.end_run ends it with the run). It imports `PRELOAD`, then listens on
"zygote-KEY.sock" in that directory (0700: only the run's user reaches it; the socket
0600, and a peer of another uid is refused). A spawn sends it the prepared spec (JSON);
it forks a supervisor, which leads a new session as a cold start's does and runs
supervisor.supervise with the worker forked from it (forkrun.fork_worker); the
supervisor's report is the reply. The zygote ends when its socket is gone (the run's
directory cleaned up) or after `IDLE_S` with no worker alive and no request, and never
serves if an import initialised CUDA (a CUDA context does not survive a fork).

Standard library only, as the rest of gpuflex.hosts: the zygote runs under the job's
interpreter and imports the preloaded modules it finds there.
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

from gpuflex.hosts import forkrun, supervisor
from gpuflex.hosts.private import open_private

# a run's zygotes, in its socket directory: one per interpreter and common environment
# (`zygote_key`), so a spawn never forks from an interpreter whose sys.path another
# environment made: "zygote-KEY.sock", its lock, pid, failure mark
ZYGOTE = "zygote-"
ZYGOTE_LOG = "zygote.log"   # in the run's log directory
# what the zygote imports before it serves (those its interpreter lacks are skipped);
# gpuflex's torch_compat also imports torch's compiler front end, as an optimizer would
PRELOAD = ("torch", "torch.distributed", "torch.optim", "gpuflex.elastic.torch_compat")
READY_S = 10.0       # how long a spawn waits for a starting zygote before it starts cold
IDLE_S = 600.0       # a zygote with no worker alive and no request this long ends
REQUEST_BYTES = 1 << 20
# the environment that differs between a run's workers: never the zygote's
WORKER_ONLY = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
               "OMP_NUM_THREADS", "MKL_NUM_THREADS")
WORKER_PREFIXES = ("GPUFLEX_", "TORCHELASTIC_")


# ---- the spawn's side (hostops) -------------------------------------------------------------
def spawn(req: dict[str, Any]) -> dict[str, int]:
    """hostops spawn: the worker of `req` started, forked from the run's zygote when it can
    be (see the module's doc), else cold; {"pid", "pgid"}. SpawnError for a worker that
    could not start, NotPrivate for a directory that is not ours."""
    spec = supervisor.prepare(req)
    if forkable(spec):
        # the worker's whole environment as this process would give it, not the zygote's
        full = {**spec, "env": supervisor.spawn_env(spec), "clean_env": True}
        reply = fork_spawn(full, float(spec.get("fork_ready_s") or READY_S))
        if reply is not None:
            if "error" in reply:
                raise supervisor.SpawnError(str(reply["error"]))
            return {"pid": int(reply["pid"]), "pgid": int(reply["pgid"])}
    return supervisor.start(spec)


def forkable(spec: dict[str, Any]) -> bool:
    """Whether `spec` asks for a fork start and a fork can run it as a fresh interpreter would."""
    if spec.get("container") or not spec.get("socket_dir") or not spec.get("fork_start"):
        return False
    return forkrun.parse_python_argv(list(spec.get("argv") or ())) is not None


def zygote_key(spec: dict[str, Any]) -> str:
    """Which of the run's zygotes serves `spec`: its interpreter and common environment."""
    env = zygote_env(supervisor.spawn_env(spec))
    return hashlib.sha256(json.dumps([spec["argv"][0], sorted(env.items())]).encode()).hexdigest()[:16]


def zygote_env(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment less what differs between workers (WORKER_ONLY)."""
    return {k: v for k, v in env.items() if k not in WORKER_ONLY and not k.startswith(WORKER_PREFIXES)}


def fork_spawn(spec: dict[str, Any], ready_s: float = READY_S) -> dict[str, int] | None:
    """Start the worker of a prepared `spec` forked from the run's zygote, starting that
    first when there is none; its reply
    ({"pid", "pgid"}, or {"error"} for a worker that could not start), or None when no
    zygote answers within `ready_s`: the caller starts it cold (a zygote still importing
    serves the run's later spawns)."""
    base = os.path.join(os.path.expanduser(spec["socket_dir"]), ZYGOTE + zygote_key(spec))
    path, failed = base + ".sock", base + ".failed"
    if os.path.exists(failed):
        return None
    reply = _ask(path, spec)
    if reply is not None:
        return reply
    deadline = time.monotonic() + ready_s
    lock = open_private(base + ".lock", os.O_RDWR)
    try:
        while True:   # one spawn at a time starts it or waits for it; bounded
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
        reply = _ask(path, spec)
        if reply is not None or os.path.exists(failed):
            return reply
        pid = _read_pid(base + ".pid")
        if pid is None or not _alive(pid):
            pid = _start(spec, path, base + ".pid")
        state = "dead" if pid is None else _wait_ready(path, pid, deadline)
        if state == "dead":
            os.close(open_private(failed, os.O_WRONLY))
            return None
        return _ask(path, spec) if state == "ready" else None
    finally:
        os.close(lock)


def _ask(path: str, spec: dict[str, Any], timeout_s: float = 60.0) -> dict[str, int] | None:
    """The zygote's reply to a spawn request (read to its end); None when none serves at `path`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path)
            s.sendall(json.dumps({"op": "spawn", "spec": spec}).encode() + b"\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return None
    try:
        reply = json.loads(data)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) and ("pid" in reply or "error" in reply) else None


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    fields = supervisor.stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def _start(spec: dict[str, Any], path: str, pid_path: str) -> int | None:
    """Start a zygote for `spec` (its interpreter, its common environment) serving `path`;
    its pid (recorded at `pid_path`), or None when it cannot be started."""
    argv0 = os.path.expanduser(spec["argv"][0])
    env = {**zygote_env(supervisor.spawn_env(spec)), forkrun.ROOM_VARIABLE: " " * forkrun.ENV_ROOM}
    log_dir = os.path.dirname(os.path.expanduser(spec["log"]))
    log_fd = open_private(os.path.join(log_dir, ZYGOTE_LOG), os.O_WRONLY | os.O_APPEND)
    try:
        proc = subprocess.Popen([argv0, "-m", "gpuflex.hosts.zygote", "--socket", path, "--room",
                                 " " * forkrun.ARGV_ROOM],   # its workers' command lines take its place
                                cwd=os.path.dirname(path), env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError:
        return None
    finally:
        os.close(log_fd)
    fd = open_private(pid_path, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, str(proc.pid).encode())
    os.close(fd)
    return proc.pid


def _wait_ready(path: str, pid: int, deadline: float) -> str:
    """"ready" once the zygote serves, "dead" if it ended first, "slow" at the deadline."""
    while True:
        if os.path.exists(path):
            return "ready"
        if not _alive(pid):
            return "ready" if os.path.exists(path) else "dead"
        if time.monotonic() > deadline:
            return "slow"
        time.sleep(0.05)


# ---- the zygote --------------------------------------------------------------------------
def serve(path: str, preload: tuple[str, ...] = PRELOAD, idle_s: float = IDLE_S) -> int:
    """The zygote's life (see the module's doc); its exit code."""
    atexit.register(forkrun.die_if_interrupted)   # first: a worker's last handler (forkrun.run_main)
    supervisor.mark_group(os.path.dirname(path))
    for name in preload:
        try:
            __import__(name)
        except Exception as e:   # noqa: BLE001 - a module its interpreter lacks, or that fails: not preloaded
            print(f"zygote: not preloaded: {name}: {type(e).__name__}: {e}", flush=True)
    compat = sys.modules.get("gpuflex.elastic.torch_compat")
    if compat is not None:
        compat.preload_dynamo()
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
        print("zygote: an import initialised CUDA; a CUDA context does not survive a fork: not serving", flush=True)
        return 1
    tmp = f"{path}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(tmp)
    os.chmod(tmp, 0o600)
    listener.listen(64)
    os.rename(tmp, path)    # serving from the moment the name exists
    me = os.stat(path).st_ino
    children: set[int] = set()
    last = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"zygote: serving {path} (pid {os.getpid()})", flush=True)
    while True:
        children -= _reaped(children)
        try:
            if os.stat(path).st_ino != me:
                return 0   # removed or replaced: the run is over
        except OSError:
            return 0
        if not children and time.monotonic() - last > idle_s:
            os.unlink(path)
            return 0
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not ready:
            continue
        conn, _ = listener.accept()
        try:
            pid = _handle(conn, listener)
            if pid is not None:   # a spawn (a probe of whether the socket is served is no use)
                children.add(pid)
                last = time.monotonic()
        finally:
            conn.close()


def _reaped(children: set[int]) -> set[int]:
    done = set()
    for pid in children:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                done.add(pid)
        except ChildProcessError:
            done.add(pid)
    return done


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _handle(conn: socket.socket, listener: socket.socket) -> int | None:
    """One request: fork the worker's supervisor, which replies on `conn`; its pid, or None."""
    conn.settimeout(10.0)
    try:
        if _peer_uid(conn) != os.getuid():
            conn.sendall(b'{"error": "refused: another user"}\n')
            return None
        data = b""
        while not data.endswith(b"\n") and len(data) < REQUEST_BYTES:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        req = json.loads(data)
        spec = req["spec"]
        if req.get("op") != "spawn" or not isinstance(spec, dict):
            raise ValueError("not a spawn request")
    except (OSError, ValueError, KeyError, TypeError) as e:
        try:
            conn.sendall(json.dumps({"error": f"a bad request: {e}"}).encode() + b"\n")
        except OSError:
            pass
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:   # the worker's supervisor
        try:
            listener.close()
            os.setsid()
            _supervisor(spec, conn)
        except SystemExit:
            raise   # the worker forked down there, ending as its script did: the interpreter's exit
        except BaseException:   # noqa: BLE001 - the supervisor's own failure
            os._exit(1)
        os._exit(0)
    return pid


def _supervisor(spec: dict[str, Any], conn: socket.socket) -> None:
    """supervisor.supervise with the worker forked from here; its report is the reply on `conn`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log_fd = open_private(os.path.expanduser(spec["log"]), os.O_WRONLY | os.O_APPEND)
    report_fd = os.dup(conn.fileno())
    conn.close()

    def start(argv: list[str], cwd: str, env: dict[str, str], fd: int) -> forkrun.Forked:
        return forkrun.fork_worker(argv, cwd, env, fd, not_its=(report_fd,))

    supervisor.supervise(spec, log_fd, os.path.expanduser(spec["exit_path"]), report_fd, start=start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a run's warm interpreter (gpuflex.hosts.zygote)")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--idle-s", type=float, default=IDLE_S)
    ap.add_argument("--preload", default=",".join(PRELOAD))
    ap.add_argument("--room", default="", help="blanks: room for a worker's command line (forkrun.retitle)")
    args = ap.parse_args(argv)
    return serve(args.socket, tuple(m for m in args.preload.split(",") if m), args.idle_s)


if __name__ == "__main__":
    sys.exit(main())
