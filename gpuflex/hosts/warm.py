"""Warm starts: a run's Python workers forked from an interpreter that has already
imported what they all import, instead of each paying for the imports.

A training script's worker spends its first seconds of CPU importing torch and, at its
optimizer's construction, torch's compiler front end (torch._dynamo, which
`Optimizer.__init__` imports through torch's `_disable_dynamo` wrapper): about 2.5 s of
CPU a worker on a 2-core machine. Three such workers started fresh took 8.1 s of CPU,
forked from one interpreter that had imported them 2.8 s.

One warm interpreter (the "zygote") per run and host, started by the run's first spawn
there that can use it, with that spawn's interpreter and environment less what differs
between workers (`WORKER_ONLY`), in a session of its own whose group is marked in the
run's socket directory (so hostops.end_run ends it with the run); it ends by itself when
that directory is gone or when it has had no worker and no request for `IDLE_S`. It
listens on `ZYGOTE_SOCKET` in that directory (0700: only the run's user reaches it; the
socket 0600, and a peer of another uid is refused). A spawn sends it the worker's spec
(JSON, one line); it forks a supervisor, which leads a new session as
gpuflex.hosts.supervisor's does, marks its group, forks the worker and does the rest of a
supervisor's work (the exit record, the run's deadline). The worker runs its script as
`python SCRIPT ARGS` or `python -m MODULE ARGS` would (`run_main`): the worker's
environment, directory, argv and sys.path[0], stdin from /dev/null, stdout and stderr to
its log, the signals a fresh interpreter has, torch's intra-op threads from its
OMP_NUM_THREADS, an uncaught exception's traceback without our frames, the exit code.

Only what a fresh interpreter would run the same way is forked: `warmable` takes a
Python interpreter with no options but `-u`, a script or `-m MODULE`, and no container.
Everything else, and any spawn that cannot reach a zygote in time, starts cold, as before.
The zygote never initialises CUDA (it refuses to serve if an import did): a CUDA context
does not survive a fork.

Standard library only, as the rest of gpuflex.hosts: the zygote runs under the job's
interpreter and imports the preloaded modules it finds there.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from typing import Any, NoReturn

from gpuflex.hosts import supervisor
from gpuflex.hosts.private import open_private

# a run's zygotes, in its socket directory: one per interpreter and common environment
# (`zygote_key`), so a spawn never forks from an interpreter whose sys.path another
# environment made: "zygote-KEY.sock", its lock, pid, failure mark
ZYGOTE = "zygote-"
ZYGOTE_LOG = "zygote.log"   # in the run's log directory
# what the zygote imports before it serves (those its interpreter lacks are skipped)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.optim")
READY_S = 10.0       # how long a spawn waits for a starting zygote before it starts cold
IDLE_S = 600.0       # a zygote with no worker alive and no request this long ends
REQUEST_BYTES = 1 << 20
# the environment that differs between a run's workers: never the zygote's
WORKER_ONLY = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
               "OMP_NUM_THREADS", "MKL_NUM_THREADS")
WORKER_PREFIXES = ("GPUFLEX_", "TORCHELASTIC_")
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")


# ---- the spawn's side (hostops) -------------------------------------------------------------
def warmable(spec: dict[str, Any]) -> bool:
    """Whether `spec` asks for a warm start (`warm`: a worker's spec) and runs a script or
    module under a Python interpreter the way `run_main` can (see the module's doc);
    False: it starts cold."""
    if spec.get("container") or not spec.get("socket_dir") or not spec.get("warm"):
        return False
    return parse_python_argv(list(spec.get("argv") or ())) is not None


def zygote_key(spec: dict[str, Any]) -> str:
    """Which of the run's zygotes serves `spec`: its interpreter and common environment."""
    import hashlib
    env = zygote_env(supervisor.spawn_env(spec))
    text = json.dumps([spec["argv"][0], sorted(env.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_python_argv(argv: list[str]) -> tuple[str, str, list[str], bool] | None:
    """(kind "script" | "module", target, its args, unbuffered) for `python [-u] SCRIPT
    ARGS` or `python [-u] -m MODULE ARGS`; None for anything else."""
    if len(argv) < 2 or not _PYTHON.match(os.path.basename(argv[0])):
        return None
    i, unbuffered = 1, False
    while i < len(argv) and argv[i] == "-u":
        unbuffered, i = True, i + 1
    if i < len(argv) and argv[i] == "-m":
        return ("module", argv[i + 1], argv[i + 2:], unbuffered) if i + 1 < len(argv) and argv[i + 1] else None
    if i >= len(argv) or argv[i].startswith("-"):
        return None
    return "script", argv[i], argv[i + 1:], unbuffered


def zygote_env(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment less what differs between workers (WORKER_ONLY)."""
    return {k: v for k, v in env.items() if k not in WORKER_ONLY and not k.startswith(WORKER_PREFIXES)}


def spawn(spec: dict[str, Any], ready_s: float = READY_S) -> dict[str, int] | None:
    """Start the worker of `spec` (as supervisor.spawn, whose checks it has run) forked
    from the run's zygote, starting that first when there is none; its reply
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
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def _start(spec: dict[str, Any], path: str, pid_path: str) -> int | None:
    """Start a zygote for `spec` (its interpreter, its common environment) serving `path`;
    its pid (recorded at `pid_path`), or None when it cannot be started."""
    argv0 = os.path.expanduser(spec["argv"][0])
    env = zygote_env(supervisor.spawn_env(spec))
    log_dir = os.path.dirname(os.path.expanduser(spec["log"]))
    log_fd = open_private(os.path.join(log_dir, ZYGOTE_LOG), os.O_WRONLY | os.O_APPEND)
    try:
        proc = subprocess.Popen([argv0, "-m", "gpuflex.hosts.warm", "--socket", path],
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
    sock_dir = os.path.dirname(path)
    supervisor.mark_group(sock_dir)
    for name in preload:
        try:
            __import__(name)
        except Exception as e:   # noqa: BLE001 - a module its interpreter lacks, or that fails: not preloaded
            print(f"zygote: not preloaded: {name}: {type(e).__name__}: {e}", flush=True)
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
        last = time.monotonic()
        try:
            pid = _handle(conn, listener)
            if pid is not None:
                children.add(pid)
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
        finally:
            os._exit(0)
    return pid


# descriptors the worker must not keep (the reply's: the spawn reads it to its end)
_NOT_THE_WORKERS: list[int] = []


def _supervisor(spec: dict[str, Any], conn: socket.socket) -> None:
    """supervisor._supervise with the worker forked from here; its reply on `conn`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log_fd = open_private(os.path.expanduser(spec["log"]), os.O_WRONLY | os.O_APPEND)
    report_fd = os.dup(conn.fileno())
    conn.close()
    _NOT_THE_WORKERS.append(report_fd)
    supervisor._supervise(spec, log_fd, os.path.expanduser(spec["exit_path"]), report_fd,   # noqa: SLF001
                          start=_fork_worker)


class Forked:
    """A worker this supervisor forked: subprocess.Popen's `pid` and `wait`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is not None:
            if self._fd is not None:
                ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
                if not ready:
                    raise subprocess.TimeoutExpired(str(self.pid), timeout)
            else:
                end = time.monotonic() + timeout
                while not os.waitpid(self.pid, os.WNOHANG)[0]:
                    if time.monotonic() >= end:
                        raise subprocess.TimeoutExpired(str(self.pid), timeout)
                    time.sleep(0.05)
        while True:
            try:
                _, status = os.waitpid(self.pid, 0)
                break
            except InterruptedError:
                continue
        self.returncode = os.waitstatus_to_exitcode(status)
        if self._fd is not None:
            os.close(self._fd)
        return self.returncode


def _fork_worker(argv: list[str], cwd: str, env: dict[str, str], log_fd: int) -> Forked:
    parsed = parse_python_argv(argv)
    if parsed is None:   # not warmable after all (the spawn checked): as a cold start would
        raise OSError(errno.ENOEXEC, "not a Python script or module")
    if not os.path.isdir(cwd):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)
    pid = os.fork()
    if pid == 0:
        try:
            for fd in _NOT_THE_WORKERS:
                os.close(fd)
            run_main(parsed, cwd, env, log_fd)
        finally:
            os._exit(1)
    return Forked(pid)


# ---- the worker --------------------------------------------------------------------------
def run_main(parsed: tuple[str, str, list[str], bool], cwd: str, env: dict[str, str], log_fd: int) -> NoReturn:
    """Be `python [-u] SCRIPT ARGS` or `python [-u] -m MODULE ARGS` in this forked process."""
    import runpy
    import threading

    kind, target, args, unbuffered = parsed
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if unbuffered or env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    torch = sys.modules.get("torch")
    if torch is not None:   # torch took its intra-op threads at import: the worker's own count
        n = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
        if n and n.isdigit() and int(n) > 0:
            torch.set_num_threads(int(n))
    code: int = 0
    try:
        if kind == "script":
            path = os.path.abspath(target)
            if not os.path.isfile(path):   # what the interpreter says, and its exit code
                print(f"{sys.executable}: can't open file {path!r}: [Errno {errno.ENOENT}] "
                      f"{os.strerror(errno.ENOENT)}", file=sys.stderr)
                raise SystemExit(2)
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(path)
            _run_script(path)
        else:
            sys.argv = [target, *args]   # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException as e:   # noqa: BLE001 - what the interpreter would print, then exit 1
        _print_exception(e, target)
        code = 1
    finally:
        threading._shutdown()   # noqa: SLF001 - as the interpreter does before it exits
        import atexit
        atexit._run_exitfuncs()   # noqa: SLF001
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    if code == -signal.SIGINT:   # as the interpreter ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _run_script(path: str) -> None:
    """Run the file at `path` as the interpreter runs its script: a new `__main__` whose
    `__file__` is the absolute path (sys.argv[0] stays as given), its source decoded by its
    coding cookie, its frames named by that path."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__cached__ = path, builtins, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with open(path, "rb") as f:   # compile() honours a coding cookie in bytes
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)   # noqa: S102 - the job's own script, as `python SCRIPT` runs it


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_exception(e: BaseException, target: str) -> None:
    """The traceback `python` would print: from the script's first frame on, not ours or runpy's."""
    tb = e.__traceback__
    ours = (os.path.abspath(__file__).rstrip("c"), getattr(sys.modules.get("runpy"), "__file__", "") or "")
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a run's warm interpreter (gpuflex.hosts.warm)")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--idle-s", type=float, default=IDLE_S)
    ap.add_argument("--preload", default=",".join(PRELOAD))
    args = ap.parse_args(argv)
    return serve(args.socket, tuple(m for m in args.preload.split(",") if m), args.idle_s)


if __name__ == "__main__":
    sys.exit(main())
