"""`gpuflex doctor` end to end: how nvidia-smi's answers are read, a host whose transport
cannot be made, then the sshd bed (tests/sshbed.py: real sshd on 127.0.0.2..4,
each host with its own fake nvidia-smi and workdir), healthy and with a fault per host,
a port taken between two hosts, the built-in local pool, and bad input.

Each doctor run here is one CLI process; the runs over the bed are module-scoped (every
test reads the one run it needs), as each starts torch on every host it checks."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from gpuflex.config import HostConfig, parse_config
from gpuflex.control.doctor import run_doctor
from gpuflex.control.doctor_hosts import read_smi
from gpuflex.errors import TransportError
from gpuflex.hosts.transport import CommandResult, Transport
from gpuflex.policy.doctor_facts import Smi
from tests import TESTS
from tests.conftest import GpuflexCLI
from tests.sshbed import SshBed, host_toml, ssh_hosts  # noqa: F401 (fixtures)

PG_TIMEOUT_S = 3
RUN_GUARD_S = 300   # a hang guard for the CLI process, not a timing assertion


def doctor_config(bed: SshBed, path: Path, hosts_toml: str) -> Path:
    path.write_text(f'[database]\nurl = "sqlite:///{path.parent}/g.db"\n\n'
                    f"[jobs]\npg_timeout_s = {PG_TIMEOUT_S}\n\n" + hosts_toml)
    return path


def rows(findings: list[dict]) -> dict[tuple[str, str], dict]:
    return {(f["host"], f["check"]): f for f in findings}


def table_rows(stdout: str) -> dict[tuple[str, str], dict]:
    """The table's rows (printed wide enough not to wrap) as the JSON's objects."""
    out = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 5 and cells[0] and cells[0] != "HOST":
            host, check, verdict, detail, fix = cells
            out[host, check] = {"host": host, "check": check, "verdict": verdict, "detail": detail, "fix": fix}
    return out


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


# ---- a healthy bed ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def healthy(ssh_hosts, tmp_path_factory):
    home = tmp_path_factory.mktemp("doctor-healthy")
    ssh_hosts.reset_smi()
    cfg = doctor_config(ssh_hosts, home / "g.toml", "\n".join(host_toml(h, ssh_hosts) for h in ssh_hosts.hosts))
    p = GpuflexCLI(home, cfg)("doctor", "--json", timeout=RUN_GUARD_S)
    return p, rows(json.loads(p.stdout) if p.stdout.strip() else [])


def test_a_healthy_bed_passes(healthy, ssh_hosts):
    p, found = healthy
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    user = os.environ.get("USER") or __import__("getpass").getuser()
    for h in ssh_hosts.hosts:
        verdicts = {c: found[h.name, c]["verdict"] for c in ("ssh", "python", "gpuflex", "torch", "nvidia-smi",
                                                              "gpus", "workdir", "disk", "clock")}
        assert set(verdicts.values()) == {"ok"}, (h.name, verdicts)
        assert found[h.name, "ssh"]["detail"].startswith(f"{h.address}:{h.port} as {user}, host key ssh-ed25519 ")
        assert "driver 580.159.04; 2 GPU(s): NVIDIA H100 80GB HBM3" in found[h.name, "nvidia-smi"]["detail"]
        # the bed's torch is a CPU build beside fake GPUs: a warning, not a failure
        assert found[h.name, "cuda"]["verdict"] == "warn"
        assert "built without CUDA" in found[h.name, "cuda"]["detail"]


def test_every_pair_all_reduces_across_loopback_addresses(healthy, ssh_hosts):
    _, found = healthy
    g1, g2, g3 = ssh_hosts.hosts
    for a, b in ((g1, g2), (g1, g3), (g2, g3)):
        gloo = found[f"{a.name}+{b.name}", "pg gloo"]
        assert gloo["verdict"] == "ok", gloo
        assert f"store at {a.address}:" in gloo["detail"] and f"on {a.name}, {b.name} joined" in gloo["detail"]
        nccl = found[f"{a.name}+{b.name}", "pg nccl"]
        assert (nccl["verdict"], nccl["detail"]) == ("skip", f"not checked: torch on {a.name} sees no CUDA")


# ---- a bed with a fault on each host -----------------------------------------------------
@pytest.fixture(scope="module")
def sick(ssh_hosts, tmp_path_factory):
    """A pool with a fault on each host, checked once, printed as the table (wide enough
    not to wrap). gpu01: a python that exits 1. gpu02: a python without gpuflex or torch,
    a workdir under a regular file, an nvidia-smi that prints garbage. gpu03: a python
    that hangs, an nvidia-smi that fails. stranger: gpu01's sshd, its key not pinned.
    gone: nothing listens there. ok1 and ok2 (gpu01's and gpu02's sshd, healthy), with
    --pg-port naming a port something else holds on ok1's address, listening but never
    accepting: its queue is full, so new connections are dropped, as a firewall drops them."""
    home = tmp_path_factory.mktemp("doctor-sick")
    g1, g2, g3 = ssh_hosts.hosts
    pids = home / "hang.pids"
    (home / "afile").write_text("not a directory")
    (home / "empty_known_hosts").write_text("")
    broken = script(home / "broken-python", 'echo "broken-python: no interpreter here" >&2\nexit 1\n')
    bare = script(home / "bare-python", f'exec {sys.executable} -S "$@"\n')
    hang = script(home / "hang-python", f"echo $$ >> {pids}\nexec sleep 600\n")
    garbage = script(home / "garbage-smi", 'echo "Unable to determine the device handle: garbage"\necho "%% x"\n')
    g3.set_smi(fail="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    with socket.socket() as s:   # a port where nothing listens
        s.bind(("127.0.0.9", 0))
        closed = s.getsockname()[1]
    hosts = (host_toml(g1, ssh_hosts, python=broken)
             + host_toml(g2, ssh_hosts, python=bare, workdir=str(home / "afile" / "work"), nvidia_smi=garbage)
             + host_toml(g3, ssh_hosts, python=hang, command_timeout_s=3)
             + host_toml(g1, ssh_hosts, name="stranger", known_hosts=str(home / "empty_known_hosts"))
             + host_toml(g1, ssh_hosts, name="gone", address="127.0.0.9", port=closed)
             + host_toml(g1, ssh_hosts, name="ok1") + host_toml(g2, ssh_hosts, name="ok2"))
    cfg = doctor_config(ssh_hosts, home / "g.toml", hosts)
    cli = GpuflexCLI(home, cfg)
    hole = socket.socket()
    hole.bind((g1.address, 0))
    hole.listen(0)
    port = hole.getsockname()[1]
    fillers = [socket.socket() for _ in range(3)]
    for c in fillers:
        c.setblocking(False)
        c.connect_ex((g1.address, port))
    try:
        p = cli("doctor", "--pg-port", str(port), timeout=RUN_GUARD_S, env=cli.env(COLUMNS="400"))
    finally:
        for s in (hole, *fillers):
            s.close()
        ssh_hosts.reset_smi()
        for pid in (pids.read_text().split() if pids.exists() else ()):
            try:
                os.kill(int(pid), signal.SIGKILL)   # ours: the hanging "python" the check left on the host
            except ProcessLookupError:
                pass
    return p, table_rows(p.stdout), port


def test_a_sick_bed_fails_with_one_line_per_fault(sick):
    p, found, _ = sick
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr and p.stderr == ""
    assert p.stdout.startswith("gpuflex doctor")
    assert {k for k, f in found.items() if f["verdict"] == "fail"} == {
        ("gpu01", "python"), ("gpu02", "gpuflex"), ("gpu02", "torch"), ("gpu02", "nvidia-smi"),
        ("gpu02", "workdir"), ("gpu03", "python"), ("gpu03", "nvidia-smi"), ("stranger", "ssh"), ("gone", "ssh"),
        ("ok1+ok2", "pg gloo")}
    assert all(found[k]["fix"] for k, f in found.items() if f["verdict"] == "fail")


def test_a_python_that_exits_1_is_named(sick):
    _, found, _ = sick
    assert found["gpu01", "python"]["detail"].endswith("broken-python: exit 1: broken-python: no interpreter here")
    assert found["gpu01", "gpuflex"]["verdict"] == "skip"
    assert found["gpu01", "nvidia-smi"]["verdict"] == "ok"   # asked apart from python


def test_a_python_without_gpuflex_and_torch_is_named(sick):
    _, found, _ = sick
    assert found["gpu02", "python"]["verdict"] == "ok"
    assert "not importable by" in found["gpu02", "gpuflex"]["detail"]
    assert "ModuleNotFoundError: No module named 'gpuflex'" in found["gpu02", "gpuflex"]["detail"]
    assert found["gpu02", "gpuflex"]["fix"].startswith("install gpuflex 0.1.0 into ")
    assert "No module named 'torch'" in found["gpu02", "torch"]["detail"]


def test_a_workdir_that_cannot_be_made_is_named(sick):
    _, found, _ = sick
    w = found["gpu02", "workdir"]
    assert w["detail"].endswith("afile/work: Not a directory: " + w["detail"].split(":")[0])
    assert found["gpu02", "disk"]["verdict"] == "skip"


def test_an_nvidia_smi_that_prints_garbage_or_fails_is_named(sick):
    _, found, _ = sick
    assert "cannot parse what" in found["gpu02", "nvidia-smi"]["detail"]
    assert "'Unable to determine the device handle: garbage'" in found["gpu02", "nvidia-smi"]["detail"]
    assert found["gpu02", "gpus"]["verdict"] == "skip"
    assert "failed (exit 9: NVIDIA-SMI has failed" in found["gpu03", "nvidia-smi"]["detail"]


def test_a_python_that_hangs_is_cut_off_at_its_bound(sick):
    _, found, _ = sick
    assert found["gpu03", "python"]["detail"].endswith("hang-python did not answer within 3 s")
    assert found["gpu03", "clock"]["verdict"] == "ok"


def test_unpinned_and_unreachable_hosts_are_named_with_their_fix(sick):
    _, found, _ = sick
    assert "which " in found["stranger", "ssh"]["detail"] and "does not pin" in found["stranger", "ssh"]["detail"]
    assert found["stranger", "ssh"]["fix"].endswith("then: gpuflex hosts trust stranger")
    assert found["gone", "ssh"]["detail"].startswith("SSH connection refused by 127.0.0.9:")
    assert found["gone", "python"]["detail"] == "not checked: gone not reachable"


def test_a_port_taken_between_two_hosts_is_named(sick):
    _, found, port = sick
    gloo = found["ok1+ok2", "pg gloo"]
    assert gloo["verdict"] == "fail"
    assert gloo["detail"] == (f"port {port} on ok1: cannot listen (Address already in use); "
                              f"from ok2 it did not answer within {PG_TIMEOUT_S} s (timed out)")
    assert {found[h, c]["verdict"] for h in ("ok1", "ok2") for c in ("ssh", "python", "gpuflex", "torch")} == {"ok"}


def test_pairs_with_a_broken_host_are_skipped(sick):
    _, found, _ = sick
    pairs = {k: f for k, f in found.items() if k[1].startswith("pg ") and k[0] != "ok1+ok2"}
    assert len(pairs) == 2 * 20 and {f["verdict"] for f in pairs.values()} == {"skip"}
    assert found["gpu01+gpu02", "pg gloo"]["detail"] == "not checked: gpuflex or torch is not usable on gpu01"


# ---- nvidia-smi's answers -------------------------------------------------------------------
GPUS_OUT = "0, GPU-a, NVIDIA H100 80GB HBM3, 0, 0, 81559\n1, GPU-b, NVIDIA H100 80GB HBM3, 0, 0, 81559\n"


def ok(out: str) -> CommandResult:
    return CommandResult(0, out, "")


def test_nvidia_smi_answers_are_read_as_the_probe_reads_them():
    smi = read_smi("nvidia-smi", ok(GPUS_OUT), ok("GPU-a, 4242, 1024\n"), ok("580.159.04\n580.159.04\n"))
    assert smi == Smi(gpus=((0, "NVIDIA H100 80GB HBM3"), (1, "NVIDIA H100 80GB HBM3")), apps=1,
                      driver="580.159.04")
    garbage = read_smi("nvidia-smi", ok("Unable to determine the device handle\n%% x\n"), ok(""), ok(""))
    assert garbage.error == "cannot parse what nvidia-smi --query-gpu printed: 'Unable to determine the device handle'"
    warned = read_smi("nvidia-smi", ok("WARNING: infoROM is corrupted\n" + GPUS_OUT), ok(""), ok("[N/A]\n"))
    assert warned.stray == ("WARNING: infoROM is corrupted",) and warned.driver is None and len(warned.gpus) == 2
    failed = read_smi("nvidia-smi", CommandResult(9, "NVIDIA-SMI has failed", ""), ok(""), ok(""))
    assert failed.error == "nvidia-smi --query-gpu failed (exit 9: NVIDIA-SMI has failed)"
    assert read_smi("nvidia-smi", CommandResult(127, "", "sh: nvidia-smi: not found"), ok(""), ok("")).missing
    assert read_smi("nvidia-smi", CommandResult(6, "No devices were found\n", ""), ok(""), ok("")).gpus == ()


def test_what_a_real_h200_printed_reads_without_stray_lines():
    """The probe's two queries as captured on an H200 (tests/fakes/samples), and its driver
    as the capture's own driver_version column gave it."""
    samples = TESTS / "fakes" / "samples"
    info = (samples / "h200.info.csv").read_text().splitlines()
    driver = info[1].split(", ")[info[0].split(", ").index("driver_version")]
    smi = read_smi("nvidia-smi", ok((samples / "h200-busy.gpus.csv").read_text()),
                   ok((samples / "h200-busy.apps.csv").read_text()), ok(driver + "\n"))
    assert smi == Smi(gpus=((0, "NVIDIA H200"),), apps=1, driver="580.159.04")


# ---- in-process, with a host whose transport cannot be made ---------------------------------
class CannedPython(Transport):
    """Answers the doctor's python probe with a healthy host's facts."""

    def run(self, argv, *, input=None, timeout=None):
        assert argv[1:] == ["-", self.host.workdir] and "def workdir_facts" in input
        facts = {"python": {"version": "3.11.7", "executable": "/usr/bin/python3"},
                 "gpuflex": {"version": __import__("gpuflex").__version__, "path": "/site/gpuflex"},
                 "torch": {"version": "2.13.0", "cuda": None, "cuda_available": False, "device_count": 0,
                           "gloo": True, "nccl": False},
                 "workdir": {"path": "/w", "existed": True, "is_dir": True, "owned": True, "mode": 0o700,
                             "modes_kept": True, "free_bytes": 100 << 30, "error": None}}
        return CommandResult(0, "a warning printed first\n" + json.dumps(facts) + "\n", "")

    def control_request(self, path, message, timeout=5.0):
        raise NotImplementedError


def test_a_host_whose_transport_cannot_be_made_is_its_own_failed_line():
    config = parse_config({"hosts": [{"name": "a", "gpus": "cpu:1", "workdir": "/w"},
                                     {"name": "b", "gpus": "cpu:1", "workdir": "/w"}]}, "<test>")

    def transports(h: HostConfig) -> Transport:
        if h.name == "b":
            raise TransportError("b", "no transport of kind 'ssh' (registered: local).")
        return CannedPython(h)

    found = {(f.host, f.check): f for f in run_doctor(config, transports=transports)}
    assert {c: f.verdict.value for (h, c), f in found.items() if h == "a"} == {
        "ssh": "ok", "python": "ok", "gpuflex": "ok", "torch": "ok", "nvidia-smi": "skip", "gpus": "skip",
        "cuda": "skip", "workdir": "ok", "disk": "ok", "clock": "ok"}
    assert found["b", "ssh"].verdict.value == "fail"
    assert found["b", "ssh"].detail == "no transport of kind 'ssh' (registered: local)."
    assert found["a+b", "pg gloo"].detail == "not checked: gpuflex or torch is not usable on b"


# ---- the local pool and bad input -----------------------------------------------------------
def test_the_built_in_local_pool_passes_with_its_gpu_checks_skipped(home):
    p = GpuflexCLI(home, None)("doctor", "--json", timeout=RUN_GUARD_S)
    assert p.returncode == 0, p.stdout + p.stderr
    found = rows(json.loads(p.stdout))
    assert {h for h, _ in found} == {"local"}
    assert found["local", "ssh"]["detail"].startswith("local: this machine, as ")
    for check in ("nvidia-smi", "gpus", "cuda"):
        assert found["local", check]["verdict"] == "skip"
        assert found["local", check]["detail"].startswith("no GPUs configured (gpus = \"cpu:")
    assert found["local", "workdir"]["detail"].endswith("(not there yet; can be created 0700)")
    assert not (home / ".local").exists()   # tried, and left as it was


@pytest.mark.parametrize("args,message", [
    (["doctor", "local", "nope", "local", "also-nope"],
     "error: no host named 'nope', 'also-nope' in {cfg} (configured: local)."),
    (["doctor", "--pg-port", "0"], "error: Invalid value for '--pg-port': Input should be greater than or equal to 1."),
])
def test_bad_input_is_one_error_line_and_exit_2(home, config_path, args, message):
    p = GpuflexCLI(home, config_path)(*args)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(cfg=config_path)), p.stderr
    assert sorted(x.name for x in home.iterdir()) == ["g.toml"]   # nothing touched
