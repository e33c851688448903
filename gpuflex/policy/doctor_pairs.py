"""`gpuflex doctor`'s process-group check between two hosts: which pairs, which backends,
in which order, and what their answers mean. Pure.

Every pair of the hosts checked is one a job could span. Its first host (in the
config's order) plays rank 0: it serves the store on its address as the others reach it
and on a free port of its own, as a job's coordinator and MASTER_PORT do; the second
host connects (gpuflex.hosts.pgcheck). gloo is always checked; nccl where both hosts
have GPUs and torch sees CUDA on both. Pairs run in rounds in which each host is in at
most one pair (`pair_rounds`), so a host never starts more than two torch processes at
once (its own pair's side and nothing else) however big the pool.

A pair's line fails naming where it stopped: "port P on A not reachable from B within
T s (...)" when rank 1 found nothing answering there; "port P on A: cannot listen" when
something else holds it; a formation or all-reduce that failed or timed out names the
backend and the side.
"""

from __future__ import annotations

from gpuflex.config import HostConfig
from gpuflex.policy.doctor_facts import (Finding, HostFacts, HostObservation, PairObservation, PgSide, Unanswered,
                                         Verdict)

# the order of a side's stages (gpuflex.hosts.pgcheck): the earliest failure is the cause
STAGES = ("listen", "import", "connect", "store", "init", "allreduce", "finish", "done")


def pair_name(a: str, b: str) -> str:
    return f"{a}+{b}"


def pair_rounds(names: list[str]) -> list[list[tuple[str, str]]]:
    """Every pair of `names` once (first in the given order first), in rounds where each
    name is in at most one pair: the circle method, len(names) - 1 rounds (len(names) for
    an odd count)."""
    ring: list[str | None] = list(names) + ([None] if len(names) % 2 else [])
    n, order = len(ring), {name: i for i, name in enumerate(names)}
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            x, y = ring[i], ring[n - 1 - i]
            if x is not None and y is not None:
                pairs.append((x, y) if order[x] < order[y] else (y, x))
        rounds.append(sorted(pairs, key=lambda p: (order[p[0]], order[p[1]])))
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return [r for r in rounds if r]


def plan(a: HostConfig, oa: HostObservation, b: HostConfig, ob: HostObservation
         ) -> tuple[tuple[str, ...], list[Finding]]:
    """The backends to check between `a` and `b`, and the lines for those not checked."""
    name = pair_name(a.name, b.name)
    gpu_pair = a.cpu_slots is None and b.cpu_slots is None
    checks = ("pg gloo", "pg nccl") if gpu_pair else ("pg gloo",)
    for host, obs in ((a, oa), (b, ob)):
        if not (isinstance(obs.facts, HostFacts) and obs.facts.usable):
            why = f"not checked: gpuflex or torch is not usable on {host.name}"
            return (), [Finding(name, c, Verdict.SKIP, why) for c in checks]
    if not gpu_pair:
        return ("gloo",), []
    for host, obs in ((a, oa), (b, ob)):
        t = obs.facts.torch
        if not (t.cuda_available and t.nccl):
            why = "sees no CUDA" if not t.cuda_available else "has no nccl"
            return ("gloo",), [Finding(name, "pg nccl", Verdict.SKIP, f"not checked: torch on {host.name} {why}")]
    return ("gloo", "nccl"), []


def pair_findings(obs: PairObservation) -> list[Finding]:
    """One line per backend checked."""
    name = pair_name(obs.a, obs.b)
    where = f"port {obs.port} on {obs.a}"
    fix_net = (f"let {obs.b} reach {obs.a} ({obs.addr}) on TCP ports other than SSH: a job's store and MASTER_PORT "
               f"are free ports on rank 0's host and gloo/nccl connect on ephemeral ports (check firewalls)")

    def every(verdict: Verdict, detail: str, fix: str | None) -> list[Finding]:
        return [Finding(name, f"pg {b}", verdict, detail, fix) for b in obs.backends]

    if obs.sides is None:
        why = obs.port_error.message if obs.port_error else "not run"
        return every(Verdict.FAIL, f"cannot pick a free port on {obs.a}: {why}",
                     f"check that {obs.a}'s python runs (see its python line)")
    s0, s1 = obs.sides
    for rank, side, host in ((0, s0, obs.a), (1, s1, obs.b)):
        if isinstance(side, Unanswered):
            text = (f"rank {rank} on {host} did not answer within {side.timeout_s:g} s" if side.timeout_s is not None
                    else f"rank {rank} on {host}: {side.message}")
            return every(Verdict.FAIL, text, f"run `python -m gpuflex.hosts.pgcheck --help` on {host}")
    both = dict(s0.seconds).keys() & dict(s1.seconds).keys()
    if all(b in both for b in obs.backends):   # formed and all-reduced (a failed goodbye after it is no matter)
        seconds = dict(s0.seconds)
        return [Finding(name, f"pg {b}", Verdict.OK,
                        f"2 ranks all-reduced over {b}: store at {obs.addr}:{obs.port} on {obs.a}, "
                        f"{obs.b} joined ({seconds[b]:.2f} s)") for b in obs.backends]
    side = first_failure(s0, s1)
    host = obs.a if side.rank == 0 else obs.b
    if side.stage == "listen":
        detail = f"{where}: cannot listen ({side.error})"
        if s1.stage == "connect":   # what the other side saw of the port, too
            detail += f"; from {obs.b} it did not answer within {obs.timeout_s:g} s ({s1.error})"
        fix = "give --pg-port a port free on both hosts, or leave the choice to the doctor"
    elif side.stage == "connect":
        detail = f"{where} not reachable from {obs.b} within {obs.timeout_s:g} s ({side.error})"
        fix = fix_net
    elif side.stage == "store" and side.rank == 1:
        detail = f"{obs.b} reached {where}, but no store answered there: {side.error}"
        fix = fix_net
    elif side.stage == "store":
        detail = f"rank 1 on {obs.b} did not come to the store at {where}: {side.error}"
        fix = fix_net
    elif side.stage in ("init", "allreduce"):
        what = "did not form" if side.stage == "init" else "failed its all-reduce"
        detail = f"the {side.backend} group {what} (rank {side.rank} on {host}): {side.error}"
        fix = fix_net if side.backend == "gloo" else f"check NCCL between {obs.a} and {obs.b} (NCCL_DEBUG=INFO)"
    else:
        detail = f"rank {side.rank} on {host} stopped at {side.stage}: {side.error}"
        fix = f"check torch.distributed on {host} (python -m gpuflex.hosts.pgcheck)"
    return [Finding(name, f"pg {b}", Verdict.OK, f"2 ranks all-reduced over {b} ({dict(s0.seconds)[b]:.2f} s)")
            if b in both else Finding(name, f"pg {b}", Verdict.FAIL, detail, fix) for b in obs.backends]


def first_failure(s0: PgSide, s1: PgSide) -> PgSide:
    """Of two sides not both done, the failed one that stopped earliest (rank 0 first
    among equals): a rank 0 that timed out waiting for rank 1 names rank 1's cause."""
    failed = [s for s in (s0, s1) if not s.ok] or [s0]
    return min(failed, key=lambda s: (_stage_index(s.stage), s.rank))


def _stage_index(stage: str) -> int:
    return STAGES.index(stage) if stage in STAGES else len(STAGES)
