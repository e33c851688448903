"""A worker forked from a run's warm interpreter (gpuflex.hosts.zygote), made to behave as
`python [-u] SCRIPT ARGS` or `python [-u] -m MODULE ARGS` would in a fresh one.

`parse_python_argv` says which command lines it can run that way; `fork_worker` forks the
worker from a supervisor and returns what the supervisor waits on (subprocess.Popen's
`pid` and `wait`); the worker (`_become`, `run_main`) has its stdin from /dev/null, stdout and stderr
to its log, the signal dispositions a fresh interpreter has, the worker's environment
and directory, its argv and sys.path[0], torch's intra-op threads from its
OMP_NUM_THREADS (torch chose them when the zygote imported it), the script in a new
`__main__`, an uncaught exception's traceback from the script's frames on, then the
interpreter's own exit (SystemExit's code, 1 for an exception, death by SIGINT for a
KeyboardInterrupt, 2 for a script that is not there; its non-daemon threads joined, its
atexit handlers run, its streams flushed).

Standard library only, as the rest of gpuflex.hosts.
"""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, NoReturn, Sequence

from gpuflex.hosts.supervisor import stat_fields

Parsed = tuple[str, str, list[str], bool]   # ("script" | "module", target, its args, unbuffered)
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_RESET = ("SIGTERM", "SIGHUP", "SIGCHLD", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGQUIT")


def parse_python_argv(argv: Sequence[str]) -> Parsed | None:
    """How to run `python [-u] SCRIPT ARGS` or `python [-u] -m MODULE ARGS` here; None for
    any other command line (another program, another option, `-c`): it starts cold."""
    if len(argv) < 2 or not _PYTHON.match(os.path.basename(argv[0])):
        return None
    i, unbuffered = 1, False
    while i < len(argv) and argv[i] == "-u":
        unbuffered, i = True, i + 1
    if i < len(argv) and argv[i] == "-m":
        return ("module", argv[i + 1], list(argv[i + 2:]), unbuffered) \
            if i + 1 < len(argv) and argv[i + 1] and not argv[i + 1].startswith("-") else None
    if i >= len(argv) or argv[i].startswith("-"):
        return None
    return "script", argv[i], list(argv[i + 1:]), unbuffered


class Forked:
    """A worker its supervisor forked: subprocess.Popen's `pid`, `returncode` and `wait`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is not None and not self._ended_within(timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
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

    def _ended_within(self, timeout: float) -> bool:
        if self._fd is not None:
            return bool(select.select([self._fd], [], [], max(0.0, timeout))[0])
        end = time.monotonic() + timeout
        while not os.waitpid(self.pid, os.WNOHANG)[0]:   # no pidfd (Linux before 5.3): polled
            if time.monotonic() >= end:
                return False
            time.sleep(0.05)
        return True


# room the zygote's own argv and environment keep for its workers' (`retitle`): its
# `--room` argument and this variable, blanks
ARGV_ROOM, ENV_ROOM = 16 << 10, 64 << 10
ROOM_VARIABLE = "GPUFLEX_ZYGOTE_ROOM"


def retitle(argv: Sequence[str], env: dict[str, str]) -> bool:
    """Write `argv` and `env` over this process's original argument and environment areas,
    where /proc/PID/cmdline and /proc/PID/environ read them (what `ps`, a lab's accounting
    and gpuflex's own tools see of a process), the rest of each area zeros: a forked worker
    shows its own command line and environment there, not the zygote's. Safe only once
    nothing points into the old environment block (os.environ cleared and refilled);
    whether both fitted (an area too small is left as it was)."""
    import ctypes

    fields = stat_fields("self")
    try:
        arg0, arg1, env0, env1 = (int(fields[n - 3]) for n in (48, 49, 50, 51))   # proc(5)'s field numbers
    except (TypeError, ValueError, IndexError):   # unreadable (None) or a kernel without them
        return False
    fitted = True
    for start, end, items in ((arg0, arg1, argv), (env0, env1, [f"{k}={v}" for k, v in env.items()])):
        blob = b"".join(os.fsencode(x) + b"\0" for x in items)
        if not start or len(blob) > end - start:
            fitted = False
            continue
        ctypes.memmove(start, blob + bytes(end - start - len(blob)), end - start)
    return fitted


def fork_worker(argv: list[str], cwd: str, env: dict[str, str], log_fd: int, not_its: Sequence[int] = ()) -> Forked:
    """Fork the worker of `argv` (what parse_python_argv takes); `not_its`: descriptors it
    must not keep. OSError, as a cold start's exec would raise, when it cannot start. The
    worker itself never returns from here: it ends by SystemExit, which the zygote lets
    reach the interpreter's own exit (see `run_main`)."""
    parsed = parse_python_argv(argv)
    if parsed is None:
        raise OSError(errno.ENOEXEC, "not a Python script or module")
    if not os.path.isdir(cwd):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)
    pid = os.fork()
    if pid == 0:
        try:
            for fd in not_its:
                os.close(fd)
            _become(cwd, env, log_fd, parsed[3])
            retitle(argv, env)
        except BaseException:   # noqa: BLE001 - nothing of the script ran: never the supervisor's code
            os._exit(127)
        run_main(parsed)
    return Forked(pid)


def _become(cwd: str, env: dict[str, str], log_fd: int, unbuffered: bool) -> None:
    """The process a fresh interpreter would be: stdin /dev/null, stdout and stderr to the
    log, default signal dispositions, the worker's directory and environment."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((devnull, 0), (log_fd, 1), (log_fd, 2)):
        os.dup2(fd, to)
    os.close(devnull)
    os.close(log_fd)
    for name in _RESET:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()   # libc's environ then points into Python's strings only (see _retitle)
    os.environ.update(env)
    if unbuffered or env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    _threads(env)


_interrupted = False


def run_main(parsed: Parsed) -> NoReturn:
    """Run the script or module of `parsed` as `__main__`, then end by SystemExit with the
    interpreter's code for how it ended; the zygote lets that reach the interpreter's own
    exit (non-daemon threads joined, atexit handlers run, streams flushed). An uncaught
    KeyboardInterrupt ends the process by SIGINT after all of that (`die_if_interrupted`,
    which the zygote registered first, so it runs last)."""
    global _interrupted
    kind, target, args, _ = parsed
    code: Any = 0
    try:
        sys.argv = [target, *args]
        if kind == "script":
            path = os.path.abspath(target)
            sys.path[0] = os.path.dirname(path)
            _run_script(path)
        else:
            import runpy
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)   # argv[0]: the module's file
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt as e:
        _print_exception(e)
        _interrupted, code = True, 1
    except BaseException as e:   # noqa: BLE001 - what the interpreter would print, then exit 1
        _print_exception(e)
        code = 1
    raise SystemExit(code)


def die_if_interrupted() -> None:
    """The last atexit handler of a worker whose script ended by KeyboardInterrupt: the
    interpreter's way to end then, by SIGINT."""
    if _interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def _threads(env: dict[str, str]) -> None:
    """torch's intra-op threads as a fresh interpreter with this environment would take them."""
    torch = sys.modules.get("torch")
    n = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
    if torch is not None and n and n.isdigit() and int(n) > 0:
        torch.set_num_threads(int(n))


def _run_script(path: str) -> None:
    """Run the file at `path` as the interpreter runs its script: a new `__main__` whose
    `__file__` is the absolute path (sys.argv[0] stays as given), its source decoded by its
    coding cookie, its frames named by that path; a missing file is the interpreter's
    message and exit code 2."""
    import builtins
    import importlib.machinery
    import types

    if not os.path.isfile(path):
        print(f"{sys.executable}: can't open file {path!r}: [Errno {errno.ENOENT}] {os.strerror(errno.ENOENT)}",
              file=sys.stderr)
        raise SystemExit(2)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__cached__ = path, builtins, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with open(path, "rb") as f:   # compile() honours a coding cookie in bytes
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)   # noqa: S102 - the job's own script, as `python SCRIPT` runs it


def _print_exception(e: BaseException) -> None:
    """The traceback `python` would print: from the script's first frame on, not ours or runpy's."""
    tb = e.__traceback__
    ours = {os.path.abspath(__file__), getattr(sys.modules.get("runpy"), "__file__", None)}
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)
