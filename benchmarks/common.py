"""Shared helpers of the benchmarks: a throw-away gpuflex setup and step-log statistics."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpuflex.hosts.hostops import proc_stats

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "elastic_mlp.py"
GPUFLEX = str(Path(sys.executable).parent / "gpuflex")


def hidden_for(state_bytes: float) -> int:
    """Width of the example's MLP whose parameters + SGD momentum take about `state_bytes`."""
    return int((state_bytes / 8) ** 0.5)


def state_bytes(hidden: int) -> int:
    params = 16 * hidden + hidden + hidden * hidden + hidden + hidden * 4 + 4
    return params * 4 * 2


class Gpuflex:
    def __init__(self, workdir: Path, slots: int, jobs: str = "", checkpoint_interval_s: float = 600,
                 cancel_grace_s: float = 60) -> None:
        """`jobs`: extra lines for the config's [jobs] table (a key given twice is a TOML error:
        the checkpoint interval has its own argument)."""
        self.dir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "gpuflex.toml"
        self.config.write_text(
            f'[database]\nurl = "sqlite:///{workdir}/g.db"\n\n[jobs]\ncheckpoint_interval_s = {checkpoint_interval_s}\n'
            f'cancel_grace_s = {cancel_grace_s}\n{jobs}\n[[hosts]]\nname = "local"\ngpus = "cpu:{slots}"\nworkdir = "{workdir}/work"\n')

    def __call__(self, *args: str) -> str:
        p = subprocess.run([GPUFLEX, *args], capture_output=True, text=True,
                           env={**os.environ, "GPUFLEX_CONFIG": str(self.config)})
        if p.returncode != 0:
            raise RuntimeError(f"gpuflex {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def status(self, job: str) -> dict:
        return json.loads(self("status", job, "--json"))

    def pgids(self, job: str) -> list[int]:
        """The process groups of the job: its store/coordinator and its workers."""
        rows = self._db("SELECT store_pgid FROM jobs WHERE id = ?", int(job))
        rows += self._db("SELECT pgid FROM workers WHERE job_id = ?", int(job))
        return [p for (p,) in rows if p]

    def _db(self, sql: str, *args) -> list[tuple]:
        con = sqlite3.connect(str(self.dir / "g.db"), timeout=30)
        try:
            return con.execute(sql, args).fetchall()
        finally:
            con.close()

    def step(self, job: str) -> int:
        """The job's step from its coordinator's control socket (see `progress`)."""
        return self.progress(job).get("step") or 0

    def progress(self, job: str) -> dict:
        """Rank 0's last progress record (step, world_size, time...: runtime.ElasticRun.status),
        from the coordinator's control socket; {} before the first. It reaches the coordinator
        through the store, up to ~0.6 s after rank 0 posted it. In-process and cheap, so
        watching a run does not steal the CPU its workers are measured on (a `gpuflex`
        command costs ~0.7 s of CPU)."""
        from gpuflex.hosts.relay import unix_request

        (sockets,) = self._db("SELECT socket_dir FROM jobs WHERE id = ?", int(job))[0]
        if not sockets:
            return {}   # not started yet
        try:
            reply = unix_request(os.path.join(sockets, "coord.sock"), {"op": "status"}, 5)
        except OSError:
            return {}
        return reply.get("progress") or {}

    def wait_steps(self, job: str, more: int, timeout: float = 600) -> None:
        start = self.step(job)
        end = time.monotonic() + timeout
        while self.step(job) < start + more:
            if time.monotonic() > end:
                raise RuntimeError(f"job {job} stalled")
            time.sleep(0.5)

    def wait_workers_gone(self, job: str, timeout: float = 900) -> None:
        """Until every worker process of the job has exited (read from the DB and /proc)."""
        from gpuflex.hosts.hostops import group_alive

        end = time.monotonic() + timeout
        while True:
            pgids = [p for (p,) in self._db("SELECT pgid FROM workers WHERE job_id = ?", int(job)) if p]
            if pgids and not any(group_alive(p) for p in pgids):
                return
            if time.monotonic() > end:
                raise RuntimeError(f"job {job} did not finish")
            time.sleep(0.5)


def stalls(step_log: list[list[float]]) -> tuple[float, list[tuple[str, int, int, float]]]:
    """(median step time, [(grow|shrink, from, to, stall)]): a stall is the gap between the
    steps around a world-size change minus the median step time at the new world size (on
    a 2-core machine steps at 3 workers are slower than at 2; that is not a pause)."""
    pairs = list(zip(step_log, step_log[1:]))
    by_world: dict[int, list[float]] = {}
    for a, b in pairs:
        if a[2] == b[2]:
            by_world.setdefault(int(b[2]), []).append(b[1] - a[1])
    med = statistics.median([g for gs in by_world.values() for g in gs]) if by_world else 0.0
    out = []
    for a, b in pairs:
        if a[2] != b[2]:
            base = statistics.median(by_world.get(int(b[2]), [med]))
            out.append(("grow" if b[2] > a[2] else "shrink", int(a[2]), int(b[2]), (b[1] - a[1]) - base))
    return med, out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def process_groups(root: int) -> list[int]:
    """The process groups of `root` and of all its descendants (torchrun starts each
    worker in a session of its own)."""
    parent = {pid: (ppid, pgrp) for pid, _, ppid, pgrp in proc_stats()}
    tree, grew = {root}, True
    while grew:
        more = {p for p, (pp, _) in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted({parent[p][1] for p in tree if p in parent})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
