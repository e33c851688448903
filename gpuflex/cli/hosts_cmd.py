"""Pool commands: `gpuflex hosts` (probe and list) and `gpuflex hosts trust NAME`."""

from __future__ import annotations

import typer
from rich.table import Table
from rich.text import Text
from sqlalchemy import select

from gpuflex.cli.common import command, console, err_console, obj, print_json
from gpuflex.db.models import Host, Job, Worker
from gpuflex.errors import UsageError
from gpuflex.states import WorkerState

app = typer.Typer(
    help="Hosts, their GPUs (or CPU slots), utilization, idle verdict and who holds each.\n\n"
         "Example: gpuflex hosts --json",
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="hosts")


def pool_view(svc) -> list[dict]:
    """Hosts with their devices, the last probe's figures and who holds each device."""
    from gpuflex.hosts.probe import latest_samples

    with svc.sessions() as session:
        workers: dict[tuple[str, int], tuple[Job, Worker]] = {}
        for w, j in session.execute(select(Worker, Job).join(Job)):
            if not WorkerState(w.state).final:
                for d in w.gpus:
                    workers[(w.host, d)] = (j, w)
        samples = latest_samples(session)
        out = []
        for h in session.scalars(select(Host).order_by(Host.name)):
            cfg = next((c for c in svc.config.hosts if c.name == h.name), None)
            if cfg is None:
                continue
            devices = []
            for g in h.gpus:
                job_worker = workers.get((h.name, g.index))
                sample = samples.get((h.name, g.index))
                foreign = list(sample.foreign_pids) if sample is not None and g.kind == "gpu" else []
                devices.append({
                    "index": g.index, "kind": g.kind, "uuid": g.uuid, "model": g.model,
                    "utilization_pct": g.utilization_pct, "memory_used_mib": g.memory_used_mib,
                    "memory_total_mib": g.memory_total_mib, "verdict": g.verdict,
                    "idle_streak": g.idle_streak,
                    "job": job_worker[0].id if job_worker else None,
                    "rank": job_worker[1].rank if job_worker else None,
                    "foreign": foreign,
                    "zombie": g.verdict == "zombie",
                    "holder": _holder(job_worker, foreign) or _zombie(g),
                })
            out.append({
                "name": h.name, "address": h.address, "owner": h.owner, "reachable": h.reachable,
                "error": h.last_error, "last_probe_at": h.last_probe_at, "devices": devices,
            })
        return out


def _zombie(g) -> str | None:
    """Memory in use with no process listed: say so, it is why the GPU is not idle."""
    if g.verdict != "zombie":
        return None
    return f"zombie memory ({g.memory_used_mib:.0f} MiB used, no process listed)"


def _holder(job_worker, foreign: list[dict]) -> str | None:
    parts = []
    if job_worker is not None:
        j, w = job_worker
        parts.append(f"job {j.id} rank {w.rank if w.rank is not None else '?'} (w{w.wid})")
    for p in foreign:
        parts.append(f"pid {p['pid']} ({p.get('user') or 'unknown user'})")
    return ", ".join(parts) or None


@app.callback(invoke_without_command=True)
def hosts(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Hosts, their GPUs (or CPU slots), utilization, idle verdict and who holds each.

    Probes every GPU host over SSH first, all at once; an unreachable host shows its error.

    Example: gpuflex hosts --json
    """
    if ctx.invoked_subcommand is not None:
        return
    _list(ctx=ctx, as_json=as_json)


@command
def _list(ctx: typer.Context, as_json: bool) -> None:
    svc = obj(ctx).service()
    svc.refresh(probe=True)
    view = pool_view(svc)
    if as_json:
        print_json(view)
        return
    t = Table(title="gpuflex hosts", title_justify="left")
    for col in ("HOST", "ADDRESS", "DEVICE", "MODEL", "UTIL%", "MEM MiB", "VERDICT", "HOLDER"):
        t.add_column(col, no_wrap=col in ("HOST", "DEVICE", "UTIL%", "VERDICT"))
    errors = []
    for h in view:
        if h["reachable"] is False:
            t.add_row(h["name"], h["address"], "-", "-", "-", "-", Text("unreachable", style="red"), "-")
            errors.append(h["error"] or "unreachable")
            continue
        if h["error"]:
            errors.append(h["error"])
        if not h["devices"]:
            t.add_row(h["name"], h["address"], "-", "-", "-", "-",
                      Text("probe failed", style="red") if h["error"] else "no devices", "-")
        for d in h["devices"]:
            mem = "-" if d["memory_used_mib"] is None else \
                f"{d['memory_used_mib']:.0f}/{'?' if d['memory_total_mib'] is None else format(d['memory_total_mib'], '.0f')}"
            util = "-" if d["utilization_pct"] is None else f"{d['utilization_pct']:.0f}"
            model = (d["model"] or "-").removeprefix("NVIDIA ")
            t.add_row(h["name"], h["address"], f"{d['kind']} {d['index']}", model, util, mem,
                      d["verdict"] or "-", Text(d["holder"] or "free"))
    console.print(t)
    for e in errors:
        err_console.print(Text(e, style="red"))


@app.command()
@command
def trust(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The host's name in gpuflex.toml."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Pin without asking."),
) -> None:
    """Show a host's SSH host key fingerprint (SHA256) and pin it in the host's known_hosts.

    gpuflex refuses a host whose key is not pinned: run this once per new or reinstalled host.

    Check the fingerprint out of band first (on the host: ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub).

    Example: gpuflex hosts trust gpu01 --yes
    """
    from gpuflex.hosts.ssh import fingerprint, pin_host_key, pinned_keys, probe_host_key

    cfg = obj(ctx).config().host(name)
    if cfg.is_local:
        raise UsageError(f"host {name!r} is this machine (address \"local\"); there is no SSH key to trust.")
    key = probe_host_key(cfg)
    fp = fingerprint(key)
    where = f"{cfg.address}:{cfg.port}"
    pinned = pinned_keys(cfg)
    if any(k == key for k in pinned):
        console.print(f"{name} ({where}) is already trusted: {key.get_name()} {fp} in {cfg.known_hosts}", markup=False)
        return
    console.print(f"{name} ({where}) offers {key.get_name()} {fp}", markup=False)
    for old in pinned:
        if old.get_name() == key.get_name():
            err_console.print(f"[yellow]warning:[/yellow] {cfg.known_hosts} pins a different key for it: "
                              f"{old.get_name()} {fingerprint(old)}. Pinning replaces it.")
    if not yes and not typer.confirm(f"Pin this key for {name} in {cfg.known_hosts}?", default=False):
        err_console.print("not pinned.")
        raise typer.Exit(1)
    outcome = pin_host_key(cfg, key)
    console.print(f"{outcome} {key.get_name()} {fp} for {name} in {cfg.known_hosts}", markup=False)
