"""GPU probe: nvidia-smi CSV -> typed samples -> the `gpus` rows and a bounded history.

`probe_host(transport)` asks one host (two nvidia-smi queries, plus `ps` for the owners
of compute processes); `collect_probes` asks every GPU host of the pool in parallel and
`record_probes` records what each said, or why it could not be asked, without letting
one dead host fail the others.

Verdicts written to `Gpu.verdict` (what `Pool.free` reads):
- "free": a GPU of a host with no `owner`, with no foreign compute process.
- "idle": an owner's GPU that was quiet (utilization <= idle_util_pct, memory <=
  idle_memory_mib, no foreign process) for `idle_samples` probes in a row, or that
  gpuflex already holds and nobody else has touched since.
- "owner": an owner's GPU that is in use, or not quiet for long enough yet.
- "busy": a foreign (not gpuflex) compute process is on it.
- "zombie": memory in use above idle_memory_mib with no compute process listed (a crashed
  process's leftovers, or one in a PID namespace nvidia-smi cannot see): never idle.
- "unknown": the last probe of the host failed.
Only "free" and "idle" GPUs are placed on.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import time
from typing import Iterable

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from gpuflex.config import HarvestSettings, HostConfig
from gpuflex.db.models import Gpu, Host, Job, Worker
from gpuflex.db.models import GpuSample as SampleRow
from gpuflex.errors import TransportError
from gpuflex.hosts.fanout import Result
from gpuflex.hosts.transport import Transport
from gpuflex.states import JobState, WorkerState

GPU_QUERY = "index,uuid,name,utilization.gpu,memory.used,memory.total"
APP_QUERY = "gpu_uuid,pid,used_memory"
CSV_FORMAT = "--format=csv,noheader,nounits"
HISTORY_PER_GPU = 360  # an hour of samples at 10 s, six at the default 60 s tick
NO_DEVICES = "No devices were found"
EXIT_NO_DEVICES = 6    # nvidia-smi's exit status when it finds no GPU

log = logging.getLogger(__name__)


class ProbeError(TransportError):
    """The host answered, but nvidia-smi is missing, failed, or said something unparsable."""


@dataclasses.dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str | None
    name: str | None
    utilization_pct: float | None      # None: [N/A] / [Not Supported] (MIG, some SoCs)
    memory_used_mib: float | None
    memory_total_mib: float | None


@dataclasses.dataclass(frozen=True)
class ComputeApp:
    gpu_uuid: str
    pid: int
    used_memory_mib: float | None


@dataclasses.dataclass(frozen=True)
class ProcInfo:
    pid: int
    pgid: int | None
    user: str | None


@dataclasses.dataclass(frozen=True)
class HostProbe:
    host: str
    time: float
    gpus: tuple[GpuSample, ...]
    apps: tuple[ComputeApp, ...]
    procs: tuple[ProcInfo, ...] = ()

    def proc(self, pid: int) -> ProcInfo | None:
        return next((p for p in self.procs if p.pid == pid), None)


# ---- parsing (pure) -------------------------------------------------------------------
def parse_number(text: str) -> float | None:
    """'45' -> 45.0; '45 %' / '1024 MiB' (without nounits) -> the number; '[N/A]',
    '[Not Supported]', 'N/A', '' and anything unparsable -> None."""
    t = text.strip()
    if not t or t.startswith("[") or t.upper() == "N/A":
        return None
    try:
        return float(t.split()[0])
    except ValueError:
        return None


def _text(cell: str) -> str | None:
    t = cell.strip()
    return None if not t or t.startswith("[") or t.upper() == "N/A" else t


def _rows(text: str, width: int) -> Iterable[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for row in csv.reader(lines, skipinitialspace=True):
        if len(row) == width:
            yield row
        else:
            log.debug("nvidia-smi: skipping a line that is not a row of %d: %r", width, row)


def parse_gpus(text: str) -> list[GpuSample]:
    """Rows of `--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total`.

    Blank output or "No devices were found" is no GPU; lines that are not rows (warnings
    such as "WARNING: infoROM is corrupted") are skipped.
    """
    out = []
    for index, uuid, name, util, used, total in _rows(text, 6):
        try:
            i = int(index)
        except ValueError:
            log.debug("nvidia-smi: skipping a GPU row without an index: %r", index)
            continue
        out.append(GpuSample(i, _text(uuid), _text(name), parse_number(util),
                             parse_number(used), parse_number(total)))
    return sorted(out, key=lambda g: g.index)


def parse_apps(text: str) -> list[ComputeApp]:
    """Rows of `--query-compute-apps=gpu_uuid,pid,used_memory`; blank output is none."""
    out = []
    for uuid, pid, used in _rows(text, 3):
        try:
            p = int(pid)
        except ValueError:
            log.debug("nvidia-smi: skipping a compute-app row without a pid: %r", pid)
            continue
        out.append(ComputeApp(uuid.strip(), p, parse_number(used)))
    return out


def parse_ps(text: str) -> list[ProcInfo]:
    """Lines of `ps -o pid=,pgid=,user= -p PIDS`."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit():
            out.append(ProcInfo(int(parts[0]), int(parts[1]) if parts[1].isdigit() else None, parts[2]))
    return out


# ---- asking one host --------------------------------------------------------------------
def probe_host(transport: Transport) -> HostProbe:
    """Query one host's GPUs and compute processes. Raises TransportError (unreachable)
    or ProbeError (nvidia-smi missing or failing)."""
    host = transport.host
    now = time.time()
    res = transport.run([host.nvidia_smi, f"--query-gpu={GPU_QUERY}", CSV_FORMAT],
                        timeout=host.command_timeout_s)
    if res.returncode == EXIT_NO_DEVICES or NO_DEVICES in res.stdout:
        return HostProbe(host.name, now, (), ())
    _check(host, res.returncode, res.stdout, res.stderr)
    gpus = parse_gpus(res.stdout)
    if not gpus:
        if res.stdout.strip():
            raise ProbeError(host.name, f"cannot parse nvidia-smi output: {res.stdout.strip()[:200]!r}")
        return HostProbe(host.name, now, (), ())
    res = transport.run([host.nvidia_smi, f"--query-compute-apps={APP_QUERY}", CSV_FORMAT],
                        timeout=host.command_timeout_s)
    _check(host, res.returncode, res.stdout, res.stderr)
    apps = parse_apps(res.stdout)
    procs: list[ProcInfo] = []
    if apps:
        pids = ",".join(str(p) for p in sorted({a.pid for a in apps}))
        # exit 1 when none of the pids exists any more: not an error
        procs = parse_ps(transport.run(["ps", "-o", "pid=,pgid=,user=", "-p", pids],
                                       timeout=host.command_timeout_s).stdout)
    return HostProbe(host.name, now, tuple(gpus), tuple(apps), tuple(procs))


def _check(host: HostConfig, rc: int, out: str, err: str) -> None:
    if rc == 0:
        return
    text = (err.strip() or out.strip())[-300:]
    if rc == 127:
        raise ProbeError(host.name, f"{host.nvidia_smi} not found on the host (set nvidia_smi in "
                                    f"gpuflex.toml, or gpus = \"cpu:N\" for a host without GPUs): {text}")
    raise ProbeError(host.name, f"{host.nvidia_smi} failed (exit {rc}): {text}")


# ---- verdicts (pure) --------------------------------------------------------------------
def verdict(*, owner: str | None, foreign: bool, ours: bool, quiet: bool, streak: int,
            previous: str | None, harvest: HarvestSettings, zombie: bool = False) -> tuple[str, int]:
    """(verdict, new idle streak) for one GPU after one probe; see the module docstring."""
    if foreign:
        return "busy", 0
    if zombie and not ours:
        return "zombie", 0
    if owner is None:
        return "free", streak + 1 if quiet else 0
    if ours and not quiet:
        # our own worker keeps it busy: what it was when we took it still holds
        return (previous if previous in ("idle", "owner") else "owner"), streak
    streak = streak + 1 if quiet else 0
    return ("idle" if streak >= harvest.idle_samples else "owner"), streak


def is_quiet(g: GpuSample, harvest: HarvestSettings) -> bool:
    """Low utilization and memory; an unknown ([N/A]) value is not proof of quiet."""
    return (g.utilization_pct is not None and g.utilization_pct <= harvest.idle_util_pct
            and g.memory_used_mib is not None and g.memory_used_mib <= harvest.idle_memory_mib)


def is_zombie(g: GpuSample, apps: list[ComputeApp], harvest: HarvestSettings) -> bool:
    """Memory in use (above idle_memory_mib) while nvidia-smi lists no compute process."""
    return not apps and g.memory_used_mib is not None and g.memory_used_mib > harvest.idle_memory_mib


# ---- recording ----------------------------------------------------------------------------
def worker_pgids(session: Session) -> dict[str, set[int]]:
    """Process groups gpuflex started that are still meant to live, per host."""
    out: dict[str, set[int]] = {}
    live = [JobState.RUNNING.value, JobState.SCALING.value]
    for host, pgid, state in session.execute(
            select(Worker.host, Worker.pgid, Worker.state).join(Job).where(Job.state.in_(live))):
        if pgid is not None and not WorkerState(state).final:
            out.setdefault(host, set()).add(pgid)
    for host, pgid in session.execute(select(Job.store_host, Job.store_pgid).where(Job.state.in_(live))):
        if host and pgid is not None:
            out.setdefault(host, set()).add(pgid)
    return out


def record_probe(session: Session, host: Host, cfg: HostConfig, probe: HostProbe,
                 harvest: HarvestSettings, ours: set[int] = frozenset(),
                 history: int = HISTORY_PER_GPU) -> None:
    """Write one host's probe: `gpus` rows (created, updated, removed), verdicts and samples."""
    wanted = None if cfg.gpus == "all" else set(cfg.gpus)
    seen = [g for g in probe.gpus if wanted is None or g.index in wanted]
    rows = {g.index: g for g in host.gpus if g.kind == "gpu"}
    for g in list(host.gpus):
        if g.kind != "gpu" or g.index not in {s.index for s in seen}:
            host.gpus.remove(g)  # gone from the bus, or not configured any more
    for s in seen:
        row = rows.get(s.index)
        if row is None:
            row = Gpu(index=s.index, kind="gpu", idle_streak=0)
            host.gpus.append(row)
        if row.uuid is not None and s.uuid is not None and row.uuid != s.uuid:
            row.idle_streak, row.verdict = 0, None  # another board in this slot: start over
        apps = [a for a in probe.apps if s.uuid is not None and a.gpu_uuid == s.uuid]
        foreign, mine = [], False
        for a in apps:
            info = probe.proc(a.pid)
            if info is not None and info.pgid in ours:
                mine = True
            else:  # unknown to ps (another pid namespace) counts as foreign: we cannot prove it ours
                foreign.append({"pid": a.pid, "user": info.user if info else None,
                                "memory_mib": a.used_memory_mib})
        row.verdict, row.idle_streak = verdict(
            owner=cfg.owner, foreign=bool(foreign), ours=mine, quiet=is_quiet(s, harvest),
            streak=row.idle_streak or 0, previous=row.verdict, harvest=harvest,
            zombie=is_zombie(s, apps, harvest))
        row.uuid, row.model = s.uuid, s.name
        row.utilization_pct, row.memory_used_mib, row.memory_total_mib = \
            s.utilization_pct, s.memory_used_mib, s.memory_total_mib
        row.updated_at = probe.time
        session.add(SampleRow(host=host.name, gpu_index=s.index, uuid=s.uuid, time=probe.time,
                              utilization_pct=s.utilization_pct, memory_used_mib=s.memory_used_mib,
                              memory_total_mib=s.memory_total_mib, foreign_pids=foreign))
    host.reachable, host.last_error, host.last_probe_at = True, None, probe.time
    session.flush()
    prune_history(session, host.name, [s.index for s in seen], history)


def record_failure(host: Host, error: BaseException, now: float | None = None) -> None:
    """The host could not be probed: unreachable (TransportError), or reachable with a
    failing nvidia-smi (ProbeError). Its GPUs become "unknown" until the next good probe."""
    host.reachable, host.last_error = isinstance(error, ProbeError), str(error)
    host.last_probe_at = time.time() if now is None else now
    for g in host.gpus:
        if g.kind == "gpu":
            g.verdict, g.idle_streak = "unknown", 0


def prune_history(session: Session, host: str, indices: list[int], keep: int) -> None:
    """Keep the newest `keep` samples of each GPU."""
    for i in indices:
        cutoff = session.scalar(
            select(SampleRow.id).where(SampleRow.host == host, SampleRow.gpu_index == i)
            .order_by(SampleRow.time.desc(), SampleRow.id.desc()).offset(keep).limit(1))
        if cutoff is not None:
            session.execute(delete(SampleRow).where(
                SampleRow.host == host, SampleRow.gpu_index == i, SampleRow.id <= cutoff))


def latest_samples(session: Session) -> dict[tuple[str, int], SampleRow]:
    """The newest stored sample row per (host, GPU index)."""
    newest = select(func.max(SampleRow.id)).group_by(SampleRow.host, SampleRow.gpu_index)
    return {(s.host, s.gpu_index): s for s in session.scalars(select(SampleRow).where(SampleRow.id.in_(newest)))}


def collect_probes(pool, timeout: float | None = None,
                   hosts: list[str] | None = None) -> dict[str, Result[HostProbe]]:
    """Ask every configured GPU host (not `cpu:N` hosts) at once; no database access, so a
    caller can do it outside its lock. Returns {host name: Result}; never raises for a host."""
    cfgs = [h for h in pool.config.hosts if h.cpu_slots is None and (hosts is None or h.name in hosts)]
    if not cfgs:
        return {}
    if timeout is None:
        timeout = max(c.connect_timeout_s + 3 * c.command_timeout_s for c in cfgs)
    return pool.fan_out(cfgs, probe_host, timeout)


def record_probes(pool, session: Session, results: dict[str, Result[HostProbe]],
                  harvest: HarvestSettings | None = None) -> None:
    """Write what `collect_probes` found: each host's GPUs and samples, or its error."""
    if not results:
        return
    harvest = harvest or pool.config.harvest
    pool.sync_hosts(session)
    rows = {h.name: h for h in session.scalars(select(Host).where(Host.name.in_(list(results))))}
    ours = worker_pgids(session)
    for name, r in results.items():
        if name not in rows:
            continue  # removed from the config meanwhile
        if r.ok:
            record_probe(session, rows[name], pool.config.host(name), r.value, harvest, ours.get(name, set()))
        else:
            record_failure(rows[name], r.error)
    session.flush()

