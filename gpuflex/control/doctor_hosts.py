"""What `gpuflex doctor` asks each host, and the helpers its pair check shares.

Per host, through its transport (nothing is installed or left behind):
- reach: the SSH server's key against known_hosts (gpuflex.hosts.ssh), then `id -un`
  (the login user); the local host is "local".
- one run of its `python` with gpuflex.hosts.hostfacts' source on stdin (so it answers
  where gpuflex is missing): python, gpuflex and torch versions, CUDA as torch sees it,
  the workdir tried and its free space; bounded by the host's `command_timeout_s`.
- the probe's nvidia-smi queries (gpuflex.hosts.probe) and `--query-gpu=driver_version`,
  on GPU hosts; `date +%s.%N` three times for the clock (the sample with the shortest
  round trip, against this machine's clock at its midpoint).
These run at once, on the host's one pooled connection; every failure to get an answer
becomes an `Unanswered` (with the bound, for one that did not finish in time).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from gpuflex.config import HostConfig
from gpuflex.control.launch import local_user
from gpuflex.errors import CommandTimeout, TransportError
from gpuflex.hosts import hostfacts
from gpuflex.hosts.fanout import Result, run_bounded
from gpuflex.hosts.probe import APP_QUERY, CSV_FORMAT, EXIT_NO_DEVICES, GPU_QUERY, NO_DEVICES, parse_apps, parse_gpus
from gpuflex.hosts.transport import CommandResult, Transport
from gpuflex.policy.doctor_facts import Clock, HostFacts, HostObservation, Reach, Smi, Unanswered

CLOCK_SAMPLES = 3
SLACK_S = 5.0   # a backstop's margin over the bounds it backs (the transports' own timeouts end first)


def bind(fn: Callable[[Transport], Any], t: Transport) -> Callable[[], Any]:
    """`fn(t)`, to be called later (run_bounded's tasks take no argument)."""
    return lambda: fn(t)


def host_bound(h: HostConfig) -> float:
    """A backstop for one host's observation: the key probe (connect, banner, key
    exchange) and the login, then its probes at once (the clock's samples one after
    another, each bounded by the host's command timeout)."""
    reach = 4 * h.connect_timeout_s + h.command_timeout_s
    return reach + CLOCK_SAMPLES * h.command_timeout_s + 2 * SLACK_S


def observation(h: HostConfig, r: Result[HostObservation]) -> HostObservation:
    if r.ok:
        return r.unwrap()
    return HostObservation(Reach(h.transport, stage="connect", error=message(h.name, r.error)))


def message(host: str, e: BaseException | None) -> str:
    """A transport error's text without the "host: " its table line already shows."""
    text = str(e)
    return text[len(host) + 2:] if text.startswith(f"{host}: ") else text


def unanswered(host: str, e: TransportError) -> Unanswered:
    return Unanswered(message(host, e), e.timeout_s if isinstance(e, CommandTimeout) else None)


def observe(t: Transport) -> HostObservation:
    h = t.host
    reach = reach_host(t)
    if reach.error is not None:
        return HostObservation(reach)
    probes: dict[str, Callable[[], Any]] = {"facts": lambda: ask_python(t)}
    if h.cpu_slots is None:
        probes["smi"] = lambda: ask_smi(t)
    if not h.is_local:
        probes["clock"] = lambda: ask_clock(t)
    got = run_bounded(probes, CLOCK_SAMPLES * h.command_timeout_s + SLACK_S)
    answer = {k: (r.value if r.ok else unanswered(h.name, r.error)) for k, r in got.items()}
    return HostObservation(reach, answer["facts"], answer.get("smi"), answer.get("clock"))


def reach_host(t: Transport) -> Reach:
    h = t.host
    if h.is_local:
        return Reach("local", user=local_user())
    where = f"{h.address}:{h.port}"
    key = None
    if h.transport == "ssh":
        from gpuflex.hosts.ssh import fingerprint, pinned_keys, probe_host_key

        try:
            offered = probe_host_key(h)
            pinned = pinned_keys(h)
        except TransportError as e:
            return Reach("ssh", where=where, stage="connect", error=message(h.name, e))
        key = f"{offered.get_name()} {fingerprint(offered)}"
        if not any(k == offered for k in pinned):
            same = [k for k in pinned if k.get_name() == offered.get_name()]
            state = "mismatch" if same else "unknown"
            return Reach("ssh", where=where, key=key, key_state=state, stage="key", error="host key not pinned",
                         pinned=f"{same[0].get_name()} {fingerprint(same[0])}" if same else None)
    try:
        res = t.run(["id", "-un"], timeout=h.connect_timeout_s + h.command_timeout_s)
    except TransportError as e:
        return Reach(h.transport, where=where, key=key, stage="login", error=message(h.name, e))
    user = res.stdout.strip() if res.returncode == 0 else None
    return Reach(h.transport, user=user or "?", where=where, key=key,
                 key_state="pinned" if key else None)


def last_json(res: CommandResult) -> Any:
    """The last line of stdout that is a JSON object (a sitecustomize or a warning may
    print before it); None when there is none."""
    for line in reversed(res.stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def failed(res: CommandResult) -> str:
    text = " ".join((res.stderr.strip() or res.stdout.strip()).split())[-300:]
    what = "not found" if res.returncode == 127 else f"exit {res.returncode}"
    return f"{what}: {text}" if text else what


FACTS_SOURCE = Path(hostfacts.__file__)


def ask_python(t: Transport) -> HostFacts | Unanswered:
    h = t.host
    try:
        res = t.run([h.python, "-", h.workdir], input=FACTS_SOURCE.read_text(), timeout=h.command_timeout_s)
    except TransportError as e:
        return unanswered(h.name, e)
    data = last_json(res)
    if res.returncode != 0 or data is None:
        return Unanswered(failed(res))
    try:
        return HostFacts.parse(data)
    except ValueError as e:
        return Unanswered(str(e))


def ask_smi(t: Transport) -> Smi | Unanswered:
    h = t.host
    queries = {"gpus": [h.nvidia_smi, f"--query-gpu={GPU_QUERY}", CSV_FORMAT],
               "apps": [h.nvidia_smi, f"--query-compute-apps={APP_QUERY}", CSV_FORMAT],
               "driver": [h.nvidia_smi, "--query-gpu=driver_version", "--format=csv,noheader"]}
    got = run_bounded({k: bind(lambda tt, argv=argv: tt.run(argv, timeout=h.command_timeout_s), t)
                       for k, argv in queries.items()}, h.command_timeout_s + SLACK_S)
    for r in got.values():
        if not r.ok:
            return unanswered(h.name, r.error)
    return read_smi(h.nvidia_smi, got["gpus"].unwrap(), got["apps"].unwrap(), got["driver"].unwrap())


def read_smi(prog: str, gpus: CommandResult, apps: CommandResult, driver: CommandResult) -> Smi:
    """The three answers as the probe reads them, with the lines it would skip."""
    if 127 in (gpus.returncode, apps.returncode):
        return Smi(missing=True)
    if gpus.returncode == EXIT_NO_DEVICES or NO_DEVICES in gpus.stdout:
        return Smi(driver=None)
    stray: list[str] = []
    for name, res, parse in (("--query-gpu", gpus, parse_gpus), ("--query-compute-apps", apps, parse_apps)):
        if res.returncode != 0:
            return Smi(error=f"{prog} {name} failed ({failed(res)})")
        lines = [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]
        bad = [ln for ln in lines if not parse(ln)]
        if lines and len(bad) == len(lines):
            return Smi(error=f"cannot parse what {prog} {name} printed: {bad[0][:120]!r}")
        stray += bad
    rows = parse_gpus(gpus.stdout)
    # one line per GPU, all alike; "[N/A]" or an error text is no version
    versions = {ln.strip() for ln in driver.stdout.splitlines() if ln.strip()} if driver.returncode == 0 else set()
    ok = sorted(v for v in versions if v[:1].isdigit())
    return Smi(gpus=tuple((g.index, g.name) for g in rows), apps=len(parse_apps(apps.stdout)),
               driver=", ".join(ok) or None, stray=tuple(stray))


def ask_clock(t: Transport) -> Clock | Unanswered:
    """The host's clock minus this machine's: of CLOCK_SAMPLES runs of `date +%s.%N`, the
    one with the shortest round trip, against this clock at its midpoint."""
    h = t.host
    best: Clock | None = None
    for _ in range(CLOCK_SAMPLES):
        start, t0 = time.time(), time.monotonic()
        try:
            res = t.run(["date", "+%s.%N"], timeout=h.command_timeout_s)
        except TransportError as e:
            return unanswered(h.name, e)
        rtt = time.monotonic() - t0
        text = res.stdout.strip()
        try:
            remote, extra = float(text), 0.0
        except ValueError:
            try:   # a date without %N (busybox, BSD): whole seconds
                remote, extra = float(text.split(".")[0]), 1.0
            except ValueError:
                return Unanswered(f"`date +%s.%N` printed {text[:60]!r} ({failed(res)})")
        sample = Clock(remote - (start + rtt / 2), rtt / 2 + extra)
        if best is None or sample.uncertainty_s < best.uncertainty_s:
            best = sample
    return best if best is not None else Unanswered("no sample")
