"""SSHTransport against real OpenSSH servers on loopback (tests/sshbed.py)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.config import HostConfig, load_config
from gpuflex.elastic.protocol.control_socket import ControlServer
from gpuflex.errors import CommandTimeout, TransportError
from gpuflex.hosts import hostops
from gpuflex.hosts.fanout import fan_out
from gpuflex.hosts.ssh import SSHTransport
from gpuflex.hosts.transport import LocalTransport, SpawnSpec
from tests.sshbed import keygen, ssh_bed, ssh_hosts, write_config  # noqa: F401 (fixtures)


def host_cfg(bed, base="gpu01", **changes) -> HostConfig:
    """The bed's config of host `base`, with `changes` (a new name, address, known_hosts...)."""
    return dataclasses.replace(load_config(str(bed.config_path)).host(base), **changes)


@pytest.fixture
def gpu01(ssh_bed):
    t = SSHTransport(host_cfg(ssh_bed))
    yield t
    t.close()


def wait_for(predicate, timeout=20.0, every=0.05):
    """Poll until predicate() is truthy (a bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    return predicate()


def test_run_passes_argv_verbatim_and_returns_exit_code_and_streams(gpu01):
    res = gpu01.run(["printf", "%s|", "a b", "$HOME", "it's", "; rm -rf /"])
    assert (res.returncode, res.stdout) == (0, "a b|$HOME|it's|; rm -rf /|")

    res = gpu01.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (res.returncode, res.stdout, res.stderr) == (3, "out\n", "err\n")


def test_run_writes_input_to_stdin(gpu01):
    text = "line one\nline two ünïcode\n" * 1000
    assert gpu01.run(["cat"], input=text).stdout == text


def test_one_connection_is_reused_until_closed(gpu01):
    gpu01.run(["true"])
    first = gpu01.client()
    gpu01.run(["true"])
    assert gpu01.client() is first
    gpu01.close()
    gpu01.run(["true"])
    assert gpu01.client() is not first


def test_command_timeout_raises_transport_error(gpu01):
    with pytest.raises(CommandTimeout, match=r"gpu01: command timed out after 0.3 s: sleep") as e:
        gpu01.run(["sleep", "3"], timeout=0.3)
    assert isinstance(e.value, TransportError) and e.value.timeout_s == 0.3
    assert gpu01.run(["echo", "still usable"]).stdout == "still usable\n"


def test_a_local_command_timeout_is_the_same_error():
    with pytest.raises(CommandTimeout, match=r"box: command timed out after 0.3 s: sleep") as e:
        LocalTransport(HostConfig(name="box")).run(["sleep", "3"], timeout=0.3)
    assert e.value.timeout_s == 0.3


def test_spawn_status_read_and_stop_a_detached_group(gpu01, ssh_bed):
    work = ssh_bed.host("gpu01").workdir
    spec = SpawnSpec(
        argv=[sys.executable, "-c", "import time; print('worker up', flush=True); time.sleep(120)"],
        cwd=str(work), env={"PYTHONUNBUFFERED": "1"},
        log=str(work / "w0" / "worker.log"), exit_path=str(work / "w0" / "worker.exit"))
    spawned = gpu01.spawn(spec)
    try:
        # the SSH channel has closed, yet the group lives on
        [st] = gpu01.status([(spawned.pgid, spec.exit_path)])
        assert st.alive and st.exit is None
        log = wait_for(lambda: "worker up" in gpu01.read(spec.log)["data"] and gpu01.read(spec.log))
        assert log["data"] == "worker up\n" and log["missing"] is False

        assert gpu01.stop([spawned.pgid], grace_s=5) == ["terminated"]
        [st] = gpu01.status([(spawned.pgid, spec.exit_path)])
        assert not st.alive
        assert not hostops.group_alive(spawned.pgid)  # the bed's hosts are this machine
        assert wait_for(lambda: gpu01.status([(spawned.pgid, spec.exit_path)])[0].returncode) == -15
    finally:
        hostops.signal_groups([spawned.pgid], 9)


def test_read_reports_a_missing_file(gpu01, ssh_bed):
    assert gpu01.read(str(ssh_bed.root / "nope.log"))["missing"] is True


def test_control_request_goes_through_the_relay_to_a_unix_socket(gpu01):
    d = tempfile.mkdtemp(prefix="gfx-", dir="/tmp")
    path = os.path.join(d, "ctl", "w0.sock")
    server = ControlServer(path, {"echo": lambda m: {"echo": m["payload"], "pid": os.getpid()}})
    try:
        reply = gpu01.control_request(path, {"op": "echo", "payload": {"x": [1, "two"]}})
        assert reply == {"ok": True, "echo": {"x": [1, "two"]}, "pid": os.getpid()}
        # the server's own refusals come back as replies, not transport errors
        assert gpu01.control_request(path, {"op": "nope"})["ok"] is False
    finally:
        server.close()
        shutil.rmtree(d, ignore_errors=True)
    with pytest.raises(TransportError, match=r"gpu01: control socket .*w0.sock"):
        gpu01.control_request(path, {"op": "echo", "payload": 1})


def test_a_host_key_other_than_the_pinned_one_is_refused(ssh_bed, tmp_path):
    other = keygen(tmp_path / "other_key").split()
    h = ssh_bed.host("gpu02")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[{h.address}]:{h.port} {other[0]} {other[1]}\n")
    t = SSHTransport(host_cfg(ssh_bed, "gpu02", known_hosts=str(kh)))
    with pytest.raises(TransportError) as err:
        t.run(["true"])
    assert str(err.value).startswith(f"gpu02: host key mismatch for {h.address}:{h.port} — ")
    assert "gpuflex hosts trust gpu02" in str(err.value)


def test_an_unknown_host_key_is_refused_with_its_fingerprint(ssh_bed, tmp_path):
    h = ssh_bed.host("gpu03")
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    with pytest.raises(TransportError) as err:
        SSHTransport(host_cfg(ssh_bed, "gpu03", known_hosts=str(kh))).run(["true"])
    fp = subprocess.run(["ssh-keygen", "-lf", str(h.dir / "ssh_host_ed25519_key.pub")],
                        capture_output=True, text=True, check=True).stdout.split()[1]
    assert f"gpu03: unknown host key for {h.address}:{h.port} (ssh-ed25519 {fp})" in str(err.value)
    assert kh.read_text() == ""  # nothing was added behind the user's back


def silent_listener(address: str) -> socket.socket:
    """A socket that accepts TCP connections (kernel backlog) but never says a word."""
    s = socket.socket()
    s.bind((address, 0))
    s.listen(4)
    return s


def test_fan_out_reports_refused_and_silent_hosts_beside_the_good_ones(ssh_bed):
    with socket.socket() as probe:  # a port with nothing behind it
        probe.bind(("127.0.0.9", 0))
        dead_port = probe.getsockname()[1]
    silent = silent_listener("127.0.0.10")
    try:
        hosts = [host_cfg(ssh_bed, "gpu01"),
                 host_cfg(ssh_bed, "gpu01", name="dead", address="127.0.0.9", port=dead_port),
                 host_cfg(ssh_bed, "gpu01", name="silent", address="127.0.0.10",
                          port=silent.getsockname()[1], connect_timeout_s=0.5),
                 host_cfg(ssh_bed, "gpu02")]
        ts = {h.name: SSHTransport(h) for h in hosts}
        results = fan_out(hosts, lambda h: ts[h.name].run(["echo", h.name]).stdout.strip(), timeout=30)
        assert list(results) == ["gpu01", "dead", "silent", "gpu02"]
        assert results["gpu01"].value == "gpu01" and results["gpu02"].value == "gpu02"
        assert str(results["dead"].error) == f"dead: SSH connection refused by 127.0.0.9:{dead_port}"
        assert str(results["silent"].error).startswith(
            f"silent: no SSH server answered at 127.0.0.10:{silent.getsockname()[1]} within 0.5 s")
        for t in ts.values():
            t.close()
    finally:
        silent.close()


def test_fan_out_gives_up_on_a_hung_host_without_waiting_for_it():
    release = threading.Event()
    hosts = [HostConfig(name="fast"), HostConfig(name="hung"), HostConfig(name="broken")]

    def fn(h):
        if h.name == "hung":
            release.wait(30)
        if h.name == "broken":
            raise KeyError("bug")
        return h.name.upper()

    try:
        results = fan_out(hosts, fn, timeout=0.5)
    finally:
        release.set()
    assert results["fast"].ok and results["fast"].unwrap() == "FAST"
    assert str(results["hung"].error) == "hung: no answer within 0.5 s"
    assert isinstance(results["hung"].error, CommandTimeout) and results["hung"].error.timeout_s == 0.5
    assert str(results["broken"].error) == "broken: KeyError: 'bug'"
    with pytest.raises(TransportError):
        results["hung"].unwrap()


def test_hosts_trust_pins_the_key_after_confirmation(ssh_bed, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text("# my comment\n")
    cfg = write_config(ssh_bed, tmp_path / "gpuflex.toml", known_hosts=str(kh))
    h = ssh_bed.host("gpu01")
    fp = subprocess.run(["ssh-keygen", "-lf", str(h.dir / "ssh_host_ed25519_key.pub")],
                        capture_output=True, text=True, check=True).stdout.split()[1]
    runner = CliRunner()

    no = runner.invoke(app, ["--config", str(cfg), "hosts", "trust", "gpu01"], input="n\n")
    assert no.exit_code == 1 and fp in no.output
    assert kh.read_text() == "# my comment\n"

    yes = runner.invoke(app, ["--config", str(cfg), "hosts", "trust", "gpu01"], input="y\n")
    assert yes.exit_code == 0, yes.output
    assert f"added ssh-ed25519 {fp} for gpu01" in yes.output
    assert kh.read_text() == "# my comment\n" + h.known_hosts_line + "\n"
    assert SSHTransport(host_cfg(ssh_bed, known_hosts=str(kh))).run(["echo", "ok"]).stdout == "ok\n"

    again = runner.invoke(app, ["--config", str(cfg), "hosts", "trust", "gpu01", "--yes"])
    assert again.exit_code == 0 and "already trusted" in again.output


def test_hosts_trust_yes_replaces_a_changed_key(ssh_bed, tmp_path):
    other = keygen(tmp_path / "other_key").split()
    h = ssh_bed.host("gpu02")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[{h.address}]:{h.port} {other[0]} {other[1]}\n{ssh_bed.host('gpu03').known_hosts_line}\n")
    cfg = write_config(ssh_bed, tmp_path / "gpuflex.toml", known_hosts=str(kh))
    res = CliRunner().invoke(app, ["--config", str(cfg), "hosts", "trust", "gpu02", "--yes"])
    assert res.exit_code == 0, res.output
    assert "replaced" in res.output and "pins a different key" in res.output
    assert kh.read_text() == f"{ssh_bed.host('gpu03').known_hosts_line}\n{h.known_hosts_line}\n"


def test_hosts_trust_names_an_unknown_host_as_bad_input(ssh_bed):
    res = CliRunner().invoke(app, ["--config", str(ssh_bed.config_path), "hosts", "trust", "gpu99", "--yes"])
    assert res.exit_code == 2 and "no host named 'gpu99'" in res.output


def test_a_command_that_exits_before_reading_its_input_gives_its_exit_status(gpu01):
    """Its stdin closes under the input still being sent (a python that fails at once):
    the exit status and stderr say what happened, not a lost connection."""
    res = gpu01.run(["sh", "-c", "echo gone >&2; exit 3"], input="x" * (8 << 20))
    assert (res.returncode, res.stdout, res.stderr) == (3, "", "gone\n")
