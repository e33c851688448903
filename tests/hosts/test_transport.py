"""The transport registry: a host's kind picks the transport, new kinds register by name,
and the host-side modules import nothing but the standard library."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuflex.config import HostConfig
from gpuflex.errors import TransportError
from gpuflex.hosts.supervisor import local_deadline
from gpuflex.hosts.relay import relay
from gpuflex.hosts.transport import (CommandResult, LocalTransport, SpawnSpec, Transport, exit_on_our_clock,
                                     make_transport, register_transport, spawn_request)


class EchoTransport(Transport):
    """A transport of a kind gpuflex does not ship: answers every command with its argv."""

    def run(self, argv, *, input=None, timeout=None):
        return CommandResult(0, " ".join(argv), "")

    def control_request(self, path, message, timeout=5.0):
        return {"ok": True, "path": path}


class EchoHost(HostConfig):
    """A host whose config names the "echo" kind."""

    @property
    def transport(self) -> str:
        return "echo"


def test_the_address_picks_the_kind():
    assert HostConfig(name="here").transport == "local"
    assert HostConfig(name="there", address="gpu01.lab").transport == "ssh"


def test_a_local_host_gets_a_local_transport():
    t = make_transport(HostConfig(name="here"))
    assert type(t) is LocalTransport and t.host.name == "here"


def test_a_remote_host_gets_an_ssh_transport_without_connecting():
    from gpuflex.hosts.ssh import SSHTransport

    t = make_transport(HostConfig(name="there", address="192.0.2.1"))  # TEST-NET: never reached
    assert type(t) is SSHTransport and t.host.name == "there"
    t.close()


def test_a_kind_registered_from_outside_is_built_for_its_hosts():
    register_transport("echo", EchoTransport)
    t = make_transport(EchoHost(name="e1"))
    assert isinstance(t, EchoTransport) and t.host.name == "e1"
    assert t.run(["nvidia-smi", "-L"]).stdout == "nvidia-smi -L"


def test_registering_a_kind_again_replaces_its_factory():
    from gpuflex.hosts.ssh import SSHTransport

    register_transport("ssh", EchoTransport)
    try:
        assert isinstance(make_transport(HostConfig(name="r", address="r.lab")), EchoTransport)
    finally:
        register_transport("ssh", SSHTransport)
    assert isinstance(make_transport(HostConfig(name="r", address="r.lab")), SSHTransport)


def test_an_unknown_kind_is_an_error_naming_the_host_and_the_known_kinds():
    class NowhereHost(HostConfig):
        @property
        def transport(self) -> str:
            return "nowhere"

    with pytest.raises(TransportError) as info:
        make_transport(NowhereHost(name="n1"))
    msg = str(info.value)
    assert info.value.host == "n1"
    assert msg.startswith("n1: no transport of kind 'nowhere' (registered: ")
    assert "local" in msg and "ssh" in msg


@pytest.mark.parametrize("kind", ["", "SSH", "my-kind", "../x", "a.b"])
def test_a_kind_must_be_a_lowercase_identifier(kind):
    with pytest.raises(ValueError, match="lowercase identifier"):
        register_transport(kind, EchoTransport)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_ssh_module_is_loaded_only_for_the_first_ssh_host():
    before = _modules_after("import gpuflex.hosts.transport")
    assert "gpuflex.hosts.ssh" not in before and "paramiko" not in before
    after = _modules_after("from gpuflex.config import HostConfig\n"
                           "from gpuflex.hosts.transport import make_transport\n"
                           "make_transport(HostConfig(name='r', address='r.lab'))")
    assert "gpuflex.hosts.ssh" in after and "paramiko" in after


# the modules that run on a host, under its python (`python -m gpuflex.hosts.X`, or imported
# by one that does), where gpuflex's dependencies may be missing
HOST_SIDE = ["gpuflex.hosts.relay", "gpuflex.hosts.hostops", "gpuflex.hosts.supervisor", "gpuflex.hosts.private", "gpuflex.hosts.container",
             "gpuflex.hosts.gather", "gpuflex.hosts.unpack", "gpuflex.hosts.attach", "gpuflex.hosts.envsetup",
             "gpuflex.hosts.terminal", "gpuflex.hosts.zygote", "gpuflex.hosts.forkrun"]


@pytest.mark.parametrize("module", HOST_SIDE)
def test_the_host_side_modules_need_only_the_standard_library(module):
    # each imports only the standard library and other host-side modules
    loaded = _modules_after(f"import {module}")
    assert {m for m in loaded if m.startswith("gpuflex")} <= {"gpuflex", "gpuflex.hosts", *HOST_SIDE}
    assert not {"pydantic", "paramiko", "sqlalchemy"} & loaded


def test_the_host_side_and_the_coordinator_name_process_group_marks_alike():
    from gpuflex.elastic.protocol import run_dir
    from gpuflex.hosts import supervisor
    assert supervisor.GROUP_MARK == run_dir.GROUP_MARK


# ---- a host whose clock differs from ours (issue 28: a host clock 10 minutes off) --------
def test_a_host_is_sent_the_seconds_left_which_its_supervisor_puts_on_its_own_clock():
    spec = SpawnSpec(argv=["x"], cwd="~", env={}, log="l", exit_path="e", deadline=1000.0)
    request = spawn_request(spec, now=970.0)
    assert request["time_left_s"] == 30.0 and request["deadline"] == 1000.0
    # the same 30 s on a host 10 minutes ahead and on one 10 minutes behind
    assert local_deadline(request, now=970.0 + 600) == 1600.0
    assert local_deadline(request, now=970.0 - 600) == 400.0


def test_a_deadline_already_past_leaves_no_time_and_none_stays_none():
    late = SpawnSpec(argv=["x"], cwd="~", env={}, log="l", exit_path="e", deadline=1000.0)
    assert spawn_request(late, now=1010.0)["time_left_s"] == 0.0
    none = SpawnSpec(argv=["x"], cwd="~", env={}, log="l", exit_path="e")
    assert "time_left_s" not in spawn_request(none, now=1010.0)
    assert local_deadline(spawn_request(none, now=1010.0), now=5.0) is None


def test_a_spec_with_only_an_epoch_deadline_is_kept_as_it_was():
    assert local_deadline({"deadline": 1234.5}, now=99.0) == 1234.5


def test_an_exit_record_is_put_on_our_clock_by_the_difference_the_same_reply_measured():
    ahead = exit_on_our_clock({"returncode": 0, "ended_at": 1600.0}, host_now=1650.0, received=1050.5)
    assert ahead == {"returncode": 0, "ended_at": 1000.5, "host_ended_at": 1600.0}
    behind = exit_on_our_clock({"returncode": -15, "ended_at": 400.0, "time_limit": True}, 450.0, 1050.0)
    assert behind["ended_at"] == 1000.0 and behind["time_limit"] is True


@pytest.mark.parametrize("record, host_now", [
    (None, 10.0),                                   # no record yet
    ({"returncode": 0, "ended_at": 5.0}, None),     # an older host's reply: no "now"
    ({"returncode": 0, "ended_at": 5.0}, True),     # not a number
    ({"returncode": 0}, 10.0),                      # a record without ended_at
])
def test_what_cannot_be_converted_is_returned_as_it_is(record, host_now):
    assert exit_on_our_clock(record, host_now, 99.0) == record


def test_the_local_status_reply_carries_this_hosts_time(tmp_path):
    exit_path = tmp_path / "x.exit"
    exit_path.write_text('{"returncode": 3, "ended_at": 100.0}')
    (st,) = LocalTransport(HostConfig(name="local")).status([(None, str(exit_path))])
    # the same clock: moved by the reply's transit only, which here is microseconds
    assert st.returncode == 3 and st.exit["host_ended_at"] == 100.0 and 100.0 <= st.exit["ended_at"] < 100.1


def test_a_control_socket_that_cannot_be_reached_is_named_in_words_not_an_errno(tmp_path):
    """A coordinator's or worker's socket whose process is gone: "[Errno 111] Connection
    refused" (or the relay's "ConnectionRefusedError: ...") reached users as it was."""
    import socket

    t = LocalTransport(HostConfig(name="local", address="local"))
    with pytest.raises(TransportError) as missing:
        t.control_request(str(tmp_path / "gone.sock"), {"op": "status"}, timeout=1)
    assert str(missing.value) == f"local: control socket {tmp_path / 'gone.sock'}: no such socket (its process has " \
                                 "not made it, or is gone)"
    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))   # bound, never listening: as a socket whose process died
        with pytest.raises(TransportError) as refused:
            t.control_request(str(path), {"op": "status"}, timeout=1)
    assert str(refused.value).endswith("connection refused: nothing listens on it (its process is gone)")
    assert "Errno" not in str(refused.value)
    reply = relay(str(path), '{"op": "status"}', 1.0)
    assert reply == {"ok": False, "error": "connection refused: nothing listens on it (its process is gone)",
                     "relay_error": True}
