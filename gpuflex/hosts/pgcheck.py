"""One side of `gpuflex doctor`'s process-group check between two hosts.

    python -m gpuflex.hosts.pgcheck --rank 0 --addr ADDR --port PORT --timeout S --backends gloo[,nccl]

The doctor starts rank 0 on one host and rank 1 on the other at once, as a job's first
two workers would meet: rank 0 serves a TCPStore on ADDR:PORT (the address the other
hosts use for it, a free port there, as a job's store and MASTER_PORT are), rank 1
connects to it, then for each backend both form a 2-process group on that store and
all-reduce a tensor of ones (a CUDA tensor for nccl). Each side prints one JSON line:

    {"rank": 0, "stage": "done", "error": null, "backend": null,
     "results": {"gloo": {"sum": 2.0, "s": 0.05}}}

`stage` is where it stopped: "listen" (rank 0 could not bind ADDR:PORT), "import"
(torch), "connect" (rank 1 found nothing answering at ADDR:PORT within the timeout: the
port is not reachable from its host), "store", "init" and "allreduce" (of `backend`),
"finish" (the closing handshake), or "done".

Everything is bounded by `--timeout` S: rank 1's connect, each group's formation and
collective, the finish; the first meeting on the store (rank 1's client connecting, rank
0 waiting for it to say it is ready) by S plus `--start` S' more, since the other side's
python and torch may start that much later; a watchdog prints the stage it was stuck in
and exits if the whole run passes its budget (a collective that hangs inside a library
call). Rank 0 binds its port before importing torch, so a port that is there answers
rank 1's connect at once.
Imports torch; otherwise the standard library.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import sys
import threading
import time
from typing import Any

BACKENDS = ("gloo", "nccl")
DONE_KEY = "gpuflex-doctor/done"
READY_KEY = "gpuflex-doctor/ready"
EXIT_FAILED = 1
EXIT_WATCHDOG = 3


class Report:
    """What this side prints, once: the stage it reached and the results so far."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.stage = "start"
        self.backend: str | None = None
        self.results: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._printed = False

    def at(self, stage: str, backend: str | None = None) -> None:
        self.stage, self.backend = stage, backend

    def emit(self, error: str | None) -> bool:
        """Print the line (the first call only); False when it was printed already."""
        with self._lock:
            if self._printed:
                return False
            self._printed = True
            stage = "done" if error is None else self.stage
            line = {"rank": self.rank, "stage": stage, "backend": None if error is None else self.backend,
                    "error": error, "results": self.results}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            return True


def watchdog(report: Report, budget_s: float) -> None:
    """End the process if it runs past `budget_s`, after saying where it was stuck."""
    def fire() -> None:
        if report.emit(f"no progress within {budget_s:g} s (stuck in {report.stage})"):
            os._exit(EXIT_WATCHDOG)
    t = threading.Timer(budget_s, fire)
    t.daemon = True
    t.start()


def listen(addr: str, port: int) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(sockaddr)
    s.listen(64)
    return s


def reach(addr: str, port: int, timeout_s: float) -> str | None:
    """Connect to addr:port (and close) until it answers or `timeout_s` passes; None when
    it answered, else the last error (refused, timed out, no route...)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return last
        try:
            with socket.create_connection((addr, port), timeout=min(left, 2.0)):
                return None
        except OSError as e:
            last = e.strerror or type(e).__name__
            if isinstance(e, socket.timeout):
                last = "timed out"
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def run(args: argparse.Namespace, report: Report) -> str | None:
    """This side's part; None when every backend all-reduced, else the error."""
    timeout = dt.timedelta(seconds=args.timeout)
    meeting = dt.timedelta(seconds=args.timeout + args.start)   # the other side may still be starting
    fd = None
    if args.rank == 0:
        report.at("listen")
        try:
            fd = listen(args.addr, args.port).detach()
        except OSError as e:
            return e.strerror or str(e)
    report.at("import")
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - a broken torch is the answer
        return f"{type(e).__name__}: {e}"
    if args.rank == 1:
        report.at("connect")
        err = reach(args.addr, args.port, args.timeout)
        if err is not None:
            return err
    report.at("store")
    try:
        if fd is not None:
            store = dist.TCPStore(args.addr, args.port, is_master=True, wait_for_workers=False,
                                  timeout=timeout, master_listen_fd=fd)
            store.wait([READY_KEY], meeting)
        else:
            # torch's client waits unbounded on a server that accepted but does not speak (a
            # rank 0 still importing torch, or something else on the port): bound it here
            store = bounded(lambda: client(dist, args.addr, args.port, meeting), meeting.total_seconds())
        store.set_timeout(timeout)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, DistStoreError, ...
        return one_line(e)
    for backend in args.backends:
        err = all_reduce(torch, dist, store, backend, args.rank, timeout, report)
        if err is not None:
            return err
    report.at("finish")
    try:
        if args.rank == 1:
            store.set(DONE_KEY, "1")   # rank 0 keeps the store up until rank 1 is done with it
        else:
            store.wait([DONE_KEY], timeout)
    except Exception as e:  # noqa: BLE001
        return one_line(e)
    return None


def client(dist: Any, addr: str, port: int, timeout: dt.timedelta) -> Any:
    """Rank 1's store client, once it told rank 0 it is there."""
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timeout)
    store.set(READY_KEY, "1")
    return store


def bounded(fn: Any, seconds: float) -> Any:
    """fn() in a thread of its own; its value, or TimeoutError when it has not returned
    within `seconds` (the thread is left behind: the process ends with os._exit)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="gpuflex-pgcheck-bounded", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"no store answered within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def all_reduce(torch: Any, dist: Any, store: Any, backend: str, rank: int, timeout: dt.timedelta,
               report: Report) -> str | None:
    report.at("init", backend)
    start = time.monotonic()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(f"gpuflex-doctor/{backend}", store),
                                rank=rank, world_size=2, timeout=timeout)
    except Exception as e:  # noqa: BLE001
        return one_line(e)
    try:
        report.at("allreduce", backend)
        t = torch.ones(1, device="cuda:0" if backend == "nccl" else "cpu")
        dist.all_reduce(t)
        total = float(t.item())
        if total != 2.0:
            return f"the all-reduce of two ones gave {total:g}"
        report.results[backend] = {"sum": total, "s": round(time.monotonic() - start, 4)}
    except Exception as e:  # noqa: BLE001
        return one_line(e)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is gone either way
            pass
    return None


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:400]


def budget_s(timeout_s: float, backends: int, start_s: float) -> float:
    """The longest a side may take: `start_s` for its python and torch to start, then its
    waits (connect, the meeting with its `start_s`, a formation and a collective per
    backend, the finish)."""
    return 2 * start_s + timeout_s * (3 + 2 * backends)


def backends(text: str) -> list[str]:
    names = [b for b in text.split(",") if b]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"backends are {', '.join(BACKENDS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuflex.hosts.pgcheck")
    p.add_argument("--rank", type=int, choices=(0, 1), required=True)
    p.add_argument("--addr", required=True, help="rank 0's address, as the other host reaches it")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for each wait")
    p.add_argument("--backends", type=backends, default=["gloo"])
    p.add_argument("--start", type=float, default=60.0,
                   help="seconds either side's python and torch may take to start")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds the whole run may take (default: budget_s(timeout, backends, start))")
    args = p.parse_args(argv)
    report = Report(args.rank)
    watchdog(report, args.budget if args.budget is not None else budget_s(args.timeout, len(args.backends), args.start))
    error = run(args, report)
    report.emit(error)
    sys.stdout.flush()
    os._exit(0 if error is None else EXIT_FAILED)   # no atexit: a half-formed group must not hang the exit


if __name__ == "__main__":
    sys.exit(main())
