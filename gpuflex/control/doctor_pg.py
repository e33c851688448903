"""`gpuflex doctor`'s process-group check: gpuflex.hosts.pgcheck on both hosts of each
pair, as a job's first two workers would meet (which pairs, which backends and what the
answers mean: gpuflex.policy.doctor_pairs).

Rank 0's host serves the store at its address as the other hosts reach it
(launch.store_address) on a free port picked there the way a job's store and
MASTER_PORT are (launch.free_port), or on `--pg-port`. Each wait inside is bounded by
`[jobs] pg_timeout_s`, the process-group timeout a job's workers use, and the sides'
first meeting by that plus the hosts' `command_timeout_s` (the other side's python and
torch may start that much later); each side's command by all its waits (pgcheck's
watchdog prints where it was stuck before the transport gives up).
"""

from __future__ import annotations

from gpuflex.config import Config, HostConfig
from gpuflex.control.doctor_hosts import SLACK_S, failed, last_json, unanswered
from gpuflex.control.launch import free_port, store_address
from gpuflex.errors import TransportError
from gpuflex.hosts.fanout import run_bounded
from gpuflex.hosts.pgcheck import budget_s
from gpuflex.hosts.transport import Transport
from gpuflex.policy.doctor_facts import Finding, HostObservation, PairObservation, PgSide, Unanswered
from gpuflex.policy.doctor_pairs import pair_findings, pair_name, pair_rounds, plan


def check_pairs(config: Config, hosts: list[HostConfig], observed: dict[str, HostObservation],
                transports: dict[str, Transport], pg_port: int | None) -> list[Finding]:
    """The pairs' lines, in the config's order of pairs; the pairs themselves run in
    rounds (each host in one pair at a time), the pairs of a round at once."""
    by_name = {h.name: h for h in hosts}
    timeout = float(config.jobs.pg_timeout_s)
    lines: dict[tuple[str, str], list[Finding]] = {}
    backends: dict[tuple[str, str], tuple[str, ...]] = {}
    for i, a in enumerate(hosts):
        for b in hosts[i + 1:]:
            backends[a.name, b.name], lines[a.name, b.name] = plan(a, observed[a.name], b, observed[b.name])
    for rnd in pair_rounds([h.name for h in hosts]):
        todo = [p for p in rnd if backends[p]]
        if not todo:
            continue
        tasks = {pair_name(*p): _pair_task(transports[p[0]], transports[p[1]], backends[p], timeout, pg_port)
                 for p in todo}
        # picking the port, then both sides (run_pair's own backstop: their bound + SLACK_S)
        bound = max(side_bound(by_name[p[0]], by_name[p[1]], timeout, len(backends[p])) for p in todo) + \
            max(by_name[p[0]].command_timeout_s for p in todo) + 2 * SLACK_S
        got = run_bounded(tasks, bound)
        for p in todo:
            r = got[pair_name(*p)]
            obs = r.value if r.ok else PairObservation(
                p[0], p[1], store_address(by_name[p[0]]), timeout, backends[p],
                sides=(unanswered(p[0], r.error), unanswered(p[1], r.error)))
            lines[p] = pair_findings(obs) + lines[p]
    return [f for p in lines for f in lines[p]]


def start_s(a: HostConfig, b: HostConfig) -> float:
    """How long either side's python and torch may take to start: a host's command timeout."""
    return max(a.command_timeout_s, b.command_timeout_s)


def side_bound(a: HostConfig, b: HostConfig, timeout: float, backends: int) -> float:
    """How long one side of the pair a, b may take: python and torch starting, then its waits."""
    return budget_s(timeout, backends, start_s(a, b))


def _pair_task(ta: Transport, tb: Transport, backends: tuple[str, ...], timeout: float, pg_port: int | None):
    return lambda: run_pair(ta, tb, backends, timeout, pg_port)


def run_pair(ta: Transport, tb: Transport, backends: tuple[str, ...], timeout: float,
             pg_port: int | None) -> PairObservation:
    """Rank 0 on `ta`'s host, rank 1 on `tb`'s, started at once."""
    a, b = ta.host, tb.host
    addr = store_address(a)
    port = pg_port
    if port is None:
        try:
            port = free_port(ta)
        except TransportError as e:
            return PairObservation(a.name, b.name, addr, timeout, backends, port_error=unanswered(a.name, e))
        except ValueError:
            return PairObservation(a.name, b.name, addr, timeout, backends,
                                   port_error=Unanswered(f"{a.python} printed no port"))
    start = start_s(a, b)
    got = run_bounded({"0": lambda: side(ta, 0, addr, port, timeout, start, backends),
                       "1": lambda: side(tb, 1, addr, port, timeout, start, backends)},
                      side_bound(a, b, timeout, len(backends)) + SLACK_S)
    sides = tuple(r.value if r.ok else unanswered(h.name, r.error) for r, h in zip(got.values(), (a, b)))
    return PairObservation(a.name, b.name, addr, timeout, backends, port=port, sides=sides)


def side(t: Transport, rank: int, addr: str, port: int, timeout: float, start: float,
         backends: tuple[str, ...]) -> PgSide | Unanswered:
    h = t.host
    budget = budget_s(timeout, len(backends), start)
    argv = [h.python, "-m", "gpuflex.hosts.pgcheck", "--rank", str(rank), "--addr", addr, "--port", str(port),
            "--timeout", f"{timeout:g}", "--start", f"{start:g}", "--backends", ",".join(backends),
            "--budget", f"{budget:g}"]
    try:
        res = t.run(argv, timeout=budget + SLACK_S)
    except TransportError as e:
        return unanswered(h.name, e)
    data = last_json(res)
    if data is None:
        return Unanswered(failed(res))
    try:
        return PgSide.parse(data)
    except ValueError as e:
        return Unanswered(str(e))

