"""`gpuflex doctor`: ask every configured host (or those named) what a job needs there,
all hosts at once, each question bounded, and judge the answers.

What is asked of each host is doctor_hosts.py's, of each pair of hosts doctor_pg.py's;
the verdicts are gpuflex.policy.doctor's and gpuflex.policy.doctor_pairs'. Nothing is
installed on a host or left behind there, and no database is opened.
"""

from __future__ import annotations

import importlib.metadata

import gpuflex
from gpuflex.config import Config, HostConfig
from gpuflex.control import doctor_pg
from gpuflex.control.doctor_hosts import bind, host_bound, message, observation, observe
from gpuflex.errors import TransportError, UsageError
from gpuflex.hosts.fanout import run_bounded
from gpuflex.hosts.transport import Transport, TransportFactory, make_transport
from gpuflex.policy.doctor import host_findings
from gpuflex.policy.doctor_facts import Finding, HostObservation, Reach, Reference


def select_hosts(config: Config, names: list[str] | None) -> list[HostConfig]:
    """The hosts named (each once, in the config's order), or all; UsageError naming the
    configured hosts for a name that is not one of them."""
    if not names:
        return list(config.hosts)
    known = {h.name for h in config.hosts}
    unknown = [n for n in dict.fromkeys(names) if n not in known]
    if unknown:
        listed = ", ".join(h.name for h in config.hosts)
        raise UsageError(f"no host named {', '.join(map(repr, unknown))} in {config.path} (configured: {listed}).")
    return [h for h in config.hosts if h.name in names]


def reference() -> Reference:
    """This machine's gpuflex and torch versions (torch's read from its metadata: the
    control host need not import it)."""
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    return Reference(gpuflex=gpuflex.__version__, torch=torch)


def run_doctor(config: Config, names: list[str] | None = None, *, pg_port: int | None = None,
               transports: TransportFactory = make_transport) -> list[Finding]:
    """Every check's line: each host's (in the config's order), then each pair's. Raises
    UsageError (before touching any host) for an unknown host name."""
    hosts = select_hosts(config, names)
    made: dict[str, Transport] = {}
    observed: dict[str, HostObservation] = {}
    for h in hosts:
        try:
            made[h.name] = transports(h)
        except TransportError as e:   # a kind no module registers: that host's line, not the run's end
            observed[h.name] = HostObservation(Reach(h.transport, stage="connect", error=message(h.name, e)))
    try:
        ref = reference()
        reached = [h for h in hosts if h.name in made]
        if reached:
            results = run_bounded({h.name: bind(observe, made[h.name]) for h in reached},
                                  max(host_bound(h) for h in reached))
            observed.update({h.name: observation(h, results[h.name]) for h in reached})
        findings = [f for h in hosts for f in host_findings(h, observed[h.name], ref)]
        return findings + doctor_pg.check_pairs(config, hosts, observed, made, pg_port)
    finally:
        for t in made.values():
            t.close()
