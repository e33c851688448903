"""The job coordinator: serves the job's TCPStore and is the only writer of generations.

gpuflex starts one per job on its first host (`python -m gpuflex.elastic.coordinator`),
apart from the workers, so a worker crash never takes the store down. Every TICK_S it lets
the generation logic (generations.py) look at the store; its control socket answers
`status` and `resize` (the desired membership). A lock keeps the ticks and the socket's
threads apart. `--min-workers` (no generation is ever smaller: the job is held instead)
and `--max-failures` (the same failure that many times in a row aborts the job) come from
the job's record; the control side reads the outcome from `status`. A resize names only
workers of the job (failures.check_members): known ids, or newcomers' ids just above them.

When it ends the job (`abort`: a failure repeated, or an in-place job none of whose workers
ever joined the runtime, forming.py) it also writes the abort record into the run's
directory (the control socket's, run_dir.py), where the next command reads it even if the
coordinator has ended itself by then. A job whose workers never joined runs plain
processes that never read the store: the coordinator stops the run's process groups on its
host (`--stop-grace` between SIGTERM and SIGKILL), so the job ends at the deadline whether
or not a command runs; workers on other hosts are stopped by the next command.

No orphans: no daemon watches the hosts, so the coordinator ends itself once its job is
gone (failures.OrphanWatch): its `--job-dir` removed, or no worker heartbeat and no request
on its control socket for `--orphan-timeout` seconds. It then logs one JSON line
{"event": "orphan", "reason", "exit_code"}, leaves its last status reply in the run's
directory (run_dir.LAST_STATUS) and exits ORPHAN_EXIT (keys.py), which its
supervisor's exit record keeps for the next command; its workers lose the store and exit
STORE_LOST_EXIT.

Gang mode (`--gang`: every job but an in-place elastic one) runs plain processes too
(torch.distributed scripts, torchrun, shell commands): they never beat nor join, so the
formation deadline leaves a worker that never beat to the control side (forming.py), and
a local worker still running is a sign of life: one of the job's workers on this host (rank
0 always is) whose exit record (`worker-{wid}.exit` beside its `worker-{wid}.log` in
--job-dir) is not written yet. A gang's coordinator so ends itself only after its local
workers ended and no command came for the orphan timeout, or once its job dir is removed.

The store listens only on `--bind` (the address the workers use: 127.0.0.1 on one host):
torch's TCPStore server ignores its host name and listens on every interface, so the
coordinator binds and listens on a socket itself and hands its descriptor to the store
(`master_listen_fd`). What the workers write is verified with the job's secret, read from
GPUFLEX_JOB_SECRET (absent: an unauthenticated job, see auth.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterable

from torch.distributed import TCPStore

from gpuflex.elastic.protocol import run_dir, wire
from gpuflex.elastic.protocol.control_socket import ControlServer
from gpuflex.elastic.protocol.env import JOB_SECRET
from gpuflex.elastic.coordinator.failures import OrphanWatch, check_members
from gpuflex.elastic.coordinator.forming import NEVER_JOINED
from gpuflex.elastic.coordinator.generations import Generations
from gpuflex.elastic.protocol.keys import ORPHAN_EXIT
from gpuflex.elastic.protocol.logs import ensure_handler

log = logging.getLogger("gpuflex.elastic.coordinator")   # not __name__: run as __main__

TICK_S = 0.05
ORPHAN_CHECK_S = 1.0
ORPHAN_TIMEOUT_S = 120.0


class Coordinator:
    """The generation logic behind a lock, with the control socket's ops. `watch` (None:
    never an orphan) hears of every request; `max_workers` bounds a resize."""

    def __init__(self, generations: Generations, watch: OrphanWatch | None = None,
                 max_workers: int | None = None, local_workers: Callable[[], bool] | None = None) -> None:
        self.generations = generations
        self.watch = watch
        self.max_workers = max_workers
        self.local_workers = local_workers   # whether a worker on this host still runs (a gang)
        self.lock = threading.Lock()
        self.ended = False   # the job's end was handed out (`new_end`)

    def tick(self) -> None:
        with self.lock:
            self.generations.tick()

    def new_end(self) -> dict[str, Any] | None:
        """The abort ({reason, cause, at}) the first time it is asked after the job ended;
        None before, and after."""
        with self.lock:
            if self.ended or self.generations.abort is None:
                return None
            self.ended = True
            return dict(self.generations.abort)

    def orphaned(self) -> str | None:
        """Why the job is gone (see OrphanWatch); None while it is not."""
        if self.watch is None:
            return None
        with self.lock:
            self.watch.beat(self.generations.heartbeats.last_change())
            if self.local_workers is not None and self.local_workers():
                self.watch.contact()   # the timeout counts from the last local worker's end
            return self.watch.reason()

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """The control socket's ops, each a sign of life from the control side."""
        def heard(op: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
            def handle(msg: dict[str, Any]) -> dict[str, Any]:
                if self.watch is not None:
                    with self.lock:
                        self.watch.contact()
                return op(msg)
            return handle
        return {wire.STATUS: heard(self.op_status), wire.RESIZE: heard(self.op_resize)}

    def op_status(self, _msg: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            return self.generations.status()

    def op_resize(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            members = check_members(msg.get("members"), self.generations.known, self.max_workers)
            return {"desired": self.generations.resize(members)}


def local_workers_running(job_dir: str | None, wids: Callable[[], Iterable[int]]) -> Callable[[], bool]:
    """Whether one of the workers `wids()` ran on this host (its log is in `job_dir`) and
    has no exit record yet (its supervisor writes it when the worker ends)."""
    def running() -> bool:
        if not job_dir:
            return False
        return any(os.path.exists(os.path.join(job_dir, f"worker-{w}.log"))
                   and not os.path.exists(os.path.join(job_dir, f"worker-{w}.exit")) for w in wids())
    return running


def listen(address: str, port: int) -> socket.socket:
    """A TCP socket bound to `address` only and listening, for TCPStore's `master_listen_fd`."""
    family, kind, proto, _, addr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(512)
    return sock


def serve_store(address: str, port: int) -> TCPStore:
    """The job's TCPStore server, listening on `address`:`port` only."""
    sock = listen(address, port)
    fd = sock.detach()   # the store owns the descriptor from here and closes it
    try:
        return TCPStore(address, port, is_master=True, wait_for_workers=False,
                        timeout=dt.timedelta(seconds=30), master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def seconds_above_zero(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def leave_status(control: str) -> Callable[[dict[str, Any]], None]:
    """The status reply into the run's directory (beside `control`) as the coordinator ends
    itself (run_dir.LAST_STATUS): the next command judges the run by it."""
    def write(status: dict[str, Any]) -> None:
        try:
            run_dir.write_record(os.path.dirname(control), run_dir.LAST_STATUS, status)
        except (OSError, TypeError, ValueError) as e:
            log.error("cannot leave the last status in %s: %s", os.path.dirname(control), e)
    return write


def on_end(control: str, stop_grace_s: float) -> Callable[[dict[str, Any]], None]:
    """What the coordinator does once it ended the job (see the module's doc): the abort
    record into the run's directory (beside `control`); for a job whose workers never
    joined, the run's other process groups on this host stopped, from a thread (the
    ticks and the orphan check go on meanwhile)."""
    directory = os.path.dirname(control)

    def ended(abort: dict[str, Any]) -> None:
        try:
            run_dir.write_abort(directory, abort)
        except OSError as e:   # the socket answers status with it all the same
            log.error("cannot write the abort record into %s: %s", directory, e)
        if abort.get("cause") != NEVER_JOINED:
            return   # gpuflex.elastic workers read the abort and exit ABORTED_EXIT
        groups = [g for g in run_dir.marked_groups(directory) if g != os.getpgrp()]
        log.error("stopping the job's process group(s) %s on this host: they never joined the runtime", groups)
        threading.Thread(target=run_dir.stop_groups, args=(groups, stop_grace_s), daemon=True,
                         name="stop-workers").start()
    return ended


def run(coord: Coordinator, stop: threading.Event,
        ended: Callable[[dict[str, Any]], None] | None = None,
        last_words: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Tick until `stop` (0) or until the job is gone (ORPHAN_EXIT, after one JSON line and
    `last_words(status)`); `ended(abort)` once, when the job ended."""
    next_check = time.monotonic() + ORPHAN_CHECK_S
    while not stop.wait(TICK_S):
        coord.tick()
        if ended is not None and (abort := coord.new_end()) is not None:
            ended(abort)
        if time.monotonic() < next_check:
            continue
        next_check = time.monotonic() + ORPHAN_CHECK_S
        why = coord.orphaned()
        if why is not None:
            log.error("coordinator ends itself, its job is gone: %s", why)
            log.error("%s", json.dumps({"event": "orphan", "reason": why, "exit_code": ORPHAN_EXIT}))
            if last_words is not None:
                last_words(coord.op_status({}))
            return ORPHAN_EXIT
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuflex.elastic.coordinator")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--members", required=True, help="initial worker ids, comma-separated")
    ap.add_argument("--control", required=True, help="path of the control socket")
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    ap.add_argument("--bind", default="0.0.0.0",
                    help="the address the store listens on: the one the workers use")
    ap.add_argument("--min-workers", type=positive, default=1,
                    help="the job's minimum: no generation is formed with fewer members")
    ap.add_argument("--max-failures", type=positive, default=3,
                    help="the same failure this many times in a row ends the job")
    ap.add_argument("--max-workers", type=positive, default=None,
                    help="the job's maximum: a resize to more workers is refused")
    ap.add_argument("--orphan-timeout", type=seconds_above_zero, default=ORPHAN_TIMEOUT_S,
                    help="end once no worker heartbeat and no request came for this long")
    ap.add_argument("--job-dir", default=None, help="end once this directory is removed")
    ap.add_argument("--formation-timeout", type=seconds_above_zero, default=60.0,
                    help="a member not joined this long after a formation began is left out (or the job held)")
    ap.add_argument("--gang", action="store_true",
                    help="the job runs as a whole: a worker that never beat is the control side's to watch, "
                         "and a local worker still running keeps the coordinator alive")
    ap.add_argument("--stop-grace", type=float, default=10.0,
                    help="seconds between SIGTERM and SIGKILL when it stops workers that never joined")
    args = ap.parse_args(argv)
    ensure_handler(sys.stdout)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = serve_store(args.bind, args.port)
    secret = os.environ.get(JOB_SECRET) or None
    job_dir = os.path.expanduser(args.job_dir) if args.job_dir else None   # "~/..." as the host's workdir
    watch = OrphanWatch(args.orphan_timeout, job_dir, time.monotonic)
    generations = Generations(store, [int(w) for w in args.members.split(",") if w],
                              hb_timeout_s=args.heartbeat_timeout, secret=secret,
                              min_workers=args.min_workers, max_failures=args.max_failures,
                              formation_timeout_s=args.formation_timeout)
    if args.gang:
        generations.formation.as_gang()
    local = local_workers_running(job_dir, lambda: sorted(generations.known)) if args.gang else None
    coord = Coordinator(generations, watch, args.max_workers, local)
    server = ControlServer(args.control, coord.handlers())
    log.info("coordinator listening on %s:%d (%s), control %s, min %d worker(s), max %d same "
             "failures", args.bind, args.port,
             "records signed" if secret else "no job secret: records unauthenticated", args.control,
             args.min_workers, args.max_failures)
    try:
        return run(coord, stop, on_end(args.control, args.stop_grace), leave_status(args.control))
    finally:
        server.close()
        watch.close()

