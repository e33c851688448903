"""Recording probes: each host's `gpus` rows (created, updated, removed), verdicts and a
bounded sample history, or why the host could not be asked.

The probing itself (`gpuflex.hosts.probe`) needs no database, so callers probe outside
their lock and record inside it; the verdicts are `gpuflex.policy.gpus`'.
"""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from gpuflex.config import HarvestSettings, HostConfig
from gpuflex.db import queries
from gpuflex.db.models import Gpu, GpuSample as SampleRow, Host
from gpuflex.hosts.fanout import Result
from gpuflex.hosts.probe import HISTORY_PER_GPU, HostProbe, ProbeError
from gpuflex.policy.gpus import is_quiet, is_zombie, verdict


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
    queries.prune_history(session, host.name, [s.index for s in seen], history)


def record_failure(host: Host, error: BaseException, now: float | None = None) -> None:
    """The host could not be probed: unreachable (TransportError), or reachable with a
    failing nvidia-smi (ProbeError). Its GPUs become "unknown" until the next good probe."""
    host.reachable, host.last_error = isinstance(error, ProbeError), str(error)
    host.last_probe_at = time.time() if now is None else now
    for g in host.gpus:
        if g.kind == "gpu":
            g.verdict, g.idle_streak = "unknown", 0


def record_probes(pool, session: Session, results: dict[str, Result[HostProbe]],
                  harvest: HarvestSettings | None = None) -> None:
    """Write what `collect_probes` found: each host's GPUs and samples, or its error."""
    if not results:
        return
    harvest = harvest or pool.config.harvest
    pool.sync_hosts(session)
    rows = queries.hosts_named(session, list(results))
    ours = queries.worker_pgids(session)
    for name, r in results.items():
        if name not in rows:
            continue  # removed from the config meanwhile
        if r.ok:
            record_probe(session, rows[name], pool.config.host(name), r.value, harvest, ours.get(name, set()))
        else:
            record_failure(rows[name], r.error)
    session.flush()
