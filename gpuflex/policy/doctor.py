"""What `gpuflex doctor` makes of what it found on a host: facts in, findings out. Pure.

A *check* is one line of the doctor's table for a host (pairs of hosts: doctor_pairs.py);
its *verdict* is ok, warn, fail or skip; a failure or a warning carries a one-line *fix*.
The facts are gpuflex.policy.doctor_facts', gathered by `gpuflex.control.doctor`.

The rules (README's "gpuflex doctor" and docs/architecture.md say the same):
- ssh: the host answers, the key it offers is the one its known_hosts pins (else fail,
  fix `gpuflex hosts trust NAME`) and the login works; the local host passes as "local".
- python, gpuflex, torch: the host's `python` runs the doctor's probe within
  `command_timeout_s`. gpuflex must be importable there at exactly the control host's
  version (fail otherwise: the control host drives hostops, the relay and the
  coordinator there through argv and JSON that only the version names). torch must be
  importable, at least TORCH_MIN (pyproject's `torch>=2.11`) and with gloo (fail); its
  major.minor differing from the control host's is a warning: whether two hosts' torches
  form a group is what the pair check finds out.
- nvidia-smi, gpus, cuda (skipped on a `cpu:N` host: "no GPUs configured"): the probe's
  queries (gpuflex.hosts.probe) answer and parse (fail), and lines that are not rows
  warn (the probe skips them); every configured GPU is listed (fail); torch sees CUDA
  and as many devices as nvidia-smi lists (warn: a job there still runs, on the CPU).
- workdir: exists or can be created, is a directory we can write, and keeps the 0700 /
  0600 modes gpuflex gives its own directories and files (fail); not ours, or writable
  by others (warn). disk: free space there under DISK_WARN_BYTES warns, under
  DISK_FAIL_BYTES fails.
- clock: the host's clock against this one's, less the measurement's half round trip:
  more than CLOCK_WARN_S off warns, more than CLOCK_FAIL_S fails (each host's supervisor
  keeps a run's time limit by its own clock, from a deadline set here).
"""

from __future__ import annotations

import dataclasses

from gpuflex.config import HostConfig
from gpuflex.policy.doctor_facts import (CLOCK_FAIL_S, CLOCK_WARN_S, DISK_FAIL_BYTES, DISK_WARN_BYTES, GIB,
                                         TORCH_MIN, Clock, Finding, HostFacts, HostObservation, Reach, Reference,
                                         Smi, Unanswered, Verdict, version_tuple)

CHECKS = ("ssh", "python", "gpuflex", "torch", "nvidia-smi", "gpus", "cuda", "workdir", "disk", "clock")
GPU_CHECKS = ("nvidia-smi", "gpus", "cuda")
PYTHON_CHECKS = ("gpuflex", "torch")


@dataclasses.dataclass(frozen=True)
class Line:
    """Makes a host's findings."""

    host: str

    def ok(self, check: str, detail: str) -> Finding:
        return Finding(self.host, check, Verdict.OK, detail)

    def warn(self, check: str, detail: str, fix: str) -> Finding:
        return Finding(self.host, check, Verdict.WARN, detail, fix)

    def fail(self, check: str, detail: str, fix: str) -> Finding:
        return Finding(self.host, check, Verdict.FAIL, detail, fix)

    def skip(self, check: str, detail: str) -> Finding:
        return Finding(self.host, check, Verdict.SKIP, detail)


def host_findings(host: HostConfig, obs: HostObservation, ref: Reference) -> list[Finding]:
    """The host's lines, in the order of CHECKS."""
    line = Line(host.name)
    out = [ssh(line, host, obs.reach)]
    if obs.reach.error is not None:
        return out + [line.skip(c, f"not checked: {host.name} not reachable") for c in CHECKS[1:]]
    out += python_lines(line, host, obs.facts, ref)
    out += gpu_lines(line, host, obs.smi, obs.facts)
    out += workdir_lines(line, obs.facts)
    out.append(clock(line, host, obs.clock))
    return out


def ssh(line: Line, host: HostConfig, reach: Reach) -> Finding:
    if reach.how == "local" and reach.error is None:
        return line.ok("ssh", f"local: this machine, as {reach.user}")
    trust = f"gpuflex hosts trust {host.name}"
    if reach.key_state == "unknown":
        return line.fail("ssh", f"{reach.where} offers host key {reach.key}, which {host.known_hosts} does not pin",
                         f"verify the fingerprint on the host (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub), "
                         f"then: {trust}")
    if reach.key_state == "mismatch":
        return line.fail("ssh", f"{reach.where} offers host key {reach.key}, but {host.known_hosts} pins "
                                f"{reach.pinned}: the host was reinstalled, or someone is in the middle",
                         f"find out which, then: {trust}")
    if reach.error is not None:
        if reach.stage == "login":
            fix = f"check user and identity_file of {host.name} in gpuflex.toml"
        else:
            fix = f"check address and port of {host.name} in gpuflex.toml, and that sshd runs there"
        return line.fail("ssh", reach.error, fix)
    key = f", host key {reach.key} pinned" if reach.key else ""
    return line.ok("ssh", f"{reach.where or reach.how} as {reach.user}{key}")


def unanswered(program: str, u: Unanswered) -> str:
    if u.timeout_s is not None:
        return f"{program} did not answer within {u.timeout_s:g} s"
    return f"{program}: {u.message}"


def python_lines(line: Line, host: HostConfig, facts: HostFacts | Unanswered | None, ref: Reference) -> list[Finding]:
    py = host.python
    if facts is None:
        return [line.skip(c, "not checked") for c in ("python", *PYTHON_CHECKS)]
    if isinstance(facts, Unanswered):
        fix = (f"check that `{py} -c 'import torch'` finishes on {host.name}" if facts.timeout_s is not None
               else f"set python of {host.name} in gpuflex.toml to an interpreter with gpuflex and torch")
        return [line.fail("python", unanswered(py, facts), fix),
                *(line.skip(c, f"not checked: {py} failed") for c in PYTHON_CHECKS)]
    where = "" if facts.executable == py else f" ({facts.executable})"
    out = [line.ok("python", f"{py}: Python {facts.python_version}{where}")]
    install = f"install gpuflex {ref.gpuflex} into {py} on {host.name}"
    if facts.gpuflex_error is not None:
        out.append(line.fail("gpuflex", f"not importable by {py}: {facts.gpuflex_error}", install))
    elif facts.gpuflex_version != ref.gpuflex:
        out.append(line.fail("gpuflex", f"{facts.gpuflex_version} on {host.name}, {ref.gpuflex} here "
                                        f"(must match: hostops, relay and coordinator speak one version)", install))
    else:
        out.append(line.ok("gpuflex", f"{facts.gpuflex_version}, same as here ({facts.gpuflex_path})"))
    out.append(torch_line(line, host, facts, ref))
    return out


def torch_line(line: Line, host: HostConfig, facts: HostFacts, ref: Reference) -> Finding:
    t, py = facts.torch, host.python
    need = ".".join(map(str, TORCH_MIN))
    if t.error is not None:
        return line.fail("torch", f"not importable by {py}: {t.error}", f"install torch>={need} into {py}")
    if version_tuple(t.version) < TORCH_MIN:
        return line.fail("torch", f"{t.version}: gpuflex needs torch>={need}", f"install torch>={need} into {py}")
    if not t.gloo:
        return line.fail("torch", f"{t.version} without gloo (torch.distributed)",
                         f"install a torch build with torch.distributed into {py}")
    mine, theirs = version_tuple(ref.torch)[:2], version_tuple(t.version)[:2]
    if not mine:
        return line.ok("torch", f"{t.version} (no torch here to compare)")
    if mine != theirs:
        return line.warn("torch", f"{t.version} on {host.name}, {ref.torch} here: a job across hosts of "
                                  "different torch releases may not form (see the pg checks)",
                         f"install torch {'.'.join(map(str, mine))}.* into {py} on {host.name}")
    return line.ok("torch", f"{t.version} (here: {ref.torch})")


def gpu_lines(line: Line, host: HostConfig, smi: Smi | Unanswered | None,
              facts: HostFacts | Unanswered | None) -> list[Finding]:
    if host.cpu_slots is not None:
        return [line.skip(c, f'no GPUs configured (gpus = "{host.gpus}")') for c in GPU_CHECKS]
    smi_line, found = nvidia_smi(line, host, smi)
    out = [smi_line]
    if found is None:
        out.append(line.skip("gpus", "not checked: nvidia-smi failed"))
    else:
        out.append(gpus(line, host, found))
    out.append(cuda(line, host, facts, found, smi.driver if isinstance(smi, Smi) else None))
    return out


def nvidia_smi(line: Line, host: HostConfig, smi: Smi | Unanswered | None
               ) -> tuple[Finding, list[tuple[int, str | None]] | None]:
    """The nvidia-smi line and the GPUs it listed (None: it failed)."""
    prog = host.nvidia_smi
    fix = f"run `{prog} -L` on {host.name}: is the driver loaded? (a host without GPUs: gpus = \"cpu:N\")"
    if smi is None:
        return line.skip("nvidia-smi", "not checked"), None
    if isinstance(smi, Unanswered):
        return line.fail("nvidia-smi", unanswered(prog, smi), fix), None
    if smi.missing:
        return line.fail("nvidia-smi", f"{prog} not found on {host.name}",
                         f'set nvidia_smi of {host.name} in gpuflex.toml, or gpus = "cpu:N" for a host without GPUs'), None
    if smi.error is not None:
        return line.fail("nvidia-smi", smi.error, fix), None
    models = sorted({m or "?" for _, m in smi.gpus})
    detail = (f"driver {smi.driver or '?'}; {len(smi.gpus)} GPU(s): {', '.join(models) or 'none'}; "
              f"{smi.apps} compute process(es)")
    if smi.stray:
        return line.warn("nvidia-smi", f"{detail}; {len(smi.stray)} line(s) that are not rows, skipped: "
                                       f"{smi.stray[0][:120]!r}", fix), list(smi.gpus)
    if smi.driver is None:
        return line.warn("nvidia-smi", f"{detail}; the driver_version query gave nothing", fix), list(smi.gpus)
    return line.ok("nvidia-smi", detail), list(smi.gpus)


def gpus(line: Line, host: HostConfig, found: list[tuple[int, str | None]]) -> Finding:
    listed = sorted(i for i, _ in found)
    fix = f"set gpus of {host.name} in gpuflex.toml to GPUs nvidia-smi lists (or \"all\")"
    if not listed:
        return line.fail("gpus", "nvidia-smi lists no GPU", f'{fix}; a host without GPUs: gpus = "cpu:N"')
    if host.gpus == "all":
        return line.ok("gpus", f"all: {listed}")
    missing = sorted(set(host.gpus) - set(listed))
    if missing:
        return line.fail("gpus", f"configured {list(host.gpus)}, but nvidia-smi lists {listed}: no GPU {missing}", fix)
    return line.ok("gpus", f"configured {list(host.gpus)} of {listed}")


def cuda(line: Line, host: HostConfig, facts: HostFacts | Unanswered | None,
         found: list[tuple[int, str | None]] | None, driver: str | None) -> Finding:
    if not isinstance(facts, HostFacts) or facts.torch.error is not None:
        return line.skip("cuda", "not checked: torch failed")
    t = facts.torch
    where = f"driver {driver}" if driver else "driver ?"
    if not t.cuda_available:
        if t.cuda is None:
            return line.warn("cuda", f"torch {t.version} is built without CUDA ({where}): jobs here run on the CPU",
                             f"install a CUDA build of torch into {host.python}")
        why = f": {t.cuda_error}" if t.cuda_error else ""
        return line.warn("cuda", f"torch {t.version} (CUDA {t.cuda}) sees no CUDA device ({where}){why}",
                         f"check the driver against CUDA {t.cuda} (nvidia-smi's header names the newest it runs)")
    if found is not None and t.device_count < len(found):
        return line.warn("cuda", f"torch sees {t.device_count} of the {len(found)} GPUs nvidia-smi lists "
                                 f"(CUDA {t.cuda}, {where})",
                         f"is CUDA_VISIBLE_DEVICES set in {host.name}'s login environment?")
    return line.ok("cuda", f"CUDA {t.cuda}, {t.device_count} device(s), {where}")


def workdir_lines(line: Line, facts: HostFacts | Unanswered | None) -> list[Finding]:
    if not isinstance(facts, HostFacts):
        return [line.skip(c, "not checked: python failed") for c in ("workdir", "disk")]
    w = facts.workdir
    fix = f"set workdir of {line.host} in gpuflex.toml to a directory of yours there, or fix {w.path}"
    if w.error is not None:
        out = line.fail("workdir", f"{w.path}: {w.error}", fix)
    elif not w.modes_kept:
        out = line.fail("workdir", f"{w.path}: modes 0700/0600 do not hold there (a filesystem without POSIX modes?)",
                        "choose a workdir on a filesystem that keeps file modes")
    elif w.existed and not w.owned:
        out = line.warn("workdir", f"{w.path} belongs to another user", fix)
    elif w.existed and w.mode is not None and w.mode & 0o022:
        out = line.warn("workdir", f"{w.path} is mode {w.mode:04o}: others can write in it", f"chmod 700 {w.path}")
    elif w.existed:
        out = line.ok("workdir", f"{w.path} (mode {w.mode:04o}, ours, writable)")
    else:
        out = line.ok("workdir", f"{w.path} (not there yet; can be created 0700)")
    if w.error is not None:
        return [out, line.skip("disk", "not checked: workdir failed")]
    return [out, disk(line, facts)]


def disk(line: Line, facts: HostFacts) -> Finding:
    free, path = facts.workdir.free_bytes, facts.workdir.path
    if free is None:
        return line.skip("disk", f"free space unknown (no filesystem at or above {path})")
    text = f"{free / GIB:.1f} GiB free at {path}"
    fix = f"free space on {path}'s filesystem, or move workdir"
    if free < DISK_FAIL_BYTES:
        return line.fail("disk", f"{text}; under {DISK_FAIL_BYTES >> 20} MiB", fix)
    if free < DISK_WARN_BYTES:
        return line.warn("disk", f"{text}; under {DISK_WARN_BYTES / GIB:g} GiB", fix)
    return line.ok("disk", text)


def clock(line: Line, host: HostConfig, c: Clock | Unanswered | None) -> Finding:
    if host.is_local:
        return line.ok("clock", "this machine's own clock")
    if c is None:
        return line.skip("clock", "not checked")
    if isinstance(c, Unanswered):
        return line.warn("clock", unanswered("date", c), f"check that `date +%s.%N` runs on {host.name}")
    off = abs(c.offset_s) - c.uncertainty_s
    text = f"{c.offset_s:+.3f} s from this machine's (±{c.uncertainty_s:.3f} s)"
    fix = f"run NTP (chrony, systemd-timesyncd) on {host.name} and here"
    if off > CLOCK_FAIL_S:
        return line.fail("clock", f"{text}: over {CLOCK_FAIL_S:g} s (time limits are kept by the host's clock)", fix)
    if off > CLOCK_WARN_S:
        return line.warn("clock", f"{text}: over {CLOCK_WARN_S:g} s", fix)
    return line.ok("clock", text)
