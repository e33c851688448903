"""Pool commands: `gpuflex hosts` (probe and list) and `gpuflex hosts trust NAME`."""

from __future__ import annotations

import typer
from rich.table import Table
from rich.text import Text

from gpuflex.cli.common import command, console, err_console, obj, print_json
from gpuflex.errors import UsageError
from gpuflex.policy.speeds import speed_hint

app = typer.Typer(
    help="Hosts, their GPUs (or CPU slots), utilization, idle verdict and who holds each.\n\n"
         "Example: gpuflex hosts --json",
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="hosts")


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
    view = with_speeds(svc.hosts(), {h.name: h.speed for h in obj(ctx).config().hosts})
    if as_json:
        print_json(view)
        return
    t = Table(title="gpuflex hosts", title_justify="left")
    for col in ("HOST", "ADDRESS", "DEVICE", "MODEL", "SPEED", "UTIL%", "MEM MiB", "VERDICT", "HOLDER"):
        t.add_column(col, no_wrap=col in ("HOST", "DEVICE", "UTIL%", "VERDICT"))
    errors = []
    for h in view:
        if h["reachable"] is False:
            t.add_row(h["name"], h["address"], "-", "-", "-", "-", "-", Text("unreachable", style="red"), "-")
            errors.append(h["error"] or "unreachable")
            continue
        if h["error"]:
            errors.append(h["error"])
        if not h["devices"]:
            t.add_row(h["name"], h["address"], "-", "-", "-", "-", "-",
                      Text("probe failed", style="red") if h["error"] else "no devices", "-")
        for d in h["devices"]:
            mem = "-" if d["memory_used_mib"] is None else \
                f"{d['memory_used_mib']:.0f}/{'?' if d['memory_total_mib'] is None else format(d['memory_total_mib'], '.0f')}"
            util = "-" if d["utilization_pct"] is None else f"{d['utilization_pct']:.0f}"
            model = (d["model"] or "-").removeprefix("NVIDIA ")
            t.add_row(h["name"], h["address"], f"{d['kind']} {d['index']}", model, f"{d['speed']:g}", util, mem,
                      d["verdict"] or "-", Text(d["holder"] or "free"))
    console.print(t)
    for e in errors:
        err_console.print(Text(e, style="red"))


def with_speeds(view: list[dict], host_speeds: dict[str, float | None]) -> list[dict]:
    """Each device with "speed": the first guess of its relative speed that a worker on it
    starts from (issue 12: the host's `speed`, else its model's entry in
    gpuflex.policy.speeds' table, else 1.0) until the runtime measures it."""
    return [{**h, "devices": [{**d, "speed": speed_hint(d.get("model"), host_speeds.get(h["name"]))}
                              for d in h["devices"]]} for h in view]


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
            err_console.print(Text.assemble(("warning:", "yellow"), f" {cfg.known_hosts} pins a different key for it: "
                                            f"{old.get_name()} {fingerprint(old)}. Pinning replaces it."))
    if not yes and not typer.confirm(f"Pin this key for {name} in {cfg.known_hosts}?", default=False):
        err_console.print("not pinned.")
        raise typer.Exit(1)
    outcome = pin_host_key(cfg, key)
    console.print(f"{outcome} {key.get_name()} {fp} for {name} in {cfg.known_hosts}", markup=False)
