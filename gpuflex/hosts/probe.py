"""GPU probe: nvidia-smi CSV -> typed samples.

`probe_host(transport)` asks one host (two nvidia-smi queries, plus `ps` for the owners
of compute processes); `collect_probes` asks every GPU host of the pool in parallel,
never raising for one host. What they found is judged by `gpuflex.policy.gpus` (the
verdicts below) and written by `gpuflex.control.probes` (the `gpus` rows and a bounded
history), without letting one dead host fail the others.

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

from gpuflex.config import HostConfig
from gpuflex.errors import TransportError
from gpuflex.hosts.fanout import Result
from gpuflex.hosts.transport import Transport

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
