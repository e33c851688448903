"""Pool commands: hosts."""

from __future__ import annotations

import typer
from rich.table import Table
from sqlalchemy import select

from gpuflex.cli.common import command, console, obj, print_json
from gpuflex.db.models import Host, Job, Worker
from gpuflex.states import WorkerState


def register(app: typer.Typer) -> None:
    app.command()(hosts)


def pool_view(svc) -> list[dict]:
    """Hosts with their devices and who holds each one."""
    with svc.sessions() as session:
        holders: dict[tuple[str, int], str] = {}
        for w, j in session.execute(select(Worker, Job).join(Job)):
            if not WorkerState(w.state).final:
                for d in w.gpus:
                    holders[(w.host, d)] = f"job {j.id} rank {w.rank if w.rank is not None else '?'} (w{w.wid})"
        out = []
        for h in session.scalars(select(Host).order_by(Host.name)):
            cfg = next((c for c in svc.config.hosts if c.name == h.name), None)
            if cfg is None:
                continue
            out.append({
                "name": h.name, "address": h.address, "owner": h.owner, "reachable": h.reachable,
                "error": h.last_error,
                "devices": [{"index": g.index, "kind": g.kind, "uuid": g.uuid, "model": g.model,
                             "utilization_pct": g.utilization_pct, "memory_used_mib": g.memory_used_mib,
                             "memory_total_mib": g.memory_total_mib, "verdict": g.verdict,
                             "holder": holders.get((h.name, g.index))} for g in h.gpus],
            })
        return out


@command
def hosts(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Hosts, their GPUs (or CPU slots), utilization, idle verdict and who holds each.

    Example: gpuflex hosts --json
    """
    svc = obj(ctx).service()
    svc.refresh()
    view = pool_view(svc)
    if as_json:
        print_json(view)
        return
    t = Table(title="gpuflex hosts", title_justify="left")
    for col in ("HOST", "ADDRESS", "DEVICE", "UTIL%", "MEM MiB", "VERDICT", "HOLDER"):
        t.add_column(col)
    for h in view:
        if not h["devices"]:
            t.add_row(h["name"], h["address"], "-", "-", "-", h["error"] or "no devices", "-")
        for d in h["devices"]:
            mem = "-" if d["memory_used_mib"] is None else f"{d['memory_used_mib']:.0f}/{d['memory_total_mib']:.0f}"
            util = "-" if d["utilization_pct"] is None else f"{d['utilization_pct']:.0f}"
            t.add_row(h["name"], h["address"], f"{d['kind']} {d['index']}", util, mem,
                      d["verdict"] or "-", d["holder"] or "free")
    console.print(t)
